"""What is installed is what the image says it is.

Expected values come from ``PTMG_*`` (baked into the image), overridden by
``--expect-json`` (the host runner passes the image's labels). A check with no
expected value is skipped with the reason and the installed value, never passed.
Every check is its own test id, so one mismatch never hides the others.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from collections.abc import Callable
from typing import Any

import pytest

import smokelib
from smokelib import SmokeConfig


def _expect(smoke: SmokeConfig, name: str, found: str) -> str:
    value = smoke.expect.get(name)
    if not value:
        env_key, label = smokelib.EXPECT_KEYS[name]
        pytest.skip(f"no expected {name} ({env_key} empty, no {label}); installed: {found}")
    return value


def _cuda_build(torch: Any) -> None:
    if torch.version.cuda is None:
        pytest.skip(f"CPU-only build of torch {torch.__version__}: no CUDA libraries to check")


def _wheel_version(pattern: str) -> str | None:
    """Version of the installed distribution whose name matches ``pattern`` (nvidia-cudnn-cu12)."""
    rx = re.compile(pattern)
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if rx.fullmatch(name):
            return str(dist.version)
    return None


def check_python(smoke: SmokeConfig, torch: Any) -> None:
    found = f"{sys.version_info.major}.{sys.version_info.minor}"
    want = _expect(smoke, "python", found)
    assert smokelib.prefix_matches(want, found), f"Python {found}, expected {want}"


def check_torch(smoke: SmokeConfig, torch: Any) -> None:
    want = _expect(smoke, "torch", torch.__version__)
    assert smokelib.pin_matches(want, torch.__version__), (
        f"torch {torch.__version__}, expected {want}")


def check_torchvision(smoke: SmokeConfig, torch: Any) -> None:
    import torchvision

    want = _expect(smoke, "torchvision", torchvision.__version__)
    assert smokelib.pin_matches(want, torchvision.__version__), (
        f"torchvision {torchvision.__version__}, expected {want}")


def check_torchvision_ops(smoke: SmokeConfig, torch: Any) -> None:
    # A compiled op: fails when torchvision was built for another torch (ABI mismatch),
    # e.g. "operator torchvision::nms does not exist".
    import torchvision

    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 10.0, 10.0], [20.0, 20.0, 30.0, 30.0]])
    scores = torch.tensor([0.9, 0.8, 0.7])
    keep = torchvision.ops.nms(boxes, scores, 0.5)
    assert keep.tolist() == [0, 2], f"torchvision.ops.nms gave {keep.tolist()}, expected [0, 2]"


def check_torchvision_cuda(smoke: SmokeConfig, torch: Any) -> None:
    # torchvision checks only the major too (torchvision.extension._check_cuda_version).
    import torchvision

    tv = smokelib.decode_torchvision_cuda(getattr(torchvision.version, "cuda", None))
    pt = smokelib.version_tuple(torch.version.cuda)[:2] if torch.version.cuda else None
    assert (tv is None) == (pt is None) and (tv is None or pt is None or tv[0] == pt[0]), (
        f"torchvision built for CUDA {tv}, torch for CUDA {pt}")


def check_numpy(smoke: SmokeConfig, torch: Any) -> None:
    # torch wheels are built against one NumPy ABI: torch < 2.3 can't use NumPy 2, and then
    # DataLoader transforms, all_gather_object and TensorBoard break at run time.
    try:
        import numpy
    except ImportError:
        pytest.skip("NumPy is not installed")
    try:
        there = torch.from_numpy(numpy.arange(4)).tolist()
        back = torch.arange(4).numpy().tolist()
    except Exception as exc:
        pytest.fail(f"torch {torch.__version__} can't use NumPy {numpy.__version__} ({exc}); "
                    "pin the NumPy this torch was built for (torch < 2.3: numpy<2)", pytrace=False)
    assert there == back == [0, 1, 2, 3]


def check_cuda(smoke: SmokeConfig, torch: Any) -> None:
    found = torch.version.cuda or "cpu"
    want = _expect(smoke, "cuda", found)
    if want.lower() in smokelib.CPU_MARKERS:
        assert torch.version.cuda is None, f"expected a CPU build, torch has CUDA {found}"
        return
    assert torch.version.cuda is not None, f"expected CUDA {want}, torch is a CPU-only build"
    assert smokelib.prefix_matches(want, found), f"torch built for CUDA {found}, expected {want}"


def check_cudnn_runtime(smoke: SmokeConfig, torch: Any) -> None:
    _cuda_build(torch)
    # Loads libcudnn; needs no GPU (checked on torch 2.14.1+cu130 on a CPU-only host).
    raw = torch.backends.cudnn.version()
    assert raw is not None, "torch.backends.cudnn.version() is None: libcudnn did not load"
    found = smokelib.format_version(smokelib.decode_cudnn(int(raw)))
    want = _expect(smoke, "cudnn", f"{found} ({raw})")
    assert smokelib.prefix_matches(want, found, min_parts=1), (
        f"cuDNN {found} (torch.backends.cudnn.version()={raw}), expected {want}")


def _check_wheel(smoke: SmokeConfig, torch: Any, key: str, dist: str, name: str, elsewhere: str,
                 min_parts: int = 2) -> None:
    """The version of the nvidia-* wheel that ships a library equals the expected one."""
    _cuda_build(torch)
    found = _wheel_version(dist)
    if found is None:
        pytest.skip(f"no {name} wheel: {elsewhere} (checked at runtime)")
    want = _expect(smoke, key, found)
    assert smokelib.prefix_matches(want, found, min_parts=min_parts), f"{name} wheel {found}, expected {want}"


def check_cudnn_wheel(smoke: SmokeConfig, torch: Any) -> None:
    _check_wheel(smoke, torch, "cudnn", smokelib.contract.CUDNN_DIST_PATTERN, "nvidia-cudnn-cu*",
                 "cuDNN comes from elsewhere", min_parts=1)


def check_nccl_runtime(smoke: SmokeConfig, torch: Any) -> None:
    _cuda_build(torch)
    found = smokelib.format_version(smokelib.decode_nccl(torch.cuda.nccl.version()))
    want = _expect(smoke, "nccl", found)
    assert smokelib.prefix_matches(want, found), (
        f"NCCL {found} (torch.cuda.nccl.version()), expected {want}")


def check_nccl_wheel(smoke: SmokeConfig, torch: Any) -> None:
    _check_wheel(smoke, torch, "nccl", smokelib.contract.NCCL_DIST_PATTERN, "nvidia-nccl-cu*",
                 "NCCL is linked into torch")


def check_nccl_available(smoke: SmokeConfig, torch: Any) -> None:
    _cuda_build(torch)
    import torch.distributed as dist

    assert dist.is_available() and dist.is_nccl_available(), "torch was built without NCCL"


def check_gloo_available(smoke: SmokeConfig, torch: Any) -> None:
    import torch.distributed as dist

    assert dist.is_available() and dist.is_gloo_available(), "torch was built without gloo"


def check_cuda_arch_list(smoke: SmokeConfig, torch: Any) -> None:
    _cuda_build(torch)
    # get_arch_list() is [] without a GPU on older torch; the build flags are always there.
    found = list(torch.cuda.get_arch_list()) or smokelib.split_arch_list(
        torch._C._cuda_getArchFlags())
    want = _expect(smoke, "cuda-arch-list", " ".join(found))
    missing = sorted(set(smokelib.split_arch_list(want)) - set(found))
    extra = sorted(set(found) - set(smokelib.split_arch_list(want)))
    assert not missing and not extra, (
        f"torch's arch list {found}: missing {missing}, unexpected {extra} (expected {want})")


CHECKS: dict[str, Callable[[SmokeConfig, Any], None]] = {
    "python": check_python,
    "torch": check_torch,
    "torchvision": check_torchvision,
    "torchvision-ops": check_torchvision_ops,
    "torchvision-cuda": check_torchvision_cuda,
    "numpy": check_numpy,
    "cuda": check_cuda,
    "cudnn-runtime": check_cudnn_runtime,
    "cudnn-wheel": check_cudnn_wheel,
    "nccl-runtime": check_nccl_runtime,
    "nccl-wheel": check_nccl_wheel,
    "nccl-available": check_nccl_available,
    "gloo-available": check_gloo_available,
    "cuda-arch-list": check_cuda_arch_list,
}


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_env(check: str, smoke: SmokeConfig, torch: Any) -> None:
    CHECKS[check](smoke, torch)
