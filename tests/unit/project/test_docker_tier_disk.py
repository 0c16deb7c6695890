"""The docker tier refuses to start where it would fill the disk part-way (tests/docker/conftest.py)."""

from __future__ import annotations

from tests.docker.conftest import FREE_GB_NEEDED, disk_shortfall


def test_an_empty_engine_with_too_little_disk_is_refused_with_the_figures_and_the_fix() -> None:
    why = disk_shortfall(35.2, cells_present=False)  # what a run left by a killed one had
    assert why is not None
    assert f"needs {FREE_GB_NEEDED['empty']} GB" in why and "has 35.2 GB" in why and "Fix:" in why


def test_built_cells_lower_the_need_and_enough_disk_starts() -> None:
    assert disk_shortfall(35.2, cells_present=True) is None
    assert disk_shortfall(80.0, cells_present=False) is None
    assert disk_shortfall(FREE_GB_NEEDED["with the cells"] - 0.1, cells_present=True) is not None
