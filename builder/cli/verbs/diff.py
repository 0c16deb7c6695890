"""`build.py diff A B`: what changed between two images (cells of images.yaml or local image references)."""

from __future__ import annotations

import argparse
import json

from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.errors import InputError
from builder.common.log import log
from builder.diff import compare, facts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", type=types.text, help="a cell of images.yaml, or a local image reference")
    p.add_argument("b", metavar="B", type=types.text, help="the other one")
    p.add_argument("--limit", type=types.count(1), default=60, help="package lines shown per kind (default 60)")


def resolve(ctx: Context, name: str) -> str:
    """A cell's image (by cell name) or the reference as given."""
    cells = {c.name: c for c in ctx.matrix.cells}
    if name in cells:
        return cells[name].ref
    if ctx.engine().image_exists(name):
        return name
    close = [c for c in cells if name in c][:3]
    raise InputError(f"diff: {name!r} is neither a cell of {ctx.config_display} nor a local image"
                     + (f" (cells like it: {', '.join(close)})" if close else ""))


def run(ctx: Context) -> int:
    a, b = resolve(ctx, ctx.args.a), resolve(ctx, ctx.args.b)
    log.info("reading %s and %s (packages and directory sizes, from a throwaway container each)", a, b)
    d = compare.diff(facts.read(ctx.engine(), a), facts.read(ctx.engine(), b))
    if ctx.args.json:
        print(json.dumps(d, indent=2))
    else:
        print(compare.text(d, ctx.args.limit), end="")
    return 0


VERB = Verb("diff", "what changed between two images (cells or image references): packages, sizes, layers, labels",
            "diff A B [--json]", run, add_arguments,
            "Compare two images (cells of images.yaml or local image references): Python distributions and "
            "Debian packages added, removed and changed (with versions), the biggest size changes by directory, "
            "layer sizes, and labels that differ. Text, or --json for tools.")
