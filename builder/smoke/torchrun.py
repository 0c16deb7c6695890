"""The torchrun command lines and DDP-job arguments, shared by the smoke runner and launch (pure)."""

from __future__ import annotations

from collections.abc import Sequence

import ptmg_contract as contract

#: Where the DDP job writes inside a container: writable by the image's user.
IN_CONTAINER_OUT = "/tmp/ptmg-smoke"


def torchrun_argv(
    *,
    nnodes: int,
    nproc_per_node: int,
    script: str = contract.DDP_JOB,
    script_args: Sequence[str] = (),
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    join_timeout_s: int = 120,
) -> tuple[str, ...]:
    """The torchrun command of one node.

    Underscore spellings only: torch 2.0's torchrun knows no other, and newer ones
    accept both. One node without an endpoint is ``--standalone``.
    """
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError("nnodes and nproc_per_node must be >= 1")
    argv = ["torchrun", "--nnodes", str(nnodes), "--nproc_per_node", str(nproc_per_node),
            "--max_restarts", "0"]
    if rdzv_endpoint is None:
        if nnodes != 1:
            raise ValueError("several nodes need a rendezvous endpoint")
        argv.append("--standalone")
    else:
        if not rdzv_id:
            raise ValueError("a rendezvous needs an id shared by every node")
        # read_timeout: how long the c10d store's client keeps trying to reach the endpoint (torch's
        # default 60 s): a node up before the endpoint's node must wait as long as the join does.
        argv += ["--rdzv_backend", "c10d", "--rdzv_endpoint", rdzv_endpoint, "--rdzv_id", rdzv_id,
                 "--rdzv_conf", f"join_timeout={join_timeout_s},read_timeout={join_timeout_s}"]
    return (*argv, script, *script_args)


def ddp_job_args(
    *,
    out: str = IN_CONTAINER_OUT,
    steps: int = 60,
    timeout_s: float = 60.0,
    phase_timeout_s: float = 120.0,
    bench_sizes: Sequence[str] | None = None,
    step_sleep_s: float = 0.0,
    extra: Sequence[str] = (),
) -> tuple[str, ...]:
    """Arguments of smoke_tests/ddp_job.py. ``bench_sizes`` None: the job's own choice (up to
    1 GiB on NCCL, 4 MiB on gloo; 5 warm-ups and 20 timed iterations, as nccl-tests)."""
    args = ["--out", out, "--steps", str(steps), "--timeout", f"{timeout_s:g}",
            "--phase-timeout", f"{phase_timeout_s:g}"]
    if bench_sizes is not None:
        args += ["--bench-sizes", ",".join(bench_sizes)]
    if step_sleep_s:
        args += ["--step-sleep", f"{step_sleep_s:g}"]
    return (*args, *extra)


def node_names(count: int) -> tuple[str, ...]:
    return tuple(f"node{i}" for i in range(count))


def split_gpus(gpus: int | Sequence[str], nodes: int) -> tuple[tuple[str, ...], ...]:
    """Share a host's GPUs (a count, or their ids in order) between ``nodes`` containers
    (NCCL refuses two ranks on one GPU, also across containers). Every node gets the same
    count; what does not divide evenly stays idle."""
    ids = tuple(str(i) for i in range(gpus)) if isinstance(gpus, int) else tuple(gpus)
    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    per = len(ids) // nodes
    if per < 1:
        raise ValueError(f"{len(ids)} GPU(s) can't be shared by {nodes} nodes")
    return tuple(ids[i * per:(i + 1) * per] for i in range(nodes))
