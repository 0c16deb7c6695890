"""What a cell installs, for which target, and which wheel of a package that target takes (pure).

A cell's lock is resolved for the image, not for the host: the cell's Python and the
``<arch>-manylinux_2_<glibc>`` tag of its base OS. The tag must match the base's glibc: with a
lower one, packages that ship newer binary wheels (debugpy's manylinux_2_34, tensorboard-data-
server's manylinux_2_31) fall back to other builds than pip in the image would install.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

from builder.matrix import ImageSpec
from builder.render.dockerfile import INSTALL_LAYERS, core_requirements, devel_requirements

#: The lock's layers: what each package is installed for (pylock.toml's tool.pt-multi-gpu.layer).
LAYERS: tuple[str, ...] = ("torch", "tools", "devel")
#: NVIDIA's CUDA wheels (py3-none: the same files whatever Python installs them; torch pins their exact
#: builds, so a torch patch release usually keeps the set and a new minor usually moves cuDNN or NCCL).
CUDA_WHEEL_PREFIX = "nvidia-"


def install_layer(layer: str, name: str) -> str:
    """The RUN (builder.render.dockerfile.INSTALL_LAYERS) that installs a package of the lock's `layer`:
    the torch layer's CUDA wheels get a RUN of their own, "cuda", below torch's, so a new torch over
    the same CUDA wheels leaves their 3 GB layer alone (docs/image-layout.md, "Layers")."""
    if layer == "torch" and canonicalize_name(name).startswith(CUDA_WHEEL_PREFIX):
        return "cuda"
    return layer


assert set(INSTALL_LAYERS) == {"cuda", *LAYERS}

#: glibc of each base OS, as the manylinux minor uv knows (trixie has 2.41; uv 0.13 tags stop at 2_40,
#: and no wheel of these sets needs more).
GLIBC: Mapping[str, int] = {"bookworm": 36, "trixie": 40, "jammy": 35, "noble": 39}
MACHINE: Mapping[str, str] = {"amd64": "x86_64", "arm64": "aarch64"}
PYPI = "https://pypi.org/simple"
_NAME_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


@dataclass(frozen=True)
class Target:
    python: str  # "3.11"
    platform: str  # uv's --python-platform, e.g. "x86_64-manylinux_2_36"
    index: str  # where the cell's torch comes from: PyPI's simple index or a PyTorch index

    @property
    def environment(self) -> str:
        """The PEP 508 marker the lock is valid for (pylock.toml's ``environments``)."""
        machine = self.platform.split("-", 1)[0]
        return (f"python_version == '{self.python}' and platform_machine == '{machine}' and "
                f"sys_platform == 'linux'")


def target(spec: ImageSpec) -> Target:
    glibc = GLIBC.get(spec.os, 28)
    index = PYPI if spec.wheel_source == "pypi" else spec.wheel_source
    return Target(spec.python, f"{MACHINE[spec.arch]}-manylinux_2_{glibc}", index)


def requirement_name(req: str) -> str:
    """``jupyterlab==4.6.6`` -> ``jupyterlab``; ``cuda-toolkit[nvcc]==13.0.*`` -> ``cuda-toolkit`` (canonical)."""
    m = _NAME_RE.match(req)
    return canonicalize_name(m.group(1)) if m else req


def wanted(spec: ImageSpec) -> dict[str, tuple[str, ...]]:
    """The cell's requirements per layer, as images.yaml and the compat data say (sorted).

    torch: pip (the venv is made without it; pip comes from the lock like everything else, so
    every file in the venv is hash-checked), torch, torchvision and the release's own pins;
    tools: the tools and the cell's extra pip packages; devel: the devel flavour's toolkit and
    ninja (their torch pins, restated for a separate resolver, are the torch layer's here)."""
    core = core_requirements(spec)
    tools = set(spec.tools) | set(spec.pip)
    devel = {r for r in devel_requirements(spec) if r not in core}
    return {"torch": tuple(sorted({"pip", *core})), "tools": tuple(sorted(tools)), "devel": tuple(sorted(devel))}


# --- which wheel a target installs -----------------------------------------------------------
def target_tags(platform: str, python: str) -> list[Tag]:
    """The tags an installer on the target accepts, best first (as pip and uv rank them there)."""
    machine, _, rest = platform.partition("-")
    m = re.fullmatch(r"manylinux_2_(\d+)", rest)
    if not m:
        raise ValueError(f"{platform}: expected ARCH-manylinux_2_NN")
    glibc = int(m.group(1))
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    plats: list[str] = []
    for minor in range(glibc, 4, -1):
        if machine == "aarch64" and minor < 17:
            break
        plats.append(f"manylinux_2_{minor}_{machine}")
        if minor in legacy:
            plats.append(f"{legacy[minor]}_{machine}")
    version = tuple(int(x) for x in python.split("."))
    return [*cpython_tags(version, platforms=plats),
            *compatible_tags(version, f"cp{version[0]}{version[1]}", plats)]


def best_wheel(filenames: Sequence[str], tags: Sequence[Tag]) -> str | None:
    """The filename the target's installer would take (the best-ranked tag); None if none fits."""
    rank = {t: i for i, t in enumerate(tags)}
    scored = []
    for f in filenames:
        score = min((rank.get(t, len(rank)) for t in parse_wheel_filename(f)[3]), default=len(rank))
        if score < len(rank):
            scored.append((score, f))
    return min(scored)[1] if scored else None
