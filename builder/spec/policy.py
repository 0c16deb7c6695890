"""images.yaml's top-level ``audit:`` key: how long an image may carry known, fixable
vulnerabilities before `build.py publish` refuses it. One section per audit of `build.py audit`::

    audit:
      debian:                  # pending Debian security updates (builder/audit/debian.py, #16)
        max_pending_days: 14   # refuse an image whose OS layer was brought up to date longer ago,
                               # when updates are pending now; 0 = refuse any pending update
      python:                  # the venv's packages against OSV (the supply-chain audit)
        max_pending_days: 14

Absent keys take the defaults below. Checked with every other problem of the file, each located.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from builder.common.yamlpos import Path_

DEFAULT_MAX_PENDING_DAYS = 14
#: Each section's keys. A section's owner adds keys here and a field to SectionPolicy (or a
#: policy class of its own), with a check in _section.
SECTION_KEYS: Mapping[str, tuple[str, ...]] = {
    "debian": ("max_pending_days",),
    "python": ("max_pending_days",),
}

#: err(path, message, key) records a located problem (builder.spec.validate.Checker.err).
Report = Callable[[Path_, str, bool], None]


@dataclass(frozen=True)
class SectionPolicy:
    #: Publish refuses an image with pending updates when its patch level is older than this.
    max_pending_days: int = DEFAULT_MAX_PENDING_DAYS


@dataclass(frozen=True)
class AuditPolicy:
    debian: SectionPolicy = field(default_factory=SectionPolicy)
    python: SectionPolicy = field(default_factory=SectionPolicy)

    def section(self, name: str) -> SectionPolicy:
        return getattr(self, name)  # type: ignore[no-any-return]


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "text", bool: "true/false", int: "a number", float: "a number",
            type(None): "empty"}.get(
        type(value), type(value).__name__)


def _unknown(report: Report, m: Mapping[str, Any], allowed: tuple[str, ...], path: Path_, where: str) -> bool:
    bad = False
    for k in m:
        if k not in allowed:
            close = difflib.get_close_matches(str(k), allowed, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            report((*path, k), f"unknown key {k!r} in {where}{hint}; valid keys: {', '.join(allowed)}", True)
            bad = True
    return bad


def _section(report: Report, value: Any, path: Path_) -> SectionPolicy:
    name = str(path[-1])
    if value is None:
        return SectionPolicy()
    if not isinstance(value, dict):
        report(path, f"audit.{name} must be a mapping, e.g. {{max_pending_days: 14}}, got {_type_name(value)}", False)
        return SectionPolicy()
    _unknown(report, value, SECTION_KEYS[name], path, f"audit.{name}")
    days = value.get("max_pending_days", DEFAULT_MAX_PENDING_DAYS)
    if isinstance(days, bool) or not isinstance(days, int) or not 0 <= days <= 3650:
        report((*path, "max_pending_days"), f"audit.{name}.max_pending_days must be a whole number of days from 0 "
               f"to 3650, e.g. 14, got {days!r}", False)
        days = DEFAULT_MAX_PENDING_DAYS
    return SectionPolicy(days)


def check_audit(report: Report, value: Any, path: Path_ = ("audit",)) -> AuditPolicy:
    """The validated `audit:` mapping; every problem goes to `report` (located), defaults stand in."""
    if value is None:
        return AuditPolicy()
    if not isinstance(value, dict):
        report(path, "audit must be a mapping, e.g. audit: {debian: {max_pending_days: 14}}, got "
               f"{_type_name(value)}", False)
        return AuditPolicy()
    _unknown(report, value, tuple(SECTION_KEYS), path, "audit")
    sections = {name: _section(report, value.get(name), (*path, name)) for name in SECTION_KEYS}
    return AuditPolicy(**sections)
