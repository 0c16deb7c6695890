"""A warm pytest per scratch copy: each mutant's test run forks from a process that has already imported
pytest and the standard-library and installed modules the tests use, instead of starting Python anew.

A fresh interpreter with pytest and the unit tier's conftest costs about 0.35 s before a test runs, and
most mutants are killed in a fraction of that: over the 2,500 mutants of `make mutants` that start was a
third of the run. The server never imports a module of the tree (builder/, entrypoint/, smoke_tests/,
tests/; it refuses to serve if one got in): each child imports those itself, so it sees the mutated file
as a fresh `python -m pytest` would. A child runs `pytest.main` in a session of its own (a timeout kills
its whole process group); its exit status and output are what cosmic-ray's own run gives.
scripts/mutants.py uses it unless `--cold`.

Protocol, one line each way: the request `{"args": [...], "out": PATH}`; the answers `PID` once the
child has started and `STATUS` once it has ended (its exit status, or minus the signal that ended it).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# The baseline's pytest run, then the modules it holds that a warm server may import first: the
# standard library's and the installed packages' only, never the tree's or a stand-in that a test
# wrote to a temporary folder.
DUMP = """
import json, sys, sysconfig, pytest
rc = pytest.main(sys.argv[2:])
roots = tuple({sysconfig.get_path(k) + "/" for k in ("stdlib", "platstdlib", "purelib", "platlib")})
names = [n for n, m in list(sys.modules.items()) if n != "__main__" and (
    n in sys.builtin_module_names or str(getattr(m, "__file__", None) or "").startswith(roots))]
with open(sys.argv[1], "w") as f:
    json.dump(sorted(names), f)
sys.exit(rc)
"""

SERVER = """
import importlib, json, os, sys, threading
sys.path[0] = os.getcwd()  # as `python -m pytest` has it: a test's chdir does not move the tree
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except BaseException:
        pass
import pytest
here = os.getcwd() + "/"
tree = [n for n, m in list(sys.modules.items()) if str(getattr(m, "__file__", None) or "").startswith(here)]
out = os.fdopen(1, "w", buffering=1)
print("ready" if threading.active_count() == 1 and not tree else
      f"{threading.active_count()} threads, modules of the tree {tree[:3]}", file=out)
while line := sys.stdin.readline():
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setsid()
            fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            code = int(pytest.main(req["args"]))
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    print(pid, file=out)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), file=out)
"""


def dump_argv(py: str, dump: Path, pytest_args: list[str]) -> list[str]:
    """The baseline's command: pytest `pytest_args`, then the names of the modules to preload, to `dump`."""
    return [py, "-c", DUMP, str(dump), *pytest_args]


class Cold(Exception):
    """The warm server cannot serve (a thread or a module of the tree in it, or it ended)."""


class Warm:
    """One server in `scratch`, one test run at a time."""

    def __init__(self, py: str, scratch: Path, preload: list[str]) -> None:
        self.scratch, self.child = scratch, 0
        self.proc = subprocess.Popen([py, "-c", SERVER, json.dumps(preload)], cwd=scratch, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out, self._buf = self.proc.stdin, self.proc.stdout.fileno(), b""
        first = self._line(time.monotonic() + 300)
        if first != "ready":
            self.close()
            raise Cold(f"the warm pytest in {scratch} would not be clean: {first}")

    def _line(self, deadline: float | None) -> str | None:
        """The server's next line, or None at `deadline` (None: as long as it takes)."""
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._out], [], [], left)[0]:
                return None
            chunk = os.read(self._out, 4096)
            if not chunk:
                raise Cold(f"the warm pytest in {self.scratch} ended (status {self.proc.wait()})")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def run(self, args: list[str], timeout: float) -> tuple[int | None, str]:
        """pytest `args` in a fork: (its exit status, its output), or (None, its output) when it ran past
        `timeout` seconds and its process group was killed."""
        out = self.scratch / ".mutants-run.out"
        self._in.write((json.dumps({"args": args, "out": str(out)}) + "\n").encode())
        self._in.flush()
        self.child = int(self._line(time.monotonic() + 60) or 0)
        if not self.child:
            raise Cold(f"the warm pytest in {self.scratch} started no run in 60 s")
        status = self._line(time.monotonic() + timeout)
        if status is None:
            self._kill()
            self._line(None)  # the server has reaped it
        self.child = 0
        text = out.read_text(encoding="utf-8", errors="replace") if out.exists() else ""
        return (None if status is None else int(status)), text

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child, signal.SIGKILL)

    def close(self) -> None:
        """The server and a run still going (an interrupted `make mutants`) end."""
        if self.child:
            self._kill()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start(py: str, scratch: Path, preload: list[str], stack: contextlib.ExitStack) -> Warm | None:
    """The warm server of `scratch`, closed with `stack`; None (the copy runs its mutants cold) when it
    would not be clean."""
    try:
        server = Warm(py, scratch, preload)
    except Cold as e:
        print(f"mutants: {e}; this copy runs its mutants cold", file=sys.stderr, flush=True)
        return None
    stack.callback(server.close)
    return server


def mutate_and_test(mutations: list[Any], warm: Warm, args: list[str], timeout: float) -> Any:
    """cosmic-ray's `mutate_and_test` (8.7, requirements-mutants.txt) with the test run forked from `warm`:
    the same mutation of the file on disk, undone after, the same diff and the same outcomes (a non-zero
    status killed, zero survived, a timeout killed with the output "timeout", an exception incompetent).
    A `Cold` server is raised, the file already restored, for the caller to run the mutant cold."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import _make_diff, use_mutation
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    try:
        (m,) = mutations
        operator = cosmic_ray.plugins.get_operator(m.operator_name)(**(getattr(m, "operator_args", None) or {}))
        with use_mutation(m.module_path, operator, m.occurrence) as (before, after):
            if after is None:
                return WorkResult(worker_outcome=WorkerOutcome.NO_TEST)
            status, output = warm.run(args, timeout)
        outcome = TestOutcome.KILLED if status is None or status != 0 else TestOutcome.SURVIVED
        return WorkResult(output="timeout" if status is None else output, diff="\n".join(
            _make_diff(before, after, m.module_path)), test_outcome=outcome, worker_outcome=WorkerOutcome.NORMAL)
    except Cold:
        raise
    except Exception:
        return WorkResult(output=traceback.format_exc(), test_outcome=TestOutcome.INCOMPETENT,
                          worker_outcome=WorkerOutcome.EXCEPTION)
