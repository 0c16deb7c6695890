"""Check this image on this host: versions, GPUs, a DDP job, the seed templates.

    selftest                      # everything; GPU checks skip without a GPU
    selftest --require-gpu        # a missing GPU is a failure (for GPU hosts and CI)
    selftest --require-gpu --require-multi-gpu   # and one GPU (no NCCL transport) is a failure too
    selftest --nproc 4 --junit /workspace/selftest.xml -k "not seed"

Prints one line per check and a summary; exits 0 when nothing failed, 1 when
something failed (or nothing ran), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import where  # noqa: E402 - beside this file

DEFAULT_OUT = "/workspace/runs/ddp-smoke"


class Recorder:
    """A pytest plugin that keeps one outcome per test id, for the summary."""

    def __init__(self) -> None:
        self.rows: dict[str, list[Any]] = {}
        self.order: list[str] = []

    def pytest_runtest_logreport(self, report: Any) -> None:
        nodeid = report.nodeid.split("::", 1)[-1]
        if nodeid not in self.rows:
            self.rows[nodeid] = ["passed", 0.0, ""]
            self.order.append(nodeid)
        row = self.rows[nodeid]
        row[1] += report.duration
        if report.skipped and row[0] == "passed":
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            row[0], row[2] = "skipped", str(reason).replace("Skipped: ", "")
        elif report.failed:
            row[0] = "failed" if report.when == "call" else "error"
            row[2] = _first_line(report)

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.rows[report.nodeid or "collection"] = ["error", 0.0, _first_line(report)]
            self.order.append(report.nodeid or "collection")


def _first_line(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0] if text.strip() else ""


def default_out() -> str:
    parent = os.path.dirname(os.path.dirname(DEFAULT_OUT))
    if os.path.isdir(parent) and os.access(parent, os.W_OK):
        return DEFAULT_OUT
    return tempfile.mkdtemp(prefix="ptmg-selftest-")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="selftest", description=__doc__.split("\n\n")[0])
    p.add_argument("--require-gpu", action="store_true",
                   help="fail (instead of skip) the GPU checks when no GPU is visible")
    p.add_argument("--require-multi-gpu", action="store_true",
                   help="with --require-gpu: fail, instead of skip, the DDP checks that need two GPUs when "
                        "only one is visible (at one rank NCCL moves no byte between ranks)")
    p.add_argument("--nproc", type=int, default=None,
                   help="DDP ranks: default one per visible GPU (NCCL; more are clamped to the GPUs), "
                        "else 2 CPU ranks (gloo)")
    p.add_argument("--out", default=None,
                   help=f"results folder (default {DEFAULT_OUT}, else a temporary one)")
    p.add_argument("--junit", default=None, help="write JUnit XML here (default OUT/junit.xml)")
    p.add_argument("--expect", default=None, metavar="FILE",
                   help="JSON of expected versions (image labels or names); overrides PTMG_*")
    p.add_argument("--expect-json", default=None, metavar="JSON", help="the same, inline")
    p.add_argument("-k", dest="keyword", default=None, help="only checks matching this pytest -k")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="hard limit in seconds for each torchrun launch (default %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true", help="pytest's own output too")
    args = p.parse_args(argv)
    if args.nproc is not None and args.nproc < 1:
        p.error("--nproc must be >= 1")
    if args.require_multi_gpu and not args.require_gpu:
        p.error("--require-multi-gpu needs --require-gpu")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import pytest
    except ImportError:
        print("selftest: pytest is not installed in this environment", file=sys.stderr)
        return 2
    expect: dict[str, Any] = {}
    try:
        if args.expect:
            with open(args.expect) as fh:
                expect.update(json.load(fh))
        if args.expect_json:
            expect.update(json.loads(args.expect_json))
    except (OSError, ValueError) as exc:
        print(f"selftest: cannot read the expected versions: {exc}", file=sys.stderr)
        return 2
    out = args.out or default_out()
    os.makedirs(out, exist_ok=True)
    junit = args.junit or os.path.join(out, "junit.xml")
    os.makedirs(os.path.dirname(os.path.abspath(junit)), exist_ok=True)

    pytest_args = [HERE, "-c", os.path.join(HERE, "pytest.ini"), "--rootdir", HERE,
                   "--junitxml", junit, "--smoke-out", out, "--ddp-timeout", str(args.timeout),
                   "--expect-json", json.dumps(expect)]
    if args.require_gpu:
        pytest_args.append("--require-gpu")
    if args.require_multi_gpu:
        pytest_args.append("--require-multi-gpu")
    if args.nproc is not None:
        pytest_args += ["--nproc", str(args.nproc)]
    if args.keyword:
        pytest_args += ["-k", args.keyword]
    pytest_args += ["-v"] if args.verbose else ["-q", "--no-header", "--tb=short"]

    recorder = Recorder()
    t0 = time.monotonic()
    code = int(pytest.main(pytest_args, plugins=[recorder]))
    wall = time.monotonic() - t0

    counts = {k: 0 for k in ("passed", "failed", "error", "skipped")}
    width = max([len(n) for n in recorder.order] + [10])
    print(f"pt-multi-gpu selftest: {os.environ.get('PTMG_CELL', 'unknown cell')} "
          f"in {where.runtime()}, as uid {os.getuid()}")
    for nodeid in recorder.order:
        outcome, seconds, note = recorder.rows[nodeid]
        counts[outcome] += 1
        label = {"passed": "PASS", "failed": "FAIL", "error": "ERROR", "skipped": "SKIP"}[outcome]
        print(f"  {label:<5} {nodeid:<{width}} {seconds:6.1f}s  {note}".rstrip())
    print(f"{counts['passed']} passed, {counts['failed'] + counts['error']} failed, "
          f"{counts['skipped']} skipped in {wall:.1f}s (JUnit: {junit}; results: {out})")
    if counts["failed"] or counts["error"] or code not in (0, 5):
        return 1
    if counts["passed"] == 0:
        print("selftest: no check passed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
