"""DDP smoke benchmarks. Prints a markdown report (paste into BENCHMARKS.md).

    .venv/bin/python bench/bench_ddp.py --image pt-multi-gpu:2.7.0-cuda12.6-cudnn9-runtime [--repeat 3]
    .venv/bin/python bench/bench_ddp.py --image IMAGE --gpus      # a GPU host: NCCL on every visible GPU

Figures (wall time on the host, container start and removal included):
  1. single-node DDP smoke: 2 CPU ranks over gloo, or with --gpus one NCCL rank per visible GPU
     (torchrun --standalone)                                                   target <= 60 s
  2. multi-node DDP smoke: 2 containers x 2 CPU ranks on a Docker network (with --gpus: the
     GPUs shared between the containers)                                     target <= 90 s
  3. the all-reduce bus bandwidth table of each, measured the nccl-tests way (all_reduce_perf's
     defaults: 5 warm-ups, 20 timed iterations per size, float sum, the time averaged over
     ranks; sizes to 1 GiB on NCCL, 4 MiB on gloo), with the slowest rank beside it. On a GPU
     host put it beside `all_reduce_perf -b 8 -e 1G -f 2 -g <GPUs>` from the same box: the
     sizes are rows of that output, and busbw is computed the same way (algbw * 2(n-1)/n).

With --repeat N each wall time is the median of N runs. Exits 1 when a run fails
its checks (a slow run is reported, not failed). A run at world size 1 (one GPU) is
reported as "skipped (one GPU)": it measured no bandwidth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from builder.engine import Engine  # noqa: E402
from builder.smoke import gpus, results, runner  # noqa: E402

TARGETS = {"single": 60.0, "multi": 90.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", default=os.environ.get("PTMG_TEST_IMAGE", "pt-multi-gpu:latest"))
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks per container (default: 2 CPU ranks; with --gpus one per GPU)")
    p.add_argument("--gpus", action="store_true",
                   help="every visible GPU (nvidia-smi, narrowed by CUDA_VISIBLE_DEVICES), NCCL")
    a = p.parse_args(argv)

    ids: tuple[str, ...] | None = None
    if a.gpus:
        ids, note = gpus.host_gpus(os.environ)
        if not ids:
            print(f"--gpus: no GPU visible ({note})", file=sys.stderr)
            return 1
    plans = {"single": gpus.plan_run(ids, 1, a.nproc), "multi": gpus.plan_run(ids, a.nodes, a.nproc)}

    engine = Engine()
    runs: dict[str, list[results.DDPRun]] = {"single": [], "multi": []}
    try:
        for i in range(a.repeat):
            for kind, plan in plans.items():
                print(f"run {i + 1}/{a.repeat}: {plan.describe()} ...", file=sys.stderr)
                runs[kind].append(runner.run_plan(engine, a.image, plan))
    finally:
        engine.cleanup_session()

    failed = [r for rs in runs.values() for r in rs if not r.ok]
    where = "GPUs (NCCL)" if a.gpus else "CPU ranks (gloo)"
    labels = {kind: f"{plan.nodes} node(s) x {plan.nproc_per_node} {where}" for kind, plan in plans.items()}
    print(f"## DDP smoke on `{a.image}`\n")
    print(f"Host: {os.cpu_count()} CPUs{', GPUs ' + ', '.join(ids) if ids else ''}. Wall time includes "
          f"container start and removal; {'median of ' + str(a.repeat) + ' runs' if a.repeat > 1 else 'one run'}.\n")
    print("| run | world size | wall (s) | target (s) | in the job (s) | steps/s | verdict |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for kind, rs in runs.items():
        wall = statistics.median(r.wall_s for r in rs)
        last = rs[-1]
        job = f"{last.result.wall_s:.1f}" if last.result else "-"
        sps = f"{last.result.steps_per_s:.0f}" if last.result else "-"
        verdict = "FAIL" if any(not r.ok for r in rs) else last.verdict if not last.passed else (
            "ok" if wall <= TARGETS[kind] else "slow")
        print(f"| {labels[kind]} | {last.world_size} | {wall:.1f} | {TARGETS[kind]:.0f} | {job} | {sps} | {verdict} |")
    for kind, rs in runs.items():
        result = rs[-1].result
        if result is not None and result.busbw:
            print(f"\n### all-reduce bus bandwidth, {labels[kind]}, world size {result.world_size}\n")
            print(results.busbw_markdown(result, same_host_nodes=plans[kind].nodes))
    print("\nReproduce: `.venv/bin/python bench/bench_ddp.py --image IMAGE --repeat N"
          f"{' --gpus' if a.gpus else ''}`")
    for r in failed:
        print(r.summary(), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
