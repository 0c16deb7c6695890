"""The docker tier's module order (tests/docker/conftest.py): what holds the 4 GB export runs last."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOCKER = ROOT / "tests" / "docker"


def _run_last() -> tuple[str, ...]:
    tree = ast.parse((DOCKER / "conftest.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "RUN_LAST" for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, tuple)
            return value
    raise AssertionError("tests/docker/conftest.py has no RUN_LAST")


def test_every_module_that_takes_the_sessions_export_runs_last_after_the_export_tests() -> None:
    """exported_sqsh lives until the session ends: a module run earlier would hold it beside every build
    (the disk's low point fell to 14 GB when test_pyxis ran third)."""
    run_last = _run_last()
    takers = sorted(p.name for p in DOCKER.glob("test_*.py") if "exported_sqsh" in p.read_text())
    assert takers, "no docker module takes exported_sqsh: drop this test with the fixture"
    assert [m for m in takers if m not in run_last] == []
    assert all(run_last.index(m) >= run_last.index("test_hpc_export.py") for m in takers)


def _tuple(name: str) -> tuple[str, ...]:
    tree = ast.parse((DOCKER / "conftest.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, tuple)
            return value
    raise AssertionError(f"tests/docker/conftest.py has no {name}")


def test_every_module_on_the_second_engine_waits_for_the_native_builds_or_is_out_of_make_test() -> None:
    """The second engine's data-root peaks at about 15 GB: beside the native cells' background builds, or
    beside the export, the disk's low point would fall under 15 GB free."""
    after = _tuple("AFTER_NATIVE")
    users = sorted(p.name for p in DOCKER.glob("test_*.py") if "from .engine28 import" in p.read_text())
    assert users, "no docker module starts the second engine: drop this test with AFTER_NATIVE"
    repro_only = {p for p in users if "pytestmark = pytest.mark.repro" in (DOCKER / p).read_text()}
    assert [m for m in users if m not in after and m not in repro_only] == []
    assert "not repro" in (ROOT / "Makefile").read_text()  # repro's module stays out of make test
