"""`build.py export CELL --format sqsh|sif [-o PATH]`: a local image as one file for an HPC runtime."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.log import log, table
from builder.export import squash


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", nargs="?", metavar="CELL|IMAGE", type=types.text,
                   help="a cell of images.yaml or a local image reference (default: the one cell --only selects)")
    p.add_argument("--format", dest="fmt", choices=sorted(squash.FORMATS), default="sqsh",
                   help="sqsh: enroot/pyxis squashfs (Charliecloud runs it too); sif: Apptainer/Singularity")
    p.add_argument("--output", "-o", metavar="PATH", type=types.text,
                   help="the file to write (default: exports/<cell>.<format>)")


def run(ctx: Context) -> int:
    ref, stem = ctx.one_image("export", ctx.args.target)
    fmt = ctx.args.fmt
    default = ctx.root / "exports" / f"{stem}{squash.FORMATS[fmt]}"
    if ctx.args.output is None:
        default.parent.mkdir(exist_ok=True)
    out = squash.check_output(Path(ctx.args.output) if ctx.args.output else default, fmt)
    log.info("exporting %s as %s to %s", ref, fmt, out)
    done = squash.export(ctx.engine(), ref, fmt, out)
    report = {"image": ref, "format": fmt, "path": str(done.path), "size": done.size, "sha256": done.sha256,
              "seconds": round(done.seconds, 1)}
    logs = ctx.root / "build-logs"
    logs.mkdir(exist_ok=True)
    (logs / f"{stem}.export-{fmt}.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(table(["image", "format", "file", "size", "sha256", "time"],
                [[ref, fmt, str(done.path), f"{done.size / 1e9:.2f} GB", done.sha256, f"{done.seconds:.0f} s"]]))
    return 0


VERB = Verb("export", "write a built image as an enroot squashfs (.sqsh) or an Apptainer SIF (.sif), offline",
            "export CELL|IMAGE [--format sqsh|sif] [-o PATH]", run, add_arguments,
            "Write a local image as one file an HPC runtime runs, with no registry: --format sqsh is enroot's "
            "squashfs format (pyxis: srun --container-image=/abs/x.sqsh; Charliecloud: ch-run x.sqsh), --format sif "
            "the same squashfs wrapped as an Apptainer/Singularity SIF. The file is written under a temporary name "
            "and renamed only when complete; its size and sha256 are printed and written to "
            "build-logs/<cell>.export-<format>.json. Needs squashfs-tools (and siftool for sif): "
            "scripts/ensure-tools.sh export.")
