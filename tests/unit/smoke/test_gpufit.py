"""Whether a cell runs on the host's GPUs (builder/smoke/gpufit.py, pure): the driver against the
cell's minimum at its boundary, every GPU's compute capability against the arch list, MIG and NCCL,
mixed models and the device order. doctor and `build.py test` drive the same functions through a
fake nvidia-smi in tests/unit/project/test_gpu_host_checks.py."""

from __future__ import annotations

import dataclasses

import pytest

from builder.matrix import ImageSpec
from builder.smoke import gpufit
from builder.smoke.gpus import HostGpu, RunPlan
from tests import support


@pytest.fixture(scope="module")
def cells(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ImageSpec]:
    matrix = support.small_matrix(tmp_path_factory.mktemp("matrix"))
    return {c.name: c for c in matrix.cells}


def gpu(index: int, cap: tuple[int, int] | None, driver: str = "580.65.06", name: str = "NVIDIA A100",
        mig: bool = False) -> HostGpu:
    return HostGpu(str(index), f"GPU-{index}", name, cap, driver, mig)


A100, H100, B200 = (8, 0), (9, 0), (10, 0)


# --- the driver -------------------------------------------------------------------------------------
def test_a_driver_exactly_at_the_cells_minimum_runs_and_one_below_is_refused(cells: dict[str, ImageSpec]) -> None:
    mid = cells[support.MID]
    assert mid.min_driver == "525.60.13"
    assert gpufit.cell_problems(mid, [gpu(0, A100, driver="525.60.13")]) == []
    assert gpufit.cell_problems(mid, [gpu(0, A100, driver="525.60.14")]) == []
    below = gpufit.cell_problems(mid, [gpu(0, A100, driver="525.60.12")])
    assert len(below) == 1
    assert below[0].startswith("driver 525.60.12 is older than 525.60.13, the minimum for CUDA 12.6")


def test_the_driver_is_the_first_one_a_gpu_reports(cells: dict[str, ImageSpec]) -> None:
    mid = cells[support.MID]
    old = gpufit.cell_problems(mid, [gpu(0, A100, driver=""), gpu(1, A100, driver="470.57.02")])
    assert len(old) == 1 and old[0].startswith("driver 470.57.02 is older than 525.60.13")
    assert gpufit.cell_problems(mid, [gpu(0, A100, driver=""), gpu(1, A100, driver="")]) == []  # not known
    assert gpufit.cell_problems(dataclasses.replace(mid, min_driver=""), [gpu(0, A100, driver="1.0")]) == []


# --- the compute capability of every GPU ------------------------------------------------------------
def test_every_gpus_compute_capability_is_checked_not_only_the_first(cells: dict[str, ImageSpec]) -> None:
    old = cells[support.OLD]  # sm_37 ... sm_86: no code for sm_90
    assert gpufit.cell_problems(old, [gpu(0, A100), gpu(1, A100)]) == []
    problems = gpufit.cell_problems(old, [gpu(0, A100), gpu(1, H100, name="NVIDIA H100")])
    assert problems == ["GPU 1 (NVIDIA H100, sm_90): torch 2.0.1 (CUDA 11.7) is built for sm_37 sm_50 sm_60 sm_70 "
                        "sm_75 sm_80 sm_86: no cubin or PTX runs on sm_90"]
    last = gpufit.cell_problems(old, [gpu(0, A100), gpu(1, A100), gpu(2, B200, name="NVIDIA B200")])
    assert len(last) == 1 and last[0].startswith("GPU 2 (NVIDIA B200, sm_100)")


def test_one_problem_per_model_and_capability_and_an_unknown_capability_is_no_problem(
        cells: dict[str, ImageSpec]) -> None:
    old = cells[support.OLD]
    same = gpufit.cell_problems(old, [gpu(0, H100, name="H100"), gpu(1, H100, name="H100")])
    assert len(same) == 1 and same[0].startswith("GPU 0 (H100, sm_90)")
    two = gpufit.cell_problems(old, [gpu(0, H100, name="H100"), gpu(1, H100, name="GH200")])
    assert [p.split(":")[0] for p in two] == ["GPU 0 (H100, sm_90)", "GPU 1 (GH200, sm_90)"]
    assert gpufit.cell_problems(old, [gpu(0, None), gpu(1, A100)]) == []


def test_cpu_emulated_cells_and_a_host_without_gpus_have_no_problems(cells: dict[str, ImageSpec]) -> None:
    old = cells[support.OLD]
    bad = [gpu(0, B200, driver="1.0")]
    assert len(gpufit.cell_problems(old, bad)) == 2  # the control: both the driver and the arch
    assert gpufit.cell_problems(dataclasses.replace(old, cuda="cpu"), bad) == []
    assert gpufit.cell_problems(dataclasses.replace(old, platform="linux/arm64"), bad) == []
    assert gpufit.cell_problems(old, []) == []


# --- the refusal and what runs instead -----------------------------------------------------------------
def test_the_refusal_names_the_problems_and_the_cells_that_run(cells: dict[str, ImageSpec]) -> None:
    every = list(cells.values())
    h100 = [gpu(0, H100, driver="580.65.06", name="H100")]
    cpu = dataclasses.replace(cells[support.OLD], name="cpu-cell", cuda="cpu")
    arm = dataclasses.replace(cells[support.LATEST], name="arm-cell", platform="linux/arm64")
    assert gpufit.runnable([*every, cpu, arm], h100) == [support.MID, support.LATEST]
    assert gpufit.refusal(cells[support.MID], every, h100) == ""
    text = gpufit.refusal(cells[support.OLD], [*every, cpu, arm], h100)
    assert text.startswith(f"{support.OLD} can't run on this host's GPUs: GPU 0 (H100, sm_90): torch 2.0.1")
    assert text.endswith(f"(cells that run here: {support.MID}, {support.LATEST})")
    old_driver = [gpu(0, H100, driver="400.1", name="H100")]
    assert gpufit.refusal(cells[support.OLD], every, old_driver).endswith(
        "(no cell of the matrix runs on these GPUs)")
    assert "; " in gpufit.refusal(cells[support.OLD], every, old_driver)  # both problems, joined


# --- MIG and NCCL --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("plan", "refused"), [
    (RunPlan(1, 2, "nccl"), True),
    (RunPlan(2, 1, "nccl"), True),
    (RunPlan(1, 1, "nccl"), False),  # one rank: nothing to talk to
    (RunPlan(1, 2, "gloo"), False),
])
def test_nccl_across_mig_slices_is_refused_only_with_two_ranks_or_more(plan: RunPlan, refused: bool) -> None:
    gpus = [gpu(0, A100, mig=True), gpu(1, A100), gpu(2, A100, mig=True)]
    text = gpufit.mig_problem(gpus, plan)
    assert bool(text) == refused
    if refused:
        assert text.startswith("MIG mode is enabled on GPU 0 (NVIDIA A100, sm_80), GPU 2 (NVIDIA A100, sm_80): ")
        assert f"a {plan.world_size}-rank NCCL run across MIG slices is refused" in text
    assert gpufit.mig_problem([gpu(0, A100), gpu(1, A100)], plan) == ""


# --- mixed models and the device order -----------------------------------------------------------------
@pytest.mark.parametrize(("names", "env", "shown"), [
    (["A100", "A100"], {}, None),
    (["A100", ""], {}, None),  # a GPU that reports no name is not another model
    (["A100", "H100"], {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, None),
    (["A100", "H100"], {}, "unset (FASTEST_FIRST)"),
    (["H100", "A100"], {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, "FASTEST_FIRST"),
])
def test_mixed_models_warn_unless_the_order_is_by_pci_bus(names: list[str], env: dict[str, str],
                                                          shown: str | None) -> None:
    text = gpufit.device_order_warning([gpu(i, A100, name=n) for i, n in enumerate(names)], env)
    if shown is None:
        assert text == ""
    else:
        assert text.startswith(f"mixed GPU models (A100, H100) and CUDA_DEVICE_ORDER={shown}: ")
        assert text.endswith("export CUDA_DEVICE_ORDER=PCI_BUS_ID")



# --- what fixes a refusal --------------------------------------------------------------------------------
def test_the_fix_names_only_the_gpus_without_code_and_the_other_cells_that_run(cells: dict[str, ImageSpec]) -> None:
    every = list(cells.values())
    old = cells[support.OLD]  # sm_37 ... sm_86, driver >= 450.80.02
    mixed = [gpu(0, A100), gpu(1, None), gpu(2, H100, name="H100"), gpu(3, H100, name="GH200")]
    assert gpufit.refusal_fix(old, mixed, cells=every) == (
        f"use a cell whose torch has code for sm_90 ({support.MID}, {support.LATEST})")
    assert gpufit.refusal_fix(old, [gpu(0, A100), gpu(1, None)], cells=every) == ""  # covered: nothing to fix


def test_the_fix_upgrades_the_driver_only_below_the_cells_minimum(cells: dict[str, ImageSpec]) -> None:
    every = list(cells.values())
    mid = cells[support.MID]  # min_driver 525.60.13
    assert gpufit.refusal_fix(mid, [gpu(0, A100, driver="525.60.13")], cells=every) == ""
    assert gpufit.refusal_fix(mid, [gpu(0, A100, driver="580.65.06")], cells=every) == ""
    assert gpufit.refusal_fix(mid, [gpu(0, A100, driver="525.60.12")], cells=every) == (
        "upgrade the NVIDIA driver (525.60.12) to >= 525.60.13, or use a cell with an older CUDA")
    assert gpufit.refusal_fix(mid, [gpu(0, A100, driver="")], cells=every) == ""  # not known
    no_minimum = dataclasses.replace(mid, min_driver="")
    assert gpufit.refusal_fix(no_minimum, [gpu(0, A100, driver="1.0")], cells=every) == ""


def test_with_both_problems_and_no_other_cell_the_fix_says_both(cells: dict[str, ImageSpec]) -> None:
    old = cells[support.OLD]
    b200 = [gpu(0, B200, driver="400.1", name="NVIDIA B200")]
    assert gpufit.refusal_fix(old, b200, cells=list(cells.values())) == (
        "upgrade the NVIDIA driver (400.1) to >= 450.80.02, or use a cell with an older CUDA; "
        "use a cell whose torch has code for sm_100 (a newer torch; none in this matrix)")


# --- PTX JIT only ----------------------------------------------------------------------------------------
JIT_FIX = ("use a cell with a cubin for sm_100, or keep the JIT cache (CUDA_CACHE_PATH on a persistent disk, "
           "CUDA_CACHE_MAXSIZE=4294967296)")


def ptx_cell(cells: dict[str, ImageSpec]) -> ImageSpec:
    """MID with PTX for sm_90 added: a B200 (sm_100) runs it only by JIT, an A100 by its cubin."""
    mid = cells[support.MID]
    return dataclasses.replace(mid, arch_list=(*mid.arch_list, "compute_90"))


def jit_text(cell: ImageSpec, index: int, name: str = "NVIDIA B200") -> str:
    return (f"{cell.name}: GPU {index} ({name}, sm_100): torch 2.7.0 has no cubin for sm_100; only PTX JIT of "
            "compute_90 runs there (the first start compiles every kernel, minutes)")


def test_a_gpu_that_runs_the_cell_only_by_ptx_jit_is_warned_once_per_model(cells: dict[str, ImageSpec]) -> None:
    cell = ptx_cell(cells)
    assert cell.min_driver_full == "560.35.05"
    gpus = [gpu(0, None), gpu(1, A100), gpu(2, B200, name="NVIDIA B200"), gpu(3, B200, name="NVIDIA B200"),
            gpu(4, (3, 5), name="K40"), gpu(5, B200, name="GB200")]
    assert gpufit.ptx_warnings(cell, gpus) == [(jit_text(cell, 2), JIT_FIX), (jit_text(cell, 5, "GB200"), JIT_FIX)]
    assert gpufit.ptx_warnings(cell, [gpu(0, A100), gpu(1, (3, 5), name="K40")]) == []  # a cubin; no code at all
    assert gpufit.ptx_warnings(cells[support.MID], [gpu(0, B200, name="NVIDIA B200")]) == []  # no PTX: refused
    assert gpufit.ptx_warnings(dataclasses.replace(cell, cuda="cpu"), gpus) == []


def test_a_driver_older_than_the_toolkit_that_built_the_ptx_is_told_the_jit_will_refuse(
        cells: dict[str, ImageSpec]) -> None:
    cell = ptx_cell(cells)
    b200 = [gpu(0, None, driver=""), gpu(1, B200, driver="560.35.04", name="NVIDIA B200")]
    assert gpufit.ptx_warnings(cell, b200) == [(
        f"{jit_text(cell, 1)}, and driver 560.35.04 is older than 560.35.05, the driver of CUDA 12.6.3 that "
        "built that PTX: the JIT will refuse it",
        "upgrade the NVIDIA driver to >= 560.35.05, or use a cell with a cubin for sm_100")]
    for driver in ("560.35.05", "580.65.06", ""):  # at the minimum, above it, not known
        assert gpufit.ptx_warnings(cell, [gpu(0, B200, driver=driver, name="NVIDIA B200")]) == [
            (jit_text(cell, 0), JIT_FIX)], driver
    no_minimum = dataclasses.replace(cell, min_driver_full="")
    assert gpufit.ptx_warnings(no_minimum, [gpu(0, B200, driver="1.0", name="NVIDIA B200")]) == [
        (jit_text(no_minimum, 0), JIT_FIX)]
