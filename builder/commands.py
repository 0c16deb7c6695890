"""Verbs that need the Docker engine: build, base, doctor (test and publish join them)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder import base as base_mod
from builder import buildenv, doctor
from builder import launch as launch_mod
from builder import publish as publish_mod
from builder.engine import Engine, EngineError
from builder.images import BuildConfig, CellResult, build_all
from builder.log import BuildProgress, human_size, log, table

if TYPE_CHECKING:
    from builder.cli import Context

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


def _engine() -> Engine | None:
    try:
        return Engine()
    except EngineError as exc:
        log.error("%s", exc)
        return None


def _summary(results: list[CellResult], as_json: bool) -> None:
    if as_json:
        print(json.dumps([{"cell": r.cell, "status": r.status, "seconds": round(r.seconds, 1), "size": r.size,
                           "image_id": r.image_id, "message": r.message,
                           "log": str(r.log_path) if r.log_path else None} for r in results], indent=2))
        return
    rows = [[r.cell, r.status, f"{r.seconds:.1f}s", human_size(r.size)] for r in results]
    print(table(["cell", "status", "time", "size"], rows))


def cmd_build(ctx: Context) -> int:
    """Build the selected cells (skipping those whose inputs are unchanged) and print a summary."""
    a = ctx.args
    try:
        env = buildenv.detect(os.environ, [Path(p) for p in a.ca_cert])
    except buildenv.BuildEnvError as exc:
        log.error("%s", exc)
        return EXIT_INVALID
    for item in env.describe():
        log.info("carrying into the build (as a secret): %s", item)
    engine = _engine()
    if engine is None:
        return EXIT_FAILED
    cfg = BuildConfig(force=a.force, no_cache=a.no_cache, jobs=a.jobs, keep_going=a.keep_going,
                      log_dir=Path(a.log_dir), build_env=env, mirror=a.mirror, dry_run=a.dry_run,
                      docker_dir=ctx.docker_dir, source=ctx.source)
    with BuildProgress([c.name for c in ctx.cells]) as progress:
        results = build_all(engine, ctx.cells, cfg, progress.line)
    for r in results:
        if r.status == "failed":
            log.error("%s failed:\n%s", r.cell, r.message)
    _summary(results, a.json)
    return EXIT_FAILED if any(r.status in ("failed", "not-run") for r in results) else EXIT_OK


def _add_build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="rebuild even when the inputs hash is unchanged")
    p.add_argument("--no-cache", action="store_true", help="do not reuse the engine's layer cache")
    p.add_argument("--jobs", "-j", type=int, default=int(os.environ.get("PTMG_JOBS", "1")),
                   help="cells to build in parallel (default 1; env PTMG_JOBS)")
    p.add_argument("--keep-going", "-k", action="store_true", help="keep building other cells after a failure")
    p.add_argument("--ca-cert", action="append", default=[], metavar="FILE",
                   help="extra CA certificate (PEM) the build must trust; repeatable. Host CAs in "
                        "/usr/local/share/ca-certificates and SSL_CERT_FILE/REQUESTS_CA_BUNDLE/PIP_CERT are added "
                        "automatically. Never stored in the image.")
    p.add_argument("--log-dir", default=os.environ.get("PTMG_LOG_DIR", "build-logs"),
                   help="where each cell's full build log goes (default build-logs/)")
    p.add_argument("--mirror", default=os.environ.get("PTMG_DEBIAN_MIRROR", base_mod.DEFAULT_MIRROR),
                   help="Debian mirror for bootstrapping a base (env PTMG_DEBIAN_MIRROR)")


def cmd_base(ctx: Context) -> int:
    """Make each selected cell's base image available: local, else pull, else debootstrap."""
    engine = _engine()
    if engine is None:
        return EXIT_FAILED
    done: dict[str, str] = {}
    failed = False
    for cell in ctx.cells:
        if cell.base in done:
            continue
        if ctx.args.dry_run:
            done[cell.base] = "present" if engine.image_exists(cell.base) else "would pull or bootstrap"
            continue
        try:
            if ctx.args.rebootstrap and cell.bootstrap:
                base_mod.bootstrap(engine, cell.bootstrap, cell.base, ctx.args.mirror)
                done[cell.base] = "bootstrapped"
            else:
                done[cell.base] = base_mod.ensure(engine, cell, ctx.args.mirror).how
        except (base_mod.BaseError, EngineError) as exc:
            log.error("%s", exc)
            done[cell.base] = "failed"
            failed = True
    print(table(["base", "status"], sorted(done.items())))
    return EXIT_FAILED if failed else EXIT_OK


def _add_base_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mirror", default=os.environ.get("PTMG_DEBIAN_MIRROR", base_mod.DEFAULT_MIRROR),
                   help="Debian mirror for debootstrap (env PTMG_DEBIAN_MIRROR)")
    p.add_argument("--rebootstrap", action="store_true", help="bootstrap again even if the base exists")


def cmd_test(ctx: Context) -> int:
    """Run each selected cell's smoke tests in containers: selftest, then the DDP job (--nodes N)."""
    from builder import records, smoke

    a = ctx.args
    engine = _engine()
    if engine is None:
        return EXIT_FAILED
    junit_dir = Path(a.junit_dir)
    junit_dir.mkdir(parents=True, exist_ok=True)
    rows: list[list[str]] = []
    report: list[dict[str, Any]] = []
    failed = False
    try:
        for cell in ctx.cells:
            if not engine.image_exists(cell.ref):
                log.error("%s: image %s is not built; run `python build.py build --only %s`",
                          cell.name, cell.ref, cell.name)
                rows.append([cell.name, "not built", "-", "-", "-", "-"])
                failed = True
                continue
            image_id = engine.image_id(cell.ref)
            log.info("%s: selftest", cell.name)
            st = smoke.run_selftest(engine, cell.ref, gpus=a.require_gpu,
                                    args=["--nproc", str(a.nproc)])
            if st.junit_xml:
                (junit_dir / f"{cell.name}.xml").write_text(st.junit_xml, encoding="utf-8")
            log.info("%s", st.summary())
            if a.nodes > 1:
                log.info("%s: DDP across %d nodes x %d ranks", cell.name, a.nodes, a.nproc)
                ddp = smoke.run_multinode(engine, cell.ref, nodes=a.nodes, nproc_per_node=a.nproc)
            else:
                log.info("%s: DDP on one node, %d ranks", cell.name, a.nproc)
                ddp = smoke.run_single_node(engine, cell.ref, nproc=a.nproc, gpus=a.require_gpu)
            log.info("%s", ddp.summary())
            ok = st.ok and ddp.ok
            failed |= not ok
            c = st.counts
            if ok:
                records.record_pass(image_id, cell.name, c.passed, c.skipped, a.nodes)
            rows.append([cell.name, "PASS" if ok else "FAIL", str(c.passed), str(c.failed + c.errors),
                         str(c.skipped), f"{ddp.wall_s:.1f}s (world {ddp.world_size})"])
            report.append({"cell": cell.name, "image_id": image_id, "ok": ok, "selftest": c.__dict__,
                           "selftest_failures": list(st.failures), "junit": str(junit_dir / f"{cell.name}.xml"),
                           "ddp": {"ok": ddp.ok, "wall_s": round(ddp.wall_s, 1), "world_size": ddp.world_size,
                                   "result": ddp.result.__dict__ if ddp.result else None,
                                   "nodes": [n.describe() for n in ddp.nodes]}})
    finally:
        engine.cleanup_session()
    if a.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(table(["cell", "status", "passed", "failed", "skipped", "DDP"], rows))
    return EXIT_FAILED if failed else EXIT_OK


def _add_test_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=1, help="DDP across N containers on a private network (default 1)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per node on CPU (gloo); default 2")
    p.add_argument("--require-gpu", action="store_true",
                   help="run with --gpus all and fail when no GPU is visible (GPU runners)")
    p.add_argument("--junit-dir", default=os.environ.get("PTMG_JUNIT_DIR", "build-logs/junit"),
                   help="where the JUnit XML of each image goes (default build-logs/junit/)")


def cmd_doctor(ctx: Context) -> int:
    """Check this host: engine, BuildKit, disk, NVIDIA runtime, GPUs, and which cells it can run."""
    findings = doctor.diagnose(ctx.cells)
    if ctx.args.json:
        print(json.dumps([f.__dict__ for f in findings], indent=2))
    else:
        mark = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}
        for f in findings:
            print(f"[{mark[f.level]}] {f.what}")
            if f.fix and f.level != "ok":
                print(f"       fix: {f.fix}")
    return EXIT_FAILED if any(f.level == "fail" for f in findings) else EXIT_OK


def _with_args(fn: Callable[[Context], int], adder: Callable[[argparse.ArgumentParser], None]) -> Any:
    fn.add_arguments = adder  # type: ignore[attr-defined]
    return fn


VERBS: dict[str, tuple[Callable[[Context], int], str]] = {
    "build": (_with_args(cmd_build, _add_build_args), "build the images (skips unchanged cells)"),
    "base": (_with_args(cmd_base, _add_base_args), "make base images available (pull or debootstrap)"),
    "test": (_with_args(cmd_test, _add_test_args), "smoke-test the built images in containers (selftest + DDP)"),
    "doctor": (cmd_doctor, "check this host and say which cells it can run"),
    "publish": (_with_args(publish_mod.cmd_publish, publish_mod.add_arguments),
                "push the images to a registry: immutable tags, then floating ones; verify; report"),
    "launch": (launch_mod.cmd_launch, "write job definitions for a cell: Slurm sbatch, PyTorchJob, JobSet"),
}
