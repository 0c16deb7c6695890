"""The docker tier's one README selftest per cell (tests/docker/readme_selftest.py): read back as each
check's outcome, and run once however many tests ask for it."""

from __future__ import annotations

import subprocess
from concurrent.futures import Future

from tests.docker import readme_selftest

SUMMARY = """\
..F.s
  PASS  not_a_check_before_the_summary  0.0s
pt-multi-gpu selftest: 2.14.1-cuda13.0-cudnn9-runtime in docker, as uid 1000
  PASS  test_compile_claim                           14.7s
  FAIL  test_compile_model_cpu                        4.0s
  SKIP  test_devel_toolkit                            0.0s  runtime image: no CUDA toolkit (nvcc)
  ERROR test_rdma_rdmacm                              0.0s
  PASS  test_rdma_ibverbs[libibverbs.so.1]            0.0s
33 passed, 1 failed, 10 skipped in 104.6s
"""


def test_each_checks_outcome_comes_from_the_summary_only() -> None:
    assert readme_selftest.outcomes(SUMMARY) == {
        "test_compile_claim": "PASS", "test_compile_model_cpu": "FAIL", "test_devel_toolkit": "SKIP",
        "test_rdma_rdmacm": "ERROR", "test_rdma_ibverbs[libibverbs.so.1]": "PASS"}


def test_no_summary_is_no_outcome() -> None:
    assert readme_selftest.outcomes("docker: Error response from daemon\n  PASS  test_compile_claim") == {}


def test_the_run_is_made_once_per_cell_and_again_when_it_was_cancelled(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(readme_selftest, "RUNS", {})
    calls: list[list[str]] = []

    def fake_run(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, "out", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    labels = {"project": "pt-multi-gpu", "session": "s1"}
    first = readme_selftest.result("cell-a", "pt-multi-gpu", labels)
    assert readme_selftest.result("cell-a", "pt-multi-gpu:cell-a", labels) is first
    assert calls == [["docker", "run", "--rm", "--label", "project=pt-multi-gpu", "--label", "session=s1",
                      "pt-multi-gpu", "selftest"]]

    cancelled: Future[subprocess.CompletedProcess[str]] = Future()
    cancelled.cancel()
    readme_selftest.RUNS["cell-b"] = cancelled  # a pool shut down before it started this one
    assert readme_selftest.result("cell-b", "pt-multi-gpu:cell-b", labels).returncode == 0
    assert len(calls) == 2


def test_a_run_that_timed_out_fails_every_test_that_reads_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(readme_selftest, "RUNS", {})
    calls: list[list[str]] = []

    def slow(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        raise subprocess.TimeoutExpired(argv, readme_selftest.TIMEOUT_S)

    monkeypatch.setattr(subprocess, "run", slow)
    for _ in range(2):
        try:
            readme_selftest.result("cell-c", "ref", {})
        except subprocess.TimeoutExpired:
            continue
        raise AssertionError("a timed-out run read as a result")
    assert len(calls) == 1
