"""Long work the docker tier starts at the session's start and collects later: building the
native cells other than the one under test, and the arm64 cell's emulated build and test.

On a 2-core machine most of the tier waits on containers (a service starting, a port answering,
a job's ranks meeting); the emulated arm64 build keeps one core busy with qemu for 15 minutes and
more. Run in order, one after the other, they add up; started together, the background soaks up
the time the tests leave idle. A :class:`Job` is a list of `build.py` (or other) commands run one
after another in a thread, each a subprocess with its output kept; the first that fails ends it.
A test that needs a step's result waits for that step (:meth:`Job.step`), never longer than the
step's own time limit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import stop_process

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    timeout: float
    env: dict[str, str] = field(default_factory=dict)
    builds: bool = True  # it runs image builds (the tier prunes the build cache only when none does)


@dataclass(frozen=True)
class Done:
    """How a step ended: its exit status (-1: past its time limit, or stopped), output, wall time."""

    name: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float


class Job:
    """``steps`` run in order in a background thread from :meth:`start` on; output is also written
    to ``log`` as it ends, for the test artifacts. Each step runs with this process's environment
    and its own ``env``. ``data`` is the starter's own (what it knew then).
    Whatever happens in the thread (a step that cannot start, a full disk for the log), the job
    ends with a :class:`Done` that says so and wakes every waiter: no test waits for nothing."""

    def __init__(self, name: str, steps: list[Step], log: Path, data: Any = None) -> None:
        self.name, self.steps, self.log, self.data = name, steps, log, data
        self.done: dict[str, Done] = {}
        self._proc: subprocess.Popen[str] | None = None
        self._current: Step | None = None
        self._finished = False
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # _stopped's check and the start of a step, against stop()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"background {name}", daemon=True)

    def start(self) -> Job:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text(f"background job {self.name}: {len(self.steps)} step(s)\n")
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._finished

    @property
    def building(self) -> bool:
        """A step that builds images is running."""
        step = self._current
        return self.running and step is not None and step.builds

    def _run(self) -> None:
        step: Step | None = None
        try:
            for step in self.steps:
                done = self._run_step(step)
                if done is None or done.returncode != 0:
                    break
        except BaseException:  # reported as the step's result, never lost with the thread
            if step is not None and step.name not in self.done:
                self._record(Done(step.name, -1, "", f"[background] {step.name} could not run:\n"
                                  f"{traceback.format_exc()}", 0.0))
        finally:
            self._current = None
            with self._changed:
                self._finished = True
                self._changed.notify_all()

    def _run_step(self, step: Step) -> Done | None:
        t0 = time.monotonic()
        with self._lock:
            if self._stopped.is_set():
                return None
            self._current = step
            self._proc = proc = subprocess.Popen(
                list(step.argv), cwd=ROOT, env={**os.environ, **step.env}, text=True, encoding="utf-8",
                errors="replace", stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        try:
            out, err = proc.communicate(timeout=step.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            interrupt(proc)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a grandchild holds the pipes: what was read is lost
                out, err = "", ""
            rc, err = -1, f"{err}\n[background] {step.name}: past its {step.timeout:.0f} s limit, stopped"
        done = Done(step.name, rc if not self._stopped.is_set() else -1, out, err, time.monotonic() - t0)
        self._record(done, step.argv)
        return done

    def _record(self, done: Done, argv: tuple[str, ...] = ()) -> None:
        with self._changed:
            self.done[done.name] = done
            self._changed.notify_all()
        with self.log.open("a") as f:
            f.write(f"\n== {done.name} ({' '.join(argv)}): exit {done.returncode} after {done.seconds:.0f} s\n"
                    f"-- stdout\n{done.stdout}\n-- stderr\n{done.stderr}\n")

    def step(self, name: str) -> Done | None:
        """Wait for step ``name`` to end; None when the job ended without running it (an earlier
        step failed: that step's :class:`Done` says why)."""
        with self._changed:
            self._changed.wait_for(lambda: name in self.done or self._finished, timeout=self._limit)
            return self.done.get(name)

    @property
    def _limit(self) -> float:
        """The longest the whole job can take: every step's limit, and time to stop each."""
        return sum(s.timeout + 120 for s in self.steps)

    def failed_step(self) -> Done | None:
        return next((d for d in self.done.values() if d.returncode != 0), None)

    def wait(self) -> None:
        """Until every step ran or one failed."""
        with self._changed:
            self._changed.wait_for(lambda: self._finished, timeout=self._limit)

    def stop(self) -> None:
        """Stop the running step (SIGINT, then SIGKILL: build.py removes what it started) and run
        no more."""
        with self._lock:
            self._stopped.set()
            proc = self._proc
        if proc is not None:
            interrupt(proc)
        self._thread.join(180)


def interrupt(proc: subprocess.Popen[str]) -> None:
    """SIGINT first, as Ctrl-C: build.py's cleanups run (its containers and networks are removed),
    which SIGTERM's default would skip; SIGKILL after two minutes."""
    stop_process(proc, grace=120, sig=signal.SIGINT)
