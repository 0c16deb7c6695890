"""The DDP job's all-reduce bus bandwidth benchmark, measured as nccl-tests' all_reduce_perf
does: the message sizes, the algbw/busbw arithmetic, one row of the table, whether a size fits
the deadline, and the timed loop itself (:func:`run_bench`, which gets torch from the job).

Nothing here imports torch: the host's unit tests import this module without it. Standard
library only, no syntax newer than Python 3.8: it runs inside every image.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable, Sequence
from typing import Any


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s for one all-reduce, as nccl-tests computes them.

    algbw = bytes / time; busbw = algbw * 2(n-1)/n (what each link carries in a ring).
    """
    if seconds <= 0:
        raise ValueError("time must be positive")
    algbw = nbytes / seconds
    factor = 2.0 * (world_size - 1) / world_size if world_size > 0 else 0.0
    return algbw, algbw * factor


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536, ``"4M"`` -> 4194304, ``"512"`` -> 512."""
    m = re.match(r"^\s*(\d+)\s*([KMG]?)i?B?\s*$", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]
    return int(m.group(1)) * scale


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


#: The all-reduce benchmark, as nccl-tests' all_reduce_perf measures it (its defaults: -w 5
#: warm-up and -n 20 timed iterations, float sum, time averaged over ranks: -a 1).
BENCH_WARMUP = 5
BENCH_ITERS = 20
#: Sizes on NCCL go up to 1 GiB (each one a size in ``all_reduce_perf -b 8 -e 1G -f 2``'s
#: output, so rows line up); gloo stops at 4 MiB.
GPU_BENCH_SIZES = "1K,64K,1M,16M,256M,1G"
CPU_BENCH_SIZES = "4K,64K,1M,4M"


def bench_sizes(spec: str, backend: str) -> list[int]:
    """``"auto"`` -> the default sizes for ``backend`` (NCCL: up to 1 GiB; gloo, also over CUDA
    tensors, which it stages through host memory: up to 4 MiB); else a comma list (``""``: none)."""
    if spec.strip() == "auto":
        spec = GPU_BENCH_SIZES if backend == "nccl" else CPU_BENCH_SIZES
    return [parse_size(s) for s in spec.split(",") if s.strip()]


def busbw_row(nbytes: int, rank_seconds: Sequence[float], world_size: int) -> dict[str, float]:
    """One size of the table from every rank's mean time per iteration.

    As nccl-tests (``-a 1``): the time is the average over ranks, and algbw/busbw follow from
    it; the slowest rank's time and the busbw it gives are reported beside it.
    """
    if not rank_seconds:
        raise ValueError("no rank reported a time")
    avg = sum(rank_seconds) / len(rank_seconds)
    slowest = max(rank_seconds)
    alg, bus = bus_bandwidth(nbytes, avg, world_size)
    _, bus_slowest = bus_bandwidth(nbytes, slowest, world_size)
    return {"bytes": nbytes, "time_us": avg * 1e6, "time_us_max": slowest * 1e6,
            "algbw_GBps": alg / 1e9, "busbw_GBps": bus / 1e9, "busbw_GBps_min": bus_slowest / 1e9}


def bench_fits(estimate_s: float, iters: int, budget_s: float) -> bool:
    """Whether ``iters`` timed iterations of ~``estimate_s`` each finish within ``budget_s``
    (the rest of the watchdog's deadline). A size that does not fit is reported as skipped,
    never timed with fewer iterations."""
    return estimate_s * iters <= budget_s


def measure(args: argparse.Namespace, dist: Any, torch: Any, device: Any, backend: str, world_size: int,
            watchdog_s: float, mark: Callable[[str, int], None]) -> tuple[list[dict[str, float]], list[int], list[int]]:
    """(rows, sizes skipped for time, sizes asked) of the all-reduce bus bandwidth table.

    Per size, as all_reduce_perf: ``--bench-warmup`` all-reduces, then ``--bench-iters`` timed
    ones between two device syncs; each rank's mean time per iteration is gathered, the table
    gives the average over ranks (and the slowest). A size whose warm-ups say it would not finish
    within half the watchdog's deadline is skipped on every rank (decided together), never timed
    with fewer iterations. Nothing is measured at world size 1 (busbw would be 0).
    """
    sizes = bench_sizes(args.bench_sizes, backend)
    if world_size < 2:
        return [], [], sizes
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    rows: list[dict[str, float]] = []
    skipped: list[int] = []
    budget = watchdog_s / 2
    for i, nbytes in enumerate(sizes):
        mark("bench", i)
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.bench_warmup):  # connections, allocator, NCCL's channels
            dist.all_reduce(buf)
        sync()
        estimate = torch.tensor([(time.perf_counter() - t0) / max(1, args.bench_warmup)], dtype=torch.float64,
                                device=device)
        dist.all_reduce(estimate, op=dist.ReduceOp.MAX)  # every rank takes the same decision
        if not bench_fits(float(estimate.item()), args.bench_iters, budget):
            skipped.append(nbytes)
            continue
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.bench_iters):
            dist.all_reduce(buf)
        sync()
        mine = torch.tensor([(time.perf_counter() - t0) / args.bench_iters], dtype=torch.float64, device=device)
        every = [torch.zeros_like(mine) for _ in range(world_size)]
        dist.all_gather(every, mine)
        rows.append(busbw_row(buf.numel() * 4, [float(t.item()) for t in every], world_size))
        del buf
    return rows, skipped, sizes
