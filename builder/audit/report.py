"""What an audit found, per image and section, and the registry of sections (pure).

A section (``debian``; the supply-chain audit adds ``python``) is a function that audits one
image and returns a :class:`SectionResult`: ``ok`` (nothing pending), ``findings`` (rows such as
package / installed / fixed), or ``failed`` (the audit could not run: a finding of its own).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from builder.engine import Engine

OK, FINDINGS, FAILED = "ok", "findings", "failed"


@dataclass(frozen=True)
class Target:
    """One image to audit: a local reference (a cell's tag or any --image), and its cell if known."""

    ref: str
    cell: str = ""


@dataclass
class SectionResult:
    section: str
    status: str  # ok | findings | failed
    findings: list[dict[str, str]] = field(default_factory=list)  # one row per finding
    facts: dict[str, str] = field(default_factory=dict)  # e.g. os.updated, the suites checked
    notes: list[str] = field(default_factory=list)
    error: str = ""


@dataclass
class ImageAudit:
    image: str
    cell: str
    image_id: str = ""
    sections: dict[str, SectionResult] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.status == OK for r in self.sections.values())


Section = Callable[[Engine, Target], SectionResult]


@dataclass(frozen=True)
class SectionSpec:
    name: str
    help: str
    run: Section
    columns: tuple[str, ...]  # the finding keys the table shows, in order


def report_json(audits: Sequence[ImageAudit]) -> str:
    data: dict[str, Any] = {"ok": all(a.ok for a in audits), "images": [asdict(a) for a in audits]}
    return json.dumps(data, indent=2) + "\n"


def rows(audits: Sequence[ImageAudit], sections: Mapping[str, SectionSpec]) -> list[list[str]]:
    """Table rows: one per finding (image, section, the section's columns), one per clean or failed section."""
    out: list[list[str]] = []
    width = max((len(s.columns) for s in sections.values()), default=0)
    for a in audits:
        for name, r in a.sections.items():
            cols = sections[name].columns if name in sections else ()
            if r.status == FINDINGS:
                for f in r.findings:
                    cells = [f.get(c, "") for c in cols]
                    out.append([a.image, name, *cells, *[""] * (width - len(cells))])
            else:
                first = r.error.splitlines()[0] if r.error else ""
                # The whole reason is logged below the table; a row keeps the table readable.
                text = "nothing pending" if r.status == OK else f"FAILED: {_clip(first, 60)}"
                out.append([a.image, name, text, *[""] * (width - 1)])
    return out


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 13] + "... (below)"
