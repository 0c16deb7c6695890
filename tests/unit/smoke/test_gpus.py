"""The GPU path before it meets a GPU, with fakes: fake nvidia-smi hosts of 0, 1, 2 and 8
GPUs, CUDA_VISIBLE_DEVICES subsets, one node and two, a scripted engine, a fake NCCL watchdog.

- the rank rule (in the image: ddp_plan.plan_ranks; on the host: builder.smoke.gpus) asks for
  one rank per visible GPU in the runner, the selftest and the launch jobs;
- world size 1 is "skipped (one GPU)", never passed (--require-multi-gpu: failed);
- --nodes 2 with GPUs hands every node container its own GPUs, and a gloo fall-back fails;
- an NCCL hang is named by the job's watchdog before torch's NCCL watchdog would abort;
- busbw is measured and reported the nccl-tests way.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

import ptmg_contract as contract
from builder.cli import main as cli
from builder.cli.verbs import test as test_verb
from builder.common.errors import StepFailed
from builder.engine import RunResult
from builder.launch import LaunchConfig, render
from builder.launch.config import ImagePin, LaunchError
from builder.smoke import gpus, passes, results, torchrun
from tests import support

ROOT = Path(__file__).resolve().parents[3]
SMOKE_DIR = ROOT / "smoke_tests"


lib = support.smoke_module("smokelib")
ddp_plan = support.smoke_module("ddp_plan")
ddp_bench = support.smoke_module("ddp_bench")
ddp_watchdog = support.smoke_module("ddp_watchdog")
run_ddp = support.smoke_module("run_ddp")
job_tests = support.smoke_module("ddp_checks")


# --- fake hosts ----------------------------------------------------------------------


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}"


def smi_text(n: int) -> str:
    return "".join(f"{i}, {uuid(i)}\n" for i in range(n))


def fake_query(n: int) -> Any:
    def query() -> tuple[tuple[gpus.HostGpu, ...], str]:
        found = gpus.parse_smi(smi_text(n))
        return found, "" if found else "nvidia-smi lists no GPU"

    return query


def test_parse_smi_and_query_smi() -> None:
    assert gpus.parse_smi("0, GPU-a\n1, GPU-b\nNo devices were found\n") == (
        gpus.HostGpu("0", "GPU-a"), gpus.HostGpu("1", "GPU-b"))

    def run(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert list(argv[1:]) == list(gpus.SMI_ARGS)
        return subprocess.CompletedProcess(argv, 0, smi_text(2), "")

    found, why = gpus.query_smi(run=run, which=lambda _: "/usr/bin/nvidia-smi")
    assert [g.uuid for g in found] == [uuid(0), uuid(1)] and why == ""
    none, why = gpus.query_smi(which=lambda _: None)
    assert none == () and "nvidia-smi not found" in why


@pytest.mark.parametrize(("n", "cvd", "want", "note"), [
    (0, None, [], "no GPU"),
    (1, None, [0], ""),
    (2, None, [0, 1], ""),
    (8, None, list(range(8)), ""),
    (8, "2,3", [2, 3], ""),
    (8, "6, 7,0", [6, 7, 0], ""),  # CUDA's order is the list's order
    (8, uuid(5)[:12], [5], ""),  # a unique UUID prefix
    (8, f"{uuid(4)},1", [4, 1], ""),
    (8, "3,9,4", [3], "'9' names no single GPU"),  # CUDA stops the list at the first bad entry
    (8, "1,1", [1], "repeats a GPU"),
    (8, "", [], "hides every GPU"),
    (8, "-1", [], "names no single GPU"),
    (2, "MIG-1234", [], "names no single GPU"),
])
def test_host_gpus_honour_cuda_visible_devices(n: int, cvd: str | None, want: list[int], note: str) -> None:
    env = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    ids, why = gpus.host_gpus(env, query=fake_query(n))
    assert ids == tuple(uuid(i) for i in want)
    assert note in why


# --- why torch sees no GPU: the host's driver, and the reason the in-image checks give ---------------

#: /proc/driver/nvidia/version of the open kernel module (570) and of the proprietary one (535).
PROC_OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  "
             "(dvs-builder@U16-I3-B03-4-3)  Thu Jan 23 21:45:09 UTC 2025\nGCC version:  gcc version 12.2.0\n")
PROC_CLOSED = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"


def _driver_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smi: str | None,
                 proc: str | None = None) -> str:
    """A host whose PATH holds only a fake nvidia-smi (the shell script `smi`, or none), and whose
    /proc driver file (returned) holds `proc` (or does not exist)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    if smi is not None:
        (bindir / "nvidia-smi").write_text("#!/bin/sh\n" + smi)
        (bindir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", str(bindir))
    proc_file = tmp_path / "version"
    if proc is not None:
        proc_file.write_text(proc)
    return str(proc_file)


@pytest.mark.parametrize(("smi", "proc", "want"), [
    ("echo 570.86.15", None, "570.86.15"),                             # one GPU
    ("printf '570.86.15\\n570.86.15\\n'", None, "570.86.15"),         # one row per GPU
    ("echo 570.86.15", PROC_CLOSED, "570.86.15"),                      # nvidia-smi first
    (None, PROC_OPEN, "570.86.15"),                                    # no nvidia-smi: the kernel module's file
    (None, PROC_CLOSED, "535.104.05"),
    ("echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver\"; exit 9",
     PROC_CLOSED, "535.104.05"),
    ("echo 570.86.15; exit 15", PROC_CLOSED, "535.104.05"),            # a failed nvidia-smi's output is not used
    ("echo 'No devices were found'", PROC_CLOSED, "535.104.05"),       # not a version
    ("exit 0", PROC_CLOSED, "535.104.05"),                             # nothing printed
    (None, "NVRM version: unknown\n", None),
    (None, None, None),                                                # no driver at all
])
def test_driver_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smi: str | None, proc: str | None,
                        want: str | None) -> None:
    assert lib.driver_version(_driver_host(tmp_path, monkeypatch, smi, proc)) == want


def test_driver_version_survives_an_nvidia_smi_that_cannot_run(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    proc_file = _driver_host(tmp_path, monkeypatch, None, PROC_CLOSED)
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_bytes(b"\x7fELF not for this machine")  # executable, but exec() refuses it: OSError
    smi.chmod(0o755)
    assert lib.driver_version(proc_file) == "535.104.05"


def test_driver_version_does_not_wait_on_a_hung_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc_file = _driver_host(tmp_path, monkeypatch, "sleep 600", PROC_CLOSED)
    seen: dict[str, Any] = {}

    def hung(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen.update(kwargs)
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"])

    monkeypatch.setattr(subprocess, "run", hung)
    assert lib.driver_version(proc_file) == "535.104.05"
    assert 0 < seen["timeout"] <= 60


_CVD_UNSET: dict[str, str] = {}


@pytest.mark.parametrize(("cuda", "driver", "min_driver", "env", "says"), [
    (None, "570.86.15", "525.60.13", _CVD_UNSET, "CPU-only build of torch 2.7.0"),
    ("", None, "", _CVD_UNSET, "CPU-only build of torch 2.7.0"),
    ("12.6", "535.104.05", "560.28.03", _CVD_UNSET,
     "the NVIDIA driver 535.104.05 is older than 560.28.03, the minimum for CUDA 12.6"),
    # the driver at the minimum, or newer: the GPU was not passed in
    ("12.6", "560.28.03", "560.28.03", _CVD_UNSET, "the host's NVIDIA driver 560.28.03 is loaded, but no GPU"),
    ("12.6", "570.86.15", "560.28.03", _CVD_UNSET, "the host's NVIDIA driver 570.86.15 is loaded, but no GPU"),
    ("12.6", "570.86.15", "", _CVD_UNSET, "the host's NVIDIA driver 570.86.15 is loaded, but no GPU"),
    ("12.6", "570.86.15", "n/a", _CVD_UNSET, "the host's NVIDIA driver 570.86.15 is loaded, but no GPU"),
    ("12.6", "570.86.15", "560.28.03", {"CUDA_VISIBLE_DEVICES": ""}, "CUDA_VISIBLE_DEVICES='' hides every GPU"),
    ("12.6", "570.86.15", "560.28.03", {"CUDA_VISIBLE_DEVICES": "-1"}, "CUDA_VISIBLE_DEVICES='-1' hides every GPU"),
    ("12.6", None, "560.28.03", {"CUDA_VISIBLE_DEVICES": "NoDevFiles"},
     "CUDA_VISIBLE_DEVICES='NoDevFiles' hides every GPU"),
    ("12.6", "570.86.15", "560.28.03", {"CUDA_VISIBLE_DEVICES": "0,1"}, "is loaded, but no GPU"),
    ("12.6", None, "560.28.03", _CVD_UNSET, "no NVIDIA driver in this container"),
    ("12.6", None, "560.28.03", _CVD_UNSET, "(this image needs >= 560.28.03)"),
    ("12.6", None, "", _CVD_UNSET, "(this image needs >= the one its CUDA needs)"),
])
def test_no_gpu_reason_names_the_most_specific_cause(cuda: str | None, driver: str | None, min_driver: str,
                                                      env: dict[str, str], says: str) -> None:
    why = lib.no_gpu_reason("2.7.0+cu126" if cuda else "2.7.0+cpu", cuda, driver, min_driver, env)
    assert says in why, why
    causes = ("CPU-only", "is older than", "hides every GPU", "no NVIDIA driver in", "is loaded, but")
    assert sum(c in why for c in causes) == 1, why  # one cause, not a list of guesses


# --- the rank rule -------------------------------------------------------------------


@pytest.mark.parametrize(("n", "requested", "want"), [
    (0, None, (2, "gloo", "cpu")),
    (0, 3, (3, "gloo", "cpu")),
    (1, None, (1, "nccl", "cuda")),
    (2, None, (2, "nccl", "cuda")),
    (8, None, (8, "nccl", "cuda")),
    (8, 4, (4, "nccl", "cuda")),  # fewer when asked
    (8, 16, (8, "nccl", "cuda")),  # more is clamped: NCCL needs one GPU per rank
])
def test_in_image_plan_one_rank_per_visible_gpu(n: int, requested: int | None, want: tuple[int, str, str]) -> None:
    plan = ddp_plan.plan_ranks(requested, n)
    assert (plan.nproc, plan.backend, plan.device) == want
    assert ("clamped" in plan.note) == (requested is not None and n > 0 and requested > n)


def test_in_image_plan_gloo_on_cuda_and_refusals() -> None:
    plan = ddp_plan.plan_ranks(2, 1, backend="gloo", device="cuda")  # two gloo ranks on the one GPU
    assert (plan.nproc, plan.backend, plan.device) == (2, "gloo", "cuda")
    assert [ddp_plan.device_index(r, 1) for r in range(2)] == [0, 0]
    assert [ddp_plan.device_index(r, 8) for r in range(8)] == list(range(8))
    with pytest.raises(ValueError, match="GPU"):
        ddp_plan.plan_ranks(None, 0, backend="nccl")
    with pytest.raises(ValueError, match="cuda"):
        ddp_plan.plan_ranks(None, 2, backend="nccl", device="cpu")
    with pytest.raises(ValueError, match="GPU"):
        ddp_plan.plan_ranks(2, 0, backend="gloo", device="cuda")


@pytest.mark.parametrize(("n", "nodes", "requested", "per_node", "nproc", "note"), [
    (1, 1, None, [[0]], 1, ""),
    (2, 1, None, [[0, 1]], 2, ""),
    (8, 1, None, [list(range(8))], 8, ""),
    (8, 1, 2, [[0, 1]], 2, ""),
    (2, 1, 4, [[0, 1]], 2, "clamped to 2"),
    (2, 2, None, [[0], [1]], 1, ""),
    (8, 2, None, [[0, 1, 2, 3], [4, 5, 6, 7]], 4, ""),
    (8, 2, 1, [[0], [4]], 1, ""),
    (3, 2, None, [[0], [1]], 1, "1 GPU(s) idle"),
])
def test_host_plan_shares_the_gpus_between_nodes(n: int, nodes: int, requested: int | None,
                                                 per_node: list[list[int]], nproc: int, note: str) -> None:
    ids, _ = gpus.host_gpus({}, query=fake_query(n))
    plan = gpus.plan_run(ids, nodes, requested)
    assert plan.backend == "nccl" and plan.nproc_per_node == nproc and plan.world_size == nodes * nproc
    assert plan.node_gpus == tuple(tuple(uuid(i) for i in node) for node in per_node)
    assert note in plan.note


def test_host_plan_with_a_cuda_visible_devices_subset_on_two_nodes() -> None:
    ids, _ = gpus.host_gpus({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, query=fake_query(8))
    plan = gpus.plan_run(ids, 2, None)
    assert plan.node_gpus == ((uuid(4), uuid(5)), (uuid(6), uuid(7))) and plan.world_size == 4


def test_host_plan_cpu_and_impossible_requests() -> None:
    cpu = gpus.plan_run(None, 2, None)
    assert (cpu.backend, cpu.nproc_per_node, cpu.node_gpus, cpu.gpu_ids) == ("gloo", 2, None, None)
    with pytest.raises(gpus.GpuPlanError, match="--nodes 2"):
        gpus.plan_run((uuid(0),), 2, None)


# --- world size 1: never a pass ----------------------------------------------------------


def job_result(world: int, backend: str, *, device: str = "cuda:0", gpus_visible: int = 1,
               nodes: int = 1) -> dict[str, Any]:
    """What ddp_job.py prints, built with the job's own check and verdict functions."""
    checks = ddp_plan.ddp_checks(world, backend, loss_decreased=True, params_identical=True, allreduce_exact=True,
                            busbw_measured=world >= 2)
    rows = [] if world < 2 else [ddp_bench.busbw_row(1 << 30, [0.010, 0.012], world)]
    return {
        "schema": 2, "ok": True, "verdict": ddp_plan.ddp_verdict(checks, world, backend), "checks": checks,
        "world_size": world, "backend": backend, "gpus_visible": gpus_visible, "device": device,
        "nodes": nodes, "hosts": [f"node{i * nodes // world}" for i in range(world)], "local_world_size": world,
        "torch": "2.7.0+cu126", "steps": 60, "steps_per_s": 100.0, "initial_loss": 6.0, "final_loss": 0.1,
        "loss_decreased": True, "params_identical": True, "params_sha256": "ab", "allreduce_exact": True,
        "busbw": rows, "tensorboard_dir": "/tmp/tb", "wall_s": 3.0,
        "bench": {"op": "all_reduce", "reduce": "sum", "dtype": "float32", "in_place": True,
                  "warmup": ddp_bench.BENCH_WARMUP, "iters": ddp_bench.BENCH_ITERS,
                  "sizes": ddp_bench.bench_sizes("auto", backend), "skipped_sizes": []},
    }


def test_the_job_calls_world_size_1_skipped_never_passed() -> None:
    checks = ddp_plan.ddp_checks(1, "nccl", loss_decreased=True, params_identical=True, allreduce_exact=True,
                            busbw_measured=False)
    assert checks["loss_decreased"] == "passed"
    for name in ddp_plan.MULTI_RANK_CHECKS:
        assert checks[name] == "skipped: one GPU, NCCL transport not exercised"
    assert ddp_plan.ddp_verdict(checks, 1, "nccl") == "skipped (one GPU)"
    assert ddp_plan.ddp_verdict(ddp_plan.ddp_checks(1, "gloo", loss_decreased=True, params_identical=True,
                                          allreduce_exact=True, busbw_measured=None), 1, "gloo") == "skipped (one rank)"
    two = ddp_plan.ddp_checks(2, "nccl", loss_decreased=True, params_identical=True, allreduce_exact=True,
                         busbw_measured=True)
    assert ddp_plan.ddp_verdict(two, 2, "nccl") == "passed"
    bad = ddp_plan.ddp_checks(2, "nccl", loss_decreased=True, params_identical=False, allreduce_exact=True,
                         busbw_measured=True)
    assert ddp_plan.ddp_verdict(bad, 2, "nccl") == "failed"
    # a failure at world size 1 is still a failure, not a skip
    assert ddp_plan.ddp_verdict(ddp_plan.ddp_checks(1, "nccl", loss_decreased=False, params_identical=True,
                                          allreduce_exact=True, busbw_measured=None), 1, "nccl") == "failed"


def _fake_job(result: dict[str, Any], nproc: int, backend: str) -> Any:
    launch = run_ddp.Launch(0, "", False, nproc, backend, "", 1.0, "cuda")
    return launch, result, "/tmp/ddp"


def _smoke(require_multi: bool = False) -> Any:
    return lib.SmokeConfig(require_gpu=True, nproc=None, out="/tmp", expect={}, ddp_timeout=60.0,
                           require_multi_gpu=require_multi)


def _outcome(check: str, job: Any, smoke: Any) -> tuple[str, str]:
    """What the in-image check did: ("passed" | "skipped" | "failed", its message). Both outcomes are
    caught here, so a check that skips where it must fail reads as "skipped", never escapes a
    ``pytest.raises(pytest.fail.Exception)`` (a skip is not a fail) and passes the test by skipping it."""
    try:
        job_tests.CHECKS[check](job, smoke)
    except pytest.skip.Exception as exc:
        return "skipped", str(exc)
    except pytest.fail.Exception as exc:
        return "failed", str(exc)
    return "passed", ""


@pytest.mark.parametrize("check", ["params-identical", "allreduce-exact", "busbw-table", "verdict"])
def test_in_image_suite_skips_the_two_rank_checks_on_one_gpu(check: str) -> None:
    job = _fake_job(job_result(1, "nccl"), 1, "nccl")
    kind, why = _outcome(check, job, _smoke())
    assert kind == "skipped" and "one GPU, NCCL transport not exercised" in why, (kind, why)
    kind, why = _outcome(check, job, _smoke(require_multi=True))
    assert kind == "failed", f"--require-multi-gpu on one GPU must fail the check, it {kind}: {why}"
    assert re.search(r"--require-multi-gpu: .*one GPU, NCCL transport not exercised", why), why


def test_a_config_without_the_multi_gpu_flag_skips_on_one_gpu() -> None:
    smoke = lib.SmokeConfig(require_gpu=True, nproc=None, out="/tmp", expect={}, ddp_timeout=60.0)
    kind, why = _outcome("verdict", _fake_job(job_result(1, "nccl"), 1, "nccl"), smoke)
    assert kind == "skipped", (kind, why)


def test_in_image_suite_passes_eight_gpus_and_refuses_a_gloo_fallback() -> None:
    eight = _fake_job(job_result(8, "nccl", gpus_visible=8), 8, "nccl")
    for check in ("world-size", "backend", "params-identical", "allreduce-exact", "busbw-table", "verdict"):
        job_tests.CHECKS[check](eight, _smoke(require_multi=True))
    fell_back = _fake_job(job_result(2, "gloo", device="cpu"), 2, "gloo")
    with pytest.raises(AssertionError, match="--require-gpu, but the job ran gloo"):
        job_tests.CHECKS["backend"](fell_back, _smoke())
    short = _fake_job(job_result(4, "nccl", gpus_visible=8), 4, "nccl")  # 4 of 8 GPUs, nobody asked for fewer
    with pytest.raises(AssertionError):
        job_tests.CHECKS["world-size"](short, _smoke())


def _good_job(tmp_path: Path, world: int = 8, backend: str = "nccl", **launch: Any) -> Any:
    """A job every in-image check passes: its TensorBoard folder holds a (1-byte) events file, and
    its bandwidth rows sit just above the checks' limits."""
    (tmp_path / "tb").mkdir(exist_ok=True)
    (tmp_path / "tb" / "events.out.tfevents.1.host").write_bytes(b"x")
    result = job_result(world, backend, gpus_visible=world if backend == "nccl" else 0,
                        device="cuda:0" if backend == "nccl" else "cpu")
    row = {"time_us": 0.5, "busbw_GBps": 0.5, "time_us_max": 0.5}
    # NCCL's table must reach 1 GiB (nccl-tests' comparison size), measured, not only asked for
    result["busbw"] = [{"bytes": 1 << 20, **row}, *([{"bytes": 1 << 30, **row}] if backend == "nccl" else [])]
    fields = {"returncode": 0, "output": "", "timed_out": False, "nproc": world, "backend": backend, "note": "",
              "seconds": 1.0, "device": "cuda" if backend == "nccl" else "cpu", **launch}
    return run_ddp.Launch(**fields), result, str(tmp_path)


def _gloo_smoke() -> Any:
    return lib.SmokeConfig(require_gpu=False, nproc=None, out="/tmp", expect={}, ddp_timeout=60.0)


def test_every_in_image_check_passes_a_good_job(tmp_path: Path) -> None:
    for check in job_tests.CHECKS.values():
        check(_good_job(tmp_path), _smoke(require_multi=True))
        check(_good_job(tmp_path, 2, "gloo"), _gloo_smoke())  # gloo: small sizes, any GPU count, name


def _worse(job: Any, launch: dict[str, Any] | None = None, **result: Any) -> Any:
    bench = {**job[1]["bench"], **result.pop("bench", {})}
    return job[0]._replace(**(launch or {})), {**job[1], **result, "bench": bench}, job[2]


@pytest.mark.parametrize(("check", "change", "says"), [
    ("exit-code", {"launch": {"timed_out": True}}, "hit the hard timeout"),
    ("exit-code", {"launch": {"returncode": 1}}, "torchrun exited 1"),
    ("world-size", {"launch": {"nproc": 4}}, None),
    ("world-size", {"world_size": 4, "launch": {"nproc": 4}}, None),  # 4 of 8 GPUs, and nobody asked for fewer
    ("backend", {"device": "cpu"}, "--require-gpu, but the job ran nccl on cpu"),
    ("loss-decreases", {"loss_decreased": False}, "did not decrease"),
    ("params-identical", {"params_identical": False}, "parameters differ"),
    ("allreduce-exact", {"allreduce_exact": False}, "gave a wrong result"),
    ("busbw-table", {"bench": {"warmup": 0}}, "warmup"),
    ("busbw-table", {"bench": {"iters": 5}}, "iters"),
    ("busbw-table", {"busbw": []}, "no all-reduce bandwidth measured"),
    ("busbw-table", {"busbw": [{"time_us": 0.0, "busbw_GBps": 1.0, "time_us_max": 1.0}]}, "time_us"),
    ("busbw-table", {"busbw": [{"time_us": 1.0, "busbw_GBps": 0.0, "time_us_max": 1.0}]}, "busbw_GBps"),
    ("busbw-table", {"busbw": [{"time_us": 2.0, "busbw_GBps": 1.0, "time_us_max": 1.0}]}, "time_us_max"),
    ("busbw-table", {"busbw": [{"bytes": 1 << 29, "time_us": 1.0, "busbw_GBps": 1.0, "time_us_max": 1.0}]},
     "the largest size measured is 512 MiB"),
    ("verdict", {"verdict": "failed"}, "the job's checks"),
])
def test_each_in_image_check_refuses_what_it_guards(tmp_path: Path, check: str, change: dict[str, Any],
                                                    says: str | None) -> None:
    job = _worse(_good_job(tmp_path), **change)
    with pytest.raises(AssertionError, match=says):
        job_tests.CHECKS[check](job, _smoke(require_multi=True))


def test_tensorboard_events_must_exist_and_hold_something(tmp_path: Path) -> None:
    job = _good_job(tmp_path)
    (tmp_path / "tb" / "events.out.tfevents.1.host").write_bytes(b"")
    with pytest.raises(AssertionError, match="no TensorBoard events written"):
        job_tests.CHECKS["tensorboard-events"](job, _smoke())
    (tmp_path / "tb" / "events.out.tfevents.1.host").unlink()
    with pytest.raises(AssertionError, match="no TensorBoard events written"):
        job_tests.CHECKS["tensorboard-events"](job, _smoke())


def test_a_job_without_a_result_fails_every_check_but_the_exit_code(tmp_path: Path) -> None:
    launch, _, out = _good_job(tmp_path)
    for name, check in job_tests.CHECKS.items():
        if name != "exit-code":
            with pytest.raises(pytest.fail.Exception, match="the DDP job printed no result"):
                check((launch, None, out), _smoke())


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    argvs: list[list[str]] = []

    def fake_run(argv: Sequence[str], timeout: float, echo: bool = False,
                 env: dict[str, str] | None = None) -> tuple[int, str, bool]:
        argvs.append(list(argv))
        return 0, "", False

    monkeypatch.setattr(run_ddp, "run_bounded", fake_run)
    yield argvs


@pytest.mark.parametrize(("n", "nproc", "backend"), [(0, 2, "gloo"), (1, 1, "nccl"), (2, 2, "nccl"), (8, 8, "nccl")])
def test_the_selftest_asks_for_every_gpu(launched: list[list[str]], monkeypatch: pytest.MonkeyPatch,
                                         n: int, nproc: int, backend: str) -> None:
    monkeypatch.setattr(run_ddp, "visible_gpus", lambda: n)
    launch = run_ddp.launch(None, script_args=["--out", "/tmp/x"])  # what test_ddp's ddp_job fixture does
    argv = launched[-1]
    assert argv[argv.index("--nproc_per_node") + 1] == str(nproc) and launch.nproc == nproc
    assert argv[argv.index("--backend") + 1] == backend
    assert argv[argv.index("--device") + 1] == ("cuda" if n else "cpu")


def test_selftest_flag_require_multi_gpu_needs_require_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    selftest = support.smoke_module("selftest")
    assert selftest.parse_args(["--require-gpu", "--require-multi-gpu"]).require_multi_gpu
    with pytest.raises(SystemExit):
        selftest.parse_args(["--require-multi-gpu"])
    assert selftest.parse_args([]).nproc is None  # no --nproc: one rank per visible GPU


# --- the host runner and `build.py test`, against a scripted engine ----------------------


class ScriptedEngine:
    """A Docker engine whose containers print what the script says (selftest or DDP run)."""

    def __init__(self, ddp_result: dict[str, Any] | None, *, selftest_junit: str | None = None) -> None:
        self.ddp_result = ddp_result
        self.junit = selftest_junit or ('<testsuite tests="1"><testcase classname="test_versions" '
                                        'name="test_env[torch]"/></testsuite>')
        self.started: list[dict[str, Any]] = []

    # images
    def image_exists(self, ref: str) -> bool:
        return True

    def image_id(self, ref: str) -> str:
        return "sha256:" + "1" * 64

    def image_labels(self, ref: str) -> dict[str, str]:
        return {"io.pt-multi-gpu.torch": "2.7.0"}

    # containers
    def start(self, image: str, command: Sequence[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        c = {"image": image, "command": list(command or []), "kwargs": kwargs, "removed": False}
        self.started.append(c)
        return c

    def wait(self, c: dict[str, Any], timeout: float) -> RunResult:
        if c["command"][0] == "selftest" or self.ddp_result is None:
            return RunResult(0, "selftest")
        rank0 = c["kwargs"].get("alias", "node0") == "node0"
        return RunResult(0, contract.DDP_RESULT_MARKER + json.dumps(self.ddp_result) if rank0 else "")

    def state(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"StartedAt": "2026-01-01T00:00:00Z", "FinishedAt": "2026-01-01T00:00:09Z", "OOMKilled": False}

    def archive(self, c: dict[str, Any], path: str) -> bytes:
        import io
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            data = self.junit.encode()
            info = tarfile.TarInfo("junit.xml")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    def logs(self, c: dict[str, Any]) -> str:
        return ""

    def remove(self, c: dict[str, Any]) -> None:
        c["removed"] = True

    def cleanup_session(self) -> None:
        pass

    def network(self, name: str) -> Any:
        import contextlib

        @contextlib.contextmanager
        def net() -> Iterator[Any]:
            class Net:
                pass

            n = Net()
            n.name = name  # type: ignore[attr-defined]
            yield n

        return net()

    # what the runner asked for
    def ddp_containers(self) -> list[dict[str, Any]]:
        return [c for c in self.started if c["command"][0] == "torchrun"]

    def selftest_container(self) -> dict[str, Any]:
        (c,) = [c for c in self.started if c["command"][0] == "selftest"]
        return c


def _run_verb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: ScriptedEngine, host_gpus: int,
              *flags: str, env: dict[str, str] | None = None) -> int:
    monkeypatch.setattr(gpus, "query_smi", fake_query(host_gpus))
    monkeypatch.setenv("PTMG_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PTMG_REQUIRE_MULTI_GPU", raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    matrix = support.write_matrix(tmp_path)
    args = cli.parser().parse_args(["test", "--config", str(matrix), "--only", support.MID, "--json",
                                    "--junit-dir", str(tmp_path / "junit"), *flags])
    ctx = cli._context(args)
    ctx._engine = engine  # type: ignore[assignment]
    return test_verb.run(ctx)


def _verb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
          engine: ScriptedEngine, host_gpus: int, *flags: str,
          env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    rc = _run_verb(tmp_path, monkeypatch, engine, host_gpus, *flags, env=env)
    (report,) = json.loads(capsys.readouterr().out)
    return rc, report


def test_one_gpu_host_ddp_verdict_is_skipped_never_passed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(job_result(1, "nccl"))
    rc, report = _verb(tmp_path, monkeypatch, capsys, engine, 1, "--require-gpu")
    assert rc == 0  # nothing failed...
    assert report["ddp"]["verdict"] == "skipped (one GPU)" and report["ddp"]["verdict"] != "passed"  # ...nothing passed
    (ddp,) = engine.ddp_containers()
    assert ddp["command"][ddp["command"].index("--nproc_per_node") + 1] == "1"  # not 2: rank 1 would have no GPU
    assert ddp["kwargs"]["device_requests"][0]["device_ids"] == [uuid(0)]
    rec = passes.smoke_pass(tmp_path, report["image_id"])
    assert rec is not None and rec.ddp == "skipped (one GPU)" and rec.world_size == 1  # the record says so too


def test_one_gpu_host_with_require_multi_gpu_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(job_result(1, "nccl"))
    rc, report = _verb(tmp_path, monkeypatch, capsys, engine, 1, "--require-gpu", "--require-multi-gpu")
    assert rc == 1 and report["ddp"]["verdict"] == "failed"
    assert any("--require-multi-gpu" in p for p in report["ddp"]["problems"])
    assert "--require-multi-gpu" in engine.selftest_container()["command"]  # the in-image suite fails it too
    assert passes.smoke_pass(tmp_path, report["image_id"]) is None
    # the same from the environment (CI sets PTMG_REQUIRE_MULTI_GPU)
    engine = ScriptedEngine(job_result(1, "nccl"))
    rc, _ = _verb(tmp_path, monkeypatch, capsys, engine, 1, "--require-gpu", env={"PTMG_REQUIRE_MULTI_GPU": "1"})
    assert rc == 1


def test_eight_gpu_host_runner_and_selftest_ask_for_eight_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(job_result(8, "nccl", gpus_visible=8))
    rc, report = _verb(tmp_path, monkeypatch, capsys, engine, 8, "--require-gpu")
    assert rc == 0 and report["ddp"]["verdict"] == "passed", report["ddp"]
    (ddp,) = engine.ddp_containers()
    assert ddp["command"][ddp["command"].index("--nproc_per_node") + 1] == "8"
    assert ddp["kwargs"]["device_requests"][0]["device_ids"] == [uuid(i) for i in range(8)]
    st = engine.selftest_container()
    assert "--require-gpu" in st["command"] and "--nproc" not in st["command"]  # in-image default: every GPU
    assert st["kwargs"]["device_requests"][0]["device_ids"] == [uuid(i) for i in range(8)]


def test_cuda_visible_devices_subset_reaches_the_containers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(job_result(2, "nccl", gpus_visible=2))
    rc, _ = _verb(tmp_path, monkeypatch, capsys, engine, 8, "--require-gpu", env={"CUDA_VISIBLE_DEVICES": "6,7"})
    assert rc == 0
    (ddp,) = engine.ddp_containers()
    assert ddp["kwargs"]["device_requests"][0]["device_ids"] == [uuid(6), uuid(7)]
    assert ddp["command"][ddp["command"].index("--nproc_per_node") + 1] == "2"


def test_two_nodes_with_gpus_pass_gpu_ids_to_both_node_containers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(job_result(8, "nccl", gpus_visible=4, nodes=2))
    rc, report = _verb(tmp_path, monkeypatch, capsys, engine, 8, "--require-gpu", "--nodes", "2")
    assert rc == 0 and report["ddp"]["verdict"] == "passed", report["ddp"]
    node0, node1 = engine.ddp_containers()
    ids = [c["kwargs"]["device_requests"][0]["device_ids"] for c in (node0, node1)]
    assert ids == [[uuid(i) for i in range(4)], [uuid(i) for i in range(4, 8)]]
    for c in (node0, node1):
        assert c["command"][c["command"].index("--nproc_per_node") + 1] == "4"
        assert c["command"][c["command"].index("--nnodes") + 1] == "2"
        assert c["kwargs"]["environment"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_two_nodes_that_fell_back_to_gloo_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(job_result(4, "gloo", device="cpu", gpus_visible=0, nodes=2))
    rc, report = _verb(tmp_path, monkeypatch, capsys, engine, 4, "--require-gpu", "--nodes", "2")
    assert rc == 1 and report["ddp"]["verdict"] == "failed"
    assert any("backend gloo ran where nccl was required" in p for p in report["ddp"]["problems"])
    assert report["ddp"]["result"]["backend"] == "gloo"  # the result says which backend ran


def test_require_gpu_on_a_host_without_gpus_fails_before_any_container(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    engine = ScriptedEngine(None)
    with pytest.raises(StepFailed, match="--require-gpu: no GPU visible on this host"):
        _run_verb(tmp_path, monkeypatch, engine, 0, "--require-gpu")
    assert engine.started == []
    with pytest.raises(StepFailed, match="--nodes 2"):
        _run_verb(tmp_path, monkeypatch, engine, 1, "--require-gpu", "--nodes", "2")


def test_cpu_run_is_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(job_result(2, "gloo", device="cpu", gpus_visible=0))
    rc, report = _verb(tmp_path, monkeypatch, capsys, engine, 8, env={"PTMG_REQUIRE_MULTI_GPU": "1"})
    assert rc == 0 and report["ddp"]["verdict"] == "passed"
    (ddp,) = engine.ddp_containers()
    assert "device_requests" not in ddp["kwargs"]  # no --require-gpu: CPU ranks, whatever the host has
    assert ddp["command"][ddp["command"].index("--nproc_per_node") + 1] == "2"


def test_ddp_run_verdicts() -> None:
    node = results.NodeRun("node0", 0, False, "")
    one = results.DDPResult.from_json(job_result(1, "nccl"))
    run = results.DDPRun("img", (node,), 1, one, 1.0, expect_backend="nccl")
    assert run.ok and not run.passed and run.verdict == "skipped (one GPU)"
    assert "SKIPPED (ONE GPU)" in run.summary() and "PASS " not in run.summary()
    assert "one GPU, NCCL transport not exercised" in run.summary()
    strict = results.DDPRun("img", (node,), 1, one, 1.0, expect_backend="nccl", require_multi=True)
    assert not strict.ok and strict.verdict == "failed"
    # results from images built before the verdict field: the same rule
    old = job_result(1, "nccl")
    del old["verdict"], old["checks"]
    assert results.DDPResult.from_json(old).verdict == "skipped (one GPU)"


# --- launch: the same rule in the generated jobs -----------------------------------------


def _launch_cfg(**over: Any) -> LaunchConfig:
    base: dict[str, Any] = {"cell": support.MID, "image": ImagePin("reg/pt:1", "reg/pt:1"), "nodes": 2,
                            "gpus_per_node": 8, "nproc_per_node": 8}
    base.update(over)
    return LaunchConfig(**base)


def test_launch_asks_for_eight_ranks_on_eight_gpu_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    matrix = support.write_matrix(tmp_path)
    rc = cli.main(["launch", "--config", str(matrix), "--only", support.MID, "--target", "slurm", "--no-pin"])
    out = capsys.readouterr().out
    assert rc == 0 and "--nproc_per_node 8" in out and "--gpus-per-node=8" in out  # the default: 8 GPUs, 8 ranks
    for target in ("pytorchjob", "jobset"):
        docs = list(yaml.safe_load_all(render(target, _launch_cfg())))
        pods = [d["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"] if target == "pytorchjob" else
                d["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
                for d in docs if d["kind"] in ("PyTorchJob", "JobSet")]
        (main,) = pods[0]["containers"]
        assert main["args"][main["args"].index("--nproc_per_node") + 1] == "8"
        assert main["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "--bench-sizes" not in " ".join(_launch_cfg().script)  # the job's own sizes: up to 1 GiB on NCCL


def test_launch_refuses_more_ranks_than_gpus() -> None:
    with pytest.raises(LaunchError, match="NCCL needs one GPU per rank"):
        _launch_cfg(nproc_per_node=16)
    _launch_cfg(nproc_per_node=4)  # fewer is the user's choice
    _launch_cfg(gpus_per_node=0, nproc_per_node=4)  # CPU ranks


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


# --- busbw, the nccl-tests way -----------------------------------------------------------------


def test_bench_settings_match_nccl_tests() -> None:
    job = support.smoke_module("ddp_job")
    ns = job.parse_args([])
    assert (ns.bench_warmup, ns.bench_iters, ns.bench_sizes) == (5, 20, "auto")
    assert max(ddp_bench.bench_sizes("auto", "nccl")) == 1 << 30
    assert max(ddp_bench.bench_sizes("auto", "gloo")) == 4 << 20
    assert ddp_bench.bench_sizes("", "nccl") == []
    assert "--bench-sizes" not in torchrun.ddp_job_args()  # the runner leaves the sizes to the job
    assert ddp_bench.bench_fits(0.01, 20, 1.0) and not ddp_bench.bench_fits(0.1, 20, 1.0)


def test_busbw_row_averages_over_ranks_and_reports_the_slowest() -> None:
    row = ddp_bench.busbw_row(1 << 30, [0.010, 0.010, 0.010, 0.014], 4)
    assert row["time_us"] == pytest.approx(11000) and row["time_us_max"] == pytest.approx(14000)
    alg = (1 << 30) / 0.011
    assert row["algbw_GBps"] == pytest.approx(alg / 1e9)
    assert row["busbw_GBps"] == pytest.approx(alg * 1.5 / 1e9)  # 2(n-1)/n at n = 4
    assert row["busbw_GBps_min"] == pytest.approx((1 << 30) / 0.014 * 1.5 / 1e9)


def test_busbw_markdown_lists_warmups_iterations_and_sizes() -> None:
    r = results.DDPResult.from_json(job_result(2, "nccl", gpus_visible=2))
    text = results.busbw_markdown(r)
    assert "5 warm-up + 20 timed iterations" in text and "1 KiB, 64 KiB, 1 MiB, 16 MiB, 256 MiB, 1 GiB" in text
    assert "| 1 GiB |" in text and "average over ranks" in text
