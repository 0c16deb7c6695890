"""`build.py matrix`: the validated cells, as a table or JSON (the CI job matrix)."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from typing import Any

import ptmg_contract as contract
from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.log import table
from builder.matrix import ImageSpec
from builder.matrix.model import DEFAULT_PLATFORM

COLUMNS = ("name", "torch", "torchvision", "cuda", "cudnn", "nccl", "python", "flavour", "base", "compile", "latest")


def _runners(text: str) -> tuple[tuple[str, tuple[int, int]], ...]:
    """``ptmg-sm80=8.0,ptmg-sm90=9.0`` -> ((label, (8, 0)), ...)."""
    out = []
    for item in (x.strip() for x in types.text(text).split(",") if x.strip()):
        label, sep, cap = item.partition("=")
        major, dot, minor = cap.partition(".")
        if not sep or not re.match(r"^[A-Za-z0-9_.-]+$", label) or not (dot and major.isdigit() and minor.isdigit()):
            raise argparse.ArgumentTypeError(f"{item!r}: expected RUNNER_LABEL=MAJOR.MINOR (the compute capability of "
                                             "the runner's GPUs), e.g. ptmg-sm90=9.0")
        out.append((label, (int(major), int(minor))))
    if not out:
        raise argparse.ArgumentTypeError("no runner: give RUNNER_LABEL=MAJOR.MINOR[,...]")
    return tuple(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--github", action="store_true",
                   help="with --json: one line {\"include\": [...]} for a GitHub Actions matrix")
    p.add_argument("--gpu-runners", type=_runners, default=None, metavar="LABEL=CC[,...]",
                   help="the GPU job matrix: one row per cell and GPU runner label whose compute capability "
                        "(e.g. ptmg-sm90=9.0) the cell's torch has code for; CPU-only and emulated cells have none")


def gpu_rows(cells: Sequence[ImageSpec], runners: Sequence[tuple[str, tuple[int, int]]]) -> list[dict[str, Any]]:
    """Each cell on each runner whose GPUs its arch list covers (the in-image test_arch_covered rule)."""
    return [{**c.summary(), "runner": label, "capability": f"{cap[0]}.{cap[1]}"}
            for c in cells if not c.cpu_only and not c.emulated_on(DEFAULT_PLATFORM)  # the runners are x86_64
            for label, cap in runners if contract.arch_covers(c.arch_list, cap)]


def run(ctx: Context) -> int:
    rows = [c.summary() for c in ctx.cells]
    if ctx.args.gpu_runners is not None:
        rows = gpu_rows(ctx.cells, ctx.args.gpu_runners)
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
