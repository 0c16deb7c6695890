"""`build.py repro CELL [--against sha256:DIGEST]`: build a cell twice from scratch, compare the digests."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.errors import InputError
from builder.common.log import BuildProgress, log, table
from builder.engine import find_buildkit_cli
from builder.engine.buildkit import buildx_facts
from builder.imaging import buildenv, repro
from builder.imaging.orchestrate import BuildConfig

DIGEST = repro.DIGEST


def digest(text: str) -> str:
    """--against: a manifest digest as `build.py repro` prints it (one-line error otherwise)."""
    value = types.text(text)
    if not DIGEST.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a digest: expected sha256: and 64 lowercase hex digits, "
                                         "as `build.py repro` prints it")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("cell", nargs="?", metavar="CELL", type=types.text,
                   help="a cell of images.yaml (default: the one cell --only selects)")
    p.add_argument("--against", metavar="sha256:DIGEST", type=digest,
                   help="build once and compare with this manifest digest (one an earlier repro printed)")
    p.add_argument("--log-dir", default=os.environ.get("PTMG_LOG_DIR", "build-logs"), type=types.text,
                   help="where each build's full log goes (default build-logs/)")


def run(ctx: Context) -> int:
    a = ctx.args
    cells = {c.name: c for c in ctx.matrix.cells}
    if a.cell is not None and a.cell not in cells:
        raise InputError(f"repro: {a.cell!r} is not a cell of {ctx.source} (build.py matrix lists them)")
    if a.cell is None and len(ctx.cells) != 1:
        raise InputError(f"repro: name one cell, or select exactly one with --only; {len(ctx.cells)} selected")
    spec = cells[a.cell] if a.cell else ctx.cells[0]
    engine = ctx.engine()
    cli = find_buildkit_cli()
    missing = repro.cannot(cli, engine.store(), str(engine.version().get("ApiVersion") or ""))
    if missing is not None:
        raise InputError(missing)
    buildx, buildkit = buildx_facts(cli) if cli is not None else (None, None)
    env = buildenv.detect(os.environ, [])
    cfg = BuildConfig(root=ctx.root, docker_dir=ctx.docker_dir, log_dir=Path(a.log_dir), build_env=env,
                      source=ctx.source, lock_root=ctx.docker_dir.parent)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    work = ctx.root / ".build"
    work.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="repro-", dir=work) as tmp, BuildProgress([spec.name]) as progress:
        verdict = repro.reproduce(engine, spec, cfg, Path(tmp), a.against, progress.line)
    rows = [[f"build {n}", b.manifest_digest, b.config_digest, f"{b.seconds:.0f} s"]
            for n, b in enumerate(verdict.builds, start=1)]
    if a.against:
        rows.append(["--against", a.against, "", ""])
    print(table(["", "manifest digest", "config digest", "time"], rows))
    print(f"SOURCE_DATE_EPOCH={verdict.epoch} (the Debian snapshot {verdict.snapshot}'s newest Release date)")
    report = {"cell": spec.name, "same": verdict.same, "against": a.against, "source_date_epoch": verdict.epoch,
              "os_snapshot": verdict.snapshot, "inputs": verdict.inputs, "differs": list(verdict.differs),
              "buildx": buildx or "", "buildkit": buildkit or "",  # the tar and gzip writers a digest depends on
              "builds": [{"manifest": b.manifest_digest, "config": b.config_digest, "seconds": round(b.seconds, 1)}
                         for b in verdict.builds]}
    repro.write_report(cfg.log_dir, spec.name, report)
    if verdict.same:
        print(f"{spec.name}: bit-identical ({verdict.builds[0].manifest_digest})")
        return 0
    log.error("%s: the builds differ:\n%s", spec.name, "\n".join(repro.shown(verdict.differs)))
    return 1


VERB = Verb("repro", "build a cell twice from scratch and compare the image digests; `--against sha256:...`",
            "repro CELL [--against sha256:DIGEST]", run, add_arguments,
            "Build the cell twice without the layer cache, each as an OCI layout with every timestamp clamped to "
            "SOURCE_DATE_EPOCH (the Debian snapshot's newest Release date), and print both manifest and config "
            "digests. Exit 0 only when they match; otherwise name the files that differ. With --against, build "
            "once and compare with a digest an earlier run printed (docs/supply-chain.md: verifying on a second "
            "machine). Needs buildx with BuildKit >= 0.13 and the containerd image store; the engine's images are "
            "not touched. Report: build-logs/<cell>.repro.json.")
