"""NCCL hangs (smoke_tests/ddp_watchdog.py): the job's hang deadlines and progress marks, and a
fake NCCL watchdog: the hang is named by the job's watchdog before torch's would abort."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

import ptmg_contract as contract
from tests.unit.smoke.test_gpus import SMOKE_DIR, ddp_watchdog

# --- NCCL hangs: the job's watchdog fires before torch's ------------------------------------


def test_hang_deadlines() -> None:
    gloo = ddp_watchdog.hang_deadlines("gloo", 60, 180)
    assert gloo == (60, 180)
    nccl = ddp_watchdog.hang_deadlines("nccl", 60, 180)
    assert nccl.collective_s == 60 and nccl.watchdog_s == 45  # a quarter of the timeout before torch's
    assert ddp_watchdog.hang_deadlines("nccl", 60, 30).watchdog_s == 30  # a shorter phase limit stays
    runner_default = ddp_watchdog.hang_deadlines("nccl", 60, 120)  # what builder.smoke.torchrun passes
    assert runner_default.watchdog_s < runner_default.collective_s
    with pytest.raises(ValueError, match="too short for NCCL"):
        ddp_watchdog.hang_deadlines("nccl", 1, 180)
    assert ddp_watchdog.hang_deadlines("gloo", 60, 1) == (60, 1)  # short, but positive
    for collective, phase in ((0, 180), (60, 0), (-1, 180), (60, -1)):
        with pytest.raises(ValueError, match="timeouts must be positive"):
            ddp_watchdog.hang_deadlines("gloo", collective, phase)


def test_progress_parsing_and_marking() -> None:
    assert ddp_watchdog.parse_progress("train:12") == (ddp_watchdog.PHASES.index("train"), 12)
    assert ddp_watchdog.parse_progress("train") == (ddp_watchdog.PHASES.index("train"), 0)
    assert ddp_watchdog.parse_progress("lunch:3") == (-1, 3)  # an unknown phase sorts before every known one
    dog = ddp_watchdog.Watchdog(0, 60.0)  # never started: only its phase is read
    store: dict[str, str] = {}

    class Store:
        def set(self, key: str, value: str) -> None:
            store[key] = value

    board = ddp_watchdog.ProgressBoard(2, 4, dog, Store())
    board.mark("setup")
    assert dog.current == "setup" and store == {"ptmg/progress/2": "setup:0"}

    class Gone:
        def set(self, key: str, value: str) -> None:
            raise ConnectionResetError("the store's host is gone")

    lost = ddp_watchdog.ProgressBoard(2, 4, dog, Gone())
    lost.mark("train", 1)  # the job goes on without the store
    assert lost.store is None and dog.current == "train"


#: A rank stuck in an NCCL collective, with fakes: the c10d store (a dict), torch's NCCL watchdog
#: (a thread that aborts the process once a collective passes the timeout, as async error handling
#: does) and the collective itself (the main thread blocks). Rank 1 last reported train:2.
NCCL_HANG = textwrap.dedent("""
    import os, sys, threading, time
    sys.path.insert(0, {path!r})
    import ddp_watchdog

    class Store(dict):
        def set(self, k, v): self[k] = v.encode()
        def get(self, k): return self[k]
        def set_timeout(self, t): pass

    collective, phase = {collective}, {phase}
    deadlines = ddp_watchdog.hang_deadlines("nccl", collective, phase) if {job_rule} else \\
        ddp_watchdog.Deadlines(collective, phase)  # without the rule: the watchdog at the phase limit only
    dog = ddp_watchdog.Watchdog(0, deadlines.watchdog_s, poll_s=0.05)
    board = ddp_watchdog.ProgressBoard(0, 2, dog, Store({{"ptmg/progress/1": b"train:2"}}))
    dog.diagnose = board.diagnose
    dog.start()
    board.mark("train", 3)

    def torch_nccl_watchdog():  # ProcessGroupNCCL: work timed out -> abort, no rank named
        time.sleep(deadlines.collective_s)
        sys.stderr.write("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE)\\n")
        sys.stderr.flush()
        os.abort()

    threading.Thread(target=torch_nccl_watchdog, daemon=True).start()
    threading.Event().wait(60)  # the all-reduce that never completes
""")


def _nccl_hang(job_rule: bool) -> subprocess.CompletedProcess[str]:
    code = NCCL_HANG.format(path=str(SMOKE_DIR), collective=2.0, phase=30.0, job_rule=job_rule)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)


def test_nccl_hang_is_named_by_the_job_before_torch_aborts() -> None:
    proc = _nccl_hang(job_rule=True)
    assert proc.returncode == 124, proc.stderr
    assert "rank 0 stuck in train" in proc.stderr
    assert f"{contract.DDP_STUCK_MARKER}1, furthest behind" in proc.stderr
    assert "Watchdog caught collective operation timeout" not in proc.stderr


def test_without_the_rule_torch_aborts_first_and_names_nobody() -> None:
    """The defect this guards against: the job's watchdog at the phase limit (above the
    collective timeout) never gets to speak."""
    proc = _nccl_hang(job_rule=False)
    assert proc.returncode == -signal.SIGABRT
    assert contract.DDP_STUCK_MARKER not in proc.stderr


