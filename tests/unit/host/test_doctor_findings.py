"""doctor's findings for the cells and the disk (builder/host/doctor.py): no GPU here, a driver
older than a cell's minimum, too little disk. tests/unit/host/test_doctor.py has its verdict per
GPU host."""

from __future__ import annotations

import pytest

from builder.host import doctor
from builder.matrix import ImageSpec
from tests.support import MID, small_matrix
from tests.support import cell as cell_named


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory) -> ImageSpec:
    return cell_named(small_matrix(tmp_path_factory.mktemp("matrix")), MID)


def test_doctor_cells_without_gpu(cell: ImageSpec) -> None:
    (f,) = doctor.cell_findings([cell], [], "nvidia-smi not found")
    assert f.level == "warn" and "no GPU here" in f.what and "525.60.13" in f.fix


def test_doctor_old_driver(cell: ImageSpec) -> None:
    (f,) = doctor.cell_findings([cell], [doctor.Gpu("H100", "470.82.01")], "")
    assert f.level == "fail" and "older than 525.60.13" in f.what
    (g,) = doctor.cell_findings([cell], [doctor.Gpu("H100", "550.54.15")], "")
    assert g.level == "ok"


def test_doctor_disk() -> None:
    assert doctor.disk_finding(100 * doctor.GB, 3).level == "ok"
    assert doctor.disk_finding(5 * doctor.GB, 3).level == "fail"


