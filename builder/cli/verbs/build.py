"""`build.py build`: build the selected cells (skipping unchanged ones) and print a summary."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common import waiting
from builder.common.log import BuildProgress, human_size, log, table
from builder.imaging import base_image, buildenv
from builder.imaging.orchestrate import BuildConfig, CellResult, build_all


def add_arguments(p: argparse.ArgumentParser) -> None:
    types.add_platforms(p, "native")
    p.add_argument("--force", action="store_true", help="rebuild even when the inputs hash is unchanged")
    p.add_argument("--no-cache", action="store_true", help="do not reuse the engine's layer cache")
    p.add_argument("--jobs", "-j", type=types.count(1, 16), default=os.environ.get("PTMG_JOBS", "1"),
                   help="cells to build in parallel, 1-16 (default 1; env PTMG_JOBS)")
    p.add_argument("--keep-going", "-k", action="store_true", help="keep building other cells after a failure")
    p.add_argument("--ca-cert", action="append", default=[], metavar="FILE", type=types.text,
                   help="extra CA certificate (PEM) the build must trust; repeatable. Host CAs in "
                        "/usr/local/share/ca-certificates and SSL_CERT_FILE/REQUESTS_CA_BUNDLE/PIP_CERT are added "
                        "automatically. Never stored in the image.")
    p.add_argument("--log-dir", default=os.environ.get("PTMG_LOG_DIR", "build-logs"), type=types.text,
                   help="where each cell's full build log goes (default build-logs/)")
    p.add_argument("--mirror", default=os.environ.get("PTMG_DEBIAN_MIRROR", base_image.DEFAULT_MIRROR),
                   type=types.text, help="Debian mirror for bootstrapping a base (env PTMG_DEBIAN_MIRROR)")


def summary(results: list[CellResult], as_json: bool) -> None:
    if as_json:
        print(json.dumps([{"cell": r.cell, "status": r.status, "seconds": round(r.seconds, 1), "size": r.size,
                           "image_id": r.image_id, "message": r.message,
                           "log": str(r.log_path) if r.log_path else None} for r in results], indent=2))
        return
    rows = [[r.cell, r.status, f"{r.seconds:.1f}s", human_size(r.size)] for r in results]
    print(table(["cell", "status", "time", "size"], rows))


def run(ctx: Context) -> int:
    a = ctx.args
    env = buildenv.detect(os.environ, [Path(p) for p in a.ca_cert])
    for item in env.describe():
        log.info("carrying into the build (as a secret): %s", item)
    cfg = BuildConfig(root=ctx.root, docker_dir=ctx.docker_dir, log_dir=Path(a.log_dir), force=a.force,
                      no_cache=a.no_cache, jobs=a.jobs, keep_going=a.keep_going, build_env=env, mirror=a.mirror,
                      dry_run=a.dry_run, source=ctx.source, lock_root=ctx.docker_dir.parent)
    with BuildProgress([c.name for c in ctx.cells]) as progress:
        results = build_all(ctx.engine(), ctx.cells, cfg, progress.line)
    for r in results:
        if r.status == "failed":
            log.error("%s failed:\n%s", r.cell, r.message)
    summary(results, a.json)
    if results and all(r.status == "skipped" for r in results):
        wall, cpu = waiting.process_times()
        slow = waiting.slow_noop(wall, cpu, os.getloadavg()[0], os.cpu_count() or 1)
        if slow:
            log.warning("%s", slow)
    return 1 if any(r.status in ("failed", "not-run") for r in results) else 0


VERB = Verb("build", "build the cells; `--jobs N`, `--keep-going`, `--force`, `--no-cache`, `--ca-cert FILE`",
            "build", run, add_arguments, "Build the selected cells (skipping those whose inputs are unchanged) "
            "and print a summary.")
