"""Launch a script under torchrun on this node, bounded in time.

    python run_ddp.py                     # the DDP smoke job: all GPUs (NCCL) or 2 CPU ranks (gloo)
    python run_ddp.py --nproc 4 --out /workspace/runs/ddp-smoke
    python run_ddp.py --backend gloo --device cuda --nproc 2   # 2 gloo ranks on one GPU
    python run_ddp.py --script seeds/seed_003_simplenet_ddp.py

The ranks follow ddp_plan.plan_ranks: one NCCL rank per visible GPU (fewer when
asked; more are clamped: NCCL refuses two ranks on one GPU), else 2 gloo ranks.
torchrun's agent checks every local rank's exit code; this wrapper adds a hard
timeout that kills the whole process group, so a hang can't outlive it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import ddp_plan  # noqa: E402

DDP_JOB = os.path.join(HERE, "ddp_job.py")


class Launch(NamedTuple):
    returncode: int
    output: str
    timed_out: bool
    nproc: int
    backend: str
    note: str
    seconds: float
    device: str = "cpu"


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose(nproc: int | None, backend: str = "auto", device: str = "auto",
           gpus: int | None = None) -> ddp_plan.RankPlan:
    """The ranks, backend and device for this node (``gpus``: default, what torch sees)."""
    return ddp_plan.plan_ranks(nproc, visible_gpus() if gpus is None else gpus, backend, device)


def torchrun_argv(nproc: int, script: str, script_args: Sequence[str]) -> list[str]:
    # Underscore spellings: the only ones torch 2.0's torchrun knows; newer ones accept both.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", str(nproc), "--max_restarts", "0", script, *script_args]


def run_bounded(argv: Sequence[str], timeout: float, echo: bool = False,
                env: dict[str, str] | None = None) -> tuple[int, str, bool]:
    """Run ``argv`` in its own process group; kill the group after ``timeout`` seconds."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace")
            lines.append(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        rc = 124
        lines.append(f"run_ddp: killed after {timeout:.0f}s (hard timeout)\n")
    reader.join(timeout=5)
    return rc, "".join(lines), timed_out


#: A timed-out NCCL collective ends the process instead of hanging it (torch 2.0 reads the
#: first spelling, newer torch the second); the job's own watchdog fires before it.
NCCL_ENV = {"NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def launch(nproc: int | None = None, *, backend: str = "auto", device: str = "auto", script: str = DDP_JOB,
           script_args: Sequence[str] = (), timeout: float = 300.0, echo: bool = False,
           gpus: int | None = None) -> Launch:
    plan = choose(nproc, backend, device, gpus)
    args = list(script_args)
    if script == DDP_JOB and "--backend" not in args:
        args = ["--backend", plan.backend, "--device", plan.device, *args]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if plan.backend == "nccl":
        for key, value in NCCL_ENV.items():
            env.setdefault(key, value)
    t0 = time.monotonic()
    rc, output, timed_out = run_bounded(torchrun_argv(plan.nproc, script, args), timeout, echo, env)
    return Launch(rc, output, timed_out, plan.nproc, plan.backend, plan.note, time.monotonic() - t0, plan.device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks on this node (default: one per GPU, or 2 CPU ranks)")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="gloo over CUDA tensors with cuda (several ranks may share one GPU)")
    p.add_argument("--script", default=DDP_JOB, help="the script torchrun runs (default: the DDP job)")
    p.add_argument("--timeout", type=float, default=300.0, help="hard limit in seconds")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="arguments for the script, after --")
    a = p.parse_args(argv)
    extra = a.script_args[1:] if a.script_args[:1] == ["--"] else a.script_args
    result = launch(a.nproc, backend=a.backend, device=a.device, script=a.script, script_args=extra,
                    timeout=a.timeout, echo=True)
    if result.note:
        print(f"run_ddp: {result.note}", file=sys.stderr)
    status = "timed out" if result.timed_out else f"exit {result.returncode}"
    print(f"run_ddp: {result.nproc} rank(s), {result.backend} on {result.device}, {status}, "
          f"{result.seconds:.1f}s", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
