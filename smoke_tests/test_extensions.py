"""JIT C++ extensions in every image, as whoever runs it, with no network.

``cpp-extension``: torch.utils.cpp_extension.load_inline compiles a C++ op with the image's g++
and ninja into its default build directory (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions:
the venv's startup module makes HOME writable when the runtime gives none), imports it and runs
it on the CPU. It needs what a day-one extension needs: the compiler, ninja, torch's headers and,
for torch < 2.2, setuptools' pkg_resources (cpp_extension imports it).
"""

from __future__ import annotations

from typing import Any

CPP_SRC = r"""
torch::Tensor ptmg_add_one(torch::Tensor x) {
    return x + 1;
}
"""


def test_cpp_extension(torch: Any) -> None:
    from torch.utils import cpp_extension

    # -O0: the op is a probe of the toolchain, and most of the build is parsing torch's headers
    module = cpp_extension.load_inline(name="ptmg_selftest_cpp_op", cpp_sources=[CPP_SRC], functions=["ptmg_add_one"],
                                       extra_cflags=["-O0"], verbose=False)
    assert module.ptmg_add_one(torch.arange(4)).tolist() == [1, 2, 3, 4]
