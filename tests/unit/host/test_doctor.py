"""doctor's verdict per host: an arm64 GPU host (GB200, GH200) runs the arm64 cells natively and
the amd64 ones under emulation only; a refusal's fix names what is wrong (the driver or the
cell's code), and a GPU reached only by PTX JIT is warned about (the build toolkit's driver)."""

from __future__ import annotations

import dataclasses
import json
import platform
from pathlib import Path

import pytest

from builder.cli import main as cli
from builder.host import doctor
from builder.matrix import Matrix, platforms
from tests.support import LATEST, MID, OLD, cell, small_matrix
from tests.unit.project.test_arm64 import ARM, ARM_MATRIX

GB200 = doctor.Gpu("NVIDIA GB200", "580.95.05", (10, 0))
GH200 = doctor.Gpu("NVIDIA GH200 480GB", "580.95.05", (9, 0))
H200 = doctor.Gpu("NVIDIA H200", "570.86.15", (9, 0))
H200_580 = dataclasses.replace(H200, driver="580.95.05")


@pytest.fixture
def matrix(tmp_path: Path) -> Matrix:
    return small_matrix(tmp_path / "m", ARM_MATRIX)


@pytest.fixture
def aarch64(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine, as the kernel names it, is an aarch64 (Grace) host."""
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")


@pytest.mark.parametrize("gpu", [GB200, GH200], ids=["GB200-sm_100", "GH200-sm_90"])
def test_doctor_on_an_arm64_gpu_host_runs_the_arm64_cell_and_emulates_the_amd64_ones(
        matrix: Matrix, gpu: doctor.Gpu, aarch64: None) -> None:
    assert platforms.host_platform() == "linux/arm64"
    by_cell = {f.what.split(":")[0]: f for f in doctor.cell_findings(matrix.cells, [gpu], "", matrix.cells)}
    arm = by_cell[ARM]
    assert arm.level == "ok" and "runs here" in arm.what, arm
    assert f"sm_{gpu.capability[0]}{gpu.capability[1]}" in arm.what  # type: ignore[index]
    amd = by_cell[LATEST]
    assert amd.level == "warn" and "emulation only" in amd.what and "GPU checks are skipped" in amd.what, amd
    assert "linux/amd64" in amd.what and "x86_64 host" in amd.fix and "Grace" not in amd.fix
    # the cell model agrees: the same cells are emulated wherever asked
    assert not cell(matrix, ARM).emulated and cell(matrix, LATEST).emulated



def test_on_an_arm64_host_the_files_meant_for_everyone_stay_the_same(matrix: Matrix, tmp_path: Path, aarch64: None,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """What is emulated here is the host's business; a job's image and the GPU runners' matrix are not."""
    config = tmp_path / "m" / "images.yaml"
    assert cli.main(["launch", "--config", str(config), "--only", ARM, "--target", "jobset", "--no-pin"]) == 0
    assert f"image: pt-multi-gpu:{LATEST}\n" in capsys.readouterr().out  # the registry tag of both platforms
    assert cli.main(["matrix", "--config", str(config), "--json", "--gpu-runners", "ptmg-sm90=9.0"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert ARM not in {r["name"] for r in rows} and LATEST in {r["name"] for r in rows}  # x86_64 runners


def test_doctor_takes_the_host_platform_it_is_given(matrix: Matrix) -> None:
    on_arm = {f.what.split(":")[0]: f.level for f in doctor.cell_findings(matrix.cells, [GH200], "",
                                                                          host="linux/arm64")}
    on_x86 = {f.what.split(":")[0]: f.level for f in doctor.cell_findings(matrix.cells, [H200_580], "",
                                                                          host="linux/amd64")}
    assert (on_arm[ARM], on_arm[LATEST]) == ("ok", "warn")
    assert (on_x86[ARM], on_x86[LATEST]) == ("warn", "ok")


def test_an_arch_refusal_on_a_new_driver_names_other_cells_not_a_driver_upgrade(matrix: Matrix) -> None:
    (old,) = [f for f in doctor.cell_findings(matrix.cells, [H200], "", host="linux/amd64")
              if f.what.startswith(OLD)]
    assert old.level == "fail" and "sm_90" in old.what
    assert "upgrade" not in old.fix and "450.80.02" not in old.fix, old.fix
    assert "code for sm_90" in old.fix and MID in old.fix and LATEST not in old.fix, old.fix  # LATEST needs 580


def test_a_driver_refusal_names_the_upgrade(matrix: Matrix) -> None:
    (f,) = doctor.cell_findings([cell(matrix, LATEST)], [doctor.Gpu("NVIDIA H200", "550.54.15", (9, 0))], "",
                                host="linux/amd64")
    assert f.level == "fail" and "upgrade the NVIDIA driver (550.54.15) to >= 580" in f.fix, f.fix
    assert "code for" not in f.fix


def test_doctor_warns_where_only_ptx_jit_runs_and_where_the_driver_is_too_old_for_it(matrix: Matrix) -> None:
    base = cell(matrix, LATEST)
    ptx = dataclasses.replace(base, arch_list=("sm_80", "sm_90", "compute_90"))
    b200 = doctor.Gpu("NVIDIA B200", "590.44.01", (10, 0))
    ok, jit = doctor.cell_findings([ptx], [b200], "", host="linux/amd64")
    assert ok.level == "ok" and jit.level == "warn", (ok, jit)
    assert "no cubin for sm_100" in jit.what and "PTX JIT of compute_90" in jit.what
    assert "refuse" not in jit.what
    older = dataclasses.replace(b200, driver="580.65.06")  # >= 580 (runs) but < 580.95.05 (CUDA 13.0.2's)
    ok, jit = doctor.cell_findings([ptx], [older], "", host="linux/amd64")
    assert ok.level == "ok" and jit.level == "warn"
    assert base.min_driver_full == "580.95.05" and "older than 580.95.05" in jit.what and "refuse" in jit.what
    assert ">= 580.95.05" in jit.fix
    # a cubin for the GPU: no warning
    assert [f.level for f in doctor.cell_findings([base], [older], "", host="linux/amd64")] == ["ok"]
