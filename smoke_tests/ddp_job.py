"""The DDP smoke job. Launch it with torchrun; every rank runs this file.

    torchrun --standalone --nproc_per_node 2 ddp_job.py --out /workspace/runs/ddp-smoke
    torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d \\
             --rdzv_endpoint node0:29400 --rdzv_id JOB ddp_job.py

NCCL over every visible GPU (one rank per GPU), or gloo over CPU ranks (or over
CUDA tensors with ``--device cuda``: two gloo ranks can share one GPU). It trains
a small model on synthetic data (DistributedSampler + set_epoch) and checks what
a broken multi-GPU setup gets wrong:

- the global loss decreases;
- the parameters are bitwise identical on every rank afterwards;
- an all-reduce of known values gives the exact expected result;
- all-reduce bus bandwidth by message size, measured as nccl-tests' all_reduce_perf
  does (5 warm-ups, 20 timed iterations, sizes up to 1 GiB on GPU, time averaged
  over ranks, the slowest rank beside it).

At world size 1 the last three are trivially true (and busbw is 0), so they are
reported as skipped ("one GPU, NCCL transport not exercised") and the verdict is
"skipped (one GPU)", never "passed".

Rank 0 writes TensorBoard events to ``OUT/tb`` (none where TensorBoard is not
installed: the result says so) and the result to ``OUT/result.json``, and prints
it as one ``PTMG_DDP_RESULT {json}`` line. With
``--node-out DIR`` each node's local rank 0 also writes ``DIR/node-<GROUP_RANK>.json``
(host, ranks, its exit status): a result from every node of a multi-node job. Every
rank exits non-zero when a check fails. A hung collective fails in bounded time:
``init_process_group(timeout=...)`` bounds gloo/NCCL waits and a per-rank
watchdog names the stuck rank and phase, then exits 124. On NCCL the watchdog's
deadline is set below the collective timeout (ddp_watchdog.hang_deadlines): torch's
NCCL watchdog would otherwise abort the process first, naming no rank.

Works with torch 2.0.1 and newer: it uses no API newer than that.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import socket
import sys
import time
from typing import Any, NoReturn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ddp_bench
import ddp_plan
import ddp_watchdog

DEFAULT_OUT = "/workspace/runs/ddp-smoke"
HOST_BYTES = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("PTMG_DDP_OUT", DEFAULT_OUT),
                   help="results folder: result.json and tb/ (default %(default)s)")
    p.add_argument("--node-out", default=None,
                   help="also write NODE_OUT/node-<GROUP_RANK>.json from each node's local rank 0 (host, "
                        "ranks, exit status): one result per node, e.g. on a folder every node shares")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="auto: nccl when a GPU is visible, else gloo")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="where tensors live: auto = cuda for nccl, cpu for gloo; gloo with cuda runs "
                        "several ranks on one GPU")
    p.add_argument("--steps", type=int, default=60, help="training steps (default %(default)s)")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--samples", type=int, default=4096, help="synthetic data set size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="sleep per step, to keep a run alive for fault tests")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="collective timeout in seconds (init_process_group)")
    p.add_argument("--phase-timeout", type=float, default=180.0,
                   help="watchdog: seconds one phase may take before the rank exits 124 (on NCCL "
                        "capped below --timeout, so the job names the stuck rank before torch aborts)")
    p.add_argument("--bench-sizes", default="auto",
                   help=f"all-reduce message sizes for the bus bandwidth table ('' to skip; auto: "
                        f"{ddp_bench.GPU_BENCH_SIZES} on NCCL, {ddp_bench.CPU_BENCH_SIZES} on gloo)")
    p.add_argument("--bench-iters", type=int, default=ddp_bench.BENCH_ITERS,
                   help="timed iterations per size (default %(default)s, as nccl-tests)")
    p.add_argument("--bench-warmup", type=int, default=ddp_bench.BENCH_WARMUP,
                   help="warm-up iterations per size (default %(default)s, as nccl-tests)")
    p.add_argument("--fault", choices=("none", "hang", "crash"), default="none",
                   help="inject a fault on --fault-rank at --fault-step (for tests)")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=3)
    return p.parse_args(argv)


def log(rank: int, msg: str) -> None:
    print(f"PTMG_DDP rank {rank}: {msg}", flush=True)


class Progress(ddp_watchdog.ProgressBoard):
    """ddp_watchdog.ProgressBoard on the job's c10d store (torchrun's rendezvous store)."""

    def attach(self) -> None:
        try:  # private but stable since torch 1.x
            from torch.distributed import distributed_c10d

            self.store = distributed_c10d._get_default_store()
        except Exception:
            self.store = None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dog = ddp_watchdog.Watchdog(rank, args.phase_timeout)
    progress = Progress(rank, world_size, dog)
    dog.diagnose = progress.diagnose
    dog.start()
    try:
        rc = run(args, rank, local_rank, world_size, progress)
    except Exception as exc:  # a failed collective: name the rank, the phase, the laggard
        sys.stderr.write(
            f"PTMG_DDP rank {rank} failed in {dog.current}: {type(exc).__name__}: {exc}\n"
        )
        try:
            sys.stderr.write(progress.diagnose() + "\n")
        except Exception as diag_exc:
            sys.stderr.write(f"PTMG_DDP rank {rank}: no diagnosis ({diag_exc})\n")
        sys.stderr.flush()
        rc = 1
    finally:
        dog.stop()
    if args.node_out and local_rank == 0:
        ddp_plan.write_node_result(args.node_out, ddp_plan.node_result(rank, world_size, rc))
    return rc


class Phase:
    """What the phases of one rank's run share: the arguments, the rank, torch and where tensors live."""

    def __init__(self, args: argparse.Namespace, rank: int, local_rank: int, world_size: int,
                 progress: Progress) -> None:
        import torch
        import torch.distributed as dist

        self.args, self.rank, self.local_rank, self.world_size = args, rank, local_rank, world_size
        self.progress, self.mark, self.torch, self.dist = progress, progress.mark, torch, dist
        self.gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.backend = args.backend if args.backend != "auto" else ("nccl" if self.gpus else "gloo")
        self.device = self._device()
        # NCCL: the job's watchdog fires before torch's NCCL watchdog would abort the process.
        self.deadlines = ddp_watchdog.hang_deadlines(self.backend, args.timeout, args.phase_timeout)

    def _device(self) -> Any:
        torch, gpus = self.torch, self.gpus
        if self.backend == "nccl" and not gpus:  # a GPU job never passes on CPU: say why there is no GPU
            from smokelib import contract, driver_version, no_gpu_reason

            cuda = torch.version.cuda
            why = no_gpu_reason(torch.__version__, cuda, driver_version() if cuda else None,
                                os.environ.get(contract.ENV_MIN_DRIVER, ""), os.environ)
            raise RuntimeError("--backend nccl, but CUDA is not available to torch here (torch.cuda.is_available() "
                               "is False): " + why)
        kind = self.args.device if self.args.device != "auto" else ("cuda" if self.backend == "nccl" else "cpu")
        if kind != "cuda":
            torch.set_num_threads(1)  # N ranks share the host's cores
            return torch.device("cpu")
        if self.backend == "nccl" and self.local_rank >= gpus:
            raise RuntimeError(f"local rank {self.local_rank} has no GPU of its own ({gpus} visible): NCCL needs "
                               f"one GPU per rank; run at most {gpus} rank(s) per node")
        index = ddp_plan.device_index(self.local_rank, gpus)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)


def join(ph: Phase) -> list[str]:
    """init_process_group, then every rank's host name (the job's hosts, in rank order)."""
    torch, dist, rank = ph.torch, ph.dist, ph.rank
    ph.progress.dog.phase("start", ph.deadlines.watchdog_s)
    ph.mark("init_process_group")
    dist.init_process_group(ph.backend, timeout=datetime.timedelta(seconds=ph.deadlines.collective_s))
    ph.progress.attach()
    assert dist.get_world_size() == ph.world_size and dist.get_rank() == rank

    ph.mark("gather-hosts")
    # Tensors, not all_gather_object: that pickles through NumPy on torch 2.0, and a
    # NumPy ABI problem is test_env[numpy]'s to report, not a reason to skip the DDP checks.
    name = socket.gethostname().encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
    mine_host = torch.tensor(list(name), dtype=torch.uint8, device=ph.device)
    all_hosts = [torch.empty_like(mine_host) for _ in range(ph.world_size)]
    dist.all_gather(all_hosts, mine_host)
    hosts = [bytes(t.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace") for t in all_hosts]
    if rank == 0:
        log(rank, f"world_size={ph.world_size} backend={ph.backend} device={ph.device} gpus_visible={ph.gpus} "
                  f"hosts={hosts} torch={torch.__version__} watchdog={ph.deadlines.watchdog_s:g}s "
                  f"collective_timeout={ph.deadlines.collective_s:g}s")
    return hosts


def tensorboard_writer(out: str) -> tuple[Any, str]:
    """Rank 0's SummaryWriter on ``out/tb``, or (None, why) where TensorBoard is not installed: the
    job's checks don't need it (a bare GPU host may lack it; the image has it)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        return None, f"TensorBoard not installed ({exc}): no events written"
    return SummaryWriter(log_dir=os.path.join(out, "tb")), ""


def train(ph: Phase, writer: Any) -> tuple[Any, list[float], float]:
    """The model, trained for --steps on synthetic data (identical on every rank, sharded by the
    sampler): (the model, the global loss per step, seconds)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    torch, args, rank, device = ph.torch, ph.args, ph.rank, ph.device
    ph.mark("setup")
    g = torch.Generator().manual_seed(args.seed)
    features = 16
    x = torch.randn(args.samples, features, generator=g)
    w_true = torch.randn(features, 1, generator=g)
    y = x @ w_true + 0.01 * torch.randn(args.samples, 1, generator=g)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=ph.world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.MSELoss()

    ph.mark("train")
    losses: list[float] = []
    step, epoch = 0, 0
    t_train = time.monotonic()
    while step < args.steps:
        sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
        for xb, yb in loader:
            if step >= args.steps:
                break
            if args.fault != "none" and rank == args.fault_rank and step == args.fault_step:
                log(rank, f"injecting fault {args.fault} at step {step}")
                if args.fault == "crash":
                    os._exit(3)
                while True:  # hang: the other ranks wait for us in the next collective
                    time.sleep(3600)
            ph.mark("train", step)  # working on this step; resets the watchdog's deadline
            inputs, targets = xb.to(device), yb.to(device)
            opt.zero_grad()
            loss = loss_fn(ddp(inputs), targets)
            loss.backward()
            opt.step()
            global_loss = loss.detach().clone()
            ph.dist.all_reduce(global_loss)  # the mean loss over all ranks, identical everywhere
            value = global_loss.item() / ph.world_size
            losses.append(value)
            if writer is not None:
                writer.add_scalar("loss/train", value, step)
            if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                log(rank, f"phase=train epoch={epoch} step={step} loss={value:.5f}")
            step += 1
            if args.step_sleep:
                time.sleep(args.step_sleep)
        epoch += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model, losses, time.monotonic() - t_train


def params_check(ph: Phase, model: Any) -> tuple[bool, str]:
    """(the parameters are bitwise identical on every rank, their sha256)."""
    torch = ph.torch
    ph.mark("param-check")
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    bits = flat.view(torch.int32)
    gathered = [torch.empty_like(bits) for _ in range(ph.world_size)]
    ph.dist.all_gather(gathered, bits)
    digest = hashlib.sha256(repr(bits.cpu().tolist()).encode()).hexdigest()
    return all(torch.equal(gathered[0], t) for t in gathered), digest


def allreduce_check(ph: Phase) -> bool:
    """An all-reduce of known values (sum of ints and floats, max) gives the exact result."""
    torch, dist, device, rank, world_size = ph.torch, ph.dist, ph.device, ph.rank, ph.world_size
    ph.mark("allreduce-check")
    n = 4096
    ints = torch.arange(n, dtype=torch.int64, device=device) * (rank + 1)
    dist.all_reduce(ints)
    tri = world_size * (world_size + 1) // 2
    ints_ok = torch.equal(ints, torch.arange(n, dtype=torch.int64, device=device) * tri)
    floats = torch.full((n,), float(rank + 1), dtype=torch.float32, device=device)
    dist.all_reduce(floats)
    floats_ok = bool((floats == float(tri)).all().item())
    maxes = torch.tensor([float(rank)], device=device)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    return ints_ok and floats_ok and maxes.item() == float(world_size - 1)


def run(args: argparse.Namespace, rank: int, local_rank: int, world_size: int,
        progress: Progress) -> int:
    t_start = time.monotonic()
    ph = Phase(args, rank, local_rank, world_size, progress)
    torch, dist = ph.torch, ph.dist
    hosts = join(ph)
    writer, no_tensorboard = tensorboard_writer(args.out) if rank == 0 else (None, "")
    if no_tensorboard:
        log(rank, no_tensorboard)
    model, losses, train_s = train(ph, writer)
    params_identical, params_sha256 = params_check(ph, model)
    allreduce_exact = allreduce_check(ph)
    # -- all-reduce bandwidth by message size, the nccl-tests way
    busbw, skipped_sizes, sizes = ddp_bench.measure(args, dist, torch, ph.device, ph.backend, world_size,
                                                      ph.deadlines.watchdog_s, ph.mark)

    # -- every rank's verdict, so one bad rank fails them all
    ph.mark("verdict")
    decreased = ddp_plan.loss_decreased(losses)
    checks = ddp_plan.ddp_checks(world_size, ph.backend, loss_decreased=decreased, params_identical=params_identical,
                                 allreduce_exact=allreduce_exact,
                                 busbw_measured=bool(busbw) if sizes and len(skipped_sizes) < len(sizes) else None)
    mine = torch.tensor([int(ddp_plan.FAILED not in checks.values())], dtype=torch.int64, device=ph.device)
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    ok = bool(mine.item())
    verdict = ddp_plan.ddp_verdict(checks, world_size, ph.backend) if ok else ddp_plan.FAILED

    if rank == 0:
        ph.mark("write-result")
        if writer is not None:
            writer.close()
        result: dict[str, Any] = {
            "schema": 2,
            "ok": ok,
            "verdict": verdict,
            "checks": checks,
            "world_size": world_size,
            "backend": ph.backend,
            "gpus_visible": ph.gpus,
            "nodes": len(set(hosts)),
            "hosts": hosts,
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
            "device": str(ph.device),
            "torch": torch.__version__,
            "steps": len(losses),
            "steps_per_s": len(losses) / train_s if train_s > 0 else 0.0,
            "initial_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "loss_decreased": decreased,
            "params_identical": params_identical,
            "params_sha256": params_sha256,
            "allreduce_exact": allreduce_exact,
            "busbw": busbw,
            "bench": {"op": "all_reduce", "reduce": "sum", "dtype": "float32", "in_place": True,
                      "warmup": args.bench_warmup, "iters": args.bench_iters, "sizes": sizes,
                      "skipped_sizes": skipped_sizes,
                      "time": "mean per iteration, averaged over ranks (nccl-tests -a 1); slowest rank beside it"},
            "deadlines": {"collective_s": ph.deadlines.collective_s, "watchdog_s": ph.deadlines.watchdog_s},
            "tensorboard_dir": None if no_tensorboard else os.path.join(args.out, "tb"),
            "tensorboard_missing": no_tensorboard,
            "wall_s": time.monotonic() - t_start,
        }
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "result.json"), "w") as fh:
            json.dump(result, fh, indent=2)
        print(ddp_plan.RESULT_MARKER + json.dumps(result, sort_keys=True), flush=True)

    ph.mark("destroy")
    dist.barrier()
    # No destroy_process_group(): the rank ends right after this (finish(), os._exit), which frees all of
    # it. torch 2.0.1's gloo destructor has deadlocked here (a clean-clone run, gdb): the main thread, GIL
    # held, joins a gloo worker that waits for the GIL to free a tensor; the watchdog, a Python thread,
    # then can't run either, and only run_ddp's hard timeout ended the job.
    if not ok:
        sys.stderr.write(f"PTMG_DDP rank {rank}: checks failed ({checks})\n")
        return 2
    return 0

def finish(code: int) -> NoReturn:
    """End this rank now with ``code``, its output flushed, skipping the interpreter's teardown and torch's
    C++ destructors (the process group's among them, see run()). Once main() returns, the result is
    written and the watchdog stopped, so nothing would end a hang there: a finished torch 2.0.1 gloo
    rank has stayed alive in torch's teardown until the job's hard timeout."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    finish(main())
