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
