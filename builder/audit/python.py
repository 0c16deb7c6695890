"""The ``python`` section of `build.py audit`: each cell's lock against known vulnerabilities.

What is audited: every distribution in the cell's lock (``locks/<cell>/pylock.toml``: the exact set
the image installs, pip included), or, for an image given by reference (``--image REF``), the
Python components of its SBOM. Advisories come in OSV's format from the first source that answers
(builder/audit/osv.py): an offline snapshot when ``PTMG_OSV_DIR`` / ``--osv-dir`` names one (air-
gapped sites; then nothing else), else OSV's API, then PyPI's per-release JSON.

The verdict per finding, from images.yaml's ``audit.python`` (builder/matrix/policy.py):

- ``allowed``: an allowlist entry matches (advisory id or alias, package, cells) and has not
  expired; reported, not refused;
- ``refused``: at or above ``fail_on`` (``any``: every finding, unrated ones too), not allowed;
- ``below fail_on``: reported only.

An allowlist entry past its ``expires`` date that covers the cell is an error (the section fails:
publish refuses the cell); one that matches nothing in any audited cell is a warning. When no
source answers for a package, the section fails with *unknown*: never "nothing found".
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ptmg_contract as contract
from builder.audit.osv import Advisory, Key, OsvApi, OsvDir, PypiJson, Source, query_all
from builder.audit.report import FAILED, FINDINGS, OK, ImageAudit, SectionResult, SectionSpec, Target
from builder.engine import Engine
from builder.lock import model
from builder.lock.net import Http, NetConfig
from builder.matrix.policy import SEVERITIES, AllowEntry, PythonPolicy

SECTION = "python"
COLUMNS = ("package", "installed", "advisory", "severity", "fixed", "verdict")
OSV_DIR_ENV = "PTMG_OSV_DIR"
REFUSED, ALLOWED, BELOW = "refused", "allowed", "below fail_on"
UNKNOWN = "unknown"  # a fact: "yes" when the audit could not check everything (no source answered)


@dataclass
class Settings:
    lock_root: Path
    policy: PythonPolicy = field(default_factory=PythonPolicy)
    sources: tuple[Source, ...] = ()
    today: dt.date = field(default_factory=dt.date.today)
    used: set[str] = field(default_factory=set)  # allowlist entries (where) that matched something


def live_sources(net: NetConfig | None = None, timeout: float = 20) -> tuple[Source, ...]:
    """OSV's API, then PyPI's per-release JSON, with the host's proxy and CA settings."""
    http = Http(net or NetConfig(dict(os.environ)), timeout=timeout)
    return OsvApi(http.json), PypiJson(http.json)


def sources_from(osv_dir: str | None, net: NetConfig | None = None) -> tuple[Source, ...]:
    """The offline snapshot alone when one is named, else the live sources."""
    given = osv_dir if osv_dir is not None else os.environ.get(OSV_DIR_ENV, "")
    return (OsvDir(Path(given)),) if given else live_sources(net)


_state: dict[str, Settings] = {}


def configure(settings: Settings) -> None:
    """Set what the section uses (the audit and publish verbs do, from the matrix and their flags)."""
    _state["settings"] = settings


def settings() -> Settings:
    if "settings" not in _state:
        from builder.common.paths import project_root

        _state["settings"] = Settings(project_root(), sources=sources_from(None))
    return _state["settings"]


def _applies(entry: AllowEntry, cell: str, package: str, adv: Advisory) -> bool:
    return (entry.id in adv.names() and (not entry.package or entry.package == package)
            and (not entry.cells or any(fnmatch.fnmatchcase(cell, g) for g in entry.cells)))


def _counts(severity: str, fail_on: str) -> bool:
    if fail_on == "any" or severity not in SEVERITIES:  # an unrated advisory counts at every threshold
        return True
    return SEVERITIES.index(severity) >= SEVERITIES.index(fail_on)


def audit_packages(cell: str, packages: Sequence[Key], s: Settings) -> SectionResult:
    """Findings and the verdict for one cell's distributions (pure given the sources)."""
    found, by, problems = query_all(s.sources, packages)
    result = SectionResult(SECTION, OK)
    sources = sorted(set(by.values()))
    result.facts = {"packages": str(len(packages)), "source": ", ".join(sources) or "none answered"}
    for src in s.sources:
        if isinstance(src, OsvDir) and src.newest:
            result.facts["snapshot"] = f"{src.path} (newest advisory modified {src.newest[:10]})"
    expired: list[str] = []
    for (name, version), advisories in sorted(found.items()):
        for adv in advisories or []:
            entry = next((e for e in s.policy.allow if _applies(e, cell, name, adv)), None)
            if entry is not None:
                s.used.add(entry.where or entry.id)
            if entry is not None and entry.expires < s.today:
                verdict = f"{REFUSED}: allowlist entry expired {entry.expires}"
                expired.append(f"{entry.where or 'images.yaml'}: audit.python.allow entry {entry.id} expired on "
                               f"{entry.expires} ({name} {version} in {cell}); fix the package or renew the entry "
                               "with a new reason and date")
            elif entry is not None:
                verdict = f"{ALLOWED} until {entry.expires}: {entry.reason}"
            else:
                verdict = REFUSED if _counts(adv.severity, s.policy.fail_on) else BELOW
            result.findings.append({"package": name, "installed": version, "advisory": adv.id,
                                    "aliases": " ".join(adv.aliases), "severity": adv.severity +
                                    (f" ({adv.score})" if adv.score is not None else ""),
                                    "fixed": " ".join(adv.fixed) or "-", "verdict": verdict,
                                    "summary": adv.summary, "url": adv.url})
    unknown = [f"{n}=={v}" for (n, v), a in sorted(found.items()) if a is None]
    refused = [f for f in result.findings if f["verdict"].startswith(REFUSED)]
    allowed = [f for f in result.findings if f["verdict"].startswith(ALLOWED)]
    if allowed:
        result.notes.append(f"{len(allowed)} known vulnerability(ies) allowed by images.yaml: "
                            + ", ".join(f"{f['package']} {f['advisory']}" for f in allowed))
    if unknown:
        result.status, result.facts[UNKNOWN] = FAILED, "yes"
        result.error = (f"UNKNOWN: no advisory source answered for {len(unknown)} of {len(packages)} "
                        f"distribution(s) (e.g. {', '.join(unknown[:3])}); the audit could not check them. "
                        + " / ".join(problems) + f". Offline sites: point {OSV_DIR_ENV} at an OSV PyPI snapshot")
    elif expired:
        result.status, result.error = FAILED, "\n".join(expired)
    elif refused:
        result.status = FINDINGS
    return result


def lock_packages(lock_root: Path, cell: str) -> list[Key]:
    lock = model.read(model.lock_path(lock_root, cell))
    return [(p.name, p.version) for p in lock.packages]


def sbom_packages(engine: Engine, ref: str) -> list[Key] | None:
    """The pypi components of an image's SBOM; None when it has none (built before images carried one)."""
    r = engine.run(ref, [contract.SBOM_FILE], entrypoint=["/bin/cat"], timeout=120)
    if r.exit_code != 0:
        return None
    try:
        comps = json.loads(r.output).get("components") or []
    except ValueError:
        return None
    return [(str(c["name"]), str(c["version"])) for c in comps if str(c.get("purl", "")).startswith("pkg:pypi/")]


def run(engine: Engine, target: Target) -> SectionResult:
    s = settings()
    if target.cell and model.lock_path(s.lock_root, target.cell).exists():
        packages = lock_packages(s.lock_root, target.cell)
    else:
        got = sbom_packages(engine, target.ref)
        if got is None:
            return SectionResult(SECTION, FAILED, error=f"{target.ref} has no SBOM at {contract.SBOM_FILE} (built "
                                 "before images carried one) and no cell lock: rebuild it, or audit its cell")
        packages = got
    return audit_packages(target.cell or target.ref, packages, s)


def audit_locks(targets: Sequence[Target], s: Settings) -> list[ImageAudit]:
    """The python section alone, from the cells' locks: no engine, no image needed (`build.py audit
    --section python` on cells, built or not)."""
    out = []
    for t in targets:
        if t.cell and model.lock_path(s.lock_root, t.cell).exists():
            result = audit_packages(t.cell, lock_packages(s.lock_root, t.cell), s)
        else:
            result = SectionResult(SECTION, FAILED, facts={UNKNOWN: "yes"},
                                   error=f"no lock for {t.cell or t.ref} ({model.LOCK_DIR}/{t.cell}/"
                                   f"{model.LOCK_NAME}): run `build.py lock --only {t.cell}`")
        out.append(ImageAudit(t.ref, t.cell, "", {SECTION: result}))
    return out


def unused_allow_entries(policy: PythonPolicy, used: set[str]) -> list[str]:
    """Warnings for allowlist entries that matched nothing in this run."""
    return [f"{e.where or 'images.yaml'}: audit.python.allow entry {e.id} matches nothing audited; remove it"
            for e in policy.allow if (e.where or e.id) not in used]


def gate_reason(result: SectionResult) -> str | None:
    """Why publish refuses a cell for its Python distributions (None: it may go)."""
    if result.status == OK:
        return None
    if result.status == FAILED:
        return f"the Python vulnerability audit failed: {result.error.splitlines()[0]}"
    refused = [f for f in result.findings if f["verdict"].startswith(REFUSED)]
    shown = ", ".join(f"{f['package']} {f['installed']} {f['advisory']} ({f['severity']})" for f in refused[:5])
    more = f" and {len(refused) - 5} more" if len(refused) > 5 else ""
    return (f"{len(refused)} known vulnerability(ies) in its Python distributions: {shown}{more}. fix: "
            "`build.py lock --upgrade-package NAME` to a fixed version, or allowlist it in images.yaml "
            "(audit.python.allow: id, reason, expires)")


def results(audits: Sequence[ImageAudit]) -> list[SectionResult]:
    return [a.sections[SECTION] for a in audits if SECTION in a.sections]


SPEC = SectionSpec(SECTION, "each cell's lock (or an image's SBOM) against OSV advisories", run, COLUMNS)
