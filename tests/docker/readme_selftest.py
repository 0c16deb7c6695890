"""The README's `docker run --rm IMAGE selftest` of a cell, run once per session and read by every test
that checks a part of it.

test_hpc starts the run of every native cell (two at a time, its `long_runs`) and checks that each passes
as typed; test_training_features reads the compile, RDMA and devel checks from the same runs instead of
running the image's selftest again (each run is one to two minutes of one core). A run that no module has
started yet (a `-k` that selects only test_training_features) runs when it is first asked for.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from concurrent.futures import Future

from . import sessions

#: The session's runs, by cell name.
RUNS: dict[str, Future[subprocess.CompletedProcess[str]]] = {}
TIMEOUT_S = 1500
SUMMARY_HEADER = "pt-multi-gpu selftest: "
#: A line of the selftest's summary: `  PASS  test_compile_claim   14.7s`.
_OUTCOME = re.compile(r"^\s*(PASS|FAIL|ERROR|SKIP)\s+(\S+)", re.M)


def command(ref: str, labels: dict[str, str]) -> list[str]:
    """What the README types, plus this test session's labels on the container."""
    return ["docker", "run", "--rm", *sessions.label_flags(labels), ref, "selftest"]


def runner(ref: str, labels: dict[str, str]) -> Callable[[], subprocess.CompletedProcess[str]]:
    argv = command(ref, labels)
    return lambda: subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


def start(submit: Callable[[Callable[[], subprocess.CompletedProcess[str]]], Future[subprocess.CompletedProcess[str]]],
          cell: str, ref: str, labels: dict[str, str]) -> Future[subprocess.CompletedProcess[str]]:
    """The cell's run: the one the session has, or one handed to `submit` (a pool's) now."""
    future = RUNS.get(cell)
    if future is None or future.cancelled():
        future = RUNS[cell] = submit(runner(ref, labels))
    return future


def result(cell: str, ref: str, labels: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The cell's run, waited for: the one the session started, or one run here and now."""
    return start(_now, cell, ref, labels).result()


def _now(run: Callable[[], subprocess.CompletedProcess[str]]) -> Future[subprocess.CompletedProcess[str]]:
    future: Future[subprocess.CompletedProcess[str]] = Future()
    try:
        future.set_result(run())
    except Exception as exc:  # a timeout: every test that reads this run sees it
        future.set_exception(exc)
    return future


def outcomes(stdout: str) -> dict[str, str]:
    """Each check's outcome in the run's summary (what follows its `pt-multi-gpu selftest:` line):
    {"test_compile_claim": "PASS", ...}; empty when there is no summary."""
    _, header, summary = stdout.rpartition(SUMMARY_HEADER)
    return {m.group(2): m.group(1) for m in _OUTCOME.finditer(summary)} if header else {}
