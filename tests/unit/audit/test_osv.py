"""The vulnerability gate, against the small OSV snapshot in tests/fixtures/osv: matching (OSV
ranges), severity (CVSS v3), the policy (fail_on, allowlist with reason and expiry, unused entries),
"unknown" when no source answers (never a pass), images.yaml's audit.python validated with
locations, and publish refusing a cell whose lock pins a known-vulnerable release."""

from __future__ import annotations

import datetime as dt
import json
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from builder.audit import osv, python
from builder.audit.osv import Advisory, Key, OsvDir, Unavailable
from builder.audit.report import FAILED, FINDINGS, OK
from builder.audit.report import Target as AuditTarget
from builder.common.yamlpos import ProblemsError
from builder.lock import model
from builder.lock.model import CellLock, Package, Wheel
from builder.lock.target import Target
from builder.matrix import Matrix
from builder.matrix.policy import AllowEntry, PythonPolicy
from builder.publish import vulns
from tests.support import ROOT, SEED_MATRIX, small_matrix

FIXTURE = ROOT / "tests" / "fixtures" / "osv"
TODAY = dt.date(2026, 12, 1)
VULNERABLE: list[Key] = [("idna", "3.6"), ("urllib3", "2.2.1"), ("pip", "23.0.1"), ("six", "1.17.0")]


def settings(policy: PythonPolicy | None = None, sources: Sequence[osv.Source] | None = None) -> python.Settings:
    return python.Settings(ROOT, policy or PythonPolicy(), tuple(sources or (OsvDir(FIXTURE),)), TODAY)


# --- OSV --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("vector", "score"), [
    ("CVSS:3.1/AV:N/AC:L/PR:N/UI:N/S:U/C:H/I:H/A:H", 9.8), ("CVSS:3.1/AV:L/AC:L/PR:N/UI:N/S:U/C:N/I:N/A:H", 6.2),
    ("CVSS:3.1/AV:N/AC:H/PR:H/UI:N/S:U/C:H/I:N/A:N", 4.4), ("CVSS:3.1/AV:N/AC:L/PR:N/UI:R/S:C/C:L/I:L/A:N", 6.1),
    ("CVSS:3.0/AV:N/AC:L/PR:L/UI:N/S:C/C:H/I:H/A:H", 9.9), ("CVSS:3.1/AV:N/AC:L/PR:N/UI:N/S:U/C:N/I:N/A:N", 0.0),
    ("CVSS:3.1/AV:N/AC:L/PR:N/UI:N/S:C/C:H/I:H/A:H", 10.0),  # a changed scope's score is capped at 10 too
    # each weight of the specification moves at least one of these scores: privileges Low (0.62 with
    # the scope unchanged, 0.68 changed) and High (0.27, 0.50), each attack vector and complexity,
    # user interaction, Low impacts, and the changed scope's impact curve
    ("CVSS:3.1/AV:N/AC:L/PR:L/UI:N/S:U/C:H/I:H/A:H", 8.8), ("CVSS:3.1/AV:N/AC:L/PR:H/UI:N/S:C/C:H/I:H/A:H", 9.1),
    ("CVSS:3.1/AV:N/AC:L/PR:H/UI:N/S:U/C:H/I:H/A:L", 6.7), ("CVSS:3.1/AV:P/AC:L/PR:L/UI:N/S:C/C:H/I:H/A:N", 7.1),
    ("CVSS:3.1/AV:A/AC:L/PR:N/UI:N/S:U/C:H/I:H/A:H", 8.8), ("CVSS:3.1/AV:P/AC:L/PR:N/UI:N/S:U/C:H/I:H/A:H", 6.8),
    ("CVSS:3.1/AV:N/AC:L/PR:N/UI:R/S:U/C:H/I:H/A:H", 8.8), ("CVSS:3.1/AV:N/AC:L/PR:N/UI:N/S:U/C:L/I:N/A:N", 5.3),
    ("CVSS:3.1/AV:N/AC:L/PR:N/UI:N/S:U/C:L/I:L/A:L", 7.3), ("CVSS:3.1/AV:N/AC:L/PR:L/UI:R/S:C/C:L/I:L/A:N", 5.4),
    ("CVSS:3.1/AV:N/AC:L/PR:H/UI:R/S:C/C:L/I:L/A:N", 4.8), ("CVSS:3.1/AV:A/AC:H/PR:H/UI:R/S:C/C:H/I:H/A:L", 7.2),
    ("CVSS:3.1/AV:N/AC:H/PR:L/UI:N/S:U/C:H/I:H/A:H", 7.5),
    # Roundup at its edges: 5.50032 goes up to 5.6, 8.19958 to 8.2 (not 8.3)
    ("CVSS:3.1/AV:L/AC:L/PR:H/UI:N/S:U/C:H/I:L/A:L", 5.6), ("CVSS:3.1/AV:L/AC:L/PR:N/UI:R/S:C/C:H/I:H/A:N", 8.2),
])
def test_cvss3_base_scores(vector: str, score: float) -> None:
    assert osv.cvss3_score(vector) == score


@pytest.mark.parametrize(("raw", "up"), [
    (4.02, 4.1), (4.0, 4.0), (4.0999, 4.1), (4.00004, 4.1),
    (4.000000000000001, 4.0),  # the float error the specification's Roundup is written to absorb
    (4.000004, 4.0),  # it rounds to 5 decimals first
])
def test_cvss3_roundup_is_the_specifications(raw: float, up: float) -> None:
    assert osv._roundup(raw) == up


@pytest.mark.parametrize("vector", [
    "CVSS:3.1/AV:N/AC:L/PR:N/UI:N/S:U/C:H/I:H",  # a metric missing
    "CVSS:3.1/AV:X/AC:L/PR:N/UI:N/S:U/C:H/I:H/A:H",  # a value the metric does not have
    "CVSS:3.1/AV:N/AC:L/PR:N/UI:N/S:U/C:H/I:H/A:H/garbage",  # a part that is no metric
    "", "not a vector",
])
def test_a_malformed_cvss3_vector_has_no_score(vector: str) -> None:
    assert osv.cvss3_score(vector) is None
    raw = {"severity": [{"type": "CVSS_V3", "score": vector}], "database_specific": {"severity": "MODERATE"}}
    assert osv.severity_of(raw) == ("medium", None)  # the advisory's own word then


@pytest.mark.parametrize(("score", "word"), [
    (10.0, "critical"), (9.0, "critical"), (8.9, "high"), (7.0, "high"), (6.9, "medium"), (4.0, "medium"),
    (3.9, "low"), (0.5, "low"), (0.1, "low"), (0.0, "unrated"),
])
def test_cvss_ratings_at_their_boundaries(score: float, word: str) -> None:
    assert osv.rating(score) == word


@pytest.mark.parametrize(("name", "version", "ids"), [
    ("idna", "3.6", ["GHSA-jjg7-2v4v-x38h"]), ("idna", "3.7", []), ("idna", "3.20", []),
    ("urllib3", "1.26.18", ["GHSA-34jh-p97f-mpxf"]), ("urllib3", "1.26.19", []), ("urllib3", "2.0.0",
                                                                                   ["GHSA-34jh-p97f-mpxf"]),
    ("urllib3", "2.2.2", []), ("pip", "23.0.1", ["PYSEC-2023-228"]), ("pip", "26.3", []),
    ("six", "1.16.0", ["GHSA-q5q7-8x6x-hcg2"]), ("six", "1.17.0", []), ("six", "1.9.0", []),
])
def test_osv_ranges_match_like_the_schema_says(name: str, version: str, ids: list[str]) -> None:
    got = OsvDir(FIXTURE).query([(name, version)])[(name, version)]
    assert [a.id for a in got or []] == ids  # the withdrawn one and the npm one never match


def _advisory(osv_id: str, *affected: dict[str, Any], summary: str = "a flaw") -> dict[str, Any]:
    return {"id": osv_id, "modified": "2026-01-01T00:00:00Z", "summary": summary, "affected": list(affected)}


def _pypi(name: str, ecosystem: str = "PyPI") -> dict[str, Any]:
    return {"package": {"ecosystem": ecosystem, "name": name},
            "ranges": [{"type": "ECOSYSTEM", "events": [{"introduced": "0"}, {"fixed": "2.0"}]}]}


def test_an_advisory_counts_once_and_only_for_its_pypi_package(tmp_path: Path) -> None:
    """Listed twice for one package (two ranges entries) it is one finding; another ecosystem's
    package of the same name (npm's `six`) is not this package; a broken file does not hide the rest."""
    (tmp_path / "0-broken.json").write_text("{not json")
    (tmp_path / "GHSA-twice.json").write_text(json.dumps(_advisory("GHSA-twice", _pypi("six"), _pypi("six"))))
    (tmp_path / "GHSA-npm.json").write_text(json.dumps(_advisory("GHSA-npm", _pypi("six", "npm"), _pypi("idna"))))
    fixed_long_ago = {"package": {"ecosystem": "PyPI", "name": "urllib3"},
                      "ranges": [{"type": "ECOSYSTEM", "events": [{"introduced": "0"}, {"fixed": "0.5"}]}]}
    (tmp_path / "GHSA-npm2.json").write_text(json.dumps(_advisory("GHSA-npm2", fixed_long_ago, _pypi("urllib3", "npm"))))
    got = OsvDir(tmp_path).query([("six", "1.0"), ("idna", "1.0"), ("six", "2.0"), ("urllib3", "1.0")])
    assert [a.id for a in got[("six", "1.0")] or []] == ["GHSA-twice"]
    assert [a.id for a in got[("idna", "1.0")] or []] == ["GHSA-npm"]
    assert got[("six", "2.0")] == []
    assert got[("urllib3", "1.0")] == [], "npm's urllib3 range is not PyPI's"


def _ranged(*events: dict[str, str], kind: str = "ECOSYSTEM", versions: Sequence[str] = ()) -> dict[str, Any]:
    return _advisory("GHSA-r", {"package": {"ecosystem": "PyPI", "name": "six"}, "versions": list(versions),
                                "ranges": [{"type": kind, "events": list(events)}]})


@pytest.mark.parametrize(("events", "hits", "misses"), [
    # introduced is inclusive, fixed exclusive, last_affected inclusive; a pre-release is before its release
    ([{"introduced": "1.0"}, {"fixed": "2.0"}], ["1.0", "1.9.9", "2.0rc1"], ["0.9", "2.0", "2.0.post1"]),
    ([{"introduced": "1.0"}, {"last_affected": "1.5"}], ["1.0", "1.5"], ["0.9", "1.5.1", "1.6"]),
    ([{"introduced": "0"}, {"fixed": "1.0"}, {"introduced": "2.0"}, {"fixed": "3.0"}],
     ["0.1", "2.0", "2.9"], ["1.0", "1.5", "3.0"]),
    ([{"introduced": "1.0"}], ["1.0", "99"], ["0.9"]),
    ([{"introduced": "0"}, {"fixed": "not a version"}], ["1.0"], []),  # an event it cannot read is left out
])
def test_osv_range_boundaries(events: list[dict[str, str]], hits: list[str], misses: list[str]) -> None:
    raw = _ranged(*events)
    assert [v for v in hits + misses if osv.affects(raw, "six", v)[0]] == hits


def test_listed_versions_match_exactly_and_a_git_range_is_not_a_version_range() -> None:
    listed = _ranged(versions=["1.0", "weird-build"], kind="GIT")
    assert osv.affects(listed, "six", "1.0") == (True, ())
    assert osv.affects(listed, "six", "weird-build") == (True, ())  # not PEP 440, but listed
    assert osv.affects(listed, "six", "1.0.1")[0] is False
    git = _ranged({"introduced": "0"}, {"fixed": "2.0"}, kind="GIT")  # commit hashes, not versions
    assert osv.affects(git, "six", "1.0") == (False, ())
    ranged = _ranged({"introduced": "0"}, {"fixed": "2.0"})
    assert osv.affects(ranged, "six", "weird-build") == (False, ())  # cannot be placed in a range


def test_a_snapshot_document_without_an_id_is_not_an_advisory(tmp_path: Path) -> None:
    raw = _advisory("GHSA-x", _pypi("six"))
    del raw["id"]
    (tmp_path / "GHSA-x.json").write_text(json.dumps(raw))
    with pytest.raises(Unavailable, match="no OSV advisories"):
        OsvDir(tmp_path).query([("six", "1.0")])


def test_an_advisory_summary_is_one_line_of_at_most_200_characters() -> None:
    raw = _advisory("GHSA-long", _pypi("six"), summary="x" * 300 + "\nsecond line")
    assert osv.advisory(raw, "six", ("2.0",)).summary == "x" * 200
    assert osv.advisory({**raw, "summary": "short\nmore"}, "six", ()).summary == "short"


def test_the_export_zip_reads_the_same(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "all.zip", "w") as zf:
        for p in FIXTURE.glob("*.json"):
            zf.write(p, p.name)
    src = OsvDir(tmp_path)
    assert [a.id for a in src.query([("idna", "3.6")])[("idna", "3.6")] or []] == ["GHSA-jjg7-2v4v-x38h"]
    assert src.newest.startswith("2025-")


def test_an_empty_or_missing_snapshot_does_not_answer(tmp_path: Path) -> None:
    for path in (tmp_path, tmp_path / "missing"):
        with pytest.raises(Unavailable):
            OsvDir(path).query([("idna", "3.6")])


# --- the verdicts ---------------------------------------------------------------------------------
def test_known_vulnerable_releases_are_refused_by_default() -> None:
    r = python.audit_packages("cell", VULNERABLE, settings())
    assert r.status == FINDINGS
    got = {(f["package"], f["advisory"], f["severity"], f["verdict"]) for f in r.findings}
    assert got == {("idna", "GHSA-jjg7-2v4v-x38h", "medium (6.2)", "refused"),
                   ("urllib3", "GHSA-34jh-p97f-mpxf", "medium (4.4)", "refused"),
                   ("pip", "PYSEC-2023-228", "unrated", "refused")}
    reason = python.gate_reason(r)
    assert reason is not None and reason.startswith("3 known vulnerability(ies)") and "idna 3.6" in reason
    assert "build.py lock --upgrade-package" in reason and "audit.python.allow" in reason


def test_fail_on_high_lets_medium_pass_but_never_unrated() -> None:
    r = python.audit_packages("cell", VULNERABLE, settings(PythonPolicy("high")))
    verdicts = {f["package"]: f["verdict"] for f in r.findings}
    assert verdicts == {"idna": "below fail_on", "urllib3": "below fail_on", "pip": "refused"}
    r = python.audit_packages("cell", VULNERABLE[:2], settings(PythonPolicy("high")))
    assert r.status == OK and len(r.findings) == 2  # still reported


def test_a_finding_at_the_fail_on_level_is_refused() -> None:
    r = python.audit_packages("cell", VULNERABLE[:2], settings(PythonPolicy("medium")))
    assert {f["package"]: f["verdict"] for f in r.findings} == {"idna": "refused", "urllib3": "refused"}
    assert r.status == FINDINGS


def test_an_allowlist_entry_holds_through_its_last_day() -> None:
    entry = AllowEntry("GHSA-jjg7-2v4v-x38h", "waiting for a fix", TODAY, "idna", where="images.yaml:40:9")
    r = python.audit_packages("cell", [("idna", "3.6")], settings(PythonPolicy("any", (entry,))))
    assert r.status == OK and r.findings[0]["verdict"] == f"allowed until {TODAY}: waiting for a fix"


def test_a_cell_without_a_lock_or_an_image_without_a_cell_is_unknown(tmp_path: Path) -> None:
    s = python.Settings(tmp_path, PythonPolicy(), (OsvDir(FIXTURE),), TODAY)
    no_lock, no_cell = python.audit_locks([AuditTarget("pt:a", "no-such-cell"), AuditTarget("some/image:1")], s)
    for audit, who in ((no_lock, "no-such-cell"), (no_cell, "some/image:1")):
        result = audit.sections[python.SECTION]
        assert result.status == FAILED and result.facts == {python.UNKNOWN: "yes"}
        assert result.error is not None and result.error.startswith(f"no lock for {who} (")


def test_an_allowlisted_vulnerability_passes_with_its_reason() -> None:
    entry = AllowEntry("CVE-2024-3651", "no fixed idna for this cell yet", dt.date(2027, 1, 31), "idna",
                       where="images.yaml:40:9")
    s = settings(PythonPolicy("any", (entry,)))
    r = python.audit_packages("2.0.1-cuda11.7-cudnn8-runtime", [("idna", "3.6")], s)
    assert r.status == OK and python.gate_reason(r) is None
    assert r.findings[0]["verdict"] == "allowed until 2027-01-31: no fixed idna for this cell yet"
    assert r.notes and "idna GHSA-jjg7-2v4v-x38h" in r.notes[0]
    assert python.unused_allow_entries(s.policy, s.used) == []


def test_an_expired_entry_is_an_error_and_an_unused_one_a_warning() -> None:
    expired = AllowEntry("GHSA-jjg7-2v4v-x38h", "waiting for a fix", dt.date(2026, 11, 30), where="images.yaml:41:9")
    unused = AllowEntry("GHSA-aaaa-bbbb-cccc", "old", dt.date(2027, 1, 1), where="images.yaml:46:9")
    other_cell = AllowEntry("PYSEC-2023-228", "pip", dt.date(2027, 1, 1), cells=("2.0.1-*",), where="images.yaml:51:9")
    s = settings(PythonPolicy("any", (expired, unused, other_cell)))
    r = python.audit_packages("2.7.0-cuda12.6-cudnn9-runtime", VULNERABLE, s)
    assert r.status == FAILED
    assert "images.yaml:41:9: audit.python.allow entry GHSA-jjg7-2v4v-x38h expired on 2026-11-30" in r.error
    assert next(f for f in r.findings if f["package"] == "pip")["verdict"] == "refused"  # not this cell's entry
    warnings = python.unused_allow_entries(s.policy, s.used)
    assert any(w.startswith("images.yaml:46:9: audit.python.allow entry GHSA-aaaa-bbbb-cccc matches nothing")
               for w in warnings)
    assert any("images.yaml:51:9" in w for w in warnings)


class Down:
    name = "OSV API (api.osv.dev)"

    def query(self, packages: Sequence[Key]) -> dict[Key, list[Advisory] | None]:
        raise Unavailable("OSV API (api.osv.dev): URLError: [Errno -3] Temporary failure in name resolution")


class Partial:
    name = "PyPI JSON API (per release)"

    def query(self, packages: Sequence[Key]) -> dict[Key, list[Advisory] | None]:
        return {k: ([] if k[0] == "idna" else None) for k in packages}


def test_no_source_answering_is_unknown_never_a_pass() -> None:
    r = python.audit_packages("cell", VULNERABLE, settings(sources=[Down()]))
    assert r.status == FAILED and r.facts[python.UNKNOWN] == "yes"
    assert r.error.startswith("UNKNOWN: no advisory source answered for 4 of 4") and "PTMG_OSV_DIR" in r.error
    assert "Temporary failure in name resolution" in r.error
    part = python.audit_packages("cell", VULNERABLE, settings(sources=[Down(), Partial()]))
    assert part.status == FAILED and "for 3 of 4" in part.error  # idna answered, the rest did not


def test_live_sources_parse_osv_and_pypi_answers() -> None:
    raw = (FIXTURE / "GHSA-jjg7-2v4v-x38h.json").read_text()
    calls: list[str] = []

    def fetch(url: str, body: bytes | None) -> Any:
        import json

        calls.append(url)
        if url.endswith("/querybatch"):
            return {"results": [{"vulns": [{"id": "GHSA-jjg7-2v4v-x38h"}]}, {}]}
        if "/vulns/" in url:
            return json.loads(raw)
        if url.endswith("/idna/3.6/json"):
            return {"vulnerabilities": [{"id": "PYSEC-2024-60", "aliases": ["CVE-2024-3651"], "fixed_in": ["3.7"]}]}
        raise OSError("HTTP Error 404: Not Found")

    got = osv.OsvApi(fetch).query([("idna", "3.6"), ("six", "1.17.0")])
    assert [a.severity for a in got[("idna", "3.6")] or []] == ["medium"] and got[("six", "1.17.0")] == []
    pypi = osv.PypiJson(fetch).query([("idna", "3.6"), ("six", "1.17.0")])
    assert [a.id for a in pypi[("idna", "3.6")] or []] == ["PYSEC-2024-60"] and pypi[("six", "1.17.0")] is None


# --- images.yaml ----------------------------------------------------------------------------------
def test_audit_python_policy_is_read_with_locations(tmp_path: Path) -> None:
    m = small_matrix(tmp_path, SEED_MATRIX + "audit:\n  python:\n    fail_on: high\n    allow:\n"
                     "      - id: CVE-2024-3651\n        package: IDNA\n        reason: no fix yet\n"
                     "        expires: 2027-01-31\n")
    (entry,) = m.audit.python.allow
    assert m.audit.python.fail_on == "high" and entry.package == "idna" and entry.expires == dt.date(2027, 1, 31)
    assert entry.where.endswith("images.yaml:30:9")  # the entry, for messages long after validation


@pytest.mark.parametrize(("text", "message"), [
    ("    fail_on: severe\n", "audit.python.fail_on must be one of any, low, medium, high, critical"),
    ("    allow:\n      - id: CVE-2024-3651\n        expires: 2027-01-31\n", "reason must say why"),
    ("    allow:\n      - {id: bad id, reason: x, expires: 2027-01-31}\n", "id must be an advisory id"),
    ("    allow:\n      - {id: CVE-2024-3651, reason: x, expires: soon}\n", "expires must be a date, YYYY-MM-DD"),
    ("    allow:\n      - {id: CVE-2024-3651, reason: x, expires: 2027-01-31, until: x}\n", "unknown key 'until'"),
])
def test_audit_python_policy_errors_are_located(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ProblemsError) as exc:
        small_matrix(tmp_path, SEED_MATRIX + "audit:\n  python:\n" + text)
    (line,) = [x for x in exc.value.lines if message in x]
    assert "images.yaml:" in line.split(" ")[0] or ":2" in line, line


# --- publish ------------------------------------------------------------------------------------
def _vulnerable_lock(root: Path, cell: str, pins: Sequence[Key]) -> None:
    pkgs = tuple(Package(n, v, "tools", Wheel(f"{n}-{v}-py3-none-any.whl", "u", 1, "0" * 64)) for n, v in pins)
    path = model.lock_path(root, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(model.dumps(CellLock(cell, Target("3.11", "x86_64-manylinux_2_36", "i"), {}, pkgs)))


@pytest.fixture
def matrix(tmp_path: Path) -> Matrix:
    return small_matrix(tmp_path / "matrix")


def test_publish_refuses_the_vulnerable_lock_and_passes_the_allowlisted_one(matrix: Matrix, tmp_path: Path) -> None:
    from tests.unit.publish.test_freshness import _run
    from tests.unit.publish.test_publisher import IMG_A, A, B, World

    _vulnerable_lock(tmp_path, A, [("idna", "3.6"), ("torch", "2.7.0")])  # 2.7.0: pins a vulnerable idna
    _vulnerable_lock(tmp_path, B, [("idna", "3.20"), ("torch", "2.14.1")])
    results: dict[str, Any] = {}
    s = settings()
    w = World(matrix)
    report = _run(w, os_gate=vulns.python_gate(w.engine, s, [tmp_path], False, results))  # type: ignore[arg-type]
    a = next(c for c in report.cells if c.cell == A)
    assert not report.ok and "refused: 1 known vulnerability(ies) in its Python distributions: idna 3.6 " \
        "GHSA-jjg7-2v4v-x38h (medium (6.2))" in a.error
    assert all(not ref.endswith(A) and IMG_A not in ref for ref, _ in w.engine.pushes)
    assert results[B].status == OK

    allowed = python.Settings(ROOT, PythonPolicy("any", (AllowEntry("GHSA-jjg7-2v4v-x38h", "waiting for 3.7 in the "
                              "torch index", dt.date(2027, 1, 31), "idna", where="images.yaml:30:9"),)),
                              (OsvDir(FIXTURE),), TODAY)
    w2 = World(matrix)
    report2 = _run(w2, os_gate=vulns.python_gate(w2.engine, allowed, [tmp_path], False, {}))  # type: ignore[arg-type]
    assert report2.ok, [c.error for c in report2.cells]


def test_publish_refuses_unknown_unless_told_and_then_says_so(matrix: Matrix, tmp_path: Path) -> None:
    from tests.unit.publish.test_freshness import _run
    from tests.unit.publish.test_publisher import A, B, World

    for cell in (A, B):
        _vulnerable_lock(tmp_path, cell, [("idna", "3.20")])
    w = World(matrix)
    report = _run(w, os_gate=vulns.python_gate(w.engine, settings(sources=[Down()]), [tmp_path], False, {}))  # type: ignore[arg-type]
    assert not report.ok and all("the Python vulnerability audit failed: UNKNOWN" in c.error for c in report.cells)
    results: dict[str, Any] = {}
    w2 = World(matrix)
    report2 = _run(w2, os_gate=vulns.python_gate(w2.engine, settings(sources=[Down()]), [tmp_path], True,  # type: ignore[arg-type]
                                                 results))
    assert report2.ok and all("published with --allow-unknown-vulns" in r.notes[0] for r in results.values())


def test_combined_gates_give_every_reason() -> None:
    gate = vulns.combine(lambda *_: "2 Debian security update(s) pending", None, lambda *_: "1 known vulnerability")
    assert gate is not None and gate(None, "", {}) == "2 Debian security update(s) pending; and 1 known vulnerability"  # type: ignore[arg-type]
    assert vulns.combine(None, None) is None


def test_audit_verb_on_a_known_vulnerable_lock_and_its_allowlisting(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import builder.cli.main as cli

    matrix = 'repository: pt-multi-gpu\ninclude:\n  - {torch: "2.7.0", pip: [idna==3.6]}\n'
    config = tmp_path / "images.yaml"
    config.write_text(matrix)
    (cell,) = small_matrix(tmp_path / "copy", matrix).cells
    _vulnerable_lock(tmp_path, cell.name, [("idna", "3.6"), ("torch", "2.7.0")])
    args = ["audit", "--section", "python", "--config", str(config), "--osv-dir", str(FIXTURE), "--json"]
    assert cli.main(args) == 1
    found = json.loads(capsys.readouterr().out)["images"][0]["sections"]["python"]
    assert found["status"] == FINDINGS and found["findings"][0]["advisory"] == "GHSA-jjg7-2v4v-x38h"
    config.write_text(matrix + "audit:\n  python:\n    allow:\n      - id: CVE-2024-3651\n        package: idna\n"
                      "        reason: the cu118 index has no idna 3.7 yet\n        expires: 2099-12-31\n")
    assert cli.main(args) == 0
    allowed = json.loads(capsys.readouterr().out)["images"][0]["sections"]["python"]
    assert allowed["status"] == OK and allowed["findings"][0]["verdict"].startswith("allowed until 2099-12-31")
