"""`build.py audit`: what each image carries that already has a fix, one section per kind.

Sections (builder/audit/sections.py): ``debian``, the image's pending Debian security updates
against the live security suite (package, installed version, fixed version; #16). Audits the
selected cells' local images, or the images given with --image. Exit 0: nothing pending;
1: something pending, or an audit could not run.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from builder.audit.report import FAILED, FINDINGS, Target, report_json, rows
from builder.audit.sections import SECTIONS
from builder.audit.sections import run as run_sections
from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.errors import StepFailed
from builder.common.log import log, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image", action="append", default=[], metavar="REF", type=types.text,
                   help="audit this local image instead of the selected cells (repeatable)")
    p.add_argument("--section", action="append", default=[], choices=list(SECTIONS),
                   help=f"run only this section (repeatable; default all: {', '.join(SECTIONS)})")
    p.add_argument("--report", default=os.environ.get("PTMG_AUDIT_REPORT", ""), metavar="FILE", type=types.text,
                   help="also write the JSON report to FILE (env PTMG_AUDIT_REPORT)")


def run(ctx: Context) -> int:
    a = ctx.args
    names = list(dict.fromkeys(a.section)) or list(SECTIONS)
    if a.image:
        targets = [Target(ref) for ref in a.image]
    else:
        engine = ctx.engine()
        built = [c for c in ctx.cells if engine.image_exists(c.ref)]
        missing = [c.name for c in ctx.cells if c not in built]
        if missing:
            log.warning("not built here, not audited: %s", ", ".join(missing))
        targets = [Target(c.ref, c.name) for c in built]
    if not targets:
        raise StepFailed("no image to audit: build the cells first (`build.py build`), or name one with --image")
    if a.dry_run:
        print(table(["image", "sections"], [[t.ref, ", ".join(names)] for t in targets]))
        return 0
    audits = run_sections(ctx.engine(), targets, names)
    text = report_json(audits)
    if a.report:
        Path(a.report).parent.mkdir(parents=True, exist_ok=True)
        Path(a.report).write_text(text, encoding="utf-8")
        log.info("report: %s", a.report)
    if a.json:
        print(text, end="")
    else:
        width = max(len(SECTIONS[n].columns) for n in names)
        cols = SECTIONS[names[0]].columns if len(names) == 1 else tuple(f"detail {i + 1}" for i in range(width))
        print(table(["image", "section", *cols], rows(audits, SECTIONS)))
    for audit in audits:
        for name, r in audit.sections.items():
            for note in r.notes:
                log.warning("%s %s: %s", audit.image, name, note)
            if r.status == FAILED:
                log.error("%s %s: %s", audit.image, name, r.error)
            elif r.status == FINDINGS:
                log.warning("%s %s: %d pending (OS layer last updated %s); fix: rebuild it (`make images`)",
                            audit.image, name, len(r.findings), r.facts.get("os.updated", "unknown"))
    return 0 if all(x.ok for x in audits) else 1


VERB = Verb("audit", "report each image's pending security updates (Debian: against the live security suite)",
            "audit [--image REF] [--section debian]", run, add_arguments,
            "Audit the selected cells' images (or --image REF): per section, what is pending. debian: the image's "
            "pending Debian security updates against the live security suite (package, installed, fixed), found "
            "with the image's own apt in a throwaway container. Exit 1 when anything is pending.")
