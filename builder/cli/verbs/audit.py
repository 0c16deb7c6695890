"""`build.py audit`: what each image carries that already has a fix, one section per kind.

Sections (builder/audit/sections.py): ``debian``, the image's pending Debian security updates
against the live security suite (package, installed version, fixed version); ``python``, each
cell's lock against OSV advisories, with images.yaml's audit.python allowlist. Audits the
selected cells' local images, or the images given with --image. Exit 0: nothing pending;
1: something pending, or an audit could not run.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from builder.audit import python
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
    p.add_argument("--osv-dir", default=None, metavar="DIR", type=types.text,
                   help=f"python: advisories from this offline OSV snapshot only (OSV's PyPI export: <ID>.json files "
                        f"or all.zip; env {python.OSV_DIR_ENV}); default: OSV's API, then PyPI's JSON API")


def run(ctx: Context) -> int:
    a = ctx.args
    names = list(dict.fromkeys(a.section)) or list(SECTIONS)
    locks_only = names == [python.SECTION] and not a.image  # the cells' locks: no engine, no image
    if a.image:
        targets = [Target(ref) for ref in a.image]
    else:
        built = [c for c in ctx.cells if locks_only or ctx.engine().image_exists(c.ref)]
        missing = [c.name for c in ctx.cells if c not in built]
        if missing:
            log.warning("not built here, not audited: %s", ", ".join(missing))
        targets = [Target(c.ref, c.name) for c in built]
    if not targets:
        raise StepFailed("no image to audit: build the cells first (`build.py build`), or name one with --image")
    if a.dry_run:
        print(table(["image", "sections"], [[t.ref, ", ".join(names)] for t in targets]))
        return 0
    settings = python.Settings(ctx.docker_dir.parent, ctx.matrix.audit.python, python.sources_from(a.osv_dir))
    python.configure(settings)
    audits = python.audit_locks(targets, settings) if locks_only else run_sections(ctx.engine(), targets, names)
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
            elif r.status == FINDINGS and name == python.SECTION:
                log.warning("%s %s: %s", audit.image, name, python.gate_reason(r))
            elif r.status == FINDINGS:
                log.warning("%s %s: %d pending (OS layer last updated %s); fix: rebuild it (`make images`)",
                            audit.image, name, len(r.findings), r.facts.get("os.updated", "unknown"))
    if python.SECTION in names:
        for line in python.unused_allow_entries(ctx.matrix.audit.python, settings.used):
            log.warning("%s", line)
    return 0 if all(x.ok for x in audits) else 1


VERB = Verb("audit", "report each image's pending security updates (Debian: against the live security suite) and "
            "known vulnerabilities in each cell's lock (python: OSV)",
            "audit [--image REF] [--section debian|python] [--osv-dir DIR]", run, add_arguments,
            "Audit the selected cells' images (or --image REF): per section, what is pending. debian: the image's "
            "pending Debian security updates against the live security suite (package, installed, fixed), found "
            "with the image's own apt in a throwaway container. python: each cell's lock (or an --image's SBOM) "
            "against OSV advisories (offline snapshot with --osv-dir, else OSV's API, then PyPI's), with "
            "images.yaml's audit.python allowlist; no source answering is a failure (unknown), never a pass. "
            "Exit 1 when anything is pending or refused, or an audit could not run.")
