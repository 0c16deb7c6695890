"""The DDP job's rules that need no torch: how many ranks a node runs, on which device, what a
run can claim (each check passed, failed or skipped, and the verdict), and its result line.

Shared by the in-image DDP job (ddp_job.py), its launcher (run_ddp.py), the in-image checks
(ddp_checks.py, test_ddp.py) and, through the host's unit tests, builder/smoke. Standard library
only, no syntax newer than Python 3.8: it runs inside every image.
"""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from smokelib import contract

# --- ranks ---------------------------------------------------------------------

RESULT_MARKER = contract.DDP_RESULT_MARKER


def clamp_nproc(requested: int | None, gpus: int, backend: str) -> tuple[int, str]:
    """How many ranks one node runs, and a note when the request was changed.

    NCCL refuses two ranks on one GPU, so NCCL ranks are clamped to the GPU count
    (default: one per GPU). gloo runs ``requested`` ranks (default 2).
    """
    if backend == "nccl":
        if gpus < 1:
            raise ValueError("backend nccl needs at least one visible GPU")
        if requested is None:
            return gpus, ""
        if requested > gpus:
            return gpus, f"--nproc {requested} clamped to {gpus}: NCCL needs one GPU per rank"
        return max(1, requested), ""
    n = 2 if requested is None else requested
    if n < 1:
        raise ValueError(f"--nproc must be >= 1, got {n}")
    return n, ""


class RankPlan(NamedTuple):
    """What one node runs: ``nproc`` ranks over ``backend``, tensors on ``device``."""

    nproc: int
    backend: str  # nccl | gloo
    device: str  # cuda | cpu
    note: str

    @property
    def multi_rank(self) -> bool:
        return self.nproc >= 2


def plan_ranks(requested: int | None, gpus: int, backend: str = "auto", device: str = "auto") -> RankPlan:
    """The one rule for ranks on a node, used by run_ddp, the selftest and (on the host side,
    through builder.smoke.gpus) by ``build.py test`` and the launch jobs.

    ``gpus`` is what this node sees (``torch.cuda.device_count()``, which already honours
    CUDA_VISIBLE_DEVICES).

    - backend auto: NCCL when a GPU is visible, else gloo.
    - NCCL: one rank per visible GPU; fewer when asked; more is clamped (one GPU per rank).
    - gloo: ``requested`` ranks (default 2), on the CPU; with ``device="cuda"`` the ranks keep
      their tensors on the visible GPUs (round-robin: 2 ranks on one GPU is fine for gloo).
    """
    if backend == "auto":
        backend = "nccl" if gpus > 0 else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"unknown backend {backend!r}")
    if device == "auto":
        device = "cuda" if backend == "nccl" else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"unknown device {device!r}")
    if backend == "nccl" and device != "cuda":
        raise ValueError("backend nccl moves CUDA tensors only (device cuda)")
    if device == "cuda" and gpus < 1:
        raise ValueError(f"backend {backend} on device cuda needs at least one visible GPU")
    n, note = clamp_nproc(requested, gpus, backend)
    return RankPlan(n, backend, device, note)


def device_index(local_rank: int, gpus: int) -> int:
    """The GPU a rank uses: its local rank (NCCL: one each); gloo ranks may share (round-robin)."""
    if gpus < 1:
        raise ValueError("no visible GPU")
    return local_rank % gpus


# --- what a DDP run can claim -----------------------------------------------------

#: Why the checks that need two ranks are not a pass at world size 1.
ONE_GPU_SKIP = "one GPU, NCCL transport not exercised"
ONE_RANK_SKIP = "one rank, no transport exercised"
#: The checks that only mean something with >= 2 ranks: at world size 1 identical
#: parameters and an exact all-reduce are trivially true and bus bandwidth is 0.
MULTI_RANK_CHECKS = ("params_identical", "allreduce_exact", "busbw")
PASSED = "passed"
FAILED = "failed"
SKIPPED = "skipped"


def single_rank_reason(world_size: int, backend: str) -> str:
    """Why the multi-rank checks are skipped ("" when world_size >= 2)."""
    if world_size >= 2:
        return ""
    return ONE_GPU_SKIP if backend == "nccl" else ONE_RANK_SKIP


def ddp_checks(world_size: int, backend: str, *, loss_decreased: bool, params_identical: bool,
               allreduce_exact: bool, busbw_measured: bool | None) -> dict[str, str]:
    """Each DDP check -> ``"passed"``, ``"failed"`` or ``"skipped: <why>"``.

    At world size 1 the checks of :data:`MULTI_RANK_CHECKS` are skipped, never passed.
    ``busbw_measured`` None: no size was asked for (or none fit the deadline).
    """
    why = single_rank_reason(world_size, backend)
    raw = {"loss_decreased": loss_decreased, "params_identical": params_identical,
           "allreduce_exact": allreduce_exact, "busbw": busbw_measured}
    out: dict[str, str] = {}
    for name, good in raw.items():
        if why and name in MULTI_RANK_CHECKS:
            out[name] = f"{SKIPPED}: {why}"
        elif good is None:
            out[name] = f"{SKIPPED}: nothing measured (no size asked for, or none fit the deadline)"
        else:
            out[name] = PASSED if good else FAILED
    return out


def ddp_verdict(checks: Mapping[str, str], world_size: int, backend: str) -> str:
    """``"failed"`` when a check failed; ``"skipped (one GPU)"`` / ``"skipped (one rank)"``
    when the run had one rank (its transport never moved a byte); else ``"passed"``."""
    if any(v == FAILED for v in checks.values()):
        return FAILED
    if world_size < 2:
        return f"{SKIPPED} (one GPU)" if backend == "nccl" else f"{SKIPPED} (one rank)"
    return PASSED


def loss_decreased(losses: Sequence[float], window: int = 5, factor: float = 0.7) -> bool:
    """The mean of the last ``window`` losses is below ``factor`` x the first ``window``'s."""
    if len(losses) < 2 * window:
        return False
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    return not math.isnan(last) and last < factor * first


def find_result(text: str) -> dict[str, Any] | None:
    """The last ``PTMG_DDP_RESULT {json}`` line in a log, parsed; None when there is none."""
    found: dict[str, Any] | None = None
    for line in text.splitlines():
        idx = line.find(RESULT_MARKER)
        if idx < 0:
            continue
        try:
            value = json.loads(line[idx + len(RESULT_MARKER):])
        except ValueError:
            continue
        if isinstance(value, dict):
            found = value
    return found


def node_result(rank: int, world_size: int, rc: int) -> dict[str, Any]:
    """What --node-out records for this node (torchrun's GROUP_RANK is the node's rank)."""
    return {
        "schema": 1,
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),
        "host": socket.gethostname(),
        "rank": rank,  # the global rank of this node's local rank 0
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        "world_size": world_size,
        "exit": rc,
        "ok": rc == 0,
    }


def write_node_result(folder: str, info: dict[str, Any]) -> str:
    """``folder/node-<node_rank>.json``, written whole or not at all."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"node-{info['node_rank']}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(info, fh, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)
    print(f"PTMG_DDP node {info['node_rank']} on {info['host']}: exit {info['exit']}, wrote {path}", flush=True)
    return path
