"""The validated matrix: :class:`ImageSpec` (one cell) and :class:`Matrix`, plus the tables
the validation checks against (bases, flavours, tag placeholders)."""

from __future__ import annotations

import platform as _host
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from builder.common.yamlpos import Loc
from builder.matrix.policy import AuditPolicy

# What each supported base OS gives us. Python follows the base OS: Debian's own
# python3 is the interpreter the venv is made from, so there is one Python per OS.
# `bootstrap` names the debootstrap suite when the base can be made offline.
BASES: Mapping[str, Mapping[str, str]] = {
    "debian:bookworm-slim": {"os": "bookworm", "python": "3.11", "bootstrap": "bookworm"},
    "debian:bookworm": {"os": "bookworm", "python": "3.11", "bootstrap": "bookworm"},
    "debian:trixie-slim": {"os": "trixie", "python": "3.13", "bootstrap": "trixie"},
    "debian:trixie": {"os": "trixie", "python": "3.13", "bootstrap": "trixie"},
    "ubuntu:22.04": {"os": "jammy", "python": "3.10", "bootstrap": ""},
    "ubuntu:24.04": {"os": "noble", "python": "3.12", "bootstrap": ""},
}

# runtime: what users train in (torch.compile included: every image has g++ and the Python
# headers). devel: the runtime plus a CUDA toolkit matching the cell's CUDA (nvcc, headers; from
# NVIDIA's PyPI wheels, see `devel_toolkit` in compat_data.yaml), build-essential, git and ninja,
# for building CUDA extensions. The extra Debian packages of each flavour (its own layer, after the
# tools, so a devel cell shares every earlier layer with the runtime cell of the same torch):
FLAVOURS: Mapping[str, tuple[str, ...]] = {
    "runtime": (),
    "devel": ("build-essential", "git"),
}
#: ... and its extra pip requirements (besides the CUDA toolkit). ninja from PyPI rather than
#: Debian's ninja-build: it lands in the venv, where torch.utils.cpp_extension looks first.
FLAVOUR_PIP: Mapping[str, tuple[str, ...]] = {
    "runtime": (),
    "devel": ("ninja==1.13.0",),
}

#: Platforms a cell can target. linux/amd64 is the default; others are built under emulation
#: on an amd64 host (qemu) and get their architecture appended to the cell name.
DEFAULT_PLATFORM = "linux/amd64"
PLATFORMS: Mapping[str, str] = {"linux/amd64": "amd64", "linux/arm64": "arm64"}
#: The kernel's machine name -> the Docker platform it runs natively.
MACHINES: Mapping[str, str] = {"x86_64": "linux/amd64", "amd64": "linux/amd64", "aarch64": "linux/arm64",
                               "arm64": "linux/arm64"}


def native_platform(machine: str | None = None) -> str:
    """The Docker platform this host runs without emulation (linux/arm64 on a GH200's aarch64)."""
    return MACHINES.get((machine or _host.machine()).lower(), DEFAULT_PLATFORM)


#: Docker Hub's per-architecture namespace of the official images (arm64v8/debian:bookworm-slim):
#: the local name of a base on a platform other than linux/amd64 (one local name holds one
#: platform, and `debian:bookworm-slim` here is the amd64 one). See builder/imaging/base_foreign.py.
ARCH_NAMESPACES: Mapping[str, str] = {"arm64": "arm64v8"}
#: `cuda: cpu` asks for CPU-only torch.
CPU = "cpu"

TAG_FIELDS: Mapping[str, str] = {
    "torch": "torch version, e.g. 2.7.0",
    "torch_minor": "torch major.minor, e.g. 2.7",
    "torchvision": "torchvision version",
    "cuda": "CUDA major.minor, e.g. 12.6",
    "cuda_major": "CUDA major, e.g. 12",
    "cudnn": "cuDNN major, e.g. 9",
    "python": "Python major.minor",
    "flavour": "runtime or devel",
    "os": "base OS codename, e.g. bookworm",
}

TOP_KEYS = ("repository", "tag", "defaults", "axes", "include", "exclude", "audit")
CELL_KEYS = ("torch", "torchvision", "cuda", "cudnn", "python", "flavour", "base", "platform", "tag", "apt", "pip",
             "tools")
LIST_KEYS = ("apt", "pip", "tools")
REPO_RE = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$")
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
APT_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+~:-]+)?$")
PIP_RE = re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?\s*((==|>=|<=|~=|!=|<|>)\s*[A-Za-z0-9.*+!-]+\s*,?\s*)*$"
)


@dataclass(frozen=True)
class ImageSpec:
    """One validated cell of the matrix: everything later stages need, nothing more."""

    name: str  # the cell id: the tag, plus "-<arch>" for a platform other than linux/amd64
    repository: str
    tag: str  # what the registry calls it (one tag for every platform of a cell)
    torch: str
    torchvision: str
    cuda: str  # major.minor, or "cpu" for CPU-only torch
    cuda_full: str  # "" for CPU-only torch
    cudnn: str  # exact, as the wheel installs it, e.g. 9.5.1.17; "" for CPU-only torch
    cudnn_major: int
    nccl: str | None
    python: str
    flavour: str
    base: str
    os: str
    bootstrap: str  # debootstrap suite, or "" when the base can only be pulled
    wheel_source: str  # "pypi" or a PyTorch index URL
    neighbours: tuple[str, ...]  # the release's limits on its neighbours ("numpy<2", "setuptools<82")
    apt: tuple[str, ...]
    pip: tuple[str, ...]
    tools: tuple[str, ...]
    min_driver: str  # "" for CPU-only torch
    arch_list: tuple[str, ...]
    latest: bool
    loc: Loc
    platform: str = DEFAULT_PLATFORM
    compile_python: tuple[str, ...] = ()  # the Pythons torch.compile supports in this release
    devel_toolkit: str = ""  # devel: the CUDA toolkit's pip requirement (no version), e.g. cuda-toolkit[nvcc]
    #: the driver of the toolkit torch was built with (CUDA_RN Table 3): below it, no PTX JIT; "" for CPU
    min_driver_full: str = ""

    @property
    def ref(self) -> str:
        """The local image: repository:name (one platform per name in a local image store)."""
        return f"{self.repository}:{self.name}"

    @property
    def arch(self) -> str:
        return PLATFORMS[self.platform]

    @property
    def base_ref(self) -> str:
        """The local image the Dockerfile starts FROM: ``base`` on linux/amd64, else Docker Hub's
        per-architecture name of it (``arm64v8/debian:bookworm-slim``)."""
        if self.platform == DEFAULT_PLATFORM:
            return self.base
        return f"{ARCH_NAMESPACES[self.arch]}/{self.base}"

    @property
    def apt_cache_key(self) -> str:
        """The key of the OS layer's apt cache mounts (ptmg-apt-<key>): the OS codename, plus the
        architecture off linux/amd64 (an `apt-get update` drops the lists of other architectures,
        so one cache shared by both would be refilled by every build)."""
        return self.os if self.platform == DEFAULT_PLATFORM else f"{self.os}-{self.arch}"

    def emulated_on(self, host_platform: str) -> bool:
        """A host of ``host_platform`` runs this cell under emulation only (qemu: CPU, no GPU)."""
        return self.platform != host_platform

    @property
    def emulated(self) -> bool:
        """Emulated on this host: its platform is not the host's (an amd64 cell on a GB200 is)."""
        return self.emulated_on(native_platform())

    @property
    def cpu_only(self) -> bool:
        return self.cuda == CPU

    @property
    def compile_supported(self) -> bool:
        """torch.compile works in this image (the release supports the image's Python)."""
        return self.python in self.compile_python

    @property
    def compile_note(self) -> str:
        """Why torch.compile is unavailable, or "" when it works."""
        if self.compile_supported:
            return ""
        have = f"{self.compile_python[0]}-{self.compile_python[-1]}" if self.compile_python else "none recorded"
        return f"torch {self.torch}'s torch.compile supports Python {have}, not {self.python}"

    def summary(self) -> dict[str, Any]:
        """The machine-readable row `build.py matrix --json` prints."""
        return {
            "name": self.name,
            "image": self.ref,
            "tag": self.tag,
            "torch": self.torch,
            "torchvision": self.torchvision,
            "cuda": self.cuda,
            "cudnn": self.cudnn,
            "cudnn_major": self.cudnn_major,
            "nccl": self.nccl,
            "python": self.python,
            "flavour": self.flavour,
            "platform": self.platform,
            "base": self.base,
            "wheel_source": self.wheel_source,
            "min_driver": self.min_driver,
            "compile": self.compile_supported,
            "compile_note": self.compile_note,
            "latest": self.latest,
        }


@dataclass(frozen=True)
class Matrix:
    path: str
    repository: str
    cells: tuple[ImageSpec, ...]
    audit: AuditPolicy = field(default_factory=AuditPolicy)  # images.yaml's `audit:` (builder/matrix/policy.py)


