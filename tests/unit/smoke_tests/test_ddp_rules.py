"""The DDP job's rules without Docker or torch (smoke_tests/ddp_plan.py, ddp_bench.py,
ddp_watchdog.py, shipped in every image): ranks clamped to the GPUs, bus bandwidth as
nccl-tests computes it, the result line and its marker, laggards, and the watchdog that ends a
stuck phase with 124 and names it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import smoke_module
from tests.unit.smoke_tests.test_smokelib import SMOKE_DIR

ddp_plan = smoke_module("ddp_plan")
ddp_bench = smoke_module("ddp_bench")
ddp_watchdog = smoke_module("ddp_watchdog")


# --- DDP helpers -----------------------------------------------------------------


def test_clamp_nproc() -> None:
    assert ddp_plan.clamp_nproc(None, 0, "gloo") == (2, "")
    assert ddp_plan.clamp_nproc(3, 8, "gloo") == (3, "")  # gloo ignores the GPUs
    assert ddp_plan.clamp_nproc(None, 4, "nccl") == (4, "")
    n, note = ddp_plan.clamp_nproc(4, 2, "nccl")
    assert n == 2 and "clamped to 2" in note
    with pytest.raises(ValueError, match="GPU"):
        ddp_plan.clamp_nproc(2, 0, "nccl")
    with pytest.raises(ValueError, match=">= 1"):
        ddp_plan.clamp_nproc(0, 0, "gloo")


def test_clamp_nproc_at_its_boundaries() -> None:
    assert ddp_plan.clamp_nproc(2, 2, "nccl") == (2, "")  # one rank per GPU: nothing to clamp
    assert ddp_plan.clamp_nproc(0, 2, "nccl") == (1, "")  # never no rank at all
    assert ddp_plan.clamp_nproc(1, 0, "gloo") == (1, "")
    with pytest.raises(ValueError, match="no visible GPU"):
        ddp_plan.device_index(0, 0)


@pytest.mark.parametrize(("nproc", "multi"), [(1, False), (2, True), (3, True)])
def test_a_plan_is_multi_rank_from_two_ranks_on(nproc: int, multi: bool) -> None:
    assert ddp_plan.RankPlan(nproc, "gloo", "cpu", "").multi_rank is multi


@pytest.mark.parametrize(("n", "bus"), [(1, 0.0), (2, 1e9), (4, 1.5e9), (8, 1.75e9)])
def test_bus_bandwidth_as_nccl_tests(n: int, bus: float) -> None:
    alg, got = ddp_bench.bus_bandwidth(10**9, 1.0, n)
    assert alg == 1e9
    assert got == pytest.approx(bus)
    with pytest.raises(ValueError):
        ddp_bench.bus_bandwidth(1, 0.0, 2)


@pytest.mark.parametrize(("text", "n"), [("4K", 4096), ("64k", 65536), ("1M", 1 << 20), ("512", 512),
                                         ("2MiB", 2 << 20), ("1G", 1 << 30)])
def test_parse_size(text: str, n: int) -> None:
    assert ddp_bench.parse_size(text) == n


def test_loss_decreased() -> None:
    assert ddp_plan.loss_decreased([10.0] * 5 + [5.0] * 5 + [1.0] * 5)
    assert not ddp_plan.loss_decreased([1.0] * 20)                   # flat
    assert not ddp_plan.loss_decreased([1.0] * 10 + [float("nan")] * 5)
    assert not ddp_plan.loss_decreased([2.0, 1.0])                   # too short to tell
    assert not ddp_plan.loss_decreased([1.0] * 5 + [2.0] * 5)        # rising
    assert not ddp_plan.loss_decreased([10.0] * 5 + [1.0] * 4)        # one short of two windows
    assert ddp_plan.loss_decreased([10.0] * 5 + [1.0] * 5)            # exactly two windows are enough
    assert ddp_plan.loss_decreased([10.0] * 5 + [9.0] * 5 + [1.0] * 5)  # the last window, not all after the first
    assert not ddp_plan.loss_decreased([10.0] * 5 + [7.0] * 5)        # exactly 0.7x is not below it


def test_find_result_takes_the_last_valid_line() -> None:
    log = "\n".join([
        "noise",
        ddp_plan.RESULT_MARKER + '{"world_size": 2}',
        "[rank0]: " + ddp_plan.RESULT_MARKER + '{"world_size": 4}',
        ddp_plan.RESULT_MARKER + "{not json",
    ])
    assert ddp_plan.find_result(log) == {"world_size": 4}
    assert ddp_plan.find_result("nothing here") is None


def test_find_result_reads_only_after_its_marker() -> None:
    marker = ddp_plan.RESULT_MARKER
    assert ddp_plan.find_result(marker + '{"world_size": 2}') == {"world_size": 2}  # the marker at column 0
    # JSON where the text after a marker would start, but no marker: not a result.
    assert ddp_plan.find_result(" " * (len(marker) - 1) + '{"world_size": 8}') is None
    assert ddp_plan.find_result(f"{marker}{{broken\n{marker}{{\"world_size\": 3}}") == {"world_size": 3}


@pytest.mark.parametrize(("progress", "world", "late"), [
    ({0: "train:3", 1: "train:2"}, 2, [1]),
    ({0: "train:3", 1: "train:3"}, 2, []),                        # same point: nobody to blame
    ({0: "allreduce-check:0", 1: "train:59", 2: "allreduce-check:0"}, 3, [1]),
    ({0: "train:5"}, 2, [1]),                                      # never reported: furthest behind
    ({0: "setup:0", 1: "init_process_group:0", 2: "init_process_group:0"}, 3, [1, 2]),
    ({0: "start:0"}, 2, [1]),                                      # behind even a rank at the very start
    ({0: "lunch:0"}, 2, [1]),                                      # and one in an unknown phase
])
def test_laggards(progress: dict[int, str], world: int, late: list[int]) -> None:
    assert ddp_watchdog.laggards(progress, world) == late


WATCHDOG_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {path!r})
    import ddp_watchdog
    dog = ddp_watchdog.Watchdog(3, {deadline}, poll_s=0.05, diagnose=lambda: "DIAG rank 1 is behind").start()
    dog.phase("allreduce-check")
    for _ in range({steps}):
        time.sleep(0.1)
        if {progress}:
            dog.phase("allreduce-check")
    dog.stop()
    print("finished")
""")


def _watchdog(deadline: float, steps: int, progress: bool) -> subprocess.CompletedProcess[str]:
    code = WATCHDOG_SCRIPT.format(path=str(SMOKE_DIR), deadline=deadline, steps=steps, progress=progress)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False)


def test_watchdog_ends_a_stuck_phase_with_124_and_names_it() -> None:
    proc = _watchdog(deadline=0.3, steps=50, progress=False)
    assert proc.returncode == 124
    assert "rank 3 stuck in allreduce-check" in proc.stderr
    assert "DIAG rank 1 is behind" in proc.stderr
    assert "finished" not in proc.stdout


def test_watchdog_leaves_a_progressing_run_alone() -> None:
    proc = _watchdog(deadline=0.5, steps=10, progress=True)  # 1 s in all, 0.1 s per phase
    assert proc.returncode == 0, proc.stderr
    assert "finished" in proc.stdout


def _watchdog_run(body: str) -> subprocess.CompletedProcess[str]:
    code = f"import sys, time\nsys.path.insert(0, {str(SMOKE_DIR)!r})\nimport ddp_watchdog\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False)


def test_watchdog_does_not_hold_a_failing_rank_open() -> None:
    """A rank whose main thread fails before stop() exits with its own status at once: the watchdog
    must not keep the process alive until its deadline and turn the failure into a 124 "hang"."""
    proc = _watchdog_run("""
        ddp_watchdog.Watchdog(1, 0.5, poll_s=0.05).start()
        sys.exit(3)
    """)
    assert proc.returncode == 3, proc.stderr
    assert "stuck" not in proc.stderr


def test_watchdog_still_exits_124_when_its_diagnosis_fails() -> None:
    proc = _watchdog_run("""
        def diagnose():
            raise ConnectionResetError("the store's host is gone")
        dog = ddp_watchdog.Watchdog(2, 0.2, poll_s=0.05, diagnose=diagnose).start()
        dog.phase("train")
        time.sleep(10)
        print("finished")
    """)
    assert proc.returncode == 124, proc.stderr
    assert "rank 2 stuck in train" in proc.stderr
    assert "rank 2: no diagnosis (the store's host is gone)" in proc.stderr
    assert "finished" not in proc.stdout




# --- each node's result file (--node-out) ---------------------------------------------------------------
def test_a_nodes_result_records_its_rank_host_and_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    host = socket.gethostname()
    assert ddp_plan.node_result(4, 8, 0) == {"schema": 1, "node_rank": 1, "host": host, "rank": 4,
                                             "local_world_size": 4, "world_size": 8, "exit": 0, "ok": True}
    for rc in (1, -1, 124):
        assert ddp_plan.node_result(4, 8, rc)["ok"] is False, rc


NODE_FILE = """{
  "exit": 1,
  "host": "n2",
  "local_world_size": 2,
  "node_rank": 1,
  "ok": false,
  "rank": 2,
  "schema": 1,
  "world_size": 4
}"""


def test_each_node_writes_its_own_file_whole_in_a_shared_folder(tmp_path: Path) -> None:
    folder = tmp_path / "out" / "job"  # made on the first write
    first = {"schema": 1, "node_rank": 0, "host": "n1", "rank": 0, "local_world_size": 2, "world_size": 4,
             "exit": 0, "ok": True}
    second = {"world_size": 4, "schema": 1, "rank": 2, "ok": False, "node_rank": 1, "local_world_size": 2,
              "host": "n2", "exit": 1}
    assert ddp_plan.write_node_result(str(folder), first) == str(folder / "node-0.json")
    assert ddp_plan.write_node_result(str(folder), second) == str(folder / "node-1.json")  # the folder exists
    assert sorted(p.name for p in folder.iterdir()) == ["node-0.json", "node-1.json"]  # no temporary file left
    assert (folder / "node-1.json").read_text() == NODE_FILE  # keys sorted, two-space indent: diffable
    assert json.loads((folder / "node-0.json").read_text()) == first


def test_the_nodes_log_line_is_out_before_the_process_ends(tmp_path: Path) -> None:
    """torchrun may end the node's process right after: the line must not wait in a pipe's buffer."""
    code = (f"import os, sys; sys.path.insert(0, {str(SMOKE_DIR)!r}); import ddp_plan; "
            f"ddp_plan.write_node_result({str(tmp_path)!r}, {{'node_rank': 3, 'host': 'n4', 'exit': 0}}); "
            "os._exit(0)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe is block-buffered
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"PTMG_DDP node 3 on n4: exit 0, wrote {tmp_path / 'node-3.json'}\n"
