"""The DDP job under torchrun: NCCL across every visible GPU, or gloo across CPU ranks.

The job runs once per session; each of its checks is its own test id.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from typing import Any

import pytest

import run_ddp
import smokelib
from smokelib import SmokeConfig

pytestmark = pytest.mark.ddp

Job = tuple[run_ddp.Launch, dict[str, Any] | None, str]


@pytest.fixture(scope="session")
def ddp_job(smoke: SmokeConfig) -> Job:
    out = os.path.join(smoke.out, "ddp")
    launch = run_ddp.launch(smoke.nproc, script_args=["--out", out], timeout=smoke.ddp_timeout)
    return launch, smokelib.find_result(launch.output), out


def _tail(launch: run_ddp.Launch, lines: int = 40) -> str:
    return "\n".join(launch.output.splitlines()[-lines:])


def _result(job: Job) -> dict[str, Any]:
    launch, result, _ = job
    if result is None:
        pytest.fail(f"the DDP job printed no result (exit {launch.returncode}, "
                    f"{launch.nproc} ranks, {launch.backend}):\n{_tail(launch)}", pytrace=False)
    return result


def check_exit_code(job: Job) -> None:
    launch = job[0]
    assert not launch.timed_out, f"the DDP job hit the hard timeout:\n{_tail(launch)}"
    assert launch.returncode == 0, f"torchrun exited {launch.returncode}:\n{_tail(launch)}"


def check_world_size(job: Job) -> None:
    assert _result(job)["world_size"] == job[0].nproc


def check_backend(job: Job) -> None:
    assert _result(job)["backend"] == job[0].backend


def check_loss_decreases(job: Job) -> None:
    r = _result(job)
    assert r["loss_decreased"], f"loss {r['initial_loss']} -> {r['final_loss']}: did not decrease"


def check_params_identical(job: Job) -> None:
    assert _result(job)["params_identical"], "parameters differ between ranks after training"


def check_allreduce_exact(job: Job) -> None:
    assert _result(job)["allreduce_exact"], "all-reduce of known values gave a wrong result"


def check_tensorboard_events(job: Job) -> None:
    _result(job)
    events = glob.glob(os.path.join(job[2], "tb", "events.out.tfevents.*"))
    assert events and all(os.path.getsize(e) > 0 for e in events), "no TensorBoard events written"


def check_busbw_table(job: Job) -> None:
    rows = _result(job)["busbw"]
    assert rows, "no all-reduce bandwidth measured"
    for row in rows:
        assert row["time_us"] > 0 and row["busbw_GBps"] >= 0, row


CHECKS: dict[str, Callable[[Job], None]] = {
    "exit-code": check_exit_code,
    "world-size": check_world_size,
    "backend": check_backend,
    "loss-decreases": check_loss_decreases,
    "params-identical": check_params_identical,
    "allreduce-exact": check_allreduce_exact,
    "tensorboard-events": check_tensorboard_events,
    "busbw-table": check_busbw_table,
}


@pytest.mark.parametrize("check", list(CHECKS))
def test_ddp(check: str, ddp_job: Job) -> None:
    CHECKS[check](ddp_job)


def test_hang_fails_fast_and_names_the_rank(smoke: SmokeConfig) -> None:
    """A rank that stops answering fails the job in bounded time, and the log names it.

    Runs on gloo over 2 CPU ranks whatever the hardware: it tests the job's timeout
    and watchdog, which are the same for every backend.
    """
    launch = run_ddp.launch(
        2, backend="gloo",
        script_args=["--out", os.path.join(smoke.out, "hang"), "--fault", "hang",
                     "--fault-rank", "1", "--timeout", "10", "--phase-timeout", "20",
                     "--bench-sizes", ""],
        timeout=120,
    )
    assert not launch.timed_out, f"the hang outlived the job's own timeouts:\n{_tail(launch)}"
    assert launch.returncode != 0, "a hung rank went unnoticed"
    assert launch.seconds < 90, f"took {launch.seconds:.0f}s to fail"
    assert f"{smokelib.contract.DDP_STUCK_MARKER}1," in launch.output, (
        f"the stuck rank was not named:\n{_tail(launch)}")
