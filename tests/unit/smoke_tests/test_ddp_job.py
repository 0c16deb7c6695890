"""The DDP job's own code against a fake torch, where the unit tier can reach it:

- a rank stuck in an NCCL collective: `ddp_job.main()` (its hang deadlines, its watchdog, its
  progress board) in a subprocess, with a fake torch whose all-gather never returns and whose
  NCCL watchdog aborts the process once the collective timeout passes, as torch's does. The job
  must exit 124 first and name the stuck rank;
- the all-reduce benchmark (`ddp_bench.measure`) with a fake collective on a fake clock: the
  warm-ups, then exactly the timed iterations it reports, a size that does not fit the deadline
  skipped rather than timed with fewer iterations.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest

import ptmg_contract as contract
from tests import support

SMOKE_DIR = support.ROOT / "smoke_tests"
ddp_bench = support.smoke_module("ddp_bench")

#: `ddp_job.main()` as rank 0 of 2 on NCCL, on a fake torch: init_process_group records the
#: collective timeout it is given; the host-name all-gather (the first collective) never returns
#: (rank 1 never joins); torch's NCCL watchdog, a thread, aborts the process once that collective
#: has waited the timeout, naming no rank. The c10d store is a dict in which rank 1 never reported.
FAKE_TORCH_JOB = textwrap.dedent("""
    import os, sys, threading, time, types
    sys.path.insert(0, {smoke!r})
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1")

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, m)
        return m

    class Device:
        def __init__(self, kind, index=None):
            self.type, self.index = kind, index
        def __str__(self):
            return self.type if self.index is None else f"{{self.type}}:{{self.index}}"

    class Tensor:
        def __init__(self, data):
            self.data = list(data)

    class Store(dict):
        def set(self, key, value): self[key] = value.encode()
        def get(self, key): return self[key]
        def set_timeout(self, timeout): pass

    timeouts = []

    def init_process_group(backend, timeout):
        timeouts.append(timeout.total_seconds())
        sys.stderr.write(f"fake torch: init_process_group({{backend}}, timeout={{timeouts[0]:g}}s)\\n")

    def nccl_watchdog():  # ProcessGroupNCCL: a work item timed out -> abort the process, no rank named
        time.sleep(timeouts[0])
        sys.stderr.write("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(OpType=ALLGATHER)\\n")
        sys.stderr.flush()
        os.abort()

    def all_gather(out, tensor):  # rank 1 never joins
        threading.Thread(target=nccl_watchdog, daemon=True).start()
        threading.Event().wait(120)

    store = Store()
    module("torch", __version__="2.7.0+fake", device=Device, uint8="uint8", set_num_threads=lambda n: None,
           tensor=lambda data, dtype=None, device=None: Tensor(data), empty_like=lambda t: Tensor(t.data),
           cuda=types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2,
                                      set_device=lambda index: None, synchronize=lambda device=None: None))
    module("torch.distributed", init_process_group=init_process_group, get_world_size=lambda: 2,
           get_rank=lambda: 0, all_gather=all_gather)
    module("torch.distributed.distributed_c10d", _get_default_store=lambda: store)
    module("torch.nn")
    module("torch.nn.parallel", DistributedDataParallel=None)
    module("torch.utils")
    module("torch.utils.data", DataLoader=None, TensorDataset=None)
    module("torch.utils.data.distributed", DistributedSampler=None)

    import ddp_job
    sys.exit(ddp_job.main(["--backend", "nccl", "--timeout", "{timeout}", "--phase-timeout", "{phase}",
                           "--out", {out!r}]))
""")


def test_a_rank_stuck_in_nccl_is_named_by_the_job_before_torch_aborts(tmp_path: Any) -> None:
    """--timeout 2: the job's watchdog fires after 1 s (2 s less a margin of at least 1 s), before
    torch's NCCL watchdog would abort at 2 s; --phase-timeout 30 would be far too late."""
    code = FAKE_TORCH_JOB.format(smoke=str(SMOKE_DIR), timeout=2, phase=30, out=str(tmp_path / "out"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert "init_process_group(nccl, timeout=2s)" in proc.stderr, proc.stderr  # torch gets the collective timeout
    assert "Watchdog caught collective operation timeout" not in proc.stderr, proc.stderr
    assert proc.returncode == 124, (proc.returncode, proc.stderr)
    assert "PTMG_DDP rank 0 stuck in gather-hosts" in proc.stderr, proc.stderr
    assert f"{contract.DDP_STUCK_MARKER}1, furthest behind" in proc.stderr, proc.stderr
    assert "rank 1: never reported" in proc.stderr and "rank 0: gather-hosts:0" in proc.stderr, proc.stderr


def test_the_fake_torch_aborts_a_job_whose_watchdog_waits_too_long(tmp_path: Any) -> None:
    """The fake's other half: a watchdog later than the collective timeout never gets to speak
    (gloo's rule, the phase limit, applied to NCCL), so the test above can tell."""
    code = FAKE_TORCH_JOB.format(smoke=str(SMOKE_DIR), timeout=2, phase=30, out=str(tmp_path / "out")).replace(
        '"--backend", "nccl"', '"--backend", "gloo"')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stderr)
    assert contract.DDP_STUCK_MARKER not in proc.stderr


def test_a_finished_rank_exits_even_when_the_interpreter_teardown_would_hang(tmp_path: Any) -> None:
    """ddp_job.py run as torchrun runs it (``__main__``), on the fake torch, whose init_process_group
    fails at once; beside it a thread that never ends, as torch's teardown has hung a finished rank
    until the job's hard timeout. The rank must exit with main()'s status at once, its lines flushed."""
    code = FAKE_TORCH_JOB.format(smoke=str(SMOKE_DIR), timeout=2, phase=30, out=str(tmp_path / "out"))
    code = code.replace("timeouts.append(timeout.total_seconds())",
                        "raise RuntimeError('fake torch: no peer answered')")
    head, _, _ = code.partition("import ddp_job\n")
    code = head + textwrap.dedent(f"""
        import runpy
        threading.Thread(target=threading.Event().wait, name="teardown-hang").start()  # not a daemon
        sys.argv = ["ddp_job.py", "--backend", "gloo", "--out", {str(tmp_path / "out")!r}]
        runpy.run_path({str(SMOKE_DIR / "ddp_job.py")!r}, run_name="__main__")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "PTMG_DDP rank 0 failed in init_process_group: RuntimeError: fake torch: no peer answered" in proc.stderr, proc.stderr


# --- the benchmark's timed loop ------------------------------------------------------------------------


class FakeTensor:
    def __init__(self, n: int, value: float = 0.0) -> None:
        self.n, self.value = n, value

    def numel(self) -> int:
        return self.n

    def item(self) -> float:
        return self.value


class FakeCollectives:
    """torch.distributed for one rank of two, on a clock that only all-reduces of the benchmark's
    buffer move: each takes ``seconds_per_byte * bytes``. Records every call in order."""

    ReduceOp = SimpleNamespace(MAX="max")

    def __init__(self, seconds_per_byte: float) -> None:
        self.now = 100.0
        self.seconds_per_byte = seconds_per_byte
        self.calls: list[tuple[str, int]] = []

    def clock(self) -> float:
        return self.now

    def barrier(self) -> None:
        self.calls.append(("barrier", 0))

    def all_reduce(self, t: FakeTensor, op: str | None = None) -> None:
        if op is None:  # the buffer: sum
            self.now += self.seconds_per_byte * t.n * 4
            self.calls.append(("all_reduce", t.n * 4))

    def all_gather(self, out: list[FakeTensor], t: FakeTensor) -> None:
        for o in out:
            o.value = t.value  # both ranks took as long
        self.calls.append(("all_gather", 0))


FAKE_TORCH = SimpleNamespace(
    float32="float32", float64="float64",
    zeros=lambda n, dtype=None, device=None: FakeTensor(n),
    tensor=lambda data, dtype=None, device=None: FakeTensor(1, float(data[0])),
    zeros_like=lambda t: FakeTensor(t.n),
    cuda=SimpleNamespace(synchronize=lambda device=None: None),
)


def _measure(monkeypatch: pytest.MonkeyPatch, sizes: str, watchdog_s: float, seconds_per_byte: float = 1e-9,
             warmup: int = ddp_bench.BENCH_WARMUP, iters: int = ddp_bench.BENCH_ITERS) -> tuple[Any, FakeCollectives]:
    dist = FakeCollectives(seconds_per_byte)
    monkeypatch.setattr(ddp_bench.time, "perf_counter", dist.clock)
    args = argparse.Namespace(bench_sizes=sizes, bench_warmup=warmup, bench_iters=iters)
    marks: list[tuple[str, int]] = []
    got = ddp_bench.measure(args, dist, FAKE_TORCH, SimpleNamespace(type="cpu"), "gloo", 2, watchdog_s,
                            lambda phase, i: marks.append((phase, i)))
    assert marks == [("bench", i) for i in range(len(sizes.split(",")))]
    return got, dist


def test_the_benchmark_warms_up_then_times_exactly_the_iterations_it_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    (rows, skipped, sizes), dist = _measure(monkeypatch, "1K,64K", watchdog_s=100)
    assert sizes == [1024, 65536] and skipped == []
    per_size = [[n for call, n in dist.calls if call == "all_reduce" and n == size] for size in sizes]
    assert [len(c) for c in per_size] == [ddp_bench.BENCH_WARMUP + ddp_bench.BENCH_ITERS] * 2  # 5 + 20 each
    # The timed region holds the 20 timed all-reduces and nothing else: the mean per iteration is
    # exactly one all-reduce's time (a warm-up inside it, or fewer timed ones, would change it).
    for row, size in zip(rows, sizes, strict=True):
        one = size * 1e-9
        assert row["bytes"] == size
        assert row["time_us"] == pytest.approx(one * 1e6) and row["time_us_max"] == pytest.approx(one * 1e6)
    # warm-ups come first, then a barrier, then the timed loop, then the gather of every rank's time
    first = dist.calls[:dist.calls.index(("all_gather", 0)) + 1]
    assert first == [("barrier", 0), *[("all_reduce", 1024)] * 5, ("barrier", 0), *[("all_reduce", 1024)] * 20,
                     ("all_gather", 0)]


def test_a_size_that_would_outlast_the_deadline_is_skipped_never_timed_short(monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 ms per KiB: 1 KiB times 20 x 1 ms, within half of 10 s; 1 MiB would take 20 x 1 s: skipped.
    (rows, skipped, asked), dist = _measure(monkeypatch, "1K,1M", watchdog_s=10, seconds_per_byte=1e-3 / 1024)
    assert asked == [1024, 1 << 20] and [r["bytes"] for r in rows] == [1024] and skipped == [1 << 20]
    assert [n for call, n in dist.calls if call == "all_reduce"].count(1 << 20) == ddp_bench.BENCH_WARMUP
    assert rows[0]["time_us"] == pytest.approx(1000.0)


def test_one_rank_measures_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    dist = FakeCollectives(1e-9)
    args = argparse.Namespace(bench_sizes="1K", bench_warmup=5, bench_iters=20)
    assert ddp_bench.measure(args, dist, FAKE_TORCH, SimpleNamespace(type="cpu"), "gloo", 1, 100,
                             lambda *_: None) == ([], [], [1024])
    assert dist.calls == []
