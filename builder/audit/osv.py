"""Known vulnerabilities of Python distributions, from OSV-format advisories.

Three sources, each answering "which advisories affect NAME==VERSION" (or not answering at all):

- ``OsvDir``: an offline snapshot in OSV's per-ecosystem export format (an air-gapped site copies
  ``https://osv-vulnerabilities.storage.googleapis.com/PyPI/all.zip``): a folder of ``<ID>.json``
  advisories, or that ``all.zip`` (also ``PyPI/all.zip`` inside the folder). Matching follows the
  OSV schema: ``affected[].versions`` lists, and ``ECOSYSTEM`` ranges of introduced / fixed /
  last_affected events, compared as PEP 440 versions.
- ``OsvApi``: ``POST https://api.osv.dev/v1/querybatch``, then each advisory from ``/v1/vulns/ID``.
- ``PypiJson``: PyPI's per-release JSON (``/pypi/NAME/VERSION/json``, its ``vulnerabilities``: OSV
  ids, aliases, fixed_in; PyPI gives no severity, so those count as unrated).

A source that does not answer raises :class:`Unavailable`; the audit then says *unknown*, never
"nothing found". Severity: the highest CVSS v3 base score an advisory carries (computed from its
vector), else the GHSA ``database_specific.severity``, else unrated.
"""

from __future__ import annotations

import json
import math
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

OSV_API = "https://api.osv.dev/v1"
PYPI_JSON = "https://pypi.org/pypi"
Key = tuple[str, str]  # (canonical name, version)


class Unavailable(Exception):
    """The source did not answer (unreachable, an error, not a snapshot)."""


@dataclass(frozen=True)
class Advisory:
    id: str
    aliases: tuple[str, ...]
    summary: str
    severity: str  # low | medium | high | critical | unrated
    score: float | None
    fixed: tuple[str, ...]  # versions that fix it (for this package)
    url: str = ""

    def names(self) -> set[str]:
        return {self.id, *self.aliases}


# --- severity ---------------------------------------------------------------------------------
_W = {"AV": {"N": 0.85, "A": 0.62, "L": 0.55, "P": 0.2}, "AC": {"L": 0.77, "H": 0.44},
      "UI": {"N": 0.85, "R": 0.62}, "C": {"H": 0.56, "L": 0.22, "N": 0.0}}


def _roundup(x: float) -> float:
    i = round(x * 100000)
    return i / 100000.0 if i % 10000 == 0 else (math.floor(i / 10000) + 1) / 10.0


def cvss3_score(vector: str) -> float | None:
    """The CVSS v3.x base score of a vector such as ``CVSS:3.1/AV:N/AC:L/PR:N/UI:N/S:U/C:H/I:H/A:H``."""
    try:
        m = dict(part.split(":", 1) for part in vector.split("/")[1:])
        changed = m["S"] == "C"
        pr = {"N": 0.85, "L": 0.68 if changed else 0.62, "H": 0.5 if changed else 0.27}[m["PR"]]
        iss = 1 - (1 - _W["C"][m["C"]]) * (1 - _W["C"][m["I"]]) * (1 - _W["C"][m["A"]])
        impact = 7.52 * (iss - 0.029) - 3.25 * (iss - 0.02) ** 15 if changed else 6.42 * iss
        exploit = 8.22 * _W["AV"][m["AV"]] * _W["AC"][m["AC"]] * pr * _W["UI"][m["UI"]]
    except (KeyError, ValueError):
        return None
    if impact <= 0:
        return 0.0
    return _roundup(min(1.08 * (impact + exploit), 10) if changed else min(impact + exploit, 10))


def rating(score: float) -> str:
    return "critical" if score >= 9 else "high" if score >= 7 else "medium" if score >= 4 else "low" if score > 0 \
        else "unrated"


def severity_of(raw: Mapping[str, Any]) -> tuple[str, float | None]:
    scores = [s for s in (cvss3_score(str(x.get("score", ""))) for x in raw.get("severity") or []
                          if str(x.get("type", "")).startswith("CVSS_V3")) if s is not None]
    if scores:
        return rating(max(scores)), max(scores)
    word = str((raw.get("database_specific") or {}).get("severity", "")).lower()
    word = {"moderate": "medium"}.get(word, word)
    return (word, None) if word in ("low", "medium", "high", "critical") else ("unrated", None)


# --- matching -----------------------------------------------------------------------------------
def _v(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def _in_range(events: Sequence[Mapping[str, str]], version: Version) -> bool:
    """OSV ECOSYSTEM range semantics: sorted events; introduced opens, fixed/last_affected close."""
    affected = False
    points: list[tuple[Version, int, str]] = []
    for e in events:
        for kind, order in (("introduced", 1), ("fixed", 0), ("last_affected", 2)):
            if kind in e:
                v = Version("0") if e[kind] == "0" else _v(e[kind])
                if v is not None:
                    points.append((v, order, kind))
    for v, _order, kind in sorted(points):
        if kind == "introduced":
            affected = affected or version >= v
        elif version > v or (kind == "fixed" and version == v):  # at or past a fix, past last_affected
            affected = False
    return affected


def affects(raw: Mapping[str, Any], name: str, version: str) -> tuple[bool, tuple[str, ...]]:
    """Does this OSV advisory affect ``name==version``? (yes/no, the fixed versions it names)."""
    v = _v(version)
    hit, fixed = False, []
    for aff in raw.get("affected") or []:
        pkg = aff.get("package") or {}
        if pkg.get("ecosystem") != "PyPI" or canonicalize_name(str(pkg.get("name", ""))) != name:
            continue
        if version in (aff.get("versions") or []):
            hit = True
        for rng in aff.get("ranges") or []:
            if rng.get("type") in ("ECOSYSTEM", "SEMVER") and v is not None:
                events = rng.get("events") or []
                fixed += [e["fixed"] for e in events if "fixed" in e]
                hit = hit or _in_range(events, v)
    return hit, tuple(dict.fromkeys(fixed))


def advisory(raw: Mapping[str, Any], name: str, fixed: Sequence[str]) -> Advisory:
    sev, score = severity_of(raw)
    refs = [r.get("url", "") for r in raw.get("references") or [] if r.get("type") == "ADVISORY"]
    return Advisory(str(raw["id"]), tuple(str(a) for a in raw.get("aliases") or []),
                    str(raw.get("summary") or raw.get("details", "")).strip().splitlines()[0][:200]
                    if (raw.get("summary") or raw.get("details")) else "", sev, score, tuple(fixed),
                    refs[0] if refs else f"https://osv.dev/vulnerability/{raw['id']}")


# --- sources ------------------------------------------------------------------------------------
class Source(Protocol):
    name: str

    def query(self, packages: Sequence[Key]) -> dict[Key, list[Advisory] | None]:
        """Advisories per package; None for a package this source could not answer for."""
        ...


class OsvDir:
    """An offline OSV snapshot (OSV's PyPI export: <ID>.json files, or all.zip)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = f"offline OSV snapshot {path}"
        self._by_name: dict[str, list[dict[str, Any]]] | None = None
        self.newest = ""  # the newest `modified` of any advisory in it

    def _documents(self) -> Iterable[bytes]:
        zips = [p for p in (self.path / "all.zip", self.path / "PyPI" / "all.zip", self.path) if p.is_file()]
        if zips:
            with zipfile.ZipFile(zips[0]) as zf:
                for n in zf.namelist():
                    if n.endswith(".json"):
                        yield zf.read(n)
            return
        if not self.path.is_dir():
            raise Unavailable(f"{self.path}: no such folder (PTMG_OSV_DIR / --osv-dir)")
        for p in sorted(self.path.rglob("*.json")):
            yield p.read_bytes()

    def index(self) -> dict[str, list[dict[str, Any]]]:
        if self._by_name is None:
            by: dict[str, list[dict[str, Any]]] = {}
            count = 0
            for doc in self._documents():
                try:
                    raw = json.loads(doc)
                except ValueError:
                    continue
                if not isinstance(raw, dict) or "id" not in raw or raw.get("withdrawn"):
                    continue
                count += 1
                self.newest = max(self.newest, str(raw.get("modified", "")))
                for aff in raw.get("affected") or []:
                    pkg = aff.get("package") or {}
                    if pkg.get("ecosystem") == "PyPI":
                        by.setdefault(canonicalize_name(str(pkg.get("name", ""))), []).append(raw)
            if count == 0:
                raise Unavailable(f"{self.path}: no OSV advisories in it (expected <ID>.json files or all.zip)")
            self._by_name = by
        return self._by_name

    def query(self, packages: Sequence[Key]) -> dict[Key, list[Advisory] | None]:
        idx = self.index()
        out: dict[Key, list[Advisory] | None] = {}
        for name, version in packages:
            found: list[Advisory] = []
            for raw in idx.get(name, []):
                hit, fixed = affects(raw, name, version)
                if hit and not any(a.id == raw["id"] for a in found):
                    found.append(advisory(raw, name, fixed))
            out[(name, version)] = found
        return out


Fetch = Callable[[str, bytes | None], Any]  # (url, JSON body to POST or None) -> parsed JSON; raises OSError


class OsvApi:
    name = "OSV API (api.osv.dev)"

    def __init__(self, fetch: Fetch) -> None:
        self.fetch = fetch
        self.down = ""  # why it did not answer: asked once per run, not once per cell

    def query(self, packages: Sequence[Key]) -> dict[Key, list[Advisory] | None]:
        if self.down:
            raise Unavailable(self.down)
        body = {"queries": [{"package": {"name": n, "ecosystem": "PyPI"}, "version": v} for n, v in packages]}
        try:
            results = self.fetch(f"{OSV_API}/querybatch", json.dumps(body).encode())["results"]
            out: dict[Key, list[Advisory] | None] = {}
            cache: dict[str, Any] = {}
            for key, res in zip(packages, results, strict=True):
                found = []
                for vuln in res.get("vulns") or []:
                    raw = cache.get(vuln["id"]) or self.fetch(f"{OSV_API}/vulns/{vuln['id']}", None)
                    cache[vuln["id"]] = raw
                    _hit, fixed = affects(raw, *key)  # OSV said it affects this version; the fixes
                    found.append(advisory(raw, key[0], fixed))
                out[key] = found
            return out
        except (OSError, KeyError, TypeError, ValueError) as exc:
            self.down = f"{self.name}: {type(exc).__name__}: {exc}"
            raise Unavailable(self.down) from None


class PypiJson:
    name = "PyPI JSON API (per release)"
    #: This many failures in a row before any answer: the source is down (or, like behind some
    #: proxies, answers 404 for every release), not merely missing a release.
    GIVE_UP = 5

    def __init__(self, fetch: Fetch) -> None:
        self.fetch = fetch
        self.down = ""

    def query(self, packages: Sequence[Key]) -> dict[Key, list[Advisory] | None]:
        if self.down:
            raise Unavailable(self.down)
        out: dict[Key, list[Advisory] | None] = {}
        answered = 0
        for i, (name, version) in enumerate(packages):
            url = f"{PYPI_JSON}/{name}/{version}/json"
            try:
                data = self.fetch(url, None)
            except OSError as exc:
                out[(name, version)] = None  # 404 (also: a release only a PyTorch index has) or unreachable
                if not answered and i + 1 >= self.GIVE_UP:
                    self.down = f"{self.name}: no answer for {i + 1} releases in a row (last: {url}: {exc})"
                    raise Unavailable(self.down) from None
                continue
            answered += 1
            out[(name, version)] = [Advisory(str(v["id"]), tuple(v.get("aliases") or []),
                                             str(v.get("summary") or v.get("details") or "")[:200], "unrated", None,
                                             tuple(v.get("fixed_in") or []), str(v.get("link") or ""))
                                    for v in data.get("vulnerabilities") or [] if not v.get("withdrawn")]
        if packages and not answered:
            raise Unavailable(f"{self.name}: no answer for any release (e.g. {PYPI_JSON}/{packages[0][0]}/"
                              f"{packages[0][1]}/json)")
        return out


def query_all(sources: Sequence[Source], packages: Sequence[Key]) -> tuple[dict[Key, list[Advisory] | None],
                                                                           dict[Key, str], list[str]]:
    """Each package from the first source that answers for it: (advisories or None, which source, problems)."""
    result: dict[Key, list[Advisory] | None] = dict.fromkeys(packages)
    by: dict[Key, str] = {}
    problems: list[str] = []
    todo = list(packages)
    for src in sources:
        if not todo:
            break
        try:
            got = src.query(todo)
        except Unavailable as exc:
            problems.append(str(exc))
            continue
        for key, advisories in got.items():
            if advisories is not None:
                result[key], by[key] = advisories, src.name
        todo = [k for k in todo if k not in by]
    return result, by, problems
