"""Which GPUs the host runner hands its containers, and how many ranks each runs (pure, plus
one ``nvidia-smi`` call that tests replace with a fake).

The rule is the one the image applies inside (smoke_tests/ddp_plan.plan_ranks): one NCCL rank
per visible GPU, fewer only when asked, more clamped (NCCL refuses two ranks on one GPU); no
GPU: 2 CPU ranks over gloo. "Visible" on the host means what ``nvidia-smi`` lists, narrowed by
``CUDA_VISIBLE_DEVICES`` when it is set (a runner that owns a subset of a shared node), with
CUDA's reading of it: indices or UUIDs (a unique prefix is enough), the list ends at the first
entry that names no GPU, an empty value hides every GPU. Containers get the GPUs by UUID, so
nvidia-smi's index order (PCI bus) and CUDA's (fastest first) can't be confused.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from builder.common.errors import StepFailed
from builder.smoke.torchrun import split_gpus

#: Each GPU's index, UUID, model, compute capability, driver and MIG mode; drivers older than 510
#: know no compute_cap field, and get the short query.
SMI_ARGS = ("--query-gpu=index,uuid,name,compute_cap,driver_version,mig.mode.current", "--format=csv,noheader")
SMI_ARGS_SHORT = ("--query-gpu=index,uuid", "--format=csv,noheader")


class GpuPlanError(StepFailed):
    """GPUs were required and this host can't provide them as asked (exit 1)."""


@dataclass(frozen=True)
class HostGpu:
    index: str
    uuid: str
    name: str = ""
    capability: tuple[int, int] | None = None  # (9, 0) for sm_90; None: not reported
    driver: str = ""
    mig: bool = False  # MIG mode enabled: the GPU is split into instances

    def describe(self) -> str:
        cap = f", sm_{self.capability[0]}{self.capability[1]}" if self.capability else ""
        return f"GPU {self.index} ({self.name or self.uuid}{cap})"


def _capability(text: str) -> tuple[int, int] | None:
    major, dot, minor = text.strip().partition(".")
    return (int(major), int(minor)) if dot and major.isdigit() and minor.isdigit() else None


def parse_smi(text: str) -> tuple[HostGpu, ...]:
    """``nvidia-smi --query-gpu=index,uuid[,name,compute_cap,driver_version,mig.mode.current]
    --format=csv,noheader`` -> the GPUs, in its order."""
    out = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 2 or not fields[0].isdigit() or not fields[1]:
            continue
        if len(fields) >= 6:
            out.append(HostGpu(fields[0], fields[1], fields[2], _capability(fields[3]), fields[4],
                               fields[5].lower() == "enabled"))
        else:
            out.append(HostGpu(fields[0], fields[1]))
    return tuple(out)


def query_smi(run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
              which: Callable[[str], str | None] = shutil.which) -> tuple[tuple[HostGpu, ...], str]:
    """The host's GPUs, and why there are none when there are none."""
    smi = which("nvidia-smi")
    if smi is None:
        return (), "nvidia-smi not found (no NVIDIA driver on this host)"
    try:
        r = run([smi, *SMI_ARGS], capture_output=True, text=True, timeout=30, check=False)
        if r.returncode != 0 and "field" in (r.stdout + r.stderr).lower():  # a driver without compute_cap
            r = run([smi, *SMI_ARGS_SHORT], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return (), f"nvidia-smi did not answer ({exc})"
    if r.returncode != 0:
        return (), f"nvidia-smi failed: {(r.stderr or r.stdout).strip()[:200]}"
    gpus = parse_smi(r.stdout)
    return gpus, "" if gpus else "nvidia-smi lists no GPU"


def select_visible(gpus: Sequence[HostGpu], cuda_visible_devices: str | None) -> tuple[tuple[str, ...], str]:
    """The UUIDs of the GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible, and a note on what it dropped."""
    if cuda_visible_devices is None:
        return tuple(g.uuid for g in gpus), ""
    if not cuda_visible_devices.strip():
        return (), "CUDA_VISIBLE_DEVICES is set and empty: it hides every GPU"
    chosen: list[str] = []
    for raw in cuda_visible_devices.split(","):
        entry = raw.strip()
        if entry.isdigit():
            match = [g for g in gpus if int(entry) == int(g.index)]
        else:  # a UUID, or a unique prefix of one; MIG-... and anything else name no GPU here
            match = [g for g in gpus if entry.startswith("GPU-") and g.uuid.startswith(entry)]
        if len(match) != 1 or match[0].uuid in chosen:
            why = "repeats a GPU" if match and match[0].uuid in chosen else "names no single GPU of this host"
            note = f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: {entry!r} {why}; CUDA stops the list there"
            return tuple(chosen), note
        chosen.append(match[0].uuid)
    return tuple(chosen), ""


def visible_gpus(env: Mapping[str, str], query: Callable[[], tuple[tuple[HostGpu, ...], str]] | None = None
                 ) -> tuple[tuple[HostGpu, ...], str]:
    """The GPUs this host offers the containers, and a note (why none, or what was dropped)."""
    gpus, why = (query or query_smi)()
    if not gpus:
        return (), why
    ids, note = select_visible(gpus, env.get("CUDA_VISIBLE_DEVICES"))
    if not ids:
        return (), note or f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r} hides every GPU"
    by_uuid = {g.uuid: g for g in gpus}
    return tuple(by_uuid[i] for i in ids), note


def host_gpus(env: Mapping[str, str],
              query: Callable[[], tuple[tuple[HostGpu, ...], str]] | None = None) -> tuple[tuple[str, ...], str]:
    """The UUIDs of the GPUs this host offers the containers, and a note."""
    gpus, note = visible_gpus(env, query)
    return tuple(g.uuid for g in gpus), note


@dataclass(frozen=True)
class RunPlan:
    """What a smoke run starts: ``nodes`` containers x ``nproc_per_node`` ranks over ``backend``;
    ``node_gpus[i]`` are node i's GPUs (None: CPU ranks)."""

    nodes: int
    nproc_per_node: int
    backend: str
    node_gpus: tuple[tuple[str, ...], ...] | None = None
    note: str = ""

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def gpu_ids(self) -> tuple[str, ...] | None:
        """Every GPU the run uses (the selftest's container gets them all)."""
        return None if self.node_gpus is None else tuple(g for node in self.node_gpus for g in node)

    def describe(self) -> str:
        where = "CPU ranks" if self.node_gpus is None else f"GPUs {', '.join(self.gpu_ids or ())}"
        text = f"{self.nodes} node(s) x {self.nproc_per_node} rank(s) = world size {self.world_size}, " \
               f"{self.backend} on {where}"
        return text + (f" ({self.note})" if self.note else "")


def plan_run(gpu_ids: Sequence[str] | None, nodes: int, requested: int | None) -> RunPlan:
    """Ranks and GPUs for ``nodes`` containers: ``gpu_ids`` None means CPU (gloo, ``requested``
    ranks or 2); else the GPUs are shared evenly between the nodes and each node runs one
    NCCL rank per GPU it got (fewer when ``requested`` is smaller; a larger request is clamped)."""
    if nodes < 1 or (requested is not None and requested < 1):
        raise ValueError("nodes and ranks must be >= 1")
    if gpu_ids is None:
        return RunPlan(nodes, 2 if requested is None else requested, "gloo")
    if len(gpu_ids) < nodes:
        raise GpuPlanError(f"--nodes {nodes} with GPUs: {len(gpu_ids)} visible GPU(s) can't give every node one "
                           "(NCCL refuses two ranks on one GPU, also across containers); run fewer nodes")
    per_node = split_gpus(gpu_ids, nodes)
    have = len(per_node[0])
    notes = []
    idle = len(gpu_ids) - have * nodes
    if idle:
        notes.append(f"{idle} GPU(s) idle: {len(gpu_ids)} don't divide between {nodes} nodes")
    n = have
    if requested is not None and requested < have:
        n = requested
        per_node = tuple(p[:n] for p in per_node)
    elif requested is not None and requested > have:
        notes.append(f"--nproc {requested} clamped to {have}: NCCL needs one GPU per rank")
    return RunPlan(nodes, n, "nccl", per_node, "; ".join(notes))
