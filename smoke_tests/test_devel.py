"""The devel flavour: a CUDA toolkit matching the image's CUDA builds extensions.

- ``devel-toolkit``: CUDA_HOME is what torch.utils.cpp_extension uses, and its nvcc is the
  image's CUDA (``release 13.0``); off the image its major is torch's CUDA major (another minor
  warns, as torch does).
- ``devel-load-inline``: torch.utils.cpp_extension.load_inline compiles a C++ binding and a
  ``.cu`` kernel with nvcc, links them and imports the module; no GPU needed. One target
  (the first of TORCH_CUDA_ARCH_LIST, or the GPU's own) and no Thrust keep it to a minute.
- ``devel-kernel-gpu``: the kernel runs on the GPU and adds one to every element.

In a runtime image these skip (no toolkit: use the -devel image). Off the image they run
wherever torch finds a CUDA toolkit (CUDA_HOME or nvcc on PATH), and skip otherwise.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import warnings
from typing import Any

import pytest

import smokelib

contract = smokelib.contract

CUDA_SRC = r"""
#include <cuda_runtime.h>
#include <cstdint>

__global__ void ptmg_add_one_kernel(const float* x, float* y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] + 1.0f;
}

void ptmg_add_one_launch(const float* x, float* y, int64_t n) {
    ptmg_add_one_kernel<<<(unsigned int)((n + 255) / 256), 256>>>(x, y, n);
}
"""

CPP_SRC = r"""
void ptmg_add_one_launch(const float* x, float* y, int64_t n);

torch::Tensor add_one(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.scalar_type() == torch::kFloat, "a contiguous CUDA float tensor");
    auto y = torch::empty_like(x);
    ptmg_add_one_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
    return y;
}
"""


def _flavour() -> str:
    return os.environ.get(contract.ENV_FLAVOUR, "").strip()


@pytest.fixture(scope="session")
def cuda_home(torch: Any) -> str:
    """The toolkit torch.utils.cpp_extension would use; skips where there is none (runtime)."""
    if torch.version.cuda is None:
        pytest.skip(f"CPU-only torch {torch.__version__}: no CUDA extensions")
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    flavour = _flavour()
    if flavour and flavour != "devel":
        pytest.skip(f"{flavour} image: no CUDA toolkit (nvcc); the -devel image has one")
    if not home or not os.path.isfile(os.path.join(home, "bin", "nvcc")):
        if flavour == "devel":
            pytest.fail(f"devel image without a usable CUDA toolkit: CUDA_HOME={home!r}")
        pytest.skip("no CUDA toolkit found (set CUDA_HOME, or put nvcc on PATH)")
    return str(home)


def _nvcc_release(home: str) -> str:
    out = subprocess.run([os.path.join(home, "bin", "nvcc"), "--version"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    assert m, out
    return m.group(1)


def test_devel_toolkit(cuda_home: str, torch: Any) -> None:
    release = _nvcc_release(cuda_home)
    want = ".".join(torch.version.cuda.split(".")[:2])
    # As torch.utils.cpp_extension: another major fails, another minor only warns (it builds and runs).
    assert release.split(".")[0] == want.split(".")[0], (
        f"nvcc is CUDA {release}, torch was built for CUDA {torch.version.cuda}: the majors differ "
        f"(torch.utils.cpp_extension refuses to build)")
    if release != want:
        warnings.warn(f"nvcc is CUDA {release}, torch was built for CUDA {torch.version.cuda}: a minor "
                      f"mismatch, which torch.utils.cpp_extension only warns about", stacklevel=1)
    cell = os.environ.get(contract.ENV_CUDA, "").strip()
    if cell:
        assert release == cell, f"nvcc is CUDA {release}, the image says CUDA {cell}"
    if _flavour() == "devel":
        assert os.path.realpath(cuda_home) == os.path.realpath(contract.CUDA_HOME), cuda_home
        assert os.environ.get("TORCH_CUDA_ARCH_LIST"), "TORCH_CUDA_ARCH_LIST is not set (no GPU to ask)"


def _one_target(torch: Any) -> str:
    """A single compute capability to build for: the GPU's, else the first of the image's list."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        major, minor = torch.cuda.get_device_capability(0)
        return f"{major}.{minor}"
    listed = [t for t in re.split(r"[;\s]+", os.environ.get("TORCH_CUDA_ARCH_LIST", "")) if t]
    return listed[0].replace("+PTX", "") if listed else "8.0"


@pytest.fixture(scope="session")
def inline_module(cuda_home: str, torch: Any) -> Any:
    from torch.utils import cpp_extension

    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = _one_target(torch)
    try:
        with tempfile.TemporaryDirectory(prefix="ptmg-devel-") as build_dir:
            return cpp_extension.load_inline(
                name="ptmg_devel_probe", cpp_sources=[CPP_SRC], cuda_sources=[CUDA_SRC], functions=["add_one"],
                build_directory=build_dir, verbose=False)
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved


def test_devel_load_inline(inline_module: Any) -> None:
    assert callable(getattr(inline_module, "add_one", None)), dir(inline_module)


@pytest.mark.gpu
@pytest.mark.child  # a CUDA context in a child process only (gpu_child.py)
def test_devel_kernel_gpu(inline_module: Any, torch: Any, cuda_devices: int) -> None:
    assert cuda_devices > 0
    x = torch.arange(1000, dtype=torch.float32, device="cuda:0")
    y = inline_module.add_one(x)
    torch.cuda.synchronize()
    assert torch.equal(y.cpu(), torch.arange(1000, dtype=torch.float32) + 1)
