"""Start diagnostics: warnings only, never failures.

The fast checks (environment, /dev/shm, nvidia-smi) need no torch. torch is
imported only when a GPU device node is visible but nvidia-smi is not, or the
NCCL version is unknown, and then in a background process so it never delays
the services.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

import ptmg_contract as contract
import rdma
from common import info, warn

SHM_MIN_BYTES = 1 << 30
SHM_FIX = "run with --shm-size=8g (or --ipc=host)"
GPU_FIX = ("run with --gpus all (or --gpus '\"device=0,1\"') on a host with the NVIDIA driver "
           "and the NVIDIA Container Toolkit installed")


@dataclass(frozen=True)
class Gpu:
    index: str
    name: str
    driver: str
    memory: str


def version_tuple(text: str) -> tuple[int, ...]:
    """Lenient: a driver string that is not a version compares as (0,)."""
    try:
        return contract.version_tuple(text)
    except ValueError:
        return (0,)


def check_shm(path: str = "/dev/shm") -> None:
    try:
        st = os.statvfs(path)
    except OSError:
        warn(f"{path} is missing; PyTorch DataLoader workers and NCCL need it: {SHM_FIX}")
        return
    size = st.f_blocks * st.f_frsize
    if size < SHM_MIN_BYTES:
        warn(f"/dev/shm is only {size // (1 << 20)} MiB (< 1 GiB): PyTorch DataLoader workers "
             f"and NCCL need more shared memory; {SHM_FIX}")


def parse_nvidia_smi(text: str) -> list[Gpu]:
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) >= 4:
            gpus.append(Gpu(*fields[:4]))
    return gpus


def query_nvidia_smi(exe: str) -> list[Gpu] | str:
    """GPUs from nvidia-smi, or an error text."""
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=15, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if out.returncode != 0:
        lines = (out.stderr or out.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit status {out.returncode}"
    return parse_nvidia_smi(out.stdout)


def proc_driver_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            first = f.readline()
    except OSError:
        return None
    for word in first.split():
        if word[:1].isdigit() and "." in word:
            return word
    return None


def check_driver(driver: str | None, env: dict[str, str]) -> None:
    need = env.get(contract.ENV_MIN_DRIVER, "").strip()
    if not driver:
        return
    if need and version_tuple(driver) < version_tuple(need):
        warn(f"NVIDIA driver {driver} is older than {need}, the minimum for CUDA "
             f"{env.get(contract.ENV_CUDA) or '?'} in this image: CUDA calls will fail; upgrade the "
             f"host driver to >= {need}, or use an image built for an older CUDA")
    else:
        info(f"NVIDIA driver {driver}" + (f" (image needs >= {need})" if need else ""))


TORCH_PROBE = r"""
import json, torch
out = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": [], "nccl": None}
if torch.cuda.is_available():
    out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as exc:
        out["nccl"] = f"unknown ({exc})"
print(json.dumps(out))
"""


def torch_probe(python: str, env: dict[str, str]) -> None:
    """Ask torch itself (slow: seconds). Meant to run in a background thread."""
    try:
        out = subprocess.run(["nice", "-n", "10", python, "-c", TORCH_PROBE],
                             capture_output=True, text=True, timeout=120, env=env, check=False)
        data = json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as exc:  # diagnostics never fail the container
        warn(f"could not ask torch about GPUs: {exc}")
        return
    gpus = data.get("gpus") or []
    if gpus:
        info(f"torch sees {len(gpus)} GPU(s): " + "; ".join(f"{i}: {n}" for i, n in enumerate(gpus)))
        if data.get("nccl"):
            info(f"NCCL {data['nccl']} (from torch)")
    else:
        warn(f"torch {data.get('torch')} sees no usable GPU although /dev/nvidia* exists; "
             f"{GPU_FIX}")


def run(env: dict[str, str], *, background: Callable[[Callable[[], None]], None] | None,
        python: str, child_env: dict[str, str]) -> None:
    """Print the diagnostics. `background(fn)` runs slow torch checks off the hot
    path; None means "no torch checks" (command mode, where we exec at once)."""
    cell = env.get(contract.ENV_CELL) or "?"
    facts = (contract.ENV_TORCH, contract.ENV_CUDA, contract.ENV_CUDNN, contract.ENV_NCCL, contract.ENV_PYTHON)
    shown = [f"{key[5:].lower()}={env[key]}" for key in facts if env.get(key)]
    info(f"pt-multi-gpu cell {cell}: " + (" ".join(shown) or "no PTMG_* facts in the environment"))
    check_shm()
    cuda_image = bool(env.get(contract.ENV_CUDA, "").strip())
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*"))
    exe = shutil.which("nvidia-smi", path=env.get("PATH"))
    gpu_seen = False
    if exe:
        result = query_nvidia_smi(exe)
        if isinstance(result, str):
            warn(f"nvidia-smi failed ({result}); {GPU_FIX}")
        elif not result:
            warn(f"nvidia-smi lists no GPU; {GPU_FIX}")
        else:
            gpu_seen = True
            info(f"{len(result)} GPU(s) visible: " +
                 "; ".join(f"{g.index}: {g.name} ({g.memory})" for g in result))
            check_driver(result[0].driver, env)
    elif nodes:
        gpu_seen = True
        info(f"{len(nodes)} NVIDIA device node(s) visible but no nvidia-smi")
        check_driver(proc_driver_version(), env)
    if not gpu_seen:
        if cuda_image:
            warn(f"no GPU visible: {GPU_FIX}")
        else:
            info("no GPU visible (this is a CPU-only image)")
    nccl = env.get(contract.ENV_NCCL, "").strip()
    if nccl:
        info(f"NCCL {nccl}")
    rdma.report(env)
    need_torch = gpu_seen and (not exe or not nccl)
    if need_torch and background is not None:
        background(lambda: torch_probe(python, child_env))
