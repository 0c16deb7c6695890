"""The DDP job's checks, one function each (test_ddp.py makes each its own test id).

Kept apart from test_ddp.py so that the host's unit tier can run them against fake results
(a one-GPU world, eight GPUs, a gloo fall-back) without collecting the in-image suite.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable
from typing import Any

import pytest

import ddp_bench
import ddp_plan
import run_ddp
from smokelib import SmokeConfig, contract

Job = tuple[run_ddp.Launch, dict[str, Any] | None, str]


#: A rank's own words about why it failed (ddp_job.main), which torchrun's long traceback
#: that ends the output would push out of a plain tail.
RANK_ERROR = re.compile(r"PTMG_DDP rank \d+ (failed in |: checks failed|: no diagnosis)|"
                        + re.escape(contract.DDP_STUCK_MARKER))


def tail(launch: run_ddp.Launch, lines: int = 40) -> str:
    """The output's last ``lines`` lines, after every rank's own error line that they leave out."""
    out = launch.output.splitlines()
    last = out[-lines:]
    errors = [line for line in out[:-lines] if RANK_ERROR.search(line)]  # empty when the tail is all of it
    head = ["the ranks' own errors:", *errors, f"... the last {lines} lines:"] if errors else []
    return "\n".join([*head, *last])


def _result(job: Job) -> dict[str, Any]:
    launch, result, _ = job
    if result is None:
        pytest.fail(f"the DDP job printed no result (exit {launch.returncode}, "
                    f"{launch.nproc} ranks, {launch.backend}):\n{tail(launch)}", pytrace=False)
    return result


def skip_or_fail(smoke: SmokeConfig, why: str) -> None:
    """A check that could not be exercised: skipped with ``why``, or failed with --require-multi-gpu."""
    if smoke.require_multi_gpu:
        pytest.fail(f"--require-multi-gpu: {why}", pytrace=False)
    pytest.skip(why)


def need_two_ranks(job: Job, smoke: SmokeConfig) -> dict[str, Any]:
    """The result, when it had >= 2 ranks; else skip (or fail) with the reason."""
    r = _result(job)
    why = ddp_plan.single_rank_reason(int(r["world_size"]), str(r["backend"]))
    if why:
        skip_or_fail(smoke, why)
    return r


def check_exit_code(job: Job, smoke: SmokeConfig) -> None:
    launch = job[0]
    assert not launch.timed_out, f"the DDP job hit the hard timeout:\n{tail(launch)}"
    assert launch.returncode == 0, f"torchrun exited {launch.returncode}:\n{tail(launch)}"


def check_world_size(job: Job, smoke: SmokeConfig) -> None:
    r = _result(job)
    assert r["world_size"] == job[0].nproc
    if r["backend"] == "nccl" and smoke.nproc is None:  # every visible GPU takes part
        assert r["world_size"] == r["gpus_visible"], r


def check_backend(job: Job, smoke: SmokeConfig) -> None:
    r = _result(job)
    assert r["backend"] == job[0].backend
    if smoke.require_gpu:
        assert r["backend"] == "nccl" and str(r["device"]).startswith("cuda"), (
            f"--require-gpu, but the job ran {r['backend']} on {r['device']}")


def check_loss_decreases(job: Job, smoke: SmokeConfig) -> None:
    r = _result(job)
    assert r["loss_decreased"], f"loss {r['initial_loss']} -> {r['final_loss']}: did not decrease"


def check_params_identical(job: Job, smoke: SmokeConfig) -> None:
    r = need_two_ranks(job, smoke)
    assert r["params_identical"], "parameters differ between ranks after training"


def check_allreduce_exact(job: Job, smoke: SmokeConfig) -> None:
    r = need_two_ranks(job, smoke)
    assert r["allreduce_exact"], "all-reduce of known values gave a wrong result"


def check_tensorboard_events(job: Job, smoke: SmokeConfig) -> None:
    r = _result(job)
    if r.get("tensorboard_missing"):  # a bare host without TensorBoard: the image has it (test_versions)
        pytest.skip(str(r["tensorboard_missing"]))
    events = glob.glob(os.path.join(job[2], "tb", "events.out.tfevents.*"))
    assert events and all(os.path.getsize(e) > 0 for e in events), "no TensorBoard events written"


def check_busbw_table(job: Job, smoke: SmokeConfig) -> None:
    r = need_two_ranks(job, smoke)
    bench = r["bench"]
    assert bench["warmup"] >= ddp_bench.BENCH_WARMUP and bench["iters"] >= ddp_bench.BENCH_ITERS, bench
    rows = r["busbw"]
    assert rows, f"no all-reduce bandwidth measured (sizes skipped for time: {bench['skipped_sizes']})"
    for row in rows:
        assert row["time_us"] > 0 and row["busbw_GBps"] > 0 and row["time_us_max"] >= row["time_us"], row
    if r["backend"] == "nccl":  # the largest size measured, not the largest asked for
        biggest = max(int(row["bytes"]) for row in rows)
        skipped = ", ".join(ddp_bench.human_bytes(int(n)) for n in bench.get("skipped_sizes") or ())
        assert biggest >= 1 << 30, (
            f"the largest size measured is {ddp_bench.human_bytes(biggest)}"
            + (f" ({skipped} skipped: too slow for the deadline)" if skipped else "")
            + "; nccl-tests' comparison needs 1 GiB")


def check_verdict(job: Job, smoke: SmokeConfig) -> None:
    r = _result(job)
    assert r["verdict"] != ddp_plan.FAILED, f"the job's checks: {r['checks']}"
    if r["verdict"] != ddp_plan.PASSED:
        why = ddp_plan.single_rank_reason(int(r["world_size"]), str(r["backend"]))
        skip_or_fail(smoke, f"DDP {r['verdict']}: {why}" if why else f"DDP {r['verdict']}: {r['checks']}")


CHECKS: dict[str, Callable[[Job, SmokeConfig], None]] = {
    "exit-code": check_exit_code,
    "world-size": check_world_size,
    "backend": check_backend,
    "loss-decreases": check_loss_decreases,
    "params-identical": check_params_identical,
    "allreduce-exact": check_allreduce_exact,
    "tensorboard-events": check_tensorboard_events,
    "busbw-table": check_busbw_table,
    "verdict": check_verdict,
}
