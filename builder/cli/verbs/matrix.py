"""`build.py matrix`: the validated cells, as a table or JSON (the CI job matrix)."""

from __future__ import annotations

import argparse
import json

from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.log import table

COLUMNS = ("name", "torch", "torchvision", "cuda", "cudnn", "nccl", "python", "flavour", "base", "compile", "latest")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--github", action="store_true",
                   help="with --json: one line {\"include\": [...]} for a GitHub Actions matrix")


def run(ctx: Context) -> int:
    rows = [c.summary() for c in ctx.cells]
    if ctx.args.json:
        print(json.dumps({"include": rows} if ctx.args.github else rows, indent=None if ctx.args.github else 2))
        return 0
    def shown(row: dict[str, object], column: str) -> str:
        if column == "compile":
            return "yes" if row["compile"] else "no (below)"
        return str(row[column]) if row[column] is not None else "-"

    print(table(COLUMNS, [[shown(r, c) for c in COLUMNS] for r in rows]))
    for r in rows:
        if not r["compile"]:
            print(f"{r['name']}: no torch.compile: {r['compile_note']}")
    return 0


VERB = Verb("matrix", "validate images.yaml and list the cells (`--json --github` is the CI job matrix)",
            "matrix [--json]", run, add_arguments)
