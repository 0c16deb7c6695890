"""`build.py doctor`: check this host and say which cells it can run."""

from __future__ import annotations

import json

from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.host import doctor


def run(ctx: Context) -> int:
    findings = doctor.diagnose(ctx.cells, ctx.engine, ctx.matrix.cells)
    if ctx.args.json:
        print(json.dumps([f.__dict__ for f in findings], indent=2))
    else:
        mark = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}
        for f in findings:
            print(f"[{mark[f.level]}] {f.what}")
            if f.fix and f.level != "ok":
                print(f"       fix: {f.fix}")
    return 1 if any(f.level == "fail" for f in findings) else 0


VERB = Verb("doctor", "engine, BuildKit, disk, NVIDIA runtime, GPUs, and which cells this host can run",
            "doctor", run)
