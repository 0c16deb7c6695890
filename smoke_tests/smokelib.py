"""Pure helpers shared by the in-image smoke tests, the DDP job and the host runner.

Nothing here imports torch at module level: the host-side unit tests import this
module without torch installed. Code here runs inside every image, from torch
2.0.1 (Python 3.8+) to the newest, so it sticks to the standard library.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

try:
    import ptmg_contract as contract
except ImportError:  # run from the image's smoke_tests/ folder: the contract sits one level up
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import ptmg_contract as contract


class SmokeConfig(NamedTuple):
    """The suite's settings (from selftest's flags), shared by every smoke test."""

    require_gpu: bool
    nproc: int | None
    out: str
    expect: dict[str, str]
    ddp_timeout: float
    #: A one-GPU host fails (instead of skipping) the checks that need two GPUs.
    require_multi_gpu: bool = False


# --- expectations ------------------------------------------------------------

#: check name -> (ENV variable, image label): the image contract (ptmg_contract.py).
EXPECT_KEYS = contract.EXPECT_KEYS

#: Values of PTMG_CUDA that mean "a CPU-only build of torch".
CPU_MARKERS = frozenset({"cpu", "none"})


def load_expectations(
    env: Mapping[str, str], overrides: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """Expected versions: ``PTMG_*`` from ``env``, overridden by ``overrides``.

    ``overrides`` may be image labels (``io.pt-multi-gpu.torch``), plain names
    (``torch``) or env names (``PTMG_TORCH``). Empty values mean "unknown" and
    are left out, so a check without an expectation is skipped, never passed.
    """
    out: dict[str, str] = {}
    for name, (env_key, _label) in EXPECT_KEYS.items():
        value = env.get(env_key, "").strip()
        if value:
            out[name] = value
    for key, raw in (overrides or {}).items():
        known = _expect_name(str(key))
        value = "" if raw is None else str(raw).strip()
        if known is not None and value:
            out[known] = value
    return out


def _expect_name(key: str) -> str | None:
    for name, (env_key, label) in EXPECT_KEYS.items():
        if key in (name, env_key, label):
            return name
    return None


# --- versions ----------------------------------------------------------------

version_tuple = contract.version_tuple


def pin_matches(expected: str, actual: str) -> bool:
    """An exact pin (``2.7.0``) against an installed version (``2.7.0+cu126``).

    The local part (``+cu126``) is compared only when the pin names one.
    """
    if "+" in expected:
        return expected.strip() == actual.strip()
    return actual.split("+", 1)[0].strip() == expected.strip()


def prefix_matches(expected: str, actual: str, min_parts: int = 2) -> bool:
    """Compare on the components both sides have, at least ``min_parts``.

    ``("12.6.3", "12.6")`` matches; ``("12.6", "12.4")`` and ``("12", "12.4")`` do not.
    """
    e, a = version_tuple(expected), version_tuple(actual)
    n = min(len(e), len(a))
    if n < min_parts:
        return False
    return e[:n] == a[:n]


def decode_cudnn(version: int) -> tuple[int, int, int]:
    """``torch.backends.cudnn.version()`` -> (major, minor, patch).

    cuDNN 9 encodes ``major*10000 + minor*100 + patch`` (9.5.1 -> 90501),
    cuDNN 7/8 ``major*1000 + minor*100 + patch`` (8.5.0 -> 8500).
    """
    if version >= 90000:
        return version // 10000, (version % 10000) // 100, version % 100
    return version // 1000, (version % 1000) // 100, version % 100


def decode_nccl(version: Any) -> tuple[int, ...]:
    """``torch.cuda.nccl.version()`` -> (major, minor, patch).

    Recent torch returns a tuple; old torch an int: ``2708`` (2.7.8, before
    NCCL 2.9) or ``21403`` (2.14.3, ``major*10000 + minor*100 + patch``).
    """
    if isinstance(version, (tuple, list)):
        return tuple(int(v) for v in version[:3])
    v = int(version)
    if v >= 10000:
        return v // 10000, (v % 10000) // 100, v % 100
    return v // 1000, (v % 1000) // 100, v % 100


def decode_torchvision_cuda(version: Any) -> tuple[int, int] | None:
    """``torchvision.version.cuda`` (``"12060"``/``12060``/``"12.6"``/None) -> (12, 6)."""
    if version in (None, "", 0, "0"):
        return None
    text = str(version)
    if "." in text:
        t = version_tuple(text)
        return t[0], (t[1] if len(t) > 1 else 0)
    v = int(text)
    return v // 1000, (v % 1000) // 10


def format_version(parts: Sequence[int]) -> str:
    return ".".join(str(p) for p in parts)


# --- GPU architectures -------------------------------------------------------

_ARCH_RE = re.compile(r"^(sm|compute)_(\d+)([a-z]?)$")


def parse_arch(arch: str) -> tuple[str, int, int, str] | None:
    """``"sm_86"`` -> ("sm", 8, 6, ""); ``"compute_90"`` -> ("compute", 9, 0, "");
    ``"sm_90a"`` -> ("sm", 9, 0, "a"). Unknown text -> None."""
    m = _ARCH_RE.match(arch.strip())
    if not m:
        return None
    kind, digits, suffix = m.group(1), m.group(2), m.group(3)
    return kind, int(digits[:-1]), int(digits[-1]), suffix


def arch_covers(arch_list: Iterable[str], capability: tuple[int, int]) -> bool:
    """Whether a build for ``arch_list`` runs natively or by PTX JIT on ``capability``.

    - a cubin ``sm_XY`` runs on every GPU of the same major X with minor >= Y;
    - an arch-specific cubin (``sm_90a``, ``sm_100f``) runs only on exactly X.Y;
    - PTX ``compute_XY`` is JIT-compiled for any GPU with capability >= X.Y.
    """
    major, minor = capability
    for arch in arch_list:
        parsed = parse_arch(arch)
        if parsed is None:
            continue
        kind, a_major, a_minor, suffix = parsed
        if kind == "compute":
            if (a_major, a_minor) <= (major, minor):
                return True
        elif suffix:
            if (a_major, a_minor) == (major, minor):
                return True
        elif a_major == major and a_minor <= minor:
            return True
    return False


def split_arch_list(text: str) -> list[str]:
    """``"sm_50 sm_60;sm_90"`` -> ["sm_50", "sm_60", "sm_90"] (space, comma or semicolon)."""
    return [p for p in re.split(r"[\s,;]+", text.strip()) if p]


# --- DDP ---------------------------------------------------------------------

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


# --- hangs ---------------------------------------------------------------------------


class Deadlines(NamedTuple):
    """How long a stuck collective may take before something ends the rank.

    ``collective_s`` goes to ``init_process_group(timeout=...)``: torch's own limit.
    ``watchdog_s`` is the job's per-phase :class:`Watchdog`, which names the stuck rank(s).
    """

    collective_s: float
    watchdog_s: float


def hang_deadlines(backend: str, collective_s: float, phase_s: float, min_margin_s: float = 1.0) -> Deadlines:
    """The job's own deadline, chosen so that the job, not torch, reports a hang.

    - gloo: a timed-out collective raises in Python, where the job names the laggard, so the
      watchdog only has to catch what torch's timeout does not: ``phase_s``.
    - NCCL: with async error handling on, torch's NCCL watchdog aborts the whole process when
      a collective passes ``collective_s``, and says nothing about which rank is missing. So
      the job's watchdog must fire first: ``min(phase_s, collective_s - margin)`` with a
      margin of a quarter of the collective timeout (at least ``min_margin_s``).
    """
    if collective_s <= 0 or phase_s <= 0:
        raise ValueError("timeouts must be positive")
    if backend != "nccl":
        return Deadlines(collective_s, phase_s)
    margin = max(min_margin_s, 0.25 * collective_s)
    watchdog = min(phase_s, collective_s - margin)
    if watchdog < min_margin_s:
        raise ValueError(f"--timeout {collective_s:g}s is too short for NCCL: the job's watchdog "
                         f"needs to fire at least {margin:g}s before torch's")
    return Deadlines(collective_s, watchdog)


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


#: The DDP job's phases in order; a rank's progress is (phase index, step).
PHASES = ("start", "init_process_group", "gather-hosts", "setup", "train", "param-check",
          "allreduce-check", "bench", "verdict", "write-result", "destroy")


def parse_progress(text: str) -> tuple[int, int]:
    """``"train:12"`` -> (index of train in PHASES, 12); unknown phase -> (-1, step)."""
    phase, _, step = text.partition(":")
    index = PHASES.index(phase) if phase in PHASES else -1
    return index, int(step or 0)


def laggards(progress: Mapping[int, str], world_size: int) -> list[int]:
    """The ranks furthest behind: the ones the others wait for in a hung collective.

    ``progress`` maps rank -> ``"phase:step"`` as each rank last reported it; a
    rank that never reported counts as furthest behind. Empty when every rank is
    at the same point (then no single rank is to blame).
    """
    keyed = {r: parse_progress(progress[r]) if r in progress else (-2, 0)
             for r in range(world_size)}
    if not keyed:
        return []
    low = min(keyed.values())
    if low == max(keyed.values()):
        return []
    return sorted(r for r, k in keyed.items() if k == low)


class Watchdog:
    """Ends this process with exit code 124 when one phase runs past its deadline.

    A hung collective blocks the main thread inside C++; this thread still runs,
    names the rank and the phase on stderr, and exits hard (``os._exit``), so
    torchrun sees the failure and tears down the other ranks.
    """

    def __init__(
        self,
        rank: int,
        deadline_s: float,
        poll_s: float = 0.5,
        diagnose: Callable[[], str] | None = None,
    ) -> None:
        self.rank = rank
        self.diagnose = diagnose
        self.deadline_s = deadline_s
        self.poll_s = poll_s
        self._phase = "start"
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ptmg-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def phase(self, name: str, deadline_s: float | None = None) -> None:
        with self._lock:
            self._phase = name
            self._since = time.monotonic()
            if deadline_s is not None:
                self.deadline_s = deadline_s

    @property
    def current(self) -> str:
        with self._lock:
            return self._phase

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                phase, since, deadline = self._phase, self._since, self.deadline_s
            waited = time.monotonic() - since
            if waited > deadline:
                sys.stderr.write(
                    f"PTMG_DDP rank {self.rank} stuck in {phase} for {waited:.0f}s "
                    f"(deadline {deadline:.0f}s): exiting 124\n"
                )
                if self.diagnose is not None:
                    try:
                        sys.stderr.write(self.diagnose() + "\n")
                    except Exception as exc:  # diagnosis is best effort; the exit is not
                        sys.stderr.write(f"PTMG_DDP rank {self.rank}: no diagnosis ({exc})\n")
                sys.stderr.flush()
                sys.stdout.flush()
                os._exit(124)


class ProgressBoard:
    """Where each rank is, kept in the job's c10d store, so that a rank that times out in a
    collective (or whose watchdog fires) can name the rank it was waiting for (the laggard).

    ``store`` is anything with ``set(key, value)``, ``get(key) -> bytes`` and
    ``set_timeout(timedelta)``: torch's c10d store in the job, a dict-backed fake in tests.
    """

    def __init__(self, rank: int, world_size: int, dog: Watchdog, store: Any = None) -> None:
        self.rank, self.world_size, self.dog = rank, world_size, dog
        self.store: Any = store

    def mark(self, phase: str, step: int = 0) -> None:
        self.dog.phase(phase)
        if self.store is not None:
            try:
                self.store.set(f"ptmg/progress/{self.rank}", f"{phase}:{step}")
            except Exception:
                self.store = None  # the store's host is gone; keep going without it

    def diagnose(self) -> str:
        if self.store is None:
            return f"PTMG_DDP rank {self.rank}: other ranks' progress unknown (no store)"
        import datetime as dt

        with contextlib.suppress(Exception):
            self.store.set_timeout(dt.timedelta(seconds=3))
        seen: dict[int, str] = {}
        for r in range(self.world_size):
            # get() waits for a missing key until the timeout (no Store.check on torch 2.0);
            # a rank that never reported is left out, and laggards() counts it furthest behind.
            with contextlib.suppress(Exception):
                raw = self.store.get(f"ptmg/progress/{r}")
                seen[r] = raw.decode() if isinstance(raw, bytes) else str(raw)
        late = laggards(seen, self.world_size)
        where = ", ".join(f"rank {r}: {seen.get(r, 'never reported')}" for r in range(self.world_size))
        if late:
            return (f"{contract.DDP_STUCK_MARKER}{', '.join(map(str, late))}, furthest behind "
                    f"(seen by rank {self.rank}; {where})")
        return f"PTMG_DDP rank {self.rank}: all ranks at the same point ({where})"
