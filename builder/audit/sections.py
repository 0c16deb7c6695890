"""The sections `build.py audit` can run, by name, in report order. A new audit (e.g. the venv's
packages against OSV: ``python``) adds its :class:`~builder.audit.report.SectionSpec` here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from builder.audit import debian, python
from builder.audit.report import ImageAudit, SectionSpec, Target
from builder.common.log import log
from builder.engine import Engine

SECTIONS: Mapping[str, SectionSpec] = {debian.SPEC.name: debian.SPEC, python.SPEC.name: python.SPEC}


def run(engine: Engine, targets: Sequence[Target], names: Sequence[str]) -> list[ImageAudit]:
    """Every named section on every target, in order; one ImageAudit per target."""
    out: list[ImageAudit] = []
    for t in targets:
        attrs = engine.image_attrs(t.ref)
        audit = ImageAudit(t.ref, t.cell, str(attrs["Id"]) if attrs else "")
        for name in names:
            log.info("audit %s: %s (%s)", t.ref, name, SECTIONS[name].help)
            audit.sections[name] = SECTIONS[name].run(engine, t)
        out.append(audit)
    return out
