"""Pending Debian security updates of an image, against the live security suite.

The image's own apt runs in a throwaway container as root (``--user 0``: the image's user is
pt), with the image's own sources: ``apt-get update`` from the mirror, then
``apt-get -s dist-upgrade`` (a simulation: nothing is installed, and the container is removed).
An image that does not list its release's security suite gets it added in that container
(``PTMG_DEBIAN_SECURITY_MIRROR``, default deb.debian.org), so an image whose base lacks that suite is still
audited against the live suite. Every ``Inst`` line from a ``*-security`` origin is a finding:
package, installed version, fixed version. Needs nothing but the Debian mirror.

A failed ``apt-get update`` (also one that only warns that an index failed to download, which
would hide exactly the updates looked for) fails the audit; it never reads as "nothing pending".
"""

from __future__ import annotations

import datetime as dt
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import ptmg_contract as contract
from builder.audit.report import FAILED, FINDINGS, OK, SectionResult, SectionSpec, Target
from builder.engine import Engine, EngineError
from builder.imaging.apt_sources import DEFAULT_SECURITY_MIRROR, ENV_SECURITY_MIRROR
from builder.imaging.os_snapshot import age_days

SECTION = "debian"
COLUMNS = ("package", "installed", "fixed", "origin")
TIMEOUT = 900.0
MARK = "PTMG-AUDIT"
SCRIPT = f"""set -u
export DEBIAN_FRONTEND=noninteractive LC_ALL=C
rel=$(. /etc/os-release && echo "${{VERSION_CODENAME:-}}")
echo "{MARK} release $rel"
listed=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \\
         2>/dev/null | grep -v '^[[:space:]]*#' || true)
if [ -n "$rel" ] && ! printf '%s\\n' "$listed" | grep -Eq "(^|[[:space:]])$rel-security([[:space:]]|$)"; then
    echo "deb $PTMG_SECURITY_MIRROR $rel-security main" > /etc/apt/sources.list.d/ptmg-audit-security.list
    echo "{MARK} added $rel-security"
fi
apt-get update -o Acquire::Retries=3 2>&1
echo "{MARK} update-exit $?"
apt-get -s -o Debug::NoLocking=1 dist-upgrade 2>&1
echo "{MARK} simulate-exit $?"
"""
INST_RE = re.compile(r"^Inst (?P<package>\S+) (?:\[(?P<installed>[^\]]*)\] )?"
                     r"\((?P<fixed>\S+) (?P<origin>[^\[]*?)\s*\[(?P<arch>[^\]]+)\]\)")
UPDATE_FAILED_RE = re.compile(r"^(Err:\d+ |E: |W: (Failed to fetch|Some index files failed))", re.M)


@dataclass(frozen=True)
class Pending:
    package: str
    installed: str
    fixed: str
    origin: str  # e.g. Debian-Security:12/oldstable-security
    security: bool


def parse_simulation(text: str) -> list[Pending]:
    """Every upgrade of an installed package in `apt-get -s` output (new packages are not findings)."""
    out: list[Pending] = []
    for line in text.splitlines():
        m = INST_RE.match(line.strip())
        if not m or not m.group("installed"):
            continue
        origin = m.group("origin").strip()
        security = any("-security" in o or o.startswith("Debian-Security") for o in origin.split(", "))
        out.append(Pending(m.group("package"), m.group("installed"), m.group("fixed"), origin, security))
    return out


def _marks(output: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in output.splitlines():
        if line.startswith(MARK + " "):
            key, _, value = line[len(MARK) + 1:].partition(" ")
            found[key] = value.strip()
    return found


def evaluate(output: str, exit_code: int, labels: Mapping[str, str], now: dt.datetime) -> SectionResult:
    """The section's result from the container's output (pure)."""
    marks = _marks(output)
    facts = {"release": marks.get("release", ""), "os.updated": labels.get(contract.LABEL_OS_UPDATED, "unknown"),
             "os.suites": labels.get(contract.LABEL_OS_SUITES, "unknown")}
    age = age_days(labels.get(contract.LABEL_OS_UPDATED, ""), now)
    if age is not None:
        facts["age_days"] = f"{age:.1f}"
    notes = []
    if "added" in marks:
        notes.append(f"the image does not list {marks['added']} in its apt sources; audited against it anyway")
    update_part = output.split(f"{MARK} update-exit", 1)[0]
    update_failed = marks.get("update-exit") != "0" or bool(UPDATE_FAILED_RE.search(update_part))
    if "simulate-exit" not in marks or update_failed or marks.get("simulate-exit") != "0":
        tail = "\n".join(line for line in output.splitlines()[-15:] if not line.startswith(MARK))
        why = "apt-get update failed (the mirror did not answer, or an index did not download)" if update_failed \
            else f"apt-get -s dist-upgrade failed (container exit {exit_code})"
        return SectionResult(SECTION, FAILED, facts=facts, notes=notes, error=f"{why}:\n{tail}")
    pending = parse_simulation(output)
    security = [p for p in pending if p.security]
    facts["pending_security"] = str(len(security))
    facts["pending_other"] = str(len(pending) - len(security))
    findings = [{"package": p.package, "installed": p.installed, "fixed": p.fixed, "origin": p.origin}
                for p in security]
    return SectionResult(SECTION, FINDINGS if findings else OK, findings, facts, notes)


def audit(engine: Engine, target: Target) -> SectionResult:
    """Audit one local image (see the module's docstring)."""
    attrs = engine.image_attrs(target.ref)
    if attrs is None:
        return SectionResult(SECTION, FAILED, error=f"no image {target.ref} here; build it first (`build.py build`)")
    labels = dict((attrs.get("Config") or {}).get("Labels") or {})
    env = {"PTMG_SECURITY_MIRROR": os.environ.get(ENV_SECURITY_MIRROR) or DEFAULT_SECURITY_MIRROR}
    for name in ("http_proxy", "https_proxy", "no_proxy"):
        value = os.environ.get(name) or os.environ.get(name.upper())
        if value:
            env[name] = value
    try:
        r = engine.run(str(attrs["Id"]), ["-c", SCRIPT], entrypoint=["/bin/sh"], user="0", environment=env,
                       timeout=TIMEOUT)
    except EngineError as exc:
        return SectionResult(SECTION, FAILED, error=str(exc))
    if r.timed_out:
        return SectionResult(SECTION, FAILED, error=f"apt in the image did not finish in {TIMEOUT:.0f} s")
    return evaluate(r.output, r.exit_code, labels, dt.datetime.now(dt.timezone.utc))


SPEC = SectionSpec(SECTION, "pending Debian security updates against the live security suite (apt in the image)",
                   audit, COLUMNS)
