"""No test passes by skipping what it claims.

- **Unit tier** (tests/unit/conftest.py takes :func:`unit_tier_report` and
  :func:`unit_tier_collect_report` as its hooks): a skip or an xfail there is a failure, unless
  the test is marked ``@pytest.mark.allowed_skip(reason="...")`` with a reason. So a test that
  expects a failure and meets a skip (``pytest.skip`` escapes ``pytest.raises(pytest.fail.Exception)``:
  both are ``OutcomeException``, neither a subclass of the other) fails instead of passing quietly,
  and the unit tier reports 0 unexpected skips.
- **Docker tier** (tests/docker/conftest.py takes :func:`docker_tier_report` and
  :func:`docker_tier_collect_report`): the same rule, with one listed exception: a ``gpu``-marked
  test skips where ``PTMG_GPU_TESTS=1`` is not set (a GPU runner sets it, and there those tests
  must run). A docker test that skips because a tool or an image is missing fails the run. The
  summary (:func:`docker_tier_summary`) lists every skip that remains with its reason, one line
  each, not grouped by reason as ``-rs`` does.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import pytest

MARKER = "allowed_skip"
GPU_MARKER = "gpu"
GPU_ENV = "PTMG_GPU_TESTS"
MARKER_HELP = f"{MARKER}(reason): this test may skip, for the reason given (any other skip fails its tier)"


def skip_reason(report: Any) -> str:
    """The reason pytest recorded for a skipped (or xfailed) report."""
    if getattr(report, "wasxfail", None) is not None:
        return f"xfail: {report.wasxfail or 'no reason given'}"
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: why")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "no reason given")


def _allowed(item: pytest.Item | None) -> bool:
    mark = item.get_closest_marker(MARKER) if item is not None else None
    return mark is not None and bool(mark.kwargs.get("reason") or (mark.args and mark.args[0]))


def gpu_exempt(item: pytest.Item | None, environ: Mapping[str, str]) -> bool:
    """The docker tier's listed exception: a ``gpu``-marked test off a GPU runner (``PTMG_GPU_TESTS`` not 1)."""
    return item is not None and item.get_closest_marker(GPU_MARKER) is not None and environ.get(GPU_ENV) != "1"


def _refuse(report: Any, what: str, tier: str) -> None:
    why = skip_reason(report)
    if hasattr(report, "wasxfail"):
        del report.wasxfail
    report.outcome = "failed"
    report.longrepr = (f"{what} skipped in the {tier} tier ({why}): a {tier} test never passes by skipping. "
                       f"Make it fail where it cannot check what it claims, or mark it "
                       f"@pytest.mark.{MARKER}(reason=...) if skipping is the behaviour under test.")


@pytest.hookimpl(hookwrapper=True)
def unit_tier_report(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """pytest_runtest_makereport: an unmarked skip or xfail becomes a failure."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not _allowed(item):
        _refuse(report, item.nodeid, "unit")


@pytest.hookimpl(hookwrapper=True)
def unit_tier_collect_report(collector: pytest.Collector) -> Any:
    """pytest_make_collect_report: a module that skips itself (``pytest.importorskip``) fails."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        _refuse(report, collector.nodeid, "unit")


@pytest.hookimpl(hookwrapper=True)
def docker_tier_report(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """pytest_runtest_makereport: an unmarked skip or xfail becomes a failure, but for a ``gpu``
    test off a GPU runner (:func:`gpu_exempt`)."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not _allowed(item) and not gpu_exempt(item, os.environ):
        _refuse(report, item.nodeid, "docker")


@pytest.hookimpl(hookwrapper=True)
def docker_tier_collect_report(collector: pytest.Collector) -> Any:
    """pytest_make_collect_report: a docker module that skips itself fails."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        _refuse(report, collector.nodeid, "docker")


def skip_lines(reports: Iterable[Any]) -> list[str]:
    """One line per skipped test: its node id and its reason."""
    return [f"SKIPPED {r.nodeid}: {skip_reason(r)}" for r in reports]


def docker_tier_summary(terminalreporter: Any) -> None:
    """pytest_terminal_summary: every skip (and xfail) of the run, each with its reason."""
    reports = [*terminalreporter.stats.get("skipped", []), *terminalreporter.stats.get("xfailed", [])]
    terminalreporter.section(f"{len(reports)} skipped test(s), each with its reason", sep="=")
    for line in skip_lines(reports) or ["(none)"]:
        terminalreporter.write_line(line)
