"""Locked installs in `build.py publish`: the Python vulnerability gate, and the SBOM beside the report.

- **Gate.** Before anything of a cell is pushed, its Python distributions are audited
  (builder/audit/python.py): the image's own SBOM (what is really in it), else the cell's lock.
  A finding the policy refuses (images.yaml ``audit.python``: ``fail_on``, ``allow`` with reason
  and expiry) refuses the cell. An audit that could not run (no advisory source answered: the
  result is *unknown*; no SBOM and no lock) refuses it too, unless ``--allow-unknown-vulns``,
  which is reported loudly. The findings go into the report (a note per cell) and, in full, into
  ``python-audit.json`` beside it.
- **SBOM.** Each cell's SBOM is copied from its image to ``sbom/<cell>.cdx.json`` beside the report.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import ptmg_contract as contract
from builder.audit import python
from builder.audit.report import FAILED, OK, SectionResult
from builder.common.log import log
from builder.engine import Engine
from builder.lock import model
from builder.matrix import ImageSpec
from builder.publish.report import Report

Gate = Callable[[ImageSpec, str, Mapping[str, str]], str | None]


def python_gate(engine: Engine, settings: python.Settings, lock_roots: Sequence[Path], allow_unknown: bool,
                results: dict[str, SectionResult]) -> Gate:
    """The gate the Publisher calls per cell (image id, labels); records each cell's result in ``results``."""

    def gate(spec: ImageSpec, image_id: str, labels: Mapping[str, str]) -> str | None:
        packages = python.sbom_packages(engine, image_id) if labels.get(contract.LABEL_SBOM) else None
        where = "its SBOM"
        if packages is None:
            root = next((r for r in lock_roots if model.lock_path(r, spec.name).exists()), None)
            if root is not None:
                packages, where = python.lock_packages(root, spec.name), f"locks/{spec.name}/pylock.toml"
        if packages is None:
            result = SectionResult(python.SECTION, FAILED, facts={python.UNKNOWN: "yes"},
                                   error=f"UNKNOWN: {spec.ref} has no SBOM ({contract.SBOM_FILE}) and its cell no "
                                   "lock: nothing to audit")
        else:
            result = python.audit_packages(spec.name, packages, settings)
            result.facts["audited"] = where
        results[spec.name] = result
        reason = python.gate_reason(result)
        if reason and allow_unknown and result.facts.get(python.UNKNOWN) == "yes":
            log.warning("WARNING: %s: --allow-unknown-vulns: publishing although %s", spec.name, reason)
            result.notes.append(f"published with --allow-unknown-vulns: {reason}")
            return None
        return reason

    return gate


def combine(*gates: Gate | None) -> Gate | None:
    """One gate from several (the Publisher takes one): every reason, joined; None when all pass."""
    active = [g for g in gates if g is not None]
    if not active:
        return None

    def gate(spec: ImageSpec, image_id: str, labels: Mapping[str, str]) -> str | None:
        reasons = [r for r in (g(spec, image_id, labels) for g in active) if r]
        return "; and ".join(reasons) or None

    return gate


def annotate(report: Report, results: Mapping[str, SectionResult], settings: python.Settings) -> None:
    """Each cell's audit in the report: a note with what was found and from where."""
    for cell in report.cells:
        r = results.get(cell.cell)
        if r is None:
            continue
        found = len(r.findings)
        head = "python audit: " + (f"{found} known vulnerability(ies)" if found else "no known vulnerability")
        if r.status == FAILED:
            head = f"python audit FAILED: {r.error.splitlines()[0]}"
        cell.notes.append(f"{head} ({r.facts.get('audited', '')}; source: {r.facts.get('source', '-')})")
        cell.notes += [n for n in r.notes if n not in cell.notes]
    for line in python.unused_allow_entries(settings.policy, settings.used):
        log.warning("%s", line)


def write_extras(engine: Engine, report_dir: Path, cells: Sequence[ImageSpec], results: Mapping[str, SectionResult],
                 report: Report) -> list[Path]:
    """python-audit.json and sbom/<cell>.cdx.json beside the report; the paths written."""
    report_dir.mkdir(parents=True, exist_ok=True)
    written = []
    audit = report_dir / "python-audit.json"
    audit.write_text(json.dumps({"ok": all(r.status == OK for r in results.values()),
                                 "cells": {k: asdict(v) for k, v in sorted(results.items())}}, indent=2) + "\n",
                     encoding="utf-8")
    written.append(audit)
    ids = {c.cell: c.image_id for c in report.cells if c.image_id}
    for spec in cells:
        labels = ((engine.image_attrs(ids[spec.name]) or {}).get("Config") or {}).get("Labels") or {} \
            if spec.name in ids else {}
        if not labels.get(contract.LABEL_SBOM):
            if spec.name in ids:
                log.warning("%s: its image carries no SBOM (built before images carried one); none beside the report",
                            spec.name)
            continue
        r = engine.run(ids[spec.name], [contract.SBOM_FILE], entrypoint=["/bin/cat"], timeout=120)
        if r.exit_code != 0:
            log.warning("%s: no SBOM in the image (%s); none written beside the report", spec.name,
                        contract.SBOM_FILE)
            continue
        out = report_dir / "sbom" / f"{spec.name}.cdx.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(r.output if r.output.endswith("\n") else r.output + "\n", encoding="utf-8")
        written.append(out)
    return written
