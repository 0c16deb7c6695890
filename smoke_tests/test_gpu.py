"""What needs a GPU: skipped with the reason when none is visible, failed with
``--require-gpu``. One test id per visible GPU, so one bad GPU never hides the rest. The checks
that touch a GPU run in a child process (``child``, gpu_child.py): a GPU in EXCLUSIVE_PROCESS mode
is free again for the DDP job's ranks when they start."""

from __future__ import annotations

import os
from typing import Any

import pytest

import smokelib
from smokelib import SmokeConfig

pytestmark = pytest.mark.gpu


def need_gpu(smoke: SmokeConfig, torch: Any) -> None:
    """Skip when no GPU is visible, or fail (a test failure, not an error) with --require-gpu."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return
    cuda = torch.version.cuda
    why = smokelib.no_gpu_reason(torch.__version__, cuda, smokelib.driver_version() if cuda else None,
                                 os.environ.get(smokelib.contract.ENV_MIN_DRIVER, ""), os.environ)
    if cuda:
        why = f"no GPU visible to torch: {why}"
    if smoke.require_gpu:
        pytest.fail(f"--require-gpu: {why}", pytrace=False)
    pytest.skip(why)


def _index(gpu_id: str) -> int:
    return int(gpu_id[len("gpu"):])


def test_cuda_available(smoke: SmokeConfig, torch: Any) -> None:
    need_gpu(smoke, torch)
    assert torch.cuda.is_available() and torch.cuda.device_count() > 0


@pytest.mark.child
def test_kernel(gpu_id: str, smoke: SmokeConfig, torch: Any) -> None:
    need_gpu(smoke, torch)
    dev = torch.device("cuda", _index(gpu_id))
    a = torch.arange(1 << 16, dtype=torch.float32, device=dev)
    assert torch.equal((a + a).cpu(), torch.arange(1 << 16, dtype=torch.float32) * 2)
    g = torch.Generator().manual_seed(0)
    m = torch.randn(256, 256, generator=g)
    got = (m.to(dev) @ m.to(dev)).cpu()
    assert torch.allclose(got, m @ m, rtol=1e-3, atol=1e-2), "GPU matmul disagrees with the CPU"
    torch.cuda.synchronize(dev)


@pytest.mark.child
def test_cudnn_conv(gpu_id: str, smoke: SmokeConfig, torch: Any) -> None:
    need_gpu(smoke, torch)
    assert torch.backends.cudnn.is_available(), "cuDNN is not available to torch"
    dev = torch.device("cuda", _index(gpu_id))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 32, 32, generator=g)
    w = torch.randn(8, 3, 3, 3, generator=g)
    with torch.backends.cudnn.flags(enabled=True):
        got = torch.nn.functional.conv2d(x.to(dev), w.to(dev), padding=1).cpu()
    want = torch.nn.functional.conv2d(x, w, padding=1)
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2), "cuDNN conv2d disagrees with the CPU"


@pytest.mark.child
def test_arch_covered(gpu_id: str, smoke: SmokeConfig, torch: Any) -> None:
    need_gpu(smoke, torch)
    i = _index(gpu_id)
    cap = torch.cuda.get_device_capability(i)
    archs = list(torch.cuda.get_arch_list())
    assert smokelib.arch_covers(archs, cap), (
        f"{torch.cuda.get_device_name(i)} is sm_{cap[0]}{cap[1]}; this torch is built for "
        f"{' '.join(archs)}: no cubin or PTX runs on it")
