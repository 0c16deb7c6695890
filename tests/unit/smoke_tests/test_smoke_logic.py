"""Smoke-test logic without Docker or torch: smoke_tests/smokelib.py and the DDP job's rules
(ddp_plan.py, ddp_bench.py, ddp_watchdog.py), shipped in every image, and the pure parts of
builder/smoke, plus its orchestration against a fake engine."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import tarfile
import textwrap
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import ptmg_contract as contract
from builder.engine import RunResult
from builder.smoke import results, runner, torchrun
from tests.support import load_module, smoke_module

ROOT = Path(__file__).resolve().parents[3]
SMOKE_DIR = ROOT / "smoke_tests"



lib = smoke_module("smokelib")
ddp_plan = smoke_module("ddp_plan")
ddp_bench = smoke_module("ddp_bench")
ddp_watchdog = smoke_module("ddp_watchdog")


# --- expectations and versions ---------------------------------------------------


def test_expectations_from_env_then_labels() -> None:
    env = {"PTMG_TORCH": "2.7.0", "PTMG_NCCL": "", "PTMG_CUDA": "12.6", "HOME": "/x"}
    labels = {"io.pt-multi-gpu.cuda": "12.8", "io.pt-multi-gpu.cell": "c", "org.opencontainers.image.version": "1",
              "cudnn": "9.5.1.17", "PTMG_PYTHON": "3.11", "io.pt-multi-gpu.nccl": ""}
    got = lib.load_expectations(env, labels)
    assert got == {"torch": "2.7.0", "cuda": "12.8", "cudnn": "9.5.1.17", "python": "3.11"}
    assert "nccl" not in got  # empty means unknown: the check skips, it never passes


@pytest.mark.parametrize(("expected", "actual", "ok"), [
    ("2.7.0", "2.7.0+cu126", True),
    ("2.7.0", "2.7.1+cu126", False),
    ("2.7.0+cu126", "2.7.0+cu126", True),
    ("2.7.0+cu126", "2.7.0+cu128", False),
    ("0.22.0", "0.22.0", True),
    ("2.13.0", "2.13.0+cpu", True),
])
def test_pin_matches(expected: str, actual: str, ok: bool) -> None:
    assert lib.pin_matches(expected, actual) is ok


@pytest.mark.parametrize(("expected", "actual", "min_parts", "ok"), [
    ("12.6.3", "12.6", 2, True),
    ("12.6", "12.4", 2, False),
    ("12", "12.4", 2, False),   # too vague to pass
    ("9.5.1.17", "9.5.1", 1, True),
    ("9.5.1.17", "9.5.0", 1, False),
    ("9", "9.5.1", 1, True),
    ("2.26.2", "2.26.2.post1", 2, True),
    ("3.11", "3.11", 2, True),
    ("3.11", "3.13", 2, False),
])
def test_prefix_matches(expected: str, actual: str, min_parts: int, ok: bool) -> None:
    assert lib.prefix_matches(expected, actual, min_parts) is ok


def test_prefix_matches_needs_major_and_minor_unless_told() -> None:
    # the checks of Python, CUDA and NCCL versions call it with the default
    assert lib.prefix_matches("12.6", "12.6.3")
    assert not lib.prefix_matches("12", "12.4")


def test_smokelib_finds_the_contract_one_level_up_as_in_the_image() -> None:
    """In the image nothing puts the contract on sys.path: smokelib finds ptmg_contract.py beside
    its own folder. (-I -S: neither this checkout's PYTHONPATH nor the virtualenv's site-packages.)"""
    code = (f"import sys; sys.path.insert(0, {str(SMOKE_DIR)!r}); import smokelib; "
            "print(smokelib.contract.__file__)")
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=30,
                          check=False, cwd=SMOKE_DIR)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == ROOT / "ptmg_contract.py"


def test_version_tuple_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="not a version"):
        lib.version_tuple("cpu")


@pytest.mark.parametrize(("raw", "want"), [
    (90501, (9, 5, 1)), (92400, (9, 24, 0)), (91002, (9, 10, 2)), (8500, (8, 5, 0)), (8902, (8, 9, 2)),
    (7605, (7, 6, 5)),
    (90000, (9, 0, 0)),    # cuDNN 9.0.0: the first number of the major*10000 scheme
    (8005, (8, 0, 5)),     # cuDNN 8.0.5: the patch below the major
    (99999, (9, 99, 99)),  # each scheme's largest minor and patch
    (8999, (8, 9, 99)),
])
def test_decode_cudnn(raw: int, want: tuple[int, int, int]) -> None:
    assert lib.decode_cudnn(raw) == want


@pytest.mark.parametrize(("raw", "want"), [
    ((2, 26, 2), (2, 26, 2)), ([2, 14, 3], (2, 14, 3)), (21403, (2, 14, 3)), (2708, (2, 7, 8)), (23007, (2, 30, 7)),
    (2803, (2, 8, 3)),     # NCCL 2.8.3, the last minor of the major*1000 scheme: the patch below the minor
    (2000, (2, 0, 0)),     # the old scheme's first and last numbers for NCCL 2
    (2899, (2, 8, 99)),
    (20906, (2, 9, 6)),    # NCCL 2.9.6: from 2.9 on, the major*10000 scheme
    (29999, (2, 99, 99)),  # the new scheme's largest minor and patch
    (30000, (3, 0, 0)),    # a new major: NCCL's macro encodes 3.0.0 as 30000
])
def test_decode_nccl(raw: Any, want: tuple[int, ...]) -> None:
    assert lib.decode_nccl(raw) == want


@pytest.mark.parametrize(("raw", "want"), [
    ("13000", (13, 0)), (12060, (12, 6)), ("11070", (11, 7)), ("12.6", (12, 6)), (None, None), ("", None),
    (12090, (12, 9)),      # CUDA 12.9: the largest one-digit minor
    (12990, (12, 99)),     # CUDA_VERSION's largest minor
    (0, None), ("0", None),  # no CUDA
    ("12.", (12, 0)),      # a dotted text with the major alone
])
def test_decode_torchvision_cuda(raw: Any, want: tuple[int, int] | None) -> None:
    assert lib.decode_torchvision_cuda(raw) == want


# --- GPU architectures -----------------------------------------------------------


@pytest.mark.parametrize(("archs", "cap", "ok"), [
    (["sm_80"], (8, 6), True),          # same major, newer minor: the cubin runs
    (["sm_86"], (8, 0), False),         # a newer minor's cubin does not run on an older GPU
    (["sm_75", "sm_80"], (9, 0), False),  # no sm_9x cubin and no PTX
    (["sm_80", "compute_80"], (9, 0), True),  # PTX JIT-compiles forward
    (["compute_90"], (8, 6), False),    # PTX does not run backwards
    (["sm_90a"], (9, 0), True),
    (["sm_90a"], (10, 0), False),       # arch-specific: exactly 9.0 only
    (["sm_100f"], (10, 3), False),
    (["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"], (8, 9), True),
    (["sm_37", "sm_50"], (12, 0), False),
    ([], (8, 0), False),
    (["garbage"], (8, 0), False),
    (["sm_90"], (9, 0), True),          # the cubin's own capability
    (["sm_120"], (12, 0), True),        # a two-digit major
    (["sm_120"], (1, 2), False),
    (["compute_90"], (9, 0), True),     # PTX for exactly this capability
    (["garbage", "sm_80"], (8, 0), True),  # an entry it cannot read does not end the search
])
def test_arch_covers(archs: list[str], cap: tuple[int, int], ok: bool) -> None:
    assert lib.arch_covers(archs, cap) is ok


def test_split_arch_list() -> None:
    assert lib.split_arch_list(" sm_50 sm_60;sm_90,compute_90 ") == ["sm_50", "sm_60", "sm_90", "compute_90"]


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


# --- builder.smoke: pure parts ---------------------------------------------------

#: Every torchrun flag of torch 2.0.1's torch/distributed/run.py uses underscores; hyphen
#: aliases (--nproc-per-node) arrived later, so the runner must not use them.
TORCH_2_0_FLAGS = {"--nnodes", "--nproc_per_node", "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id",
                   "--rdzv_conf", "--standalone", "--max_restarts", "--monitor_interval", "--start_method",
                   "--role", "--module", "--no_python", "--run_path", "--log_dir", "--redirects", "--tee",
                   "--node_rank", "--master_addr", "--master_port", "--local_addr"}


def _flags(argv: Sequence[str]) -> set[str]:
    script = argv.index(contract.DDP_JOB)
    return {a for a in argv[:script] if a.startswith("--")}


def test_torchrun_argv_standalone() -> None:
    argv = torchrun.torchrun_argv(nnodes=1, nproc_per_node=2, script_args=("--steps", "5"))
    assert argv[0] == "torchrun"
    assert "--standalone" in argv and "--rdzv_endpoint" not in argv
    assert argv[argv.index("--nproc_per_node") + 1] == "2"
    assert argv[argv.index("--max_restarts") + 1] == "0"
    assert argv[-3:] == (contract.DDP_JOB, "--steps", "5")
    assert _flags(argv) <= TORCH_2_0_FLAGS


def test_torchrun_argv_multinode() -> None:
    argv = torchrun.torchrun_argv(nnodes=2, nproc_per_node=2, rdzv_endpoint="node0:29400", rdzv_id="abc")
    assert argv[argv.index("--nnodes") + 1] == "2"
    assert argv[argv.index("--rdzv_backend") + 1] == "c10d"
    assert argv[argv.index("--rdzv_endpoint") + 1] == "node0:29400"
    assert argv[argv.index("--rdzv_id") + 1] == "abc"
    assert argv[argv.index("--rdzv_conf") + 1].startswith("join_timeout=")
    assert "--standalone" not in argv
    assert _flags(argv) <= TORCH_2_0_FLAGS


def test_torchrun_argv_rejects_impossible_requests() -> None:
    with pytest.raises(ValueError, match="endpoint"):
        torchrun.torchrun_argv(nnodes=2, nproc_per_node=1)
    with pytest.raises(ValueError, match="id"):
        torchrun.torchrun_argv(nnodes=2, nproc_per_node=1, rdzv_endpoint="node0:29400")
    with pytest.raises(ValueError):
        torchrun.torchrun_argv(nnodes=1, nproc_per_node=0)


def test_ddp_job_args() -> None:
    args = torchrun.ddp_job_args(steps=7, timeout_s=20, bench_sizes=("4K", "1M"), step_sleep_s=0.05, extra=("--x",))
    assert args == ("--out", torchrun.IN_CONTAINER_OUT, "--steps", "7", "--timeout", "20", "--phase-timeout", "120",
                    "--bench-sizes", "4K,1M", "--step-sleep", "0.05", "--x")


def test_the_job_accepts_every_argument_the_runner_passes() -> None:
    # ddp_job.py parses its arguments before importing torch, so this runs without torch.
    job = load_module("ptmg_ddp_job", SMOKE_DIR / "ddp_job.py")
    ns = job.parse_args(list(torchrun.ddp_job_args(step_sleep_s=0.05, timeout_s=15)))
    assert ns.out == torchrun.IN_CONTAINER_OUT and ns.timeout == 15 and ns.step_sleep == 0.05


def test_result_marker_is_shared() -> None:
    assert contract.DDP_RESULT_MARKER == ddp_plan.RESULT_MARKER


def sample_result(**over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "schema": 1, "ok": True, "world_size": 4, "backend": "gloo", "nodes": 2, "hosts": ["node0", "node0", "node1", "node1"],
        "local_world_size": 2, "device": "cpu", "torch": "2.7.0+cu126", "steps": 60, "steps_per_s": 120.5,
        "initial_loss": 6.5, "final_loss": 0.15, "loss_decreased": True, "params_identical": True,
        "params_sha256": "ab", "allreduce_exact": True, "tensorboard_dir": "/tmp/tb", "wall_s": 3.5,
        "busbw": [{"bytes": 4096, "time_us": 1475.0, "algbw_GBps": 0.0028, "busbw_GBps": 0.0042},
                  {"bytes": 1048576, "time_us": 3450.0, "algbw_GBps": 0.304, "busbw_GBps": 0.456}],
    }
    data.update(over)
    return data


def _line(data: dict[str, Any]) -> str:
    return contract.DDP_RESULT_MARKER + json.dumps(data)


def test_find_ddp_result_parses_rank0s_line_from_any_node() -> None:
    r = results.find_ddp_result(["node1 noise", "a\n" + _line(sample_result()) + "\nb"])
    assert r is not None
    assert (r.world_size, r.backend, r.nodes, r.hosts[-1]) == (4, "gloo", 2, "node1")
    assert r.busbw[1] == results.BusBandwidth(1048576, 3450.0, 0.304, 0.456)
    assert results.find_ddp_result(["no marker"]) is None
    assert results.find_ddp_result([contract.DDP_RESULT_MARKER + '{"world_size": 2}']) is None  # malformed: ignored


def test_ddp_result_from_json_names_what_is_missing() -> None:
    data = sample_result()
    del data["params_identical"]
    with pytest.raises(ValueError, match="params_identical"):
        results.DDPResult.from_json(data)


def test_busbw_markdown() -> None:
    r = results.DDPResult.from_json(sample_result())  # schema 1: no bench settings, no per-rank max
    table = results.busbw_markdown(r).splitlines()
    assert table[0].startswith("| size |") and len(table) == 4
    assert table[3] == "| 1 MiB | 3450.0 | - | 0.304 | 0.456 | - | bandwidth |"


@pytest.mark.parametrize(("text", "want"), [
    ("2026-11-30T03:37:28.285123456Z", datetime(2026, 11, 30, 3, 37, 28, 285123, tzinfo=UTC)),
    ("2026-11-30T03:37:28Z", datetime(2026, 11, 30, 3, 37, 28, tzinfo=UTC)),
    ("2026-11-30T05:37:28.5+02:00", datetime(2026, 11, 30, 3, 37, 28, 500000, tzinfo=UTC)),
    ("0001-01-01T00:00:00Z", None),
    ("", None),
    (None, None),
])
def test_parse_docker_time(text: str | None, want: datetime | None) -> None:
    assert results.parse_docker_time(text) == want


def _node(name: str, code: int, second: int | None, timed_out: bool = False) -> results.NodeRun:
    at = None if second is None else datetime(2026, 1, 1, 0, 0, second, tzinfo=UTC)
    return results.NodeRun(name, code, timed_out, "log", finished_at=at)


def test_first_failure_is_the_node_that_died_first() -> None:
    nodes = [_node("node0", 1, 40), _node("node1", 137, 12), _node("node2", 0, 41)]
    culprit = results.first_failure(nodes)
    assert culprit is not None and culprit.name == "node1"
    assert results.first_failure([_node("node0", 0, 1)]) is None
    # a node still running at the deadline has no stop time: it comes last
    hung = [_node("node0", 124, None, timed_out=True), _node("node1", 1, 30)]
    assert results.first_failure(hung) == hung[1]


def test_ddp_run_verdict_and_summary() -> None:
    result = results.DDPResult.from_json(sample_result())
    good = results.DDPRun("img", (_node("node0", 0, 1), _node("node1", 0, 2)), 2, result, 30.0)
    assert good.ok and good.world_size == 4 and good.culprit is None
    assert "PASS" in good.summary() and "world size 4" in good.summary()

    bad = results.DDPRun("img", (_node("node0", 1, 50), _node("node1", 137, 20)), 2, None, 60.0, killed="node1")
    assert not bad.ok and [n.name for n in bad.failed_nodes] == ["node0", "node1"]
    text = bad.summary()
    assert "FAIL" in text and "first to fail: node1" in text and "SIGKILL" in text and "no DDP result" in text

    wrong_size = results.DDPRun("img", (_node("node0", 0, 1),), 2, result, 1.0)  # result says 4 ranks, 1x2 ran
    assert not wrong_size.ok
    failed_check = results.DDPResult.from_json(sample_result(ok=False, params_identical=False))
    assert not results.DDPRun("img", (_node("node0", 0, 1), _node("node1", 0, 2)), 2, failed_check, 1.0).ok


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pt-multi-gpu-selftest"
 errors="1" failures="1" skipped="2" tests="6" time="3.2"><testcase classname="test_versions" name="test_env[torch]" time="0.1"/>
<testcase classname="test_versions" name="test_env[cuda]" time="0.1"><failure message="AssertionError">x</failure></testcase>
<testcase classname="test_gpu" name="test_kernel[no-gpu]" time="0"><skipped type="pytest.skip" message="no GPU">s</skipped></testcase>
<testcase classname="test_gpu" name="test_cuda_available" time="0"><skipped type="pytest.skip" message="no GPU">s</skipped></testcase>
<testcase classname="test_ddp" name="test_ddp[exit-code]" time="9"><error message="fixture">e</error></testcase>
<testcase classname="test_ddp" name="test_ddp[world-size]" time="0"/></testsuite></testsuites>"""


def test_parse_junit() -> None:
    counts, failures = results.parse_junit(JUNIT)
    assert counts == results.TestCounts(tests=6, passed=2, failed=1, errors=1, skipped=2)
    assert failures == ("test_versions::test_env[cuda]", "test_ddp::test_ddp[exit-code]")
    bare, _ = results.parse_junit('<testsuite tests="1"><testcase classname="a" name="b"/></testsuite>')
    assert bare.passed == 1


def _tar(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_extract_file() -> None:
    assert results.extract_file(_tar("junit.xml", b"<x/>")) == b"<x/>"
    empty = io.BytesIO()
    with tarfile.open(fileobj=empty, mode="w"):
        pass
    assert results.extract_file(empty.getvalue()) is None


def test_expect_labels_keeps_only_ours() -> None:
    labels = {"io.pt-multi-gpu.torch": "2.7.0", "project": "pt-multi-gpu", "org.opencontainers.image.title": "x"}
    assert results.expect_labels(labels) == {"io.pt-multi-gpu.torch": "2.7.0"}


def test_split_gpus() -> None:
    assert torchrun.split_gpus(4, 2) == (("0", "1"), ("2", "3"))
    assert torchrun.split_gpus(3, 2) == (("0",), ("1",))
    with pytest.raises(ValueError):
        torchrun.split_gpus(1, 2)


# --- builder.smoke orchestration against a fake engine ---------------------------


class FakeContainer:
    def __init__(self, name: str, command: list[str], kwargs: dict[str, Any], log: str, code: int) -> None:
        self.name, self.command, self.kwargs, self.log, self.code = name, command, kwargs, log, code
        self.removed = False
        self.killed = False


class FakeEngine:
    """Records what the runner asks of the engine; each container 'runs' a scripted log."""

    def __init__(self, logs: Sequence[str], codes: Sequence[int], *, wait_raises: bool = False,
                 labels: dict[str, str] | None = None, archive: bytes | None = None) -> None:
        self.logs_, self.codes, self.wait_raises = list(logs), list(codes), wait_raises
        self.labels_ = labels or {}
        self.archive_ = archive
        self.started: list[FakeContainer] = []
        self.networks: list[str] = []
        self.removed_networks: list[str] = []
        self.archived: list[str] = []

    def image_labels(self, ref: str) -> dict[str, str]:
        return dict(self.labels_)

    def _make(self, command: Sequence[str] | None, kwargs: dict[str, Any]) -> FakeContainer:
        i = len(self.started)
        c = FakeContainer(f"c{i}", list(command or []), kwargs, self.logs_[i], self.codes[i])
        self.started.append(c)
        return c

    def start(self, image: str, command: Sequence[str] | None = None, **kwargs: Any) -> FakeContainer:
        return self._make(command, kwargs)

    def start_on_network(self, image: str, command: Sequence[str] | None, *, network: str, alias: str,
                         **kwargs: Any) -> FakeContainer:
        return self._make(command, {**kwargs, "network": network, "alias": alias})

    def wait(self, container: FakeContainer, timeout: float) -> RunResult:
        if self.wait_raises:
            raise RuntimeError("engine went away")
        code = 137 if container.killed else container.code
        return RunResult(code, container.log)

    def state(self, container: FakeContainer) -> dict[str, Any]:
        second = 5 if container.killed else 9
        return {"StartedAt": "2026-01-01T00:00:00Z", "FinishedAt": f"2026-01-01T00:00:0{second}.5Z",
                "OOMKilled": False}

    def logs(self, container: FakeContainer) -> str:
        return container.log

    def kill(self, container: FakeContainer, signal: str = "SIGKILL") -> None:
        container.killed = True

    def archive(self, container: FakeContainer, path: str) -> bytes | None:
        self.archived.append(path)
        return self.archive_

    def remove(self, container: FakeContainer) -> None:
        container.removed = True

    @contextlib.contextmanager
    def network(self, name: str) -> Iterator[Any]:
        self.networks.append(name)

        class Net:
            pass

        net = Net()
        net.name = name  # type: ignore[attr-defined]
        try:
            yield net
        finally:
            self.removed_networks.append(name)


def _engine(fake: FakeEngine) -> Any:
    return fake


def test_multinode_starts_every_node_collects_every_exit_and_cleans_up() -> None:
    ok_log = _line(sample_result())
    fake = FakeEngine(logs=[ok_log, "node1 log"], codes=[0, 0])
    run = runner.run_multinode(_engine(fake), "img:1", nodes=2, nproc_per_node=2, steps=5, timeout=60)
    assert run.ok, run.summary()
    assert [n.name for n in run.nodes] == ["node0", "node1"]
    assert len(fake.networks) == 1 and fake.removed_networks == fake.networks
    assert all(c.removed for c in fake.started)
    for i, c in enumerate(fake.started):
        assert c.kwargs["alias"] == c.kwargs["hostname"] == f"node{i}"
        assert c.kwargs["network"] == fake.networks[0]
        assert c.kwargs["shm_size"] == contract.SMOKE_SHM_SIZE
        assert c.kwargs["environment"]["GLOO_SOCKET_IFNAME"] == "eth0"
        assert c.kwargs["environment"]["NCCL_SOCKET_IFNAME"] == "eth0"
        assert "device_requests" not in c.kwargs
        argv = c.command
        assert argv[argv.index("--rdzv_endpoint") + 1] == "node0:29400"
        assert argv[argv.index("--nnodes") + 1] == "2"
    ids = {c.command[c.command.index("--rdzv_id") + 1] for c in fake.started}
    assert len(ids) == 1  # one rendezvous id shared by every node


def test_multinode_failure_of_one_node_fails_the_run() -> None:
    fake = FakeEngine(logs=[_line(sample_result()), "boom"], codes=[0, 1])
    run = runner.run_multinode(_engine(fake), "img", nodes=2, timeout=60)
    assert not run.ok
    assert run.culprit is not None and run.culprit.name == "node1"


def test_multinode_cleans_up_when_the_engine_fails() -> None:
    fake = FakeEngine(logs=["", ""], codes=[0, 0], wait_raises=True)
    with pytest.raises(RuntimeError, match="engine went away"):
        runner.run_multinode(_engine(fake), "img", nodes=2, timeout=60)
    assert all(c.removed for c in fake.started) and fake.removed_networks == fake.networks


def test_multinode_kill_plan_kills_the_node_and_names_it() -> None:
    marker = runner.KillPlan().when
    fake = FakeEngine(logs=[f"PTMG_DDP rank 0: {marker}loss=1", "node1"], codes=[1, 0])
    run = runner.run_multinode(_engine(fake), "img", nodes=2, timeout=60, kill=runner.KillPlan(node=1))
    assert fake.started[1].killed and not fake.started[0].killed
    assert run.killed == "node1"
    assert not run.ok
    assert run.culprit is not None and run.culprit.name == "node1"  # it stopped first (state times)
    assert "--step-sleep" in fake.started[0].command  # the run is slowed down so the kill lands mid-training


def test_multinode_kill_plan_that_never_fires_is_an_error() -> None:
    fake = FakeEngine(logs=["nothing", "nothing"], codes=[0, 0])
    with pytest.raises(runner.SmokeError, match="never injected"):
        runner.run_multinode(_engine(fake), "img", nodes=2, timeout=60,
                            kill=runner.KillPlan(node=1, within_s=0.2))
    assert all(c.removed for c in fake.started)


def test_multinode_gpu_ids_per_node() -> None:
    fake = FakeEngine(logs=["", ""], codes=[0, 0])
    runner.run_multinode(_engine(fake), "img", nodes=2, nproc_per_node=1, gpu_ids=torchrun.split_gpus(2, 2), timeout=60)
    assert [c.kwargs["device_requests"][0]["device_ids"] for c in fake.started] == [["0"], ["1"]]
    with pytest.raises(ValueError, match="one entry per node"):
        runner.run_multinode(_engine(fake), "img", nodes=2, gpu_ids=[["0"]])


def test_single_node_runs_torchrun_standalone() -> None:
    fake = FakeEngine(logs=[_line(sample_result(world_size=2, nodes=1, backend="nccl"))], codes=[0])
    run = runner.run_single_node(_engine(fake), "img", nproc=2, gpus=True)
    assert run.ok and run.passed and run.world_size == 2
    c = fake.started[0]
    assert "--standalone" in c.command and c.removed
    assert c.kwargs["device_requests"] == [{"count": -1, "capabilities": [["gpu"]]}]
    # GPUs given, gloo ran: a fall-back is a failure, not a GPU pass
    fell_back = FakeEngine(logs=[_line(sample_result(world_size=2, nodes=1))], codes=[0])
    run = runner.run_single_node(_engine(fell_back), "img", nproc=2, gpus=True)
    assert not run.ok and "backend gloo ran where nccl was required" in run.summary()


def test_selftest_passes_the_image_labels_and_collects_junit() -> None:
    fake = FakeEngine(logs=["summary"], codes=[0], labels={"io.pt-multi-gpu.torch": "2.7.0", "project": "x"},
                      archive=_tar("junit.xml", JUNIT.encode()))
    run = runner.run_selftest(_engine(fake), "img", gpus=True)
    c = fake.started[0]
    assert c.command[0] == "selftest" and "--require-gpu" in c.command
    assert json.loads(c.command[c.command.index("--expect-json") + 1]) == {"io.pt-multi-gpu.torch": "2.7.0"}
    assert fake.archived == [c.command[c.command.index("--junit") + 1]]
    assert c.removed
    assert run.counts.failed == 1 and not run.ok  # JUnit says a check failed, whatever the exit code
    assert "FAILED test_versions::test_env[cuda]" in run.summary()


def test_selftest_without_junit_is_a_failure() -> None:
    fake = FakeEngine(logs=["crashed early"], codes=[0], archive=None)
    run = runner.run_selftest(_engine(fake), "img", expect={})
    assert run.junit_xml is None and not run.ok
