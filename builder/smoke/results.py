"""What smoke runs report, parsed: DDP results, per-node runs, selftest counts (pure)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import tarfile
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import ptmg_contract as contract


@dataclass(frozen=True)
class BusBandwidth:
    """One all-reduce message size: algbw = bytes/time, busbw = algbw * 2(n-1)/n.

    ``time_us`` is the mean time per iteration averaged over ranks (nccl-tests' default
    ``-a 1``), ``time_us_max`` the slowest rank's, ``busbw_min_gbps`` the busbw it gives.
    """

    nbytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    time_us_max: float | None = None
    busbw_min_gbps: float | None = None


@dataclass(frozen=True)
class BenchSettings:
    """How the busbw table was measured (so a figure can sit beside all_reduce_perf's)."""

    warmup: int
    iters: int
    sizes: tuple[int, ...]
    skipped_sizes: tuple[int, ...] = ()
    op: str = "all_reduce sum float32, in place"


#: What a run can claim. A run at world size 1 moved no byte between ranks: never "passed".
PASSED, FAILED = "passed", "failed"
SKIPPED_ONE_GPU, SKIPPED_ONE_RANK = "skipped (one GPU)", "skipped (one rank)"
ONE_GPU_REASON = "one GPU, NCCL transport not exercised"  # smoke_tests/ddp_plan.ONE_GPU_SKIP
ONE_RANK_REASON = "one rank, no transport exercised"


def single_rank_verdict(backend: str) -> str:
    return SKIPPED_ONE_GPU if backend == "nccl" else SKIPPED_ONE_RANK


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
    verdict: str = ""  # passed | failed | skipped (one GPU) | skipped (one rank)
    checks: tuple[tuple[str, str], ...] = ()  # (check, "passed" | "failed" | "skipped: why")
    device: str = ""
    bench: BenchSettings | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DDPResult:
        try:
            ok, world, backend = bool(data["ok"]), int(data["world_size"]), str(data["backend"])
            bench = data.get("bench")
            return cls(
                ok=ok,
                world_size=world,
                backend=backend,
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
                                 float(r["busbw_GBps"]), _opt_float(r.get("time_us_max")),
                                 _opt_float(r.get("busbw_GBps_min")))
                    for r in data["busbw"]
                ),
                wall_s=float(data["wall_s"]),
                # Schema 1 (older images) had no verdict: the same rule, from ok and the world size.
                verdict=str(data.get("verdict") or (FAILED if not ok else PASSED if world >= 2
                                                    else single_rank_verdict(backend))),
                checks=tuple(sorted((str(k), str(v)) for k, v in dict(data.get("checks") or {}).items())),
                device=str(data.get("device", "")),
                bench=None if not bench else BenchSettings(
                    int(bench["warmup"]), int(bench["iters"]), tuple(int(x) for x in bench["sizes"]),
                    tuple(int(x) for x in bench.get("skipped_sizes", ()))),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed DDP result ({type(exc).__name__}: {exc})") from None


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


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
    """A DDP smoke run over one or more containers.

    ``expect_backend``: what must have run (``nccl`` when GPUs were given: a run that fell
    back to gloo fails). ``require_multi``: a world size of 1 fails instead of being skipped.
    """

    image: str
    nodes: tuple[NodeRun, ...]
    nproc_per_node: int
    result: DDPResult | None
    wall_s: float
    killed: str | None = None  # the node the runner killed on purpose (fault injection)
    expect_backend: str | None = None
    require_multi: bool = False

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
    def problems(self) -> tuple[str, ...]:
        """Why the run failed; empty when nothing failed (a one-rank run is skipped, not failed)."""
        out = [n.describe() for n in self.failed_nodes]
        r = self.result
        if r is None:
            return (*out, "no DDP result was printed")
        if not r.ok or r.verdict == FAILED:
            bad = [name for name, state in r.checks if state == FAILED]
            out.append(f"checks failed: {', '.join(bad) or 'see the log'}")
        if r.world_size != self.world_size:
            out.append(f"world size {r.world_size}, expected {self.world_size}")
        if self.expect_backend and r.backend != self.expect_backend:
            out.append(f"backend {r.backend} ran where {self.expect_backend} was required (GPUs were given: "
                       "a fall-back to gloo is not a GPU pass)")
        if self.require_multi and r.world_size < 2:
            out.append(f"--require-multi-gpu: world size {r.world_size} "
                       f"({ONE_GPU_REASON if r.backend == 'nccl' else ONE_RANK_REASON})")
        return tuple(out)

    @property
    def verdict(self) -> str:
        """``passed``, ``failed``, or ``skipped (one GPU)`` / ``skipped (one rank)``: never a
        pass for a run whose transport moved no byte between ranks."""
        if self.problems:
            return FAILED
        assert self.result is not None
        return PASSED if self.result.world_size >= 2 else single_rank_verdict(self.result.backend)

    @property
    def ok(self) -> bool:
        """Nothing failed (a skipped one-rank run is ok, but not :attr:`passed`)."""
        return not self.problems

    @property
    def passed(self) -> bool:
        return self.verdict == PASSED

    def summary(self) -> str:
        verdict = self.verdict
        word = {PASSED: "PASS", FAILED: "FAIL"}.get(verdict, verdict.upper())
        head = (f"DDP {len(self.nodes)} node(s) x {self.nproc_per_node} rank(s) on {self.image}: "
                f"{word} in {self.wall_s:.1f}s")
        lines = [head]
        if self.result is not None:
            r = self.result
            lines.append(f"  world size {r.world_size} ({r.backend}{' on ' + r.device if r.device else ''}, "
                         f"{r.nodes} host(s)), loss {r.initial_loss:.4g} -> {r.final_loss:.4g}, "
                         f"{r.steps_per_s:.1f} steps/s, params identical: {r.params_identical}, "
                         f"all-reduce exact: {r.allreduce_exact}")
            skipped = [f"{name}: {state}" for name, state in r.checks if state.startswith("skipped")]
            lines += [f"  {s}" for s in skipped]
        lines += [f"  {p}" for p in self.problems if not p.startswith(tuple(n.name + ":" for n in self.nodes))]
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


_SRUN_LABEL = re.compile(r"^ *[0-9]+: ")  # srun --label's, on every piece srun cuts a long line into


def find_ddp_result(logs: Sequence[str]) -> DDPResult | None:
    """The last ``PTMG_DDP_RESULT {json}`` line of any log, parsed (its srun --label pieces joined)."""
    found: DDPResult | None = None
    for lines in (text.splitlines() for text in logs):
        for i, line in ((i, ln) for i, ln in enumerate(lines) if contract.DDP_RESULT_MARKER in ln):
            label, body = _SRUN_LABEL.match(line), line.split(contract.DDP_RESULT_MARKER, 1)[1]
            for piece in [*(lines[i + 1:] if label else ()), ""]:  # "": the last piece's turn to parse
                with contextlib.suppress(ValueError):
                    found = DDPResult.from_json(json.loads(body))
                    break
                if label is None or not piece.startswith(label.group(0)):
                    break
                body += piece[len(label.group(0)):]
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
    return {k: v for k, v in sorted(labels.items()) if k.startswith(contract.LABEL_NS + ".")}


#: Below this size an all-reduce's time is its fixed per-call cost (kernel launch, synchronisation,
#: protocol handshakes), as nccl-tests' small sizes show: its "busbw" measures overhead, not bandwidth.
OVERHEAD_BELOW = 1 << 20


def busbw_markdown(result: DDPResult, same_host_nodes: int = 0) -> str:
    """The all-reduce bandwidth table in Markdown, with how it was measured above it.

    ``same_host_nodes`` > 1: the run's nodes were containers on one host (`build.py test --nodes N`),
    so NCCL took its network transport between them (sockets over the Docker bridge), and the table
    says so. Rows below :data:`OVERHEAD_BELOW` are labelled per-call overhead."""
    rows = []
    if same_host_nodes > 1:
        rows += [f"Socket-bound: {same_host_nodes} containers on one host, so every byte between nodes went through "
                 "the network transport over the Docker bridge (TCP sockets), not NVLink or PCIe peer-to-peer: not a "
                 "figure of the GPUs' interconnect.", ""]
    b = result.bench
    if b is not None:
        rows += [f"{b.op}; {b.warmup} warm-up + {b.iters} timed iterations per size; sizes "
                 f"{', '.join(_human_bytes(n) for n in b.sizes)}"
                 + (f" (skipped, too slow for the deadline: {', '.join(_human_bytes(n) for n in b.skipped_sizes)})"
                    if b.skipped_sizes else "")
                 + f"; world size {result.world_size}, {result.backend}. Time: average over ranks "
                 "(nccl-tests -a 1); the slowest rank beside it.", ""]
    rows += ["| size | time avg (us) | time max (us) | algbw (GB/s) | busbw (GB/s) | busbw slowest rank (GB/s) "
             "| bound by |", "|---:|---:|---:|---:|---:|---:|---|"]
    for r in result.busbw:
        slow = "-" if r.time_us_max is None else f"{r.time_us_max:.1f}"
        slow_bus = "-" if r.busbw_min_gbps is None else f"{r.busbw_min_gbps:.3f}"
        rows.append(f"| {_human_bytes(r.nbytes)} | {r.time_us:.1f} | {slow} | {r.algbw_gbps:.3f} | "
                    f"{r.busbw_gbps:.3f} | {slow_bus} | "
                    f"{'per-call overhead' if r.nbytes < OVERHEAD_BELOW else 'bandwidth'} |")
    return "\n".join(rows)


def _human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


