"""The torchrun command lines the runner builds (builder/smoke/torchrun.py): standalone and
multi-node, torch 2.0.1's underscore flags only, impossible requests refused, and the job's own
arguments (which the job accepts)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

import ptmg_contract as contract
from builder.smoke import torchrun
from tests.support import load_module
from tests.unit.smoke_tests.test_smokelib import SMOKE_DIR

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


