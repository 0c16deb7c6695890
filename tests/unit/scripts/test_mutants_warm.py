"""`make mutants`' warm pytest (scripts/mutants_warm.py): each run forks from a server that has imported
pytest but no module of the tree, so a mutated file is seen as a fresh interpreter would see it; a run
past its timeout ends with everything it started; a server holding a module of the tree refuses to serve."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, load_module

warm = load_module("mutants_warm", ROOT / "scripts" / "mutants_warm.py")


def _tree(root: Path) -> Path:
    (root / "mod.py").write_text("def add(a, b):\n    return a + b\n")
    (root / "test_mod.py").write_text("from mod import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    (root / "test_hang.py").write_text(
        "import pathlib, subprocess, time\n\n\ndef test_hang():\n"
        "    child = subprocess.Popen(['sleep', '300'])\n"
        "    pathlib.Path('grandchild.pid').write_text(str(child.pid))\n"
        "    time.sleep(300)\n")
    return root


def _gone(pid: int) -> bool:
    """Whether `pid` has ended (a zombie that no init reaps counts as ended)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return True


ARGS = ["-q", "-x", "-p", "no:cacheprovider"]


@contextlib.contextmanager
def _serving(tree: Path, preload: list[str]) -> Iterator[Any]:
    server = warm.Warm(sys.executable, tree, preload)
    try:
        yield server
    finally:
        server.close()


def test_a_mutated_module_is_seen_by_the_next_run_and_its_restoring_by_the_one_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    tree = _tree(tmp_path)
    dump = tmp_path / "modules.json"  # the baseline's run names what the server imports first
    assert subprocess.run(warm.dump_argv(sys.executable, dump, [*ARGS, "test_mod.py"]), cwd=tree,
                          capture_output=True, check=False).returncode == 0
    preload = json.loads(dump.read_text())
    assert {"pytest", "json", "subprocess"} <= set(preload) and not {"mod", "test_mod"} & set(preload)
    with _serving(tree, preload) as server:
        status, out = server.run([*ARGS, "test_mod.py"], 60)
        assert (status, out.strip().splitlines()[-1].split(" in ")[0]) == (0, "1 passed")
        (tree / "mod.py").write_text("def add(a, b):\n    return a - b\n")  # the mutant
        status, out = server.run([*ARGS, "test_mod.py"], 60)
        assert status == 1 and "FAILED test_mod.py::test_add" in out
        (tree / "mod.py").write_text("def add(a, b):\n    return a + b\n")  # restored
        assert server.run([*ARGS, "test_mod.py"], 60)[0] == 0


def test_a_run_past_its_timeout_ends_with_what_it_started_and_the_server_serves_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    tree = _tree(tmp_path)
    with _serving(tree, []) as server:
        began = time.monotonic()
        status, _ = server.run([*ARGS, "test_hang.py"], 3)
        assert status is None and time.monotonic() - began < 30
        pid = int((tree / "grandchild.pid").read_text())
        deadline = time.monotonic() + 10
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(pid), f"the test's own child {pid} outlived the timeout"
        assert server.run([*ARGS, "test_mod.py"], 60)[0] == 0


def test_a_server_that_holds_a_module_of_the_tree_refuses_to_serve(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    tree = _tree(tmp_path)
    with pytest.raises(warm.Cold, match=r"would not be clean: .*modules of the tree \['mod'\]"):
        warm.Warm(sys.executable, tree, ["mod"])  # a mutant of the tree's module would go unseen
