"""No test passes by skipping (tests/skipguard.py): the unit tier's and the docker tier's hooks, each run
by a real pytest in a subprocess over a few small tests, and the docker tier's list of skips with their reasons."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from xml.etree import ElementTree

from tests import skipguard
from tests.support import ROOT

#: The unit tier's own hooks, taken from tests/unit/conftest.py (not re-declared here), and the
#: marker's registration from tests/conftest.py.
CONFTEST = textwrap.dedent("""
    from tests.conftest import pytest_configure
    from tests.unit.conftest import pytest_make_collect_report, pytest_runtest_makereport
""")

TESTS = textwrap.dedent("""
    import pytest

    def expects_a_failure():
        pytest.skip("only one GPU")  # the code skipped where it had to fail

    def test_skip_escapes_raises_fail():
        with pytest.raises(pytest.fail.Exception):
            expects_a_failure()

    def test_plain_skip():
        pytest.skip("no reason to run")

    @pytest.mark.skipif(True, reason="a condition")
    def test_skipif():
        pass

    @pytest.mark.xfail(reason="known broken")
    def test_xfail():
        assert False

    @pytest.fixture
    def skipping_fixture():
        pytest.skip("fixture says no")

    def test_skip_in_a_fixture(skipping_fixture):
        pass

    @pytest.mark.allowed_skip(reason="the skip is what this test checks")
    def test_allowed():
        pytest.skip("allowed here")

    @pytest.mark.allowed_skip
    def test_allowed_without_a_reason():
        pytest.skip("a marker without a reason allows nothing")

    def test_passes():
        pass
""")

SKIPPING_MODULE = "import pytest\npytest.importorskip('ptmg_no_such_module')\n\ndef test_never(): pass\n"


#: The docker tier's hooks, taken from tests/docker/conftest.py the same way (by text: importing that
#: conftest would start its session fixtures' imports of the Docker SDK helpers, not its hooks).
DOCKER_CONFTEST = textwrap.dedent("""
    from tests.conftest import pytest_configure
    from tests import skipguard
""") + "\n".join(line for line in (ROOT / "tests" / "docker" / "conftest.py").read_text().splitlines()
                 if line.startswith(("pytest_runtest_makereport =", "pytest_make_collect_report =")))

GPU_TESTS = textwrap.dedent("""
    import pytest

    @pytest.mark.gpu
    @pytest.mark.skipif(True, reason="GPU smoke runs only with PTMG_GPU_TESTS=1")
    def test_gpu_off_a_runner():
        pass

    @pytest.mark.gpu
    def test_gpu_skipping_in_its_body():
        pytest.skip("no GPU here")
""")


def _run(tmp_path: Path, conftest: str = CONFTEST, gpu_env: str | None = None) -> dict[str, str]:
    """Each test's outcome (and each module's, when collecting it failed), from a real pytest run."""
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_cases.py").write_text(TESTS)
    (tmp_path / "test_module_skip.py").write_text(SKIPPING_MODULE)
    (tmp_path / "test_gpu_cases.py").write_text(GPU_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: as pyproject.toml registers it\n")
    xml = tmp_path / "junit.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PTMG_GPU_TESTS", None)
    if gpu_env is not None:
        env["PTMG_GPU_TESTS"] = gpu_env
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                    "--strict-markers", "--continue-on-collection-errors", "--junitxml", str(xml), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                   text=True, timeout=120, check=False)
    outcomes: dict[str, str] = {}
    for case in ElementTree.parse(xml).iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name") or case.get("classname") or ""] = "failed" if {"failure", "error"} & set(kinds) \
            else "skipped" if kinds else "passed"
    return outcomes


EVERY_OTHER_SKIP_FAILS = {
    "test_skip_escapes_raises_fail": "failed", "test_plain_skip": "failed", "test_skipif": "failed",
    "test_xfail": "failed", "test_skip_in_a_fixture": "failed", "test_allowed_without_a_reason": "failed",
    "test_module_skip": "failed"}


def test_a_skip_in_the_unit_tier_fails_unless_marked_with_a_reason(tmp_path: Path) -> None:
    got = _run(tmp_path)
    assert got.pop("test_allowed") == "skipped"
    assert got.pop("test_passes") == "passed"
    # The gpu exception is the docker tier's: a unit test never skips for want of a GPU.
    assert got.pop("test_gpu_off_a_runner") == got.pop("test_gpu_skipping_in_its_body") == "failed"
    # Every other way to skip (or xfail) fails, the skip that escapes pytest.raises(fail) first of all.
    assert got == EVERY_OTHER_SKIP_FAILS, got


def test_a_skip_in_the_docker_tier_fails_unless_marked_or_a_gpu_test_off_a_gpu_runner(tmp_path: Path) -> None:
    assert "pytest_runtest_makereport" in DOCKER_CONFTEST and "pytest_make_collect_report" in DOCKER_CONFTEST
    got = _run(tmp_path, DOCKER_CONFTEST)
    assert got.pop("test_allowed") == "skipped"
    assert got.pop("test_passes") == "passed"
    # The listed exception: a gpu test, where PTMG_GPU_TESTS=1 is not set.
    assert got.pop("test_gpu_off_a_runner") == got.pop("test_gpu_skipping_in_its_body") == "skipped"
    assert got == EVERY_OTHER_SKIP_FAILS, got


def test_on_a_gpu_runner_a_gpu_test_that_skips_fails(tmp_path: Path) -> None:
    got = _run(tmp_path, DOCKER_CONFTEST, gpu_env="1")
    assert (got["test_gpu_off_a_runner"], got["test_gpu_skipping_in_its_body"]) == ("failed", "failed"), got
    assert got["test_allowed"] == "skipped" and got["test_plain_skip"] == "failed"


def test_the_docker_tier_lists_each_skip_with_its_reason() -> None:
    skipped = SimpleNamespace(nodeid="tests/docker/test_runtime.py::test_gpu[0]", longrepr=(
        "tests/docker/test_runtime.py", 12, "Skipped: no GPU on this host"))
    xfailed = SimpleNamespace(nodeid="tests/docker/test_smoke.py::test_x", longrepr=None, wasxfail="known bug")
    assert skipguard.skip_lines([skipped, xfailed]) == [
        "SKIPPED tests/docker/test_runtime.py::test_gpu[0]: no GPU on this host",
        "SKIPPED tests/docker/test_smoke.py::test_x: xfail: known bug"]

    class Reporter:
        def __init__(self) -> None:
            self.stats = {"skipped": [skipped], "xfailed": [xfailed], "passed": [object()]}
            self.lines: list[str] = []

        def section(self, title: str, sep: str = "=") -> None:
            self.lines.append(f"== {title}")

        def write_line(self, line: str) -> None:
            self.lines.append(line)

    reporter = Reporter()
    skipguard.docker_tier_summary(reporter)
    assert reporter.lines == ["== 2 skipped test(s), each with its reason",
                              "SKIPPED tests/docker/test_runtime.py::test_gpu[0]: no GPU on this host",
                              "SKIPPED tests/docker/test_smoke.py::test_x: xfail: known bug"]


def test_the_docker_tier_conftest_prints_that_summary() -> None:
    text = (ROOT / "tests" / "docker" / "conftest.py").read_text()
    assert "pytest_terminal_summary = skipguard.docker_tier_summary" in text


def test_every_skip_in_the_docker_tier_is_a_gpu_test_or_marked_with_a_reason() -> None:
    """Each `skipif` written in tests/docker sits on a test marked `gpu` or `allowed_skip(reason=...)`, and
    each `pytest.skip(...)` in a test's body on one marked `allowed_skip(reason=...)` (on a GPU runner the
    gpu exception is gone). The hook enforces it at run time; this names an unmarked one before any engine runs."""
    import ast

    unmarked: list[str] = []
    for path in sorted((ROOT / "tests" / "docker").glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")):
            marks = {ast.unparse(d) for d in fn.decorator_list}
            allowed = any(m.startswith("pytest.mark.allowed_skip(reason=") for m in marks)
            decorated = " ".join(marks)
            body = "\n".join(ast.unparse(stmt) for stmt in fn.body)
            if "pytest.skip(" in body:
                if not allowed:
                    unmarked.append(f"{path.name}::{fn.name} (pytest.skip in its body)")
            elif ("skipif" in decorated or "needs_gpu_runner" in decorated or "xfail" in decorated) and not (
                    allowed or "pytest.mark.gpu" in marks):
                unmarked.append(f"{path.name}::{fn.name} (a skip marker)")
    assert not unmarked, unmarked
