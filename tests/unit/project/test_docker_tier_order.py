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


def test_every_module_on_the_second_engine_runs_after_the_native_builds_and_arm64_and_before_the_export() -> None:
    """The second engine's data-root peaks at about 19 GB: beside the native cells' background builds, the
    arm64 cell (its image and wheels, ~8 GB, gone once test_arm64 ran), or the export, the disk's low point
    would fall under 15 GB free (CI's run ran out of disk in the containerd store's build when test_arm64
    still came after it)."""
    run_last = _tuple("RUN_LAST")
    users = sorted(p.name for p in DOCKER.glob("test_*.py") if "from .engine28 import" in p.read_text())
    assert users, "no docker module starts the second engine: drop this test"
    repro_only = {p for p in users if "pytestmark = pytest.mark.repro" in (DOCKER / p).read_text()}
    in_make_test = [m for m in users if m not in repro_only]
    assert [m for m in in_make_test if m not in run_last] == []
    for m in in_make_test:
        assert run_last.index("test_arm64.py") < run_last.index(m) < run_last.index("test_hpc_export.py"), m
    assert "not repro" in (ROOT / "Makefile").read_text()  # repro's module stays out of make test


def test_the_session_removes_only_the_native_cells_it_made() -> None:
    """After the native modules, the docker tier removes what its background build made, never a ref that
    was in the engine before the session (a user's `make images`), and `latest` only where it made it."""
    from types import SimpleNamespace

    from tests.docker.conftest import session_native_refs

    cells = [SimpleNamespace(ref="pt:a", repository="pt", latest=False),
             SimpleNamespace(ref="pt:b", repository="pt", latest=True)]
    assert session_native_refs(cells, set()) == ["pt:a", "pt:b", "pt:latest"]
    assert session_native_refs(cells, {"pt:a"}) == ["pt:b", "pt:latest"]
    assert session_native_refs(cells, {"pt:b", "pt:latest"}) == ["pt:a"]
    assert session_native_refs(cells, {"pt:a", "pt:b", "pt:latest", "pt:other"}) == []


def test_no_module_after_the_native_cells_are_removed_uses_them() -> None:
    """The native cells the session built are removed after the last USE_NATIVE module: a module after it
    that waits for them, or reads the amd64 twin of the arm64 cell, would find them gone."""
    from tests.docker.conftest import RUN_LAST, USE_NATIVE

    last = max(RUN_LAST.index(m) for m in USE_NATIVE if m in RUN_LAST)
    for name in RUN_LAST[last + 1:]:
        text = (DOCKER / name).read_text()
        assert "wait_for_native_cells" not in text and "AMD" not in text, name
    users = sorted(p.name for p in DOCKER.glob("test_*.py")
                   if "wait_for_native_cells" in p.read_text() or "AMD = " in p.read_text())
    assert [m for m in users if m not in USE_NATIVE] == []


def test_the_native_cells_go_after_the_last_item_of_the_last_module_that_uses_them() -> None:
    """The session's order has one entry per test item (CI's first run with the removal never removed a cell:
    the next item of test_arm64 itself counted as a later user)."""
    from tests.docker.conftest import last_native_user

    order = ["test_build.py", "test_hpc.py", "test_hpc.py", "test_training_features.py", "test_arm64.py",
             "test_arm64.py", "test_arm64.py", "test_modern_engine.py", "test_modern_engine.py"]
    assert last_native_user("test_arm64.py", order)
    assert not last_native_user("test_hpc.py", order) and not last_native_user("test_training_features.py", order)
    assert not last_native_user("test_modern_engine.py", order) and not last_native_user("test_build.py", order)
    assert last_native_user("test_training_features.py", order[:4])  # -k without test_arm64
    assert not last_native_user("test_arm64.py", ["test_hpc.py"])  # not in this session


def test_a_module_that_starts_a_second_tier_session_runs_after_every_build() -> None:
    """A second session of the docker tier (test_sessions: the next `make test` after a killed one) prunes
    the build cache after its module, and knows nothing of this session's background builds: it runs last."""
    run_last = _tuple("RUN_LAST")
    nesting = sorted(p.name for p in DOCKER.glob("test_*.py") if '"-m", "pytest"' in p.read_text())
    assert nesting == ["test_sessions.py"], nesting
    assert run_last[-1] == "test_sessions.py"
