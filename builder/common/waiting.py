"""Waiting: the one wait_until() helper for the builder, the tests and the benchmarks, and announced(),
which names a wait on stderr once it passes a second."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
_IMPORTED = time.monotonic()


class WaitTimeout(AssertionError):
    """wait_until() gave up; an AssertionError so pytest reports it as a test failure."""


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.25,
               what: str | None = None) -> T:
    """Call `predicate` until it returns something truthy, and return that.

    An exception raised by the predicate counts as "not yet" (a port that is not
    open, a 502 from a proxy) and is kept for the error message. After `timeout`
    seconds, raise WaitTimeout naming `what`, how many tries were made, and the
    last value or exception seen.
    """
    deadline = time.monotonic() + timeout
    tries = 0
    last: object = None
    while True:
        tries += 1
        try:
            value = predicate()
        except Exception as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if value:
                return value
            last = repr(value)
        if time.monotonic() >= deadline:
            name = what or getattr(predicate, "__name__", "condition")
            raise WaitTimeout(f"timed out after {timeout:g} s ({tries} tries) waiting for {name}; "
                              f"last result: {last}")
        time.sleep(max(0.0, min(interval, deadline - time.monotonic())))


#: A wait longer than this is named on stderr (once), so a slow no-op says what it waits for.
NOTICE_AFTER = 1.0


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def announced(what: str | Callable[[], str], after: float = NOTICE_AFTER,
              say: Callable[[str], None] = _to_stderr) -> Iterator[None]:
    """Run the body; if it is still running after ``after`` seconds, say once (one line, stderr) what it
    waits for: ``what``, or what ``what()`` returns at that moment. A quick body says nothing."""
    done = threading.Event()

    def notice() -> None:
        if not done.wait(after):
            say(f"waiting for {what() if callable(what) else what}")

    watcher = threading.Thread(target=notice, name="wait-notice", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


#: A no-op `build.py build` (every cell unchanged) should take less than this; past it, it says why.
NOOP_BOUND = 2.0


def process_times() -> tuple[float, float]:
    """(wall seconds since this process started, CPU seconds it used: every thread, user + system)."""
    cpu = time.process_time()
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        up = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED, cpu
    return max(up - started, 0.0), cpu


def slow_noop(wall: float, cpu: float, load: float, cores: int, bound: float = NOOP_BOUND) -> str | None:
    """One line on why a run that built nothing took longer than ``bound``; None when it did not."""
    if wall <= bound:
        return None
    waited = max(wall - cpu, 0.0)
    why = (f"the host is busy (load average {load:.1f} on {cores} cores): most of the wait was for a CPU"
           if load >= cores else "waiting on the network or the engine (each wait past a second is named above)")
    return f"nothing to build, yet this took {wall:.1f} s ({cpu:.1f} s on a CPU, {waited:.1f} s waiting): {why}"
