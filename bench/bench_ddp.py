"""DDP smoke benchmarks. Prints a markdown report (paste into BENCHMARKS.md).

    .venv/bin/python bench/bench_ddp.py --image pt-multi-gpu:2.7.0-cuda12.6-cudnn9-runtime [--repeat 3]

Figures (wall time on the host, container start and removal included):
  1. single-node DDP smoke, 2 CPU ranks over gloo (torchrun --standalone)   target <= 60 s
  2. multi-node DDP smoke, 2 containers x 2 CPU ranks on a Docker network   target <= 90 s
  3. the gloo all-reduce bus bandwidth table of each (nccl-tests' busbw)

With --repeat N each figure is the median of N runs. Exits 1 when a run fails
its checks (a slow run is reported, not failed).
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
from builder.smoke import results, runner  # noqa: E402

TARGETS = {"single": 60.0, "multi": 90.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", default=os.environ.get("PTMG_TEST_IMAGE", "pt-multi-gpu:latest"))
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2, help="ranks per container")
    a = p.parse_args(argv)

    engine = Engine()
    runs: dict[str, list[results.DDPRun]] = {"single": [], "multi": []}
    try:
        for i in range(a.repeat):
            print(f"run {i + 1}/{a.repeat}: single node ...", file=sys.stderr)
            runs["single"].append(runner.run_single_node(engine, a.image, nproc=a.nproc))
            print(f"run {i + 1}/{a.repeat}: {a.nodes} nodes ...", file=sys.stderr)
            runs["multi"].append(runner.run_multinode(engine, a.image, nodes=a.nodes, nproc_per_node=a.nproc))
    finally:
        engine.cleanup_session()

    failed = [r for rs in runs.values() for r in rs if not r.ok]
    labels = {"single": f"single node, {a.nproc} CPU ranks (gloo)",
              "multi": f"{a.nodes} nodes x {a.nproc} CPU ranks (gloo)"}
    print(f"## DDP smoke on `{a.image}`\n")
    print(f"Host: {os.cpu_count()} CPUs. Wall time includes container start and removal; "
          f"{'median of ' + str(a.repeat) + ' runs' if a.repeat > 1 else 'one run'}.\n")
    print("| run | world size | wall (s) | target (s) | in the job (s) | steps/s | verdict |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for kind, rs in runs.items():
        wall = statistics.median(r.wall_s for r in rs)
        last = rs[-1]
        job = f"{last.result.wall_s:.1f}" if last.result else "-"
        sps = f"{last.result.steps_per_s:.0f}" if last.result else "-"
        verdict = "FAIL" if any(not r.ok for r in rs) else ("ok" if wall <= TARGETS[kind] else "slow")
        print(f"| {labels[kind]} | {last.world_size} | {wall:.1f} | {TARGETS[kind]:.0f} | {job} | {sps} | {verdict} |")
    for kind, rs in runs.items():
        result = rs[-1].result
        if result is not None:
            print(f"\n### all-reduce bus bandwidth, {labels[kind]}, world size {result.world_size}\n")
            print(results.busbw_markdown(result))
    print("\nReproduce: `.venv/bin/python bench/bench_ddp.py --image IMAGE --repeat N`")
    for r in failed:
        print(r.summary(), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
