"""The built image's probe checked against its cell (builder/imaging/probe.py): versions and the
CUDA arch list must be the cell's."""

from __future__ import annotations

import pytest

from builder.imaging import probe
from builder.matrix import ImageSpec
from tests.support import MID, small_matrix
from tests.support import cell as cell_named


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory) -> ImageSpec:
    return cell_named(small_matrix(tmp_path_factory.mktemp("matrix")), MID)


def test_check_probe(cell: ImageSpec) -> None:
    good: dict[str, object] = {"torch": "2.7.0", "torchvision": "0.22.0", "cuda": "12.6", "cudnn": "9.5.1.17", "nccl": "2.26.2",
            "python": "3.11"}
    assert probe.check_probe(cell, good) == []
    bad = {**good, "torchvision": "0.21.0"}
    (msg,) = probe.check_probe(cell, bad)
    assert "torchvision" in msg and "0.21.0" in msg


def test_check_probe_fails_on_an_arch_list_the_compat_data_does_not_match(cell: ImageSpec) -> None:
    """The image's ENV (PTMG_CUDA_ARCH_LIST) and its selftest expect the compat data's list: a
    wheel with another list must fail the build, not the user's selftest."""
    good: dict[str, object] = {"torch": "2.7.0", "torchvision": "0.22.0", "cuda": "12.6", "cudnn": "9.5.1.17",
                               "nccl": "2.26.2", "python": "3.11", "arch_list": list(cell.arch_list)}
    assert probe.check_probe(cell, good) == []
    (msg,) = probe.check_probe(cell, {**good, "arch_list": [*cell.arch_list, "compute_90"]})
    assert "cuda arch list" in msg and "extra ['compute_90']" in msg and "compat_data.yaml" in msg
    (msg,) = probe.check_probe(cell, {**good, "arch_list": list(cell.arch_list[1:])})
    assert f"missing [{cell.arch_list[0]!r}]" in msg
