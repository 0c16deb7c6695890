"""What every image gets for torch.compile and RDMA, and what the devel flavour adds: pure
rendering and validation, no Docker."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

import ptmg_contract as contract
from builder.common.yamlpos import ProblemsError
from builder.matrix import ImageSpec, load_matrix
from builder.matrix.compat_load import load_compat
from builder.render import dockerfile
from tests.support import LATEST, MID, OLD, cell, small_matrix

ROOT = Path(__file__).resolve().parents[3]

PAIR = textwrap.dedent("""\
    include:
      - {torch: "2.14.1"}
      - {torch: "2.14.1", flavour: devel}
      - {torch: "2.14.1", base: "debian:trixie-slim", tag: "{torch}-cuda{cuda}-{flavour}-py{python}"}
    """)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ImageSpec]:
    m = small_matrix(tmp_path_factory.mktemp("pair"), PAIR)
    return {c.name: c for c in m.cells}


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ImageSpec]:
    return {c.name: c for c in small_matrix(tmp_path_factory.mktemp("seeds")).cells}


RUNTIME, DEVEL, TRIXIE = ("2.14.1-cuda13.0-cudnn9-runtime", "2.14.1-cuda13.0-cudnn9-devel",
                          "2.14.1-cuda13.0-runtime-py3.13")


def _instructions(text: str) -> list[str]:
    """The Dockerfile without comments, one instruction per entry (continuations joined)."""
    joined = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    return [ln.strip() for ln in joined.splitlines() if ln.strip()]


def test_devel_shares_every_layer_up_to_the_tools_with_its_runtime_cell(pair: dict[str, ImageSpec]) -> None:
    runtime, devel = (_instructions(dockerfile.render(pair[n])) for n in (RUNTIME, DEVEL))
    tools = max(i for i, ins in enumerate(runtime) if "pip check" in ins)  # the tools layer
    assert devel[: tools + 1] == runtime[: tools + 1], "a devel cell must build on its runtime cell's layers"
    # What devel adds: its wheels right after the tools (in the venv, below the OS layer), then its
    # Debian packages right after the OS layer; the rest is the runtime cell's, in the same order.
    wheels = devel[tools + 1]
    assert "source=wheelhouse/devel," in wheels and "uv pip install" in wheels
    os_at = next(i for i, ins in enumerate(devel) if "os-layer.sh apply" in ins)
    assert devel[tools + 2: os_at + 1] == runtime[tools + 1: os_at], "the OS layer follows the devel wheels"
    sbom = next(i for i, ins in enumerate(devel) if "sbom.py" in ins) - 1  # its USER 0:0
    assert devel[sbom:sbom + 2] == runtime[os_at:os_at + 2], "then the runtime cell's SBOM layer"
    extra = devel[os_at + 1: sbom]
    assert any("build-essential" in ins and "git" in ins and "cuda-home.sh 13.0 /opt/venv" in ins for ins in extra)
    env = next(ins for ins in extra if ins.startswith("ENV"))
    assert f"CUDA_HOME={contract.CUDA_HOME}" in env and 'TORCH_CUDA_ARCH_LIST="7.5;8.0;8.6;9.0;10.0;12.0"' in env
    assert extra[-1] == "USER 1000:1000", "the devel layer hands on the user the tools layer ran as"
    assert not any("build-essential" in ins or "wheelhouse/devel" in ins for ins in runtime)


def test_devel_pip_install_restates_the_torch_pins(pair: dict[str, ImageSpec]) -> None:
    assert dockerfile.devel_requirements(pair[DEVEL]) == (
        "cuda-toolkit[cccl,cudart,nvcc]==13.0.*", "ninja==1.13.0", "torch==2.14.1", "torchvision==0.29.1")
    assert dockerfile.devel_requirements(pair[RUNTIME]) == ()
    assert dockerfile.devel_packages(pair[DEVEL]) == ("build-essential", "git")


@pytest.mark.parametrize(("os_name", "rdmacm"), [("bookworm", "librdmacm1"), ("trixie", "librdmacm1t64")])
def test_every_image_gets_the_compiler_headers_and_rdma_core(pair: dict[str, ImageSpec], os_name: str,
                                                             rdmacm: str) -> None:
    spec = pair[RUNTIME if os_name == "bookworm" else TRIXIE]
    packages = dockerfile.os_packages(spec)
    for need in ("g++", "python3-dev", "libibverbs1", "ibverbs-providers", rdmacm):
        assert need in packages, need
    assert "build-essential" not in packages
    text = dockerfile.render(spec)
    os_run = next(ins for ins in _instructions(text) if "apt_bounded upgrade" in ins)
    assert os_run.index("cp /ptmg-build/dpkg-slim-toolchain /etc/dpkg/dpkg.cfg.d/") < os_run.index("apt_bounded install")
    assert f"> {contract.LIBCUDA_LINK_DIR}/libcuda.so" in os_run and "INPUT(-l:libcuda.so.1)" in os_run


def test_the_trim_runs_in_every_run_that_installs_into_the_venv(pair: dict[str, ImageSpec],
                                                                seeds: dict[str, ImageSpec]) -> None:
    for spec in (*pair.values(), *seeds.values()):
        for ins in _instructions(dockerfile.render(spec)):
            if "pip install" in ins and " --target " not in ins:  # the shared trees' stages: imagebuild/shared-tree.sh
                assert "--mount=type=bind,source=imagebuild/slim-venv.sh,target=/ptmg-build/slim-venv.sh" in ins
                # Triton's options where Triton can be: not in the CUDA wheels' RUN (test_layer_order.py)
                triton = "" if "source=wheelhouse/cuda," in ins else "[^&]*--strip-triton[^&]*"
                assert re.search(rf"&& bash /ptmg-build/slim-venv.sh {triton}/opt/venv\s+"
                                 r"&& sh /ptmg-build/build-python.sh restore /opt/venv$", ins), ins


def test_blackwell_ptxas_goes_only_where_torch_has_no_sm_100_code(seeds: dict[str, ImageSpec]) -> None:
    assert dockerfile.slim_args(seeds[MID]) == ("--strip-triton", "--drop-ptxas-blackwell")  # cu126: sm_50..sm_90
    assert dockerfile.slim_args(seeds[LATEST]) == ("--strip-triton",)  # cu130: sm_100, sm_120


@pytest.mark.parametrize(("arch", "want"), [
    (("sm_75", "sm_80", "sm_90", "sm_100", "sm_120", "compute_120"), "7.5;8.0;9.0;10.0;12.0+PTX"),
    (("sm_50", "sm_90"), "5.0;9.0"),
    (("sm_80", "sm_90a", "compute_90"), "8.0;9.0a;9.0+PTX"),
])
def test_torch_cuda_arch_list(pair: dict[str, ImageSpec], arch: tuple[str, ...], want: str) -> None:
    from dataclasses import replace

    assert dockerfile.torch_cuda_arch_list(replace(pair[DEVEL], arch_list=arch)) == want


def test_the_image_says_whether_torch_compile_works(seeds: dict[str, ImageSpec]) -> None:
    env = dict(dockerfile.image_env(seeds[OLD]))
    assert env[contract.ENV_TORCH_COMPILE] == ('"no: torch 2.0.1\'s torch.compile supports Python 3.8-3.10, '
                                               'not 3.11"')
    assert "TRITON_LIBCUDA_PATH" not in env and env[contract.ENV_FLAVOUR] == "runtime"
    env = dict(dockerfile.image_env(seeds[MID]))
    assert env[contract.ENV_TORCH_COMPILE] == "yes" and env["TRITON_LIBCUDA_PATH"] == contract.LIBCUDA_LINK_DIR


def test_a_devel_cell_on_cuda_12_is_refused_with_what_works(tmp_path: Path) -> None:
    text = textwrap.dedent("""\
        include:
          - torch: "2.7.0"
            flavour: devel
          - {torch: "2.9.0", flavour: devel}
        """)
    with pytest.raises(ProblemsError) as info:
        small_matrix(tmp_path, text)
    first, second = (str(p) for p in info.value.problems)
    assert first.startswith("images.yaml:3:14: flavour devel needs nvcc for CUDA 12.6 from PyPI")
    assert "only for CUDA 13" in first and "nvidia-cuda-nvcc-cu12 carries ptxas, not nvcc" in first
    assert 'e.g. torch: "2.14.1" with cuda: "13.0"' in first and "or use flavour: runtime" in first
    # torch 2.9.0 defaults to CUDA 12.8 but has a CUDA 13.0 build: say so.
    assert second.startswith("images.yaml:4:") and 'give this cell cuda: "13.0"' in second


def test_compat_data_knows_where_nvcc_is_on_pypi() -> None:
    compat = load_compat()
    assert dict(compat.devel_toolkit) == {"13": "cuda-toolkit[cccl,cudart,nvcc]"}
    assert compat.newest_with_cuda_major("13") == ("2.14.1", "13.0")  # 2.15.0 has no torchvision yet


def test_real_images_yaml_has_the_devel_and_trixie_cells() -> None:
    m = load_matrix(ROOT / "images.yaml", "images.yaml")
    devel = cell(m, "2.14.1-cuda13.0-cudnn9-devel")
    assert devel.devel_toolkit and not devel.latest
    trixie = cell(m, "2.14.1-cuda13.0-cudnn9-runtime-py3.13")
    assert (trixie.python, trixie.os, trixie.compile_supported, trixie.latest) == ("3.13", "trixie", True, False)
    assert [c.name for c in m.cells if c.latest] == ["2.14.1-cuda13.0-cudnn9-runtime"]
    assert not cell(m, "2.0.1-cuda11.7-cudnn8-runtime").compile_supported
