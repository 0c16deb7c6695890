"""`build.py render`: write docker/<cell>/Dockerfile and the generated files, or check them."""

from __future__ import annotations

import argparse
from pathlib import Path

from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.log import log
from builder.render import dockerfile, generated


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true",
                   help="exit 1 and list the files that differ from what would be rendered")


def _display(ctx: Context, path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def run(ctx: Context) -> int:
    files = list(dockerfile.plan(ctx.cells, ctx.docker_dir, ctx.source))
    whole = not ctx.args.only and not ctx.args.exclude
    stale = dockerfile.stale_dirs(ctx.matrix.cells, ctx.docker_dir) if whole else ()
    if whole and ctx.is_default:  # README, compose.yaml, devcontainer: the project's own matrix only
        files += generated.project_files(ctx.root, ctx.matrix, ctx.verbs)
    if ctx.args.check:
        drifted = [_display(ctx, p) for p in dockerfile.drift(files)]
        drifted += [f"{_display(ctx, d)}/ (no such cell)" for d in stale]
        if drifted:
            log.error("rendered files drift from %s:", ctx.config_display)
            for d in drifted:
                print(d)
            log.error("fix: run `make render` (or `python build.py render`) and commit the result")
            return 1
        log.info("%d rendered file(s) up to date", len(files))
        return 0
    if ctx.args.dry_run:
        for f in files:
            print(_display(ctx, f.path))
        return 0
    written = dockerfile.write(files)
    dockerfile.remove(stale)
    for p in written:
        log.info("wrote %s", _display(ctx, p))
    for stale_dir in stale:
        log.info("removed %s (cell no longer in %s)", _display(ctx, stale_dir), ctx.config_display)
    log.info("%d file(s) rendered, %d changed", len(files), len(written))
    return 0


VERB = Verb("render", "write `docker/<cell>/Dockerfile`, the README tables, compose.yaml and the devcontainer; "
            "`--check` fails on drift", "render [--check]", run, add_arguments)
