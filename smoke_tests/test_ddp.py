"""The DDP job under torchrun: NCCL across every visible GPU, or gloo across CPU ranks.

The job runs once per session; each of its checks is its own test id. At world size 1
(a one-GPU host) the checks that need two ranks are skipped with the reason ("one GPU,
NCCL transport not exercised"), never passed; ``--require-multi-gpu`` makes that a
failure. What one GPU can show is shown: NCCL at world size 1 (the job above), and two
gloo ranks with CUDA tensors on that GPU (``test_gloo_cuda_two_ranks_on_one_gpu``).
"""

from __future__ import annotations

import os

import pytest

import ddp_plan
import run_ddp
from ddp_checks import CHECKS, Job, skip_or_fail, tail
from smokelib import SmokeConfig, contract

pytestmark = pytest.mark.ddp


@pytest.fixture(scope="session")
def ddp_job(smoke: SmokeConfig) -> Job:
    out = os.path.join(smoke.out, "ddp")
    launch = run_ddp.launch(smoke.nproc, script_args=["--out", out], timeout=smoke.ddp_timeout)
    return launch, ddp_plan.find_result(launch.output), out


@pytest.mark.parametrize("check", list(CHECKS))
def test_ddp(check: str, ddp_job: Job, smoke: SmokeConfig) -> None:
    CHECKS[check](ddp_job, smoke)


def test_gloo_cuda_two_ranks_on_one_gpu(smoke: SmokeConfig, gpu_count: int) -> None:
    """On one GPU NCCL can't run two ranks; gloo can, with CUDA tensors on that GPU: DDP's
    gradient all-reduce, the identical-parameters and exact all-reduce checks across 2 ranks."""
    if gpu_count != 1:
        pytest.skip("only on a one-GPU host (no GPU: nothing to put tensors on; several GPUs: "
                    "NCCL runs across them above)")
    launch = run_ddp.launch(2, backend="gloo", device="cuda", timeout=smoke.ddp_timeout,
                            script_args=["--out", os.path.join(smoke.out, "gloo-cuda")])
    r = ddp_plan.find_result(launch.output)
    assert launch.returncode == 0 and r is not None, f"exit {launch.returncode}:\n{tail(launch)}"
    assert (r["world_size"], r["backend"], r["device"]) == (2, "gloo", "cuda:0"), r
    assert r["params_identical"] and r["allreduce_exact"] and r["loss_decreased"], r["checks"]
    assert r["verdict"] == ddp_plan.PASSED, r["checks"]


def test_hang_fails_fast_and_names_the_rank(smoke: SmokeConfig) -> None:
    """A rank that stops answering fails the job in bounded time, and the log names it.

    On gloo over 2 CPU ranks whatever the hardware: a gloo timeout raises in Python, where
    the job names the laggard. The NCCL path (torch would abort first) is the next test.
    """
    launch = run_ddp.launch(
        2, backend="gloo",
        script_args=["--out", os.path.join(smoke.out, "hang"), "--fault", "hang",
                     "--fault-rank", "1", "--timeout", "10", "--phase-timeout", "20",
                     "--bench-sizes", ""],
        timeout=120,
    )
    assert not launch.timed_out, f"the hang outlived the job's own timeouts:\n{tail(launch)}"
    assert launch.returncode != 0, "a hung rank went unnoticed"
    assert launch.seconds < 90, f"took {launch.seconds:.0f}s to fail"
    assert f"{contract.DDP_STUCK_MARKER}1," in launch.output, (
        f"the stuck rank was not named:\n{tail(launch)}")


def test_nccl_hang_names_the_rank(smoke: SmokeConfig, gpu_count: int) -> None:
    """NCCL with async error handling: torch aborts a rank whose collective passes the timeout
    (20 s here) without naming anyone. The job's watchdog (15 s: below it) must fire first,
    name rank 1 and exit 124."""
    if gpu_count < 2:
        skip_or_fail(smoke, f"needs two GPUs ({gpu_count} visible): {ddp_plan.ONE_GPU_SKIP}")
    launch = run_ddp.launch(
        2, backend="nccl",
        script_args=["--out", os.path.join(smoke.out, "hang-nccl"), "--fault", "hang",
                     "--fault-rank", "1", "--timeout", "20", "--phase-timeout", "60",
                     "--bench-sizes", ""],
        timeout=150,
    )
    assert not launch.timed_out, f"the hang outlived the job's own timeouts:\n{tail(launch)}"
    assert launch.returncode != 0, "a hung rank went unnoticed"
    assert f"{contract.DDP_STUCK_MARKER}1," in launch.output, (
        f"the stuck rank was not named (did torch's NCCL watchdog abort first?):\n{tail(launch)}")
    assert "exiting 124" in launch.output, f"the job's watchdog did not fire:\n{tail(launch)}"
