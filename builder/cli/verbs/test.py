"""`build.py test`: each selected image's selftest, then the DDP job (`--nodes N` across containers)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.log import log, table
from builder.smoke import passes, runner


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=types.count(1, 16), default=1,
                   help="DDP across N containers on a private network, 1-16 (default 1)")
    p.add_argument("--nproc", type=types.count(1, 64), default=2, help="ranks per node on CPU (gloo); default 2")
    p.add_argument("--require-gpu", action="store_true",
                   help="run with --gpus all and fail when no GPU is visible (GPU runners)")
    p.add_argument("--junit-dir", default=os.environ.get("PTMG_JUNIT_DIR", "build-logs/junit"), type=types.text,
                   help="where the JUnit XML of each image goes (default build-logs/junit/)")


def run(ctx: Context) -> int:
    a = ctx.args
    engine = ctx.engine()
    junit_dir = Path(a.junit_dir)
    junit_dir.mkdir(parents=True, exist_ok=True)
    rows: list[list[str]] = []
    report: list[dict[str, Any]] = []
    failed = False
    for cell in ctx.cells:
        if not engine.image_exists(cell.ref):
            log.error("%s: image %s is not built; run `python build.py build --only %s`", cell.name, cell.ref,
                      cell.name)
            rows.append([cell.name, "not built", "-", "-", "-", "-"])
            failed = True
            continue
        image_id = engine.image_id(cell.ref)
        log.info("%s: selftest", cell.name)
        st = runner.run_selftest(engine, cell.ref, gpus=a.require_gpu, args=["--nproc", str(a.nproc)])
        if st.junit_xml:
            (junit_dir / f"{cell.name}.xml").write_text(st.junit_xml, encoding="utf-8")
        log.info("%s", st.summary())
        if a.nodes > 1:
            log.info("%s: DDP across %d nodes x %d ranks", cell.name, a.nodes, a.nproc)
            ddp = runner.run_multinode(engine, cell.ref, nodes=a.nodes, nproc_per_node=a.nproc)
        else:
            log.info("%s: DDP on one node, %d ranks", cell.name, a.nproc)
            ddp = runner.run_single_node(engine, cell.ref, nproc=a.nproc, gpus=a.require_gpu)
        log.info("%s", ddp.summary())
        ok = st.ok and ddp.ok
        failed |= not ok
        c = st.counts
        if ok:
            passes.record_pass(ctx.root, image_id, cell.name, c.passed, c.skipped, a.nodes)
        rows.append([cell.name, "PASS" if ok else "FAIL", str(c.passed), str(c.failed + c.errors),
                     str(c.skipped), f"{ddp.wall_s:.1f}s (world {ddp.world_size})"])
        report.append({"cell": cell.name, "image_id": image_id, "ok": ok, "selftest": c.__dict__,
                       "selftest_failures": list(st.failures), "junit": str(junit_dir / f"{cell.name}.xml"),
                       "ddp": {"ok": ddp.ok, "wall_s": round(ddp.wall_s, 1), "world_size": ddp.world_size,
                               "result": ddp.result.__dict__ if ddp.result else None,
                               "nodes": [n.describe() for n in ddp.nodes]}})
    if a.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(table(["cell", "status", "passed", "failed", "skipped", "DDP"], rows))
    return 1 if failed else 0


VERB = Verb("test", "run each image's selftest and the DDP job in containers (`--nodes 2` across containers), "
            "JUnit XML per image", "test", run, add_arguments)
