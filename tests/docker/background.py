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

import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    to ``log`` as it ends, for the test artifacts. ``data`` is the starter's own (what it knew then)."""

    def __init__(self, name: str, steps: list[Step], log: Path, env: dict[str, str], data: Any = None) -> None:
        self.name, self.steps, self.log, self.env, self.data = name, steps, log, env, data
        self.done: dict[str, Done] = {}
        self._proc: subprocess.Popen[str] | None = None
        self._current: Step | None = None
        self._stopped = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"background {name}", daemon=True)

    def start(self) -> Job:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text(f"background job {self.name}: {len(self.steps)} step(s)\n")
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def building(self) -> bool:
        """A step that builds images is running."""
        step = self._current
        return self.running and step is not None and step.builds

    def _run(self) -> None:
        for step in self.steps:
            if self._stopped.is_set():
                break
            t0 = time.monotonic()
            self._current = step
            proc = subprocess.Popen(list(step.argv), cwd=ROOT, env={**self.env, **step.env}, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
            self._proc = proc
            try:
                out, err = proc.communicate(timeout=step.timeout)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                interrupt(proc)
                out, err = proc.communicate()
                rc, err = -1, f"{err}\n[background] {step.name}: past its {step.timeout:.0f} s limit, stopped"
            done = Done(step.name, rc if not self._stopped.is_set() else -1, out, err, time.monotonic() - t0)
            with self.log.open("a") as f:
                f.write(f"\n== {step.name} ({' '.join(step.argv)}): exit {done.returncode} after "
                        f"{done.seconds:.0f} s\n-- stdout\n{out}\n-- stderr\n{err}\n")
            with self._changed:
                self.done[step.name] = done
                self._changed.notify_all()
            if done.returncode != 0:
                break
        self._current = None
        with self._changed:
            self._changed.notify_all()

    def step(self, name: str) -> Done | None:
        """Wait for step ``name`` to end; None when the job ended without running it (an earlier
        step failed: that step's :class:`Done` says why)."""
        limit = sum(s.timeout + 120 for s in self.steps)
        with self._changed:
            self._changed.wait_for(lambda: name in self.done or not self._thread.is_alive(), timeout=limit)
            return self.done.get(name)

    def failed_step(self) -> Done | None:
        return next((d for d in self.done.values() if d.returncode != 0), None)

    def wait(self) -> None:
        """Until every step ran or one failed."""
        self._thread.join(sum(s.timeout + 120 for s in self.steps))

    def stop(self) -> None:
        """Stop the running step (SIGTERM, then SIGKILL: build.py removes what it started) and run
        no more."""
        self._stopped.set()
        if self._proc is not None:
            interrupt(self._proc)
        self._thread.join(120)


def interrupt(proc: subprocess.Popen[str], grace: float = 120) -> None:
    """SIGINT first, as Ctrl-C: build.py's cleanups run (its containers and networks are removed),
    which SIGTERM's default would skip; SIGKILL after ``grace`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
