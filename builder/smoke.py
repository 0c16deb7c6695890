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
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from builder.engine import Engine, RunResult
from builder.log import log
from builder.waiting import WaitTimeout, wait_until

SMOKE_DIR = "/opt/pt-multi-gpu/smoke_tests"
DDP_JOB = f"{SMOKE_DIR}/ddp_job.py"
RESULT_MARKER = "PTMG_DDP_RESULT "  # printed by smoke_tests/ddp_job.py (smokelib.RESULT_MARKER)
LABEL_PREFIX = "io.pt-multi-gpu."
RDZV_PORT = 29400
SHM_SIZE = "1g"  # gloo and NCCL use /dev/shm; Docker's 64 MB default is too small
IN_CONTAINER_OUT = "/tmp/ptmg-smoke"  # writable by the image's user (pt)
#: Multi-node containers talk over the Docker network's eth0. NCCL_IB_DISABLE: no
#: InfiniBand between containers. Both spellings of async error handling: torch 2.0
#: reads NCCL_*, newer torch TORCH_NCCL_*.
MULTINODE_ENV: Mapping[str, str] = {
    "NCCL_SOCKET_IFNAME": "eth0",
    "GLOO_SOCKET_IFNAME": "eth0",
    "NCCL_IB_DISABLE": "1",
    "NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}


class SmokeError(RuntimeError):
    """A smoke run could not be set up (not a failed check: those are results)."""


# --- results -------------------------------------------------------------------


@dataclass(frozen=True)
class BusBandwidth:
    """One all-reduce message size: algbw = bytes/time, busbw = algbw * 2(n-1)/n."""

    nbytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float


@dataclass(frozen=True)
class DDPResult:
    """What rank 0 of smoke_tests/ddp_job.py reported (its ``PTMG_DDP_RESULT`` line)."""

    ok: bool
    world_size: int
    backend: str
    nodes: int
    hosts: tuple[str, ...]
    torch: str
    steps: int
    steps_per_s: float
    initial_loss: float
    final_loss: float
    loss_decreased: bool
    params_identical: bool
    allreduce_exact: bool
    busbw: tuple[BusBandwidth, ...]
    wall_s: float

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DDPResult:
        try:
            return cls(
                ok=bool(data["ok"]),
                world_size=int(data["world_size"]),
                backend=str(data["backend"]),
                nodes=int(data["nodes"]),
                hosts=tuple(str(h) for h in data["hosts"]),
                torch=str(data["torch"]),
                steps=int(data["steps"]),
                steps_per_s=float(data["steps_per_s"]),
                initial_loss=float(data["initial_loss"]),
                final_loss=float(data["final_loss"]),
                loss_decreased=bool(data["loss_decreased"]),
                params_identical=bool(data["params_identical"]),
                allreduce_exact=bool(data["allreduce_exact"]),
                busbw=tuple(
                    BusBandwidth(int(r["bytes"]), float(r["time_us"]), float(r["algbw_GBps"]),
                                 float(r["busbw_GBps"]))
                    for r in data["busbw"]
                ),
                wall_s=float(data["wall_s"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed DDP result ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class NodeRun:
    """One container of a run: its exit code, its log and when it stopped."""

    name: str
    exit_code: int
    timed_out: bool
    log: str
    started_at: datetime | None = None
    finished_at: datetime | None = None
    oom_killed: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def describe(self) -> str:
        if self.ok:
            return f"{self.name}: ok"
        how = "timed out (killed by the runner)" if self.timed_out else f"exit {self.exit_code}"
        if self.exit_code == 137 and not self.timed_out:
            how += " (SIGKILL: killed or out of memory)" if not self.oom_killed else " (OOM-killed)"
        return f"{self.name}: {how}"


@dataclass(frozen=True)
class DDPRun:
    """A DDP smoke run over one or more containers."""

    image: str
    nodes: tuple[NodeRun, ...]
    nproc_per_node: int
    result: DDPResult | None
    wall_s: float
    killed: str | None = None  # the node the runner killed on purpose (fault injection)

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.nproc_per_node

    @property
    def failed_nodes(self) -> tuple[NodeRun, ...]:
        return tuple(n for n in self.nodes if not n.ok)

    @property
    def culprit(self) -> NodeRun | None:
        return first_failure(self.nodes)

    @property
    def ok(self) -> bool:
        return (
            not self.failed_nodes
            and self.result is not None
            and self.result.ok
            and self.result.world_size == self.world_size
        )

    def summary(self) -> str:
        head = (f"DDP {len(self.nodes)} node(s) x {self.nproc_per_node} rank(s) on {self.image}: "
                f"{'PASS' if self.ok else 'FAIL'} in {self.wall_s:.1f}s")
        lines = [head]
        if self.result is not None:
            r = self.result
            lines.append(f"  world size {r.world_size} ({r.backend}, {r.nodes} host(s)), "
                         f"loss {r.initial_loss:.4g} -> {r.final_loss:.4g}, "
                         f"{r.steps_per_s:.1f} steps/s, params identical: {r.params_identical}, "
                         f"all-reduce exact: {r.allreduce_exact}")
        else:
            lines.append("  no DDP result was printed")
        lines += [f"  {n.describe()}" for n in self.nodes]
        culprit = self.culprit
        if culprit is not None:
            lines.append(f"  first to fail: {culprit.name}")
        return "\n".join(lines)


@dataclass(frozen=True)
class TestCounts:
    tests: int = 0
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0


@dataclass(frozen=True)
class SelftestRun:
    """``selftest`` run in one container, with the JUnit XML it wrote."""

    image: str
    exit_code: int
    timed_out: bool
    counts: TestCounts
    junit_xml: str | None
    log: str
    wall_s: float
    failures: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        c = self.counts
        return (self.exit_code == 0 and not self.timed_out and self.junit_xml is not None
                and c.failed == 0 and c.errors == 0 and c.passed > 0)

    def summary(self) -> str:
        c = self.counts
        status = "PASS" if self.ok else "FAIL"
        extra = " (timed out)" if self.timed_out else ""
        text = (f"selftest on {self.image}: {status}{extra}: {c.passed} passed, "
                f"{c.failed + c.errors} failed, {c.skipped} skipped, exit {self.exit_code}, "
                f"{self.wall_s:.1f}s")
        return "\n".join([text, *(f"  FAILED {f}" for f in self.failures)])


@dataclass(frozen=True)
class KillPlan:
    """Fault injection: SIGKILL node ``node`` once any node's log contains ``when``."""

    node: int = 1
    when: str = "phase=train epoch=0 step=10 "
    within_s: float = 120.0  # give up (and fail the run) if the marker never shows


# --- pure helpers --------------------------------------------------------------


def torchrun_argv(
    *,
    nnodes: int,
    nproc_per_node: int,
    script: str = DDP_JOB,
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
        argv += ["--rdzv_backend", "c10d", "--rdzv_endpoint", rdzv_endpoint, "--rdzv_id", rdzv_id,
                 "--rdzv_conf", f"join_timeout={join_timeout_s}"]
    return (*argv, script, *script_args)


def ddp_job_args(
    *,
    out: str = IN_CONTAINER_OUT,
    steps: int = 60,
    timeout_s: float = 60.0,
    phase_timeout_s: float = 120.0,
    bench_sizes: Sequence[str] = ("4K", "64K", "1M", "4M"),
    step_sleep_s: float = 0.0,
    extra: Sequence[str] = (),
) -> tuple[str, ...]:
    """Arguments of smoke_tests/ddp_job.py."""
    args = ["--out", out, "--steps", str(steps), "--timeout", f"{timeout_s:g}",
            "--phase-timeout", f"{phase_timeout_s:g}", "--bench-sizes", ",".join(bench_sizes)]
    if step_sleep_s:
        args += ["--step-sleep", f"{step_sleep_s:g}"]
    return (*args, *extra)


def node_names(count: int) -> tuple[str, ...]:
    return tuple(f"node{i}" for i in range(count))


def split_gpus(total: int, nodes: int) -> tuple[tuple[str, ...], ...]:
    """Share ``total`` GPUs of one host between ``nodes`` containers (NCCL refuses two
    ranks on one GPU, also across containers). Every node gets the same count."""
    per = total // nodes
    if per < 1:
        raise ValueError(f"{total} GPU(s) can't be shared by {nodes} nodes")
    return tuple(tuple(str(i * per + j) for j in range(per)) for i in range(nodes))


def find_ddp_result(logs: Sequence[str]) -> DDPResult | None:
    """The last ``PTMG_DDP_RESULT {json}`` line of any log, parsed."""
    found: DDPResult | None = None
    for text in logs:
        for line in text.splitlines():
            idx = line.find(RESULT_MARKER)
            if idx < 0:
                continue
            try:
                data = json.loads(line[idx + len(RESULT_MARKER):])
                found = DDPResult.from_json(data)
            except ValueError:
                continue
    return found


def parse_docker_time(text: str | None) -> datetime | None:
    """Docker's RFC 3339 nanosecond stamps; the zero time means "never"."""
    if not text or text.startswith("0001-01-01"):
        return None
    m = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", text.strip())
    if not m:
        raise ValueError(f"not a Docker timestamp: {text!r}")
    frac = (m.group(2) or ".0")[1:7].ljust(6, "0")
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(f"{m.group(1)}.{frac}{zone}").astimezone(timezone.utc)


def first_failure(nodes: Sequence[NodeRun]) -> NodeRun | None:
    """The failed node that stopped first: where a multi-node failure started.

    A dead node stops first; the survivors fail after it, when their collectives
    notice. Nodes without a stop time (still running at the deadline) come last.
    """
    failed = [n for n in nodes if not n.ok]
    if not failed:
        return None
    far = datetime.max.replace(tzinfo=timezone.utc)
    return min(failed, key=lambda n: (n.finished_at or far, n.name))


def parse_junit(xml_text: str) -> tuple[TestCounts, tuple[str, ...]]:
    """Counts and failed test ids from pytest's JUnit XML (xunit1 or xunit2)."""
    root = ET.fromstring(xml_text)  # noqa: S314  (our own container's output)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = passed = failed = errors = skipped = 0
    failures: list[str] = []
    for suite in suites:
        for case in suite.iter("testcase"):
            tests += 1
            name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
            if case.find("failure") is not None:
                failed += 1
                failures.append(name)
            elif case.find("error") is not None:
                errors += 1
                failures.append(name)
            elif case.find("skipped") is not None:
                skipped += 1
            else:
                passed += 1
    return TestCounts(tests, passed, failed, errors, skipped), tuple(failures)


def extract_file(tar_bytes: bytes) -> bytes | None:
    """The first regular file of a tar stream (``docker cp``/get_archive output)."""
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        for member in tar:
            if member.isfile():
                fh = tar.extractfile(member)
                return fh.read() if fh is not None else None
    return None


def expect_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """The image labels that tell the selftest what to expect (``io.pt-multi-gpu.*``)."""
    return {k: v for k, v in sorted(labels.items()) if k.startswith(LABEL_PREFIX)}


def busbw_markdown(result: DDPResult) -> str:
    """The all-reduce bandwidth table, as nccl-tests reports it, in Markdown."""
    rows = ["| size | time (us) | algbw (GB/s) | busbw (GB/s) |", "|---:|---:|---:|---:|"]
    for r in result.busbw:
        rows.append(f"| {_human_bytes(r.nbytes)} | {r.time_us:.1f} | {r.algbw_gbps:.3f} | "
                    f"{r.busbw_gbps:.3f} |")
    return "\n".join(rows)


def _human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


# --- runs (through the engine) ---------------------------------------------------


def _gpu_request(device_ids: Sequence[str] | None) -> list[dict[str, Any]]:
    if device_ids is None:
        return [{"count": -1, "capabilities": [["gpu"]]}]
    return [{"device_ids": list(device_ids), "capabilities": [["gpu"]]}]


def _node_run(engine: Engine, container: Any, name: str, waited: RunResult) -> NodeRun:
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
    timeout: float = 900.0,
    expect: Mapping[str, str] | None = None,
) -> SelftestRun:
    """``docker run IMAGE selftest ...`` and collect its JUnit XML.

    ``expect`` defaults to the image's own ``io.pt-multi-gpu.*`` labels, so the
    versions are checked against what the image claims. ``gpus`` adds
    ``--gpus all`` and ``--require-gpu``.
    """
    labels = expect_labels(engine.image_labels(image)) if expect is None else dict(expect)
    junit_path = f"{IN_CONTAINER_OUT}/junit.xml"
    command = ["selftest", "--out", IN_CONTAINER_OUT, "--junit", junit_path,
               "--expect-json", json.dumps(labels, sort_keys=True), "--timeout", "300"]
    if gpus:
        command.append("--require-gpu")
    command += list(args)
    kwargs: dict[str, Any] = {"shm_size": SHM_SIZE}
    if gpus:
        kwargs["device_requests"] = _gpu_request(None)
    t0 = time.monotonic()
    container = engine.start(image, command, extra_labels={"io.pt-multi-gpu.smoke": "selftest"},
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
    steps: int = 60,
    timeout: float = 300.0,
    job_extra: Sequence[str] = (),
) -> DDPRun:
    """One container, ``torchrun --standalone``: ``nproc`` CPU ranks (gloo), or with
    ``gpus`` one rank per GPU over NCCL (``nproc`` must not exceed the GPUs)."""
    argv = torchrun_argv(nnodes=1, nproc_per_node=nproc,
                         script_args=ddp_job_args(steps=steps, extra=job_extra))
    kwargs: dict[str, Any] = {"shm_size": SHM_SIZE, "environment": {"OMP_NUM_THREADS": "1"}}
    if gpus:
        kwargs["device_requests"] = _gpu_request(None)
    t0 = time.monotonic()
    container = engine.start(image, list(argv), extra_labels={"io.pt-multi-gpu.smoke": "ddp"},
                             **kwargs)
    try:
        node = _node_run(engine, container, "node0", engine.wait(container, timeout))
    finally:
        engine.remove(container)
    return DDPRun(image, (node,), nproc, find_ddp_result([node.log]), time.monotonic() - t0)


def run_multinode(
    engine: Engine,
    image: str,
    *,
    nodes: int = 2,
    nproc_per_node: int = 2,
    gpu_ids: Sequence[Sequence[str]] | None = None,
    steps: int = 60,
    timeout: float = 300.0,
    collective_timeout_s: float = 60.0,
    kill: KillPlan | None = None,
    job_extra: Sequence[str] = (),
) -> DDPRun:
    """K containers (``node0`` .. ``nodeK-1``) on a private, labelled Docker network,
    each running torchrun with a c10d rendezvous at ``node0:29400``.

    ``gpu_ids`` gives each node its GPUs (see :func:`split_gpus`); without it the
    ranks are CPU ranks over gloo. ``kill`` SIGKILLs one node mid-training: the
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
                         rdzv_endpoint=f"{names[0]}:{RDZV_PORT}", rdzv_id=run_id)
    env = {**MULTINODE_ENV, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    containers: list[Any] = []
    killed: str | None = None
    with engine.network(f"ptmg-smoke-{run_id}") as net:
        try:
            for i, name in enumerate(names):
                kwargs: dict[str, Any] = {"shm_size": SHM_SIZE, "environment": env,
                                          "hostname": name, "name": f"ptmg-smoke-{run_id}-{name}"}
                if gpu_ids is not None:
                    kwargs["device_requests"] = _gpu_request(gpu_ids[i])
                containers.append(engine.start_on_network(
                    image, list(argv), network=str(net.name), alias=name,
                    extra_labels={"io.pt-multi-gpu.smoke": run_id, "io.pt-multi-gpu.node": name},
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
                  time.monotonic() - t0, killed)
