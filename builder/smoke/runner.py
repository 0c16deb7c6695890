"""Run an image's smoke tests in containers: the selftest, single-node DDP, multi-node DDP.

The orchestration is pure where it can be (argv building, result parsing,
summaries: unit-tested without Docker). Containers, networks and archives go
through :class:`builder.engine.Engine`, the only module that talks to Docker.

Every run is bounded in time, collects every container's exit code and log (no
bare ``wait``), and removes its containers and network, also on failure.

    engine = Engine()
    st = run_selftest(engine, "pt-multi-gpu:2.7.0-cuda12.6-cudnn9-runtime")
    one = run_single_node(engine, image)                 # torchrun --standalone, 2 CPU ranks
    two = run_multinode(engine, image, nodes=2, nproc_per_node=2)   # world size 4
    print(two.summary())

    plan = gpus.plan_run(gpu_ids, nodes=2, requested=None)   # every visible GPU, split per node
    run = run_plan(engine, image, plan)                  # NCCL; a gloo fall-back fails
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ptmg_contract as contract
from builder.common.errors import StepFailed
from builder.common.log import log
from builder.common.waiting import WaitTimeout, wait_until
from builder.engine import Container, Engine, RunResult
from builder.smoke.gpus import RunPlan
from builder.smoke.results import (
    DDPRun,
    NodeRun,
    SelftestRun,
    TestCounts,
    expect_labels,
    extract_file,
    find_ddp_result,
    parse_docker_time,
    parse_junit,
)
from builder.smoke.torchrun import IN_CONTAINER_OUT, ddp_job_args, node_names, torchrun_argv


class SmokeError(StepFailed):
    """A smoke run could not be set up (not a failed check: those are results)."""


@dataclass(frozen=True)
class KillPlan:
    """Fault injection: SIGKILL node ``node`` once any node's log contains ``when``."""

    node: int = 1
    when: str = contract.DDP_KILL_TRIGGER
    within_s: float = 120.0  # give up (and fail the run) if the marker never shows


# --- runs (through the engine) ---------------------------------------------------


def _gpu_request(device_ids: Sequence[str] | None) -> list[dict[str, Any]]:
    if device_ids is None:
        return [{"count": -1, "capabilities": [["gpu"]]}]
    return [{"device_ids": list(device_ids), "capabilities": [["gpu"]]}]


def _node_run(engine: Engine, container: Container, name: str, waited: RunResult) -> NodeRun:
    state = engine.state(container)
    return NodeRun(
        name=name,
        exit_code=waited.exit_code,
        timed_out=waited.timed_out,
        log=waited.output,
        started_at=parse_docker_time(state.get("StartedAt")),
        finished_at=parse_docker_time(state.get("FinishedAt")),
        oom_killed=bool(state.get("OOMKilled", False)),
    )


def run_selftest(
    engine: Engine,
    image: str,
    *,
    args: Sequence[str] = (),
    gpus: bool = False,
    gpu_ids: Sequence[str] | None = None,
    require_multi_gpu: bool = False,
    timeout: float = 900.0,
    expect: Mapping[str, str] | None = None,
    emulated: str = "",
) -> SelftestRun:
    """``docker run IMAGE selftest ...`` and collect its JUnit XML.

    ``expect`` defaults to the image's own ``io.pt-multi-gpu.*`` labels, so the
    versions are checked against what the image claims. ``gpus`` adds the GPUs
    (``gpu_ids``, default all) and ``--require-gpu``; ``require_multi_gpu`` makes a
    one-GPU container fail the checks that need two. ``emulated`` (e.g. "linux/arm64 on
    linux/amd64 (qemu 10.0.2)") says the image runs under emulation: the selftest then skips, with
    that reason, what takes many minutes there (torchrun launches, torch.compile).
    """
    labels = expect_labels(engine.image_labels(image)) if expect is None else dict(expect)
    junit_path = f"{IN_CONTAINER_OUT}/junit.xml"
    command = ["selftest", "--out", IN_CONTAINER_OUT, "--junit", junit_path,
               "--expect-json", json.dumps(labels, sort_keys=True), "--timeout", "300"]
    if gpus:
        command.append("--require-gpu")
        if require_multi_gpu:
            command.append("--require-multi-gpu")
    command += list(args)
    kwargs: dict[str, Any] = {"shm_size": contract.SMOKE_SHM_SIZE}
    if gpus:
        kwargs["device_requests"] = _gpu_request(gpu_ids)
        kwargs["environment"] = dict(contract.NCCL_ASYNC_ENV)
    if emulated:
        kwargs["environment"] = {**kwargs.get("environment", {}), contract.ENV_SMOKE_EMULATED: emulated}
    t0 = time.monotonic()
    container = engine.start(image, command, extra_labels={contract.LABEL_SMOKE: "selftest"},
                             **kwargs)
    try:
        waited = engine.wait(container, timeout)
        raw = engine.archive(container, junit_path)
    finally:
        engine.remove(container)
    xml_bytes = extract_file(raw) if raw is not None else None
    junit = xml_bytes.decode("utf-8", "replace") if xml_bytes is not None else None
    counts, failures = parse_junit(junit) if junit else (TestCounts(), ())
    return SelftestRun(image, waited.exit_code, waited.timed_out, counts, junit, waited.output,
                       time.monotonic() - t0, failures)


def run_single_node(
    engine: Engine,
    image: str,
    *,
    nproc: int = 2,
    gpus: bool = False,
    gpu_ids: Sequence[str] | None = None,
    require_multi: bool = False,
    steps: int = 60,
    timeout: float = 300.0,
    job_extra: Sequence[str] = (),
) -> DDPRun:
    """One container, ``torchrun --standalone``: ``nproc`` CPU ranks (gloo), or with
    ``gpus`` one NCCL rank per GPU (``gpu_ids``, default all: ``nproc`` must match them,
    see :func:`builder.smoke.gpus.plan_run`); a run that fell back to gloo then fails."""
    argv = torchrun_argv(nnodes=1, nproc_per_node=nproc,
                         script_args=ddp_job_args(steps=steps, extra=job_extra))
    env = {"OMP_NUM_THREADS": "1", **(contract.NCCL_ASYNC_ENV if gpus else {})}
    kwargs: dict[str, Any] = {"shm_size": contract.SMOKE_SHM_SIZE, "environment": env}
    if gpus:
        kwargs["device_requests"] = _gpu_request(gpu_ids)
    t0 = time.monotonic()
    container = engine.start(image, list(argv), extra_labels={contract.LABEL_SMOKE: "ddp"},
                             **kwargs)
    try:
        node = _node_run(engine, container, "node0", engine.wait(container, timeout))
    finally:
        engine.remove(container)
    return DDPRun(image, (node,), nproc, find_ddp_result([node.log]), time.monotonic() - t0,
                  expect_backend="nccl" if gpus else "gloo", require_multi=require_multi)


def run_plan(engine: Engine, image: str, plan: RunPlan, *, require_multi: bool = False,
             timeout: float = 300.0, job_extra: Sequence[str] = ()) -> DDPRun:
    """The DDP run a :class:`RunPlan` describes: one container, or ``plan.nodes`` on a network.
    ``job_extra`` goes to the DDP job after the defaults (so it wins), e.g. longer timeouts under
    emulation (see EMULATED_JOB in builder/cli/verbs/test.py)."""
    if plan.nodes == 1:
        return run_single_node(engine, image, nproc=plan.nproc_per_node, gpus=plan.node_gpus is not None,
                               gpu_ids=plan.gpu_ids, require_multi=require_multi, timeout=timeout, job_extra=job_extra)
    return run_multinode(engine, image, nodes=plan.nodes, nproc_per_node=plan.nproc_per_node,
                         gpu_ids=plan.node_gpus, require_multi=require_multi, timeout=timeout, job_extra=job_extra)


def run_multinode(
    engine: Engine,
    image: str,
    *,
    nodes: int = 2,
    nproc_per_node: int = 2,
    gpu_ids: Sequence[Sequence[str]] | None = None,
    require_multi: bool = False,
    steps: int = 60,
    timeout: float = 300.0,
    collective_timeout_s: float = 60.0,
    kill: KillPlan | None = None,
    job_extra: Sequence[str] = (),
) -> DDPRun:
    """K containers (``node0`` .. ``nodeK-1``) on a private, labelled Docker network,
    each running torchrun with a c10d rendezvous at ``node0:29400``.

    ``gpu_ids`` gives each node its GPUs (see :func:`builder.smoke.gpus.plan_run`):
    every node container gets its own, the job must then run NCCL (a gloo fall-back
    fails); without it the ranks are CPU ranks over gloo. ``kill`` SIGKILLs one node mid-training: the
    survivors must then fail within ``collective_timeout_s`` (plus start-up), and
    :attr:`DDPRun.culprit` names the node that died first.
    """
    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    if gpu_ids is not None and len(gpu_ids) != nodes:
        raise ValueError("gpu_ids needs one entry per node")
    if kill is not None and not 0 <= kill.node < nodes:
        raise ValueError(f"kill.node must be in 0..{nodes - 1}")
    run_id = uuid.uuid4().hex[:12]
    names = node_names(nodes)
    job = ddp_job_args(
        steps=steps,
        timeout_s=collective_timeout_s,
        phase_timeout_s=collective_timeout_s * 2,
        step_sleep_s=0.05 if kill is not None else 0.0,
        extra=job_extra,
    )
    argv = torchrun_argv(nnodes=nodes, nproc_per_node=nproc_per_node, script_args=job,
                         rdzv_endpoint=f"{names[0]}:{contract.RDZV_PORT}", rdzv_id=run_id)
    env = {**contract.MULTINODE_ENV, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    containers: list[Container] = []
    killed: str | None = None
    with engine.network(f"ptmg-smoke-{run_id}") as net:
        try:
            for i, name in enumerate(names):
                kwargs: dict[str, Any] = {"shm_size": contract.SMOKE_SHM_SIZE, "environment": env,
                                          "hostname": name, "name": f"ptmg-smoke-{run_id}-{name}"}
                if gpu_ids is not None:
                    kwargs["device_requests"] = _gpu_request(gpu_ids[i])
                containers.append(engine.start(
                    image, list(argv), network=net.name, alias=name,
                    extra_labels={contract.LABEL_SMOKE: run_id, contract.LABEL_NODE: name},
                    **kwargs))
            if kill is not None:
                def marker_seen() -> bool:
                    return any(kill.when in engine.logs(c) for c in containers)

                try:
                    wait_until(marker_seen, min(kill.within_s, timeout), interval=0.5,
                               what=f"{kill.when!r} in a node's log")
                except WaitTimeout as exc:
                    log.warning("fault injection skipped: %s", exc)
                else:
                    engine.kill(containers[kill.node])
                    killed = names[kill.node]
            deadline = t0 + timeout
            runs = [
                _node_run(engine, c, name, engine.wait(c, max(1.0, deadline - time.monotonic())))
                for c, name in zip(containers, names, strict=True)
            ]
        finally:
            for c in containers:
                engine.remove(c)
    if kill is not None and killed is None:
        raise SmokeError(f"the fault was never injected: no node printed {kill.when!r} within "
                         f"{kill.within_s:g}s; logs:\n" + "\n".join(n.log[-2000:] for n in runs))
    return DDPRun(image, tuple(runs), nproc_per_node, find_ddp_result([n.log for n in runs]),
                  time.monotonic() - t0, killed, expect_backend="gloo" if gpu_ids is None else "nccl",
                  require_multi=require_multi)
