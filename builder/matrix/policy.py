"""images.yaml's top-level ``audit:`` key: how long an image may carry known, fixable
vulnerabilities before `build.py publish` refuses it. One section per audit of `build.py audit`::

    audit:
      debian:                  # pending Debian security updates (builder/audit/debian.py)
        max_pending_days: 14   # refuse an image whose OS layer was brought up to date longer ago,
                               # when updates are pending now; 0 = refuse any pending update
      python:                  # each cell's lock against OSV advisories (builder/audit/python.py)
        fail_on: any           # the lowest severity publish refuses: any (also unrated) | low | medium |
                               # high | critical
        allow:                 # known vulnerabilities publish accepts, each with a reason and an expiry
          - id: GHSA-xxxx-xxxx-xxxx   # the advisory's id or one of its aliases (CVE-..., PYSEC-...)
            package: jupyterlab       # optional: only in this distribution
            cells: ["2.0.1-*"]        # optional: only in these cells (globs)
            reason: no fix for torch 2.0.1's Python yet
            expires: 2027-01-31       # after this date the entry is an error (audit and publish)

Absent keys take the defaults below. Checked with every other problem of the file, each located.
"""

from __future__ import annotations

import datetime as dt
import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from builder.common.yamlpos import Path_

DEFAULT_MAX_PENDING_DAYS = 14
#: Each section's keys. A section's owner adds keys here and a field to SectionPolicy (or a
#: policy class of its own), with a check in _section.
SECTION_KEYS: Mapping[str, tuple[str, ...]] = {
    "debian": ("max_pending_days",),
    "python": ("fail_on", "allow"),
}
#: Severities, lowest first; audit.python.fail_on is one of these or "any" (also unrated ones).
SEVERITIES: tuple[str, ...] = ("low", "medium", "high", "critical")
FAIL_ON: tuple[str, ...] = ("any", *SEVERITIES)
ALLOW_KEYS: tuple[str, ...] = ("id", "package", "cells", "reason", "expires")
ADVISORY_ID_RE = re.compile(r"^[A-Z][A-Z0-9]*-[A-Za-z0-9][A-Za-z0-9._:-]*$")

#: err(path, message, key) records a located problem (builder.matrix.validate.Checker.err).
Report = Callable[[Path_, str, bool], None]
#: Where a path is written, as file:line:col (for messages about it long after validation).
Locate = Callable[[Path_], str]


@dataclass(frozen=True)
class SectionPolicy:
    #: Publish refuses an image with pending updates when its patch level is older than this.
    max_pending_days: int = DEFAULT_MAX_PENDING_DAYS


@dataclass(frozen=True)
class AllowEntry:
    """One accepted known vulnerability (audit.python.allow): matched by advisory id or alias."""

    id: str
    reason: str
    expires: dt.date
    package: str = ""  # canonical name; "" = any
    cells: tuple[str, ...] = ()  # globs; () = every cell
    where: str = ""  # images.yaml:line:col of the entry


@dataclass(frozen=True)
class PythonPolicy:
    fail_on: str = "any"
    allow: tuple[AllowEntry, ...] = ()


@dataclass(frozen=True)
class AuditPolicy:
    debian: SectionPolicy = field(default_factory=SectionPolicy)
    python: PythonPolicy = field(default_factory=PythonPolicy)

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


def _date(value: Any) -> dt.date | None:
    if isinstance(value, dt.datetime):
        return value.date()
    if isinstance(value, dt.date):
        return value
    if isinstance(value, str):
        try:
            return dt.date.fromisoformat(value.strip())
        except ValueError:
            return None
    return None


def _allow_entry(report: Report, value: Any, path: Path_, where: str) -> AllowEntry | None:
    if not isinstance(value, dict):
        report(path, "each audit.python.allow entry must be a mapping: {id: GHSA-..., reason: ..., expires: "
               f"YYYY-MM-DD}}, got {_type_name(value)}", False)
        return None
    bad = _unknown(report, value, ALLOW_KEYS, path, "an audit.python.allow entry")
    ident, reason = value.get("id"), value.get("reason")
    if not isinstance(ident, str) or not ADVISORY_ID_RE.match(ident.strip()):
        report((*path, "id") if "id" in value else path, "id must be an advisory id such as GHSA-j8r2-6x86-q33q, "
               f"CVE-2024-1234 or PYSEC-2023-228, got {ident!r}", False)
        bad = True
    if not isinstance(reason, str) or not reason.strip():
        report((*path, "reason") if "reason" in value else path, "reason must say why this vulnerability is "
               "accepted (non-empty text)", False)
        bad = True
    expires = _date(value.get("expires"))
    if expires is None:
        report((*path, "expires") if "expires" in value else path, "expires must be a date, YYYY-MM-DD, after "
               f"which the entry is an error; got {value.get('expires')!r}", False)
        bad = True
    package, cells = value.get("package", ""), value.get("cells", [])
    if not isinstance(package, str):
        report((*path, "package"), f"package must be a distribution name, got {_type_name(package)}", False)
        bad = True
    if not isinstance(cells, list) or not all(isinstance(c, str) and c for c in cells):
        report((*path, "cells"), "cells must be a list of cell names or globs, e.g. [\"2.0.1-*\"]", False)
        bad = True
    if bad or expires is None:
        return None
    norm = re.sub(r"[-_.]+", "-", str(package)).lower().strip()
    return AllowEntry(str(ident).strip(), str(reason).strip(), expires, norm, tuple(cells), where)


def _python(report: Report, value: Any, path: Path_, locate: Locate | None) -> PythonPolicy:
    if value is None:
        return PythonPolicy()
    if not isinstance(value, dict):
        report(path, f"audit.python must be a mapping, e.g. {{fail_on: high}}, got {_type_name(value)}", False)
        return PythonPolicy()
    _unknown(report, value, SECTION_KEYS["python"], path, "audit.python")
    fail_on = value.get("fail_on", "any")
    if fail_on not in FAIL_ON:
        report((*path, "fail_on"), f"audit.python.fail_on must be one of {', '.join(FAIL_ON)}, got {fail_on!r}",
               False)
        fail_on = "any"
    allow = value.get("allow") or []
    if not isinstance(allow, list):
        report((*path, "allow"), f"audit.python.allow must be a list of entries, got {_type_name(allow)}", False)
        allow = []
    entries = [_allow_entry(report, e, (*path, "allow", i), locate((*path, "allow", i)) if locate else "")
               for i, e in enumerate(allow)]
    return PythonPolicy(str(fail_on), tuple(e for e in entries if e is not None))


def check_audit(report: Report, value: Any, path: Path_ = ("audit",), locate: Locate | None = None) -> AuditPolicy:
    """The validated `audit:` mapping; every problem goes to `report` (located), defaults stand in."""
    if value is None:
        return AuditPolicy()
    if not isinstance(value, dict):
        report(path, "audit must be a mapping, e.g. audit: {debian: {max_pending_days: 14}}, got "
               f"{_type_name(value)}", False)
        return AuditPolicy()
    _unknown(report, value, tuple(SECTION_KEYS), path, "audit")
    return AuditPolicy(_section(report, value.get("debian"), (*path, "debian")),
                       _python(report, value.get("python"), (*path, "python"), locate))
