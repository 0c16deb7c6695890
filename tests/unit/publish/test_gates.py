"""Each publish gate stops a publish, end to end: `build.py publish` through the real verb
(builder/cli/verbs/publish.py: its gates, as it wires them) against a fake engine (the image, its
labels, apt's answer in the image) and a fake registry (requests.Session). One cell, and one
thing wrong with it at a time: known vulnerabilities in its lock (also with --allow-unknown-vulns,
also allowlisted for another package), Debian security updates pending on an old OS layer, a Debian
audit that could not run, and images.yaml's own max_pending_days. Each refusal has its control: the
same run with that one thing right publishes. Then the verb's other decisions: a cell the registry
already holds (same recipe and packages) is skipped unless --publish-unchanged, a floating tag that
cannot be read is published over with a warning, each waiver is announced, and the exit status and
stdout with and without --dry-run and --json."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

import ptmg_contract as contract
from builder.engine.model import RunResult
from builder.smoke import passes
from tests.support import SEED_MATRIX, write_matrix
from tests.unit.audit.test_osv import _vulnerable_lock
from tests.unit.publish.test_client_auth import FakeResponse, FakeSession
from tests.unit.publish.test_faults import _digest, _err, _manifest
from tests.unit.publish.test_publisher import FLOAT_A, IMG_A, TAGS_A, A, FakeEngine, FakeRegistry

CLEAN = [("idna", "3.20")]
VULNERABLE = [("idna", "3.6")]  # GHSA-jjg7-2v4v-x38h (alias CVE-2024-3651) in tests/fixtures/osv
ADVISORY = "GHSA-jjg7-2v4v-x38h"

APT_UPDATED = "PTMG-AUDIT release bookworm\nHit:1 http://deb.debian.org/debian bookworm InRelease\n" \
              "PTMG-AUDIT update-exit 0\n"
APT_NOTHING = APT_UPDATED + "0 upgraded, 0 newly installed, 0 to remove and 0 not upgraded.\nPTMG-AUDIT simulate-exit 0\n"
APT_PENDING = APT_UPDATED + ("Inst libssl3 [3.0.20-1~deb12u2] (3.0.22-1~deb12u2 Debian-Security:12/oldstable-security "
                             "[amd64])\nPTMG-AUDIT simulate-exit 0\n")
APT_FAILED = ("PTMG-AUDIT release bookworm\nErr:1 http://deb.debian.org/debian-security bookworm-security InRelease\n"
              "  Could not connect to deb.debian.org:80\nPTMG-AUDIT update-exit 100\nPTMG-AUDIT simulate-exit 0\n")


class GateEngine(FakeEngine):
    """The publish fakes' engine, plus what the Debian audit asks of it: the image by its id, and
    `apt-get update` + `apt-get -s dist-upgrade` in a container of it (scripted output)."""

    def __init__(self, registry: FakeRegistry, apt: str) -> None:
        super().__init__(registry)
        self.apt = apt
        self.sbom = ""
        self.audits = 0

    def image_attrs(self, ref: str) -> dict[str, Any] | None:
        return self.images.get(ref) or next((a for a in self.images.values() if a["Id"] == ref), None)

    def run(self, image: str, command: Sequence[str], **kw: Any) -> RunResult:
        assert image == IMG_A, image
        if kw.get("entrypoint") == ["/bin/cat"] and list(command) == [contract.SBOM_FILE]:
            return RunResult(0, self.sbom) if self.sbom else RunResult(1, f"cat: {contract.SBOM_FILE}: No such file")
        assert kw.get("user") == "0", kw
        self.audits += 1
        return RunResult(0, self.apt)

    def cleanup_session(self) -> None:
        pass


@dataclass(frozen=True)
class Case:
    pins: tuple[tuple[str, str], ...] = tuple(CLEAN)
    os_age_days: float = 3.0  # how long ago the image's OS layer was brought up to date
    apt: str = APT_NOTHING
    audit_yaml: str = ""  # images.yaml's audit: key
    flags: tuple[str, ...] = ()
    sbom: tuple[tuple[str, str], ...] | None = None  # the Python distributions the image's SBOM lists
    #: the cell's floating tag in the registry: "" absent, "same" (an image with this one's recipe and
    #: packages), "unreadable" (its manifest is there, its config blob is not)
    remote: str = ""
    tested: bool = True  # the image has a recorded smoke-test pass


@dataclass
class Outcome:
    rc: int
    engine: GateEngine
    error: str
    report_dir: Path


IDENTITY = {contract.LABEL_RECIPE_HASH: "r" * 64, contract.LABEL_OS_PACKAGES: "o" * 64,
            contract.LABEL_VENV_PACKAGES: "v" * 64}


def sbom_text(packages: Sequence[tuple[str, str]]) -> str:
    return json.dumps({"bomFormat": "CycloneDX", "specVersion": "1.5", "components": [
        {"type": "library", "name": n, "version": v, "purl": f"pkg:pypi/{n}@{v}"} for n, v in packages] + [
        {"type": "library", "name": "libssl3", "version": "3.0.20-1~deb12u2", "purl": "pkg:deb/debian/libssl3"}]})


def publish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: Case) -> Outcome:
    """`build.py publish --only A` through builder.cli.main, against the fakes (the cell's error: ""
    when it has none, or when a dry run wrote no report)."""
    import builder.cli.main as cli

    registry = FakeRegistry()
    engine = GateEngine(registry, case.apt)
    engine.add(f"pt-multi-gpu:{A}", IMG_A, A)
    updated = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=case.os_age_days)
    engine.images[f"pt-multi-gpu:{A}"]["Config"]["Labels"].update({
        contract.LABEL_OS_UPDATED: updated.strftime("%Y-%m-%dT%H:%M:%SZ"),
        contract.LABEL_OS_SUITES: "bookworm@2026-07-11T10:16:37Z bookworm-security@2026-11-29T00:53:13Z",
        **IDENTITY})
    blobs: dict[str, bytes] = {}
    if case.remote:  # an earlier publish of the same recipe and packages, under the cell's floating tag
        blob = json.dumps({"config": {"Labels": {**IDENTITY, contract.LABEL_OS_UPDATED: "2026-11-01T00:00:00Z"}}})
        registry.tags[A] = ("", _digest(blob.encode()))
        if case.remote == "same":
            blobs[_digest(blob.encode())] = blob.encode()
    if case.sbom is not None:
        engine.sbom = sbom_text(case.sbom)
        engine.images[f"pt-multi-gpu:{A}"]["Config"]["Labels"][contract.LABEL_SBOM] = contract.SBOM_FILE

    def answer(url: str, params: dict[str, str], headers: dict[str, str]) -> FakeResponse:
        if "/blobs/" in url:
            held = blobs.get(url.rpartition("/blobs/")[2])
            return FakeResponse(200, held) if held else FakeResponse(500, _err("UNKNOWN", "storage backend down"))
        tag = url.rpartition("/manifests/")[2]
        if tag not in registry.tags:
            return FakeResponse(404, _err("MANIFEST_UNKNOWN"))
        body = _manifest(registry.tags[tag][1])
        return FakeResponse(200, body, {"Docker-Content-Digest": _digest(body)})

    monkeypatch.setattr("builder.cli.context.Engine", lambda: engine)
    monkeypatch.setattr(requests, "Session", lambda: FakeSession(answer))
    for var in ("PTMG_REGISTRY", "PTMG_REGISTRY_USER", "PTMG_REGISTRY_PASSWORD", "PTMG_REGISTRY_PASSWORD_FILE",
                "PTMG_PUSH_ATTEMPTS", "PTMG_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))
    monkeypatch.setenv("PTMG_STATE_DIR", str(tmp_path / "state"))
    if case.tested:
        passes.record_pass(tmp_path, IMG_A, A, passed=3, skipped=0)
    config = write_matrix(tmp_path / "matrix", SEED_MATRIX + case.audit_yaml)
    _vulnerable_lock(config.parent, A, case.pins)  # the publish verb audits the cell's lock beside images.yaml
    report_dir = tmp_path / "report"
    rc = cli.main(["publish", "--config", str(config), "--only", A, "--registry", "127.0.0.1:5000/ns",
                   "--report-dir", str(report_dir), *case.flags])
    written = report_dir / "publish-report.json"
    cells = json.loads(written.read_text())["cells"] if written.exists() else [{"error": ""}]
    (cell,) = cells
    return Outcome(rc, engine, cell["error"], report_dir)


ALLOW = ("audit:\n  python:\n    allow:\n      - id: {id}\n        package: {package}\n"
         "        reason: no fixed release in the index yet\n        expires: 2099-12-31\n")

#: (what is wrong, the case, what the refusal says, the same case with that one thing right)
REFUSALS = [
    ("known vulnerability", Case(pins=tuple(VULNERABLE)), f"1 known vulnerability(ies) in its Python distributions: "
     f"idna 3.6 {ADVISORY}", Case()),
    ("--allow-unknown-vulns waives only an audit that could not run", Case(pins=tuple(VULNERABLE),
     flags=("--allow-unknown-vulns",)), f"idna 3.6 {ADVISORY}", Case(flags=("--allow-unknown-vulns",))),
    ("allowlisted for another package", Case(pins=tuple(VULNERABLE), audit_yaml=ALLOW.format(id=ADVISORY,
     package="requests")), f"idna 3.6 {ADVISORY}",
     Case(pins=tuple(VULNERABLE), audit_yaml=ALLOW.format(id=ADVISORY, package="idna"))),
    ("Debian security updates pending on an old OS layer", Case(os_age_days=30, apt=APT_PENDING),
     "1 Debian security update(s) pending (libssl3 3.0.20-1~deb12u2 -> 3.0.22-1~deb12u2)",
     Case(os_age_days=30, apt=APT_NOTHING)),
    ("the Debian audit could not run", Case(os_age_days=30, apt=APT_FAILED),
     "the Debian audit could not run (apt-get update failed", Case(os_age_days=30, apt=APT_NOTHING)),
    ("images.yaml's max_pending_days", Case(os_age_days=10, apt=APT_PENDING,
     audit_yaml="audit:\n  debian:\n    max_pending_days: 7\n"), "audit.debian.max_pending_days is 7",
     Case(os_age_days=10, apt=APT_PENDING)),  # the default, 14 days: a 10-day-old layer goes
]


@pytest.mark.parametrize(("wrong", "case", "says", "control"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_each_gate_stops_a_publish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrong: str, case: Case,
                                   says: str, control: Case) -> None:
    refused = publish(tmp_path / "refused", monkeypatch, case)
    assert refused.rc == 1, f"published although: {wrong}"
    assert refused.engine.pushes == [], "a refused cell pushes nothing, not even its immutable tags"
    assert "refused: " in refused.error and says in refused.error, refused.error
    ok = publish(tmp_path / "control", monkeypatch, control)
    assert ok.rc == 0 and not ok.error, ok.error
    assert {ref.rpartition(":")[2] for ref, _ in ok.engine.pushes} >= set(TAGS_A)


def test_a_young_os_layer_is_not_audited_and_an_old_one_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    young = publish(tmp_path / "young", monkeypatch, Case(os_age_days=3, apt=APT_PENDING))
    assert young.rc == 0 and young.engine.audits == 0  # pending updates are at most 3 days old: < 14
    old = publish(tmp_path / "old", monkeypatch, Case(os_age_days=30, apt=APT_NOTHING))
    assert old.rc == 0 and old.engine.audits == 1


def test_publish_audits_the_sbom_of_the_image_it_pushes_and_puts_it_beside_the_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the image carries an SBOM, that (what is really in it) is audited, not the lock."""
    refused = publish(tmp_path / "refused", monkeypatch, Case(pins=tuple(CLEAN), sbom=tuple(VULNERABLE)))
    assert refused.rc == 1 and refused.engine.pushes == [] and f"idna 3.6 {ADVISORY}" in refused.error
    ok = publish(tmp_path / "ok", monkeypatch, Case(pins=tuple(VULNERABLE), sbom=tuple(CLEAN)))
    assert ok.rc == 0, ok.error
    assert (ok.report_dir / "sbom" / f"{A}.cdx.json").read_text() == sbom_text(CLEAN) + "\n"
    audit = json.loads((ok.report_dir / "python-audit.json").read_text())
    assert audit["ok"] and audit["cells"][A]["facts"]["audited"] == "its SBOM"


def test_a_cell_whose_floating_tag_holds_the_same_recipe_is_not_published_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    skipped = publish(tmp_path / "skipped", monkeypatch, Case(remote="same"))
    assert skipped.rc == 0 and skipped.engine.pushes == []
    (cell,) = json.loads((skipped.report_dir / "publish-report.json").read_text())["cells"]
    assert cell["unchanged_since"] == "unchanged since 2026-11-01"
    forced = publish(tmp_path / "forced", monkeypatch, Case(remote="same", flags=("--publish-unchanged",)))
    assert forced.rc == 0 and {ref.rpartition(":")[2] for ref, _ in forced.engine.pushes} >= {*TAGS_A, A}


def test_a_floating_tag_that_cannot_be_read_is_published_over_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    unreadable = publish(tmp_path / "unreadable", monkeypatch, Case(remote="unreadable"))
    assert unreadable.rc == 0 and {ref.rpartition(":")[2] for ref, _ in unreadable.engine.pushes} >= set(TAGS_A)
    assert f"{A}: can't compare with the registry's {A} (GET " in caplog.text and "HTTP 500" in caplog.text
    caplog.clear()
    absent = publish(tmp_path / "absent", monkeypatch, Case())  # a first publish: nothing to compare with, no warning
    assert absent.rc == 0 and "can't compare" not in caplog.text


@pytest.mark.parametrize("flag", ["--allow-stale-os", "--allow-unknown-vulns"])
def test_each_waiver_is_announced_and_only_when_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture, flag: str) -> None:
    warning = {"--allow-stale-os": "--allow-stale-os: images are published whatever Debian security updates",
               "--allow-unknown-vulns": "WARNING: --allow-unknown-vulns: cells are published even where"}
    assert publish(tmp_path / "waived", monkeypatch, Case(flags=(flag,))).rc == 0
    assert warning[flag] in caplog.text
    caplog.clear()
    assert publish(tmp_path / "plain", monkeypatch, Case()).rc == 0
    assert not any(w in caplog.text for w in warning.values()), caplog.text


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("as_json", [False, True])
def test_the_verbs_exit_status_and_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
                                          dry_run: bool, as_json: bool) -> None:
    """1 when the floating tags are held (an image without a smoke-test pass: a dry run contacts no
    registry, but it knows that), 0 when all goes, with or without --dry-run; --json:
    stdout is the report and nothing else; otherwise a table (and a dry run's plan)."""
    flags = ("--dry-run",) * dry_run + ("--json",) * as_json
    for held, case in ((True, Case(tested=False, flags=flags)), (False, Case(flags=flags))):
        capsys.readouterr()
        caplog.clear()
        out = publish(tmp_path / str(held), monkeypatch, case)
        assert out.rc == (1 if held else 0)
        pushed = {ref.rpartition(":")[2] for ref, _ in out.engine.pushes}
        assert pushed == (set() if dry_run else set(TAGS_A) if held else {*TAGS_A, *FLOAT_A}), pushed
        assert ("publish FAILED" in caplog.text) == (held and not dry_run), caplog.text
        stdout = capsys.readouterr().out
        if as_json:
            report = json.loads(stdout)  # the whole of stdout: nothing printed around it
            assert report["cells"][0]["cell"] == A and report["floating_gate"]["open"] is not held
        else:
            assert stdout.startswith("cell ") and "{" not in stdout, stdout
            if dry_run:
                assert ("floating tags would be held" if held else "floating tags would move") in stdout, stdout


@pytest.mark.parametrize(("wrong", "case", "says", "control"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_dry_run_says_the_cell_a_real_run_refuses_would_be_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        wrong: str, case: Case, says: str, control: Case) -> None:
    """`publish --dry-run` runs the gates that need no registry (the vulnerability gate on the lock or the
    SBOM, OS freshness from the labels and the Debian audit) and says what a real run would do; it still
    asks the registry nothing."""
    sessions: list[FakeSession] = []
    real_session = FakeSession

    def recording(answer: Any) -> FakeSession:
        sessions.append(real_session(answer))
        return sessions[-1]

    monkeypatch.setattr(f"{__name__}.FakeSession", recording)
    capsys.readouterr()
    refused = publish(tmp_path / "refused", monkeypatch, Case(**{**case.__dict__, "flags": (*case.flags, "--dry-run")}))
    out = capsys.readouterr().out
    assert refused.rc == 1 and refused.engine.pushes == [], f"a dry run would publish although: {wrong}"
    assert f"smoke passed; pt-multi-gpu:{A}: would be refused: " in out and says in out, out
    assert f"{A}  -    -     would be refused" in out, out  # the table's row: not "failed", not a planned tag
    assert "floating tags would be held" in out and "floating tags would move" not in out, out
    ok = publish(tmp_path / "control", monkeypatch, Case(**{**control.__dict__, "flags": (*control.flags, "--dry-run")}))
    out = capsys.readouterr().out
    assert ok.rc == 0 and "would be refused" not in out and "floating tags would move" in out, out
    assert [call for s in sessions for call in s.calls] == [], "a dry run asks the registry nothing"
