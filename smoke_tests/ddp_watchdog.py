"""Hangs in the DDP job fail in bounded time and name the stuck rank: the deadlines (the job's
watchdog fires before torch's NCCL watchdog), the job's phases and where each rank is in them,
the per-rank :class:`Watchdog` thread, and the :class:`ProgressBoard` in the job's c10d store
that names the rank the others wait for.

Standard library only, no syntax newer than Python 3.8: it runs inside every image.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from smokelib import contract

# --- deadlines -------------------------------------------------------------------------

class Deadlines(NamedTuple):
    """How long a stuck collective may take before something ends the rank.

    ``collective_s`` goes to ``init_process_group(timeout=...)``: torch's own limit.
    ``watchdog_s`` is the job's per-phase :class:`Watchdog`, which names the stuck rank(s).
    """

    collective_s: float
    watchdog_s: float


def hang_deadlines(backend: str, collective_s: float, phase_s: float, min_margin_s: float = 1.0) -> Deadlines:
    """The job's own deadline, chosen so that the job, not torch, reports a hang.

    - gloo: a timed-out collective raises in Python, where the job names the laggard, so the
      watchdog only has to catch what torch's timeout does not: ``phase_s``.
    - NCCL: with async error handling on, torch's NCCL watchdog aborts the whole process when
      a collective passes ``collective_s``, and says nothing about which rank is missing. So
      the job's watchdog must fire first: ``min(phase_s, collective_s - margin)`` with a
      margin of a quarter of the collective timeout (at least ``min_margin_s``).
    """
    if collective_s <= 0 or phase_s <= 0:
        raise ValueError("timeouts must be positive")
    if backend != "nccl":
        return Deadlines(collective_s, phase_s)
    margin = max(min_margin_s, 0.25 * collective_s)
    watchdog = min(phase_s, collective_s - margin)
    if watchdog < min_margin_s:
        raise ValueError(f"--timeout {collective_s:g}s is too short for NCCL: the job's watchdog "
                         f"needs to fire at least {margin:g}s before torch's")
    return Deadlines(collective_s, watchdog)



# --- progress ------------------------------------------------------------------------------

#: The DDP job's phases in order; a rank's progress is (phase index, step).
PHASES = ("start", "init_process_group", "gather-hosts", "setup", "train", "param-check",
          "allreduce-check", "bench", "verdict", "write-result", "destroy")


def parse_progress(text: str) -> tuple[int, int]:
    """``"train:12"`` -> (index of train in PHASES, 12); unknown phase -> (-1, step)."""
    phase, _, step = text.partition(":")
    index = PHASES.index(phase) if phase in PHASES else -1
    return index, int(step or 0)


def laggards(progress: Mapping[int, str], world_size: int) -> list[int]:
    """The ranks furthest behind: the ones the others wait for in a hung collective.

    ``progress`` maps rank -> ``"phase:step"`` as each rank last reported it; a
    rank that never reported counts as furthest behind. Empty when every rank is
    at the same point (then no single rank is to blame).
    """
    keyed = {r: parse_progress(progress[r]) if r in progress else (-2, 0)
             for r in range(world_size)}
    if not keyed:
        return []
    low = min(keyed.values())
    if low == max(keyed.values()):
        return []
    return sorted(r for r, k in keyed.items() if k == low)


class Watchdog:
    """Ends this process with exit code 124 when one phase runs past its deadline.

    A hung collective blocks the main thread inside C++; this thread still runs,
    names the rank and the phase on stderr, and exits hard (``os._exit``), so
    torchrun sees the failure and tears down the other ranks.
    """

    def __init__(
        self,
        rank: int,
        deadline_s: float,
        poll_s: float = 0.5,
        diagnose: Callable[[], str] | None = None,
    ) -> None:
        self.rank = rank
        self.diagnose = diagnose
        self.deadline_s = deadline_s
        self.poll_s = poll_s
        self._phase = "start"
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ptmg-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def phase(self, name: str, deadline_s: float | None = None) -> None:
        with self._lock:
            self._phase = name
            self._since = time.monotonic()
            if deadline_s is not None:
                self.deadline_s = deadline_s

    @property
    def current(self) -> str:
        with self._lock:
            return self._phase

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                phase, since, deadline = self._phase, self._since, self.deadline_s
            waited = time.monotonic() - since
            if waited > deadline:
                sys.stderr.write(
                    f"PTMG_DDP rank {self.rank} stuck in {phase} for {waited:.0f}s "
                    f"(deadline {deadline:.0f}s): exiting 124\n"
                )
                if self.diagnose is not None:
                    try:
                        sys.stderr.write(self.diagnose() + "\n")
                    except Exception as exc:  # diagnosis is best effort; the exit is not
                        sys.stderr.write(f"PTMG_DDP rank {self.rank}: no diagnosis ({exc})\n")
                sys.stderr.flush()
                sys.stdout.flush()
                os._exit(124)


class ProgressBoard:
    """Where each rank is, kept in the job's c10d store, so that a rank that times out in a
    collective (or whose watchdog fires) can name the rank it was waiting for (the laggard).

    ``store`` is anything with ``set(key, value)``, ``get(key) -> bytes`` and
    ``set_timeout(timedelta)``: torch's c10d store in the job, a dict-backed fake in tests.
    """

    def __init__(self, rank: int, world_size: int, dog: Watchdog, store: Any = None) -> None:
        self.rank, self.world_size, self.dog = rank, world_size, dog
        self.store: Any = store

    def mark(self, phase: str, step: int = 0) -> None:
        self.dog.phase(phase)
        if self.store is not None:
            try:
                self.store.set(f"ptmg/progress/{self.rank}", f"{phase}:{step}")
            except Exception:
                self.store = None  # the store's host is gone; keep going without it

    def diagnose(self) -> str:
        if self.store is None:
            return f"PTMG_DDP rank {self.rank}: other ranks' progress unknown (no store)"
        import datetime as dt

        with contextlib.suppress(Exception):
            self.store.set_timeout(dt.timedelta(seconds=3))
        seen: dict[int, str] = {}
        for r in range(self.world_size):
            # get() waits for a missing key until the timeout (no Store.check on torch 2.0);
            # a rank that never reported is left out, and laggards() counts it furthest behind.
            with contextlib.suppress(Exception):
                raw = self.store.get(f"ptmg/progress/{r}")
                seen[r] = raw.decode() if isinstance(raw, bytes) else str(raw)
        late = laggards(seen, self.world_size)
        where = ", ".join(f"rank {r}: {seen.get(r, 'never reported')}" for r in range(self.world_size))
        if late:
            return (f"{contract.DDP_STUCK_MARKER}{', '.join(map(str, late))}, furthest behind "
                    f"(seen by rank {self.rank}; {where})")
        return f"PTMG_DDP rank {self.rank}: all ranks at the same point ({where})"
