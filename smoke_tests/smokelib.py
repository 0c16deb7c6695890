"""Pure helpers shared by the in-image smoke tests and the host runner: the suite's settings,
the expected versions, version and GPU architecture arithmetic, and the image contract.

The DDP job's rules live beside it: ddp_plan.py (ranks per node, what a run can claim, its result
line), ddp_bench.py (the all-reduce bus bandwidth benchmark) and ddp_watchdog.py (hang deadlines,
the per-rank watchdog and the progress board that names a stuck rank).

Nothing here imports torch at module level: the host-side unit tests import this
module without torch installed. Code here runs inside every image, from torch
2.0.1 (Python 3.8+) to the newest, so it sticks to the standard library. Its siblings
get the contract from here (``from smokelib import contract``): this module finds
ptmg_contract.py both on the host and in the image.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

try:
    import ptmg_contract as contract
except ImportError:  # run from the image's smoke_tests/ folder: the contract sits one level up
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import ptmg_contract as contract


class SmokeConfig(NamedTuple):
    """The suite's settings (from selftest's flags), shared by every smoke test."""

    require_gpu: bool
    nproc: int | None
    out: str
    expect: dict[str, str]
    ddp_timeout: float
    #: A one-GPU host fails (instead of skipping) the checks that need two GPUs.
    require_multi_gpu: bool = False


# --- expectations ------------------------------------------------------------

#: check name -> (ENV variable, image label): the image contract (ptmg_contract.py).
EXPECT_KEYS = contract.EXPECT_KEYS

#: Values of PTMG_CUDA that mean "a CPU-only build of torch".
CPU_MARKERS = frozenset({"cpu", "none"})


def load_expectations(
    env: Mapping[str, str], overrides: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """Expected versions: ``PTMG_*`` from ``env``, overridden by ``overrides``.

    ``overrides`` may be image labels (``io.pt-multi-gpu.torch``), plain names
    (``torch``) or env names (``PTMG_TORCH``). Empty values mean "unknown" and
    are left out, so a check without an expectation is skipped, never passed.
    """
    out: dict[str, str] = {}
    for name, (env_key, _label) in EXPECT_KEYS.items():
        value = env.get(env_key, "").strip()
        if value:
            out[name] = value
    for key, raw in (overrides or {}).items():
        known = _expect_name(str(key))
        value = "" if raw is None else str(raw).strip()
        if known is not None and value:
            out[known] = value
    return out


def _expect_name(key: str) -> str | None:
    for name, (env_key, label) in EXPECT_KEYS.items():
        if key in (name, env_key, label):
            return name
    return None


# --- versions ----------------------------------------------------------------

version_tuple = contract.version_tuple


def pin_matches(expected: str, actual: str) -> bool:
    """An exact pin (``2.7.0``) against an installed version (``2.7.0+cu126``).

    The local part (``+cu126``) is compared only when the pin names one.
    """
    if "+" in expected:
        return expected.strip() == actual.strip()
    return actual.split("+", 1)[0].strip() == expected.strip()


def prefix_matches(expected: str, actual: str, min_parts: int = 2) -> bool:
    """Compare on the components both sides have, at least ``min_parts``.

    ``("12.6.3", "12.6")`` matches; ``("12.6", "12.4")`` and ``("12", "12.4")`` do not.
    """
    e, a = version_tuple(expected), version_tuple(actual)
    n = min(len(e), len(a))
    if n < min_parts:
        return False
    return e[:n] == a[:n]


def decode_cudnn(version: int) -> tuple[int, int, int]:
    """``torch.backends.cudnn.version()`` -> (major, minor, patch).

    cuDNN 9 encodes ``major*10000 + minor*100 + patch`` (9.5.1 -> 90501),
    cuDNN 7/8 ``major*1000 + minor*100 + patch`` (8.5.0 -> 8500).
    """
    if version >= 90000:
        return version // 10000, (version % 10000) // 100, version % 100
    return version // 1000, (version % 1000) // 100, version % 100


def decode_nccl(version: Any) -> tuple[int, ...]:
    """``torch.cuda.nccl.version()`` -> (major, minor, patch).

    Recent torch returns a tuple; old torch an int: ``2708`` (2.7.8, before
    NCCL 2.9) or ``21403`` (2.14.3, ``major*10000 + minor*100 + patch``).
    """
    if isinstance(version, (tuple, list)):
        return tuple(int(v) for v in version[:3])
    v = int(version)
    if v >= 10000:
        return v // 10000, (v % 10000) // 100, v % 100
    return v // 1000, (v % 1000) // 100, v % 100


def decode_torchvision_cuda(version: Any) -> tuple[int, int] | None:
    """``torchvision.version.cuda`` (``"12060"``/``12060``/``"12.6"``/None) -> (12, 6)."""
    if version in (None, "", 0, "0"):
        return None
    text = str(version)
    if "." in text:
        t = version_tuple(text)
        return t[0], (t[1] if len(t) > 1 else 0)
    v = int(text)
    return v // 1000, (v % 1000) // 10


def format_version(parts: Sequence[int]) -> str:
    return ".".join(str(p) for p in parts)


# --- GPU architectures -------------------------------------------------------

#: The GPU architecture arithmetic lives in the contract: the host's doctor and `build.py test`
#: apply the same rule before a container starts.
parse_arch = contract.parse_arch
arch_covers = contract.arch_covers


def split_arch_list(text: str) -> list[str]:
    """``"sm_50 sm_60;sm_90"`` -> ["sm_50", "sm_60", "sm_90"] (space, comma or semicolon)."""
    return [p for p in re.split(r"[\s,;]+", text.strip()) if p]


# --- why there is no GPU -----------------------------------------------------------

#: How each runtime hands a container its GPUs (what is missing when the driver is there but no GPU is).
GPU_RUNTIME_FLAGS = ("docker run --gpus all; pyxis/enroot: NVIDIA_VISIBLE_DEVICES=all and "
                 "NVIDIA_DRIVER_CAPABILITIES=compute,utility in the job; apptainer exec --nv; Kubernetes: an "
                 "nvidia.com/gpu limit")
PROC_DRIVER_VERSION = "/proc/driver/nvidia/version"


def driver_version(proc_file: str = PROC_DRIVER_VERSION) -> str | None:
    """The host's NVIDIA driver version, or None: nvidia-smi when the runtime put it here, else the
    kernel module's /proc file (visible in a container even when no GPU was passed in)."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20, check=False)
            first = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
            if re.match(r"^\d+(\.\d+)+$", first):
                return first
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        with open(proc_file, encoding="utf-8", errors="replace") as fh:
            m = re.search(r"Kernel Module(?: for \w+)?\s+(\d+(?:\.\d+)+)", fh.read())
    except OSError:
        return None
    return m.group(1) if m else None


def no_gpu_reason(torch_version: str, cuda_build: str | None, driver: str | None, min_driver: str,
                  env: Mapping[str, str]) -> str:
    """Why torch sees no GPU here, most specific first: a CPU-only torch, a driver older than the
    image's CUDA needs, CUDA_VISIBLE_DEVICES hiding every GPU, or no GPU passed into the container."""
    if not cuda_build:
        return f"CPU-only build of torch {torch_version}"
    if driver and min_driver:
        try:
            old = contract.version_tuple(driver) < contract.version_tuple(min_driver)
        except ValueError:
            old = False
        if old:
            return (f"the NVIDIA driver {driver} is older than {min_driver}, the minimum for CUDA {cuda_build}: "
                    f"CUDA can't initialise; upgrade the host's driver to >= {min_driver}, or use a cell with an "
                    "older CUDA")
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and cvd.strip() in ("", "-1", "none", "NoDevFiles"):
        return f"CUDA_VISIBLE_DEVICES={cvd!r} hides every GPU"
    if driver is None:
        return (f"no NVIDIA driver in this container: no GPU was passed in ({GPU_RUNTIME_FLAGS}), or the host "
                f"has no NVIDIA driver (this image needs >= {min_driver or 'the one its CUDA needs'})")
    return (f"the host's NVIDIA driver {driver} is loaded, but no GPU was passed into this container "
            f"({GPU_RUNTIME_FLAGS})")
