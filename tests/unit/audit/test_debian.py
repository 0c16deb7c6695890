"""`build.py audit` (Debian section) from apt's own simulation in the image, and the
`audit:` policy in images.yaml (validated, located)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest

import ptmg_contract as contract
from builder.audit import debian
from builder.audit.report import FAILED, FINDINGS, OK, ImageAudit, SectionResult, Target, report_json, rows
from builder.audit.sections import SECTIONS
from builder.common.yamlpos import ProblemsError
from builder.engine.model import RunResult
from tests.support import SEED_MATRIX, small_matrix, write_matrix

NOW = dt.datetime(2026, 12, 1, 6, tzinfo=dt.timezone.utc)
M = debian.MARK
#: apt 2.6's output (bookworm) for an image whose libssl3 is from the main suite.
SIMULATION = f"""{M} release bookworm
Get:1 http://deb.debian.org/debian bookworm InRelease [151 kB]
Get:2 http://deb.debian.org/debian-security bookworm-security InRelease [48.0 kB]
Reading package lists...
{M} update-exit 0
NOTE: This is only a simulation!
Reading package lists...
The following packages will be upgraded:
  libssl3 openssl tzdata
Inst libssl3 [3.0.20-1~deb12u2] (3.0.22-1~deb12u2 Debian-Security:12/oldstable-security [amd64])
Inst openssl [3.0.20-1~deb12u2] (3.0.22-1~deb12u2 Debian:12.16/oldstable, Debian-Security:12/oldstable-security [amd64]) []
Inst tzdata [2026b-0+deb12u1] (2026f-0+deb12u1 Debian:12-updates/oldstable-updates [all])
Inst libnew1 (1.0-1 Debian-Security:12/oldstable-security [amd64])
Conf libssl3 (3.0.22-1~deb12u2 Debian-Security:12/oldstable-security [amd64])
{M} simulate-exit 0
"""
LABELS = {contract.LABEL_OS_UPDATED: "2026-11-20T06:00:00Z",
          contract.LABEL_OS_SUITES: "bookworm@2026-07-11T10:16:37Z bookworm-security@2026-11-19T00:53:13Z"}


def test_parse_simulation() -> None:
    found = debian.parse_simulation(SIMULATION)
    assert [(p.package, p.installed, p.fixed, p.security) for p in found] == [
        ("libssl3", "3.0.20-1~deb12u2", "3.0.22-1~deb12u2", True),
        ("openssl", "3.0.20-1~deb12u2", "3.0.22-1~deb12u2", True),  # in the point release and in security
        ("tzdata", "2026b-0+deb12u1", "2026f-0+deb12u1", False),  # a stable update, not a security one
    ]  # libnew1: a new package (a dependency), nothing installed to fix


def test_either_sign_of_the_security_suite_makes_a_security_update() -> None:
    """A mirror may label the suite with its own origin (`…-security` without Debian-Security), or
    the origin alone may say it: each is enough."""
    text = ("Inst libssl3 [3.0.20-1] (3.0.22-1 Mirror:12/oldstable-security [amd64])\n"
            "Inst openssl [3.0.20-1] (3.0.22-1 Debian-Security:12/oldstable [amd64])\n"
            "Inst tzdata [2026b-0] (2026f-0 Debian:12-updates/oldstable-updates [all])\n")
    assert [(p.package, p.security) for p in debian.parse_simulation(text)] == [
        ("libssl3", True), ("openssl", True), ("tzdata", False)]


def test_evaluate_findings() -> None:
    r = debian.evaluate(SIMULATION, 0, LABELS, NOW)
    assert r.status == FINDINGS
    assert r.findings[0] == {"package": "libssl3", "installed": "3.0.20-1~deb12u2", "fixed": "3.0.22-1~deb12u2",
                             "origin": "Debian-Security:12/oldstable-security"}
    assert r.facts["pending_security"] == "2" and r.facts["pending_other"] == "1"
    assert r.facts["os.updated"] == "2026-11-20T06:00:00Z" and r.facts["age_days"] == "11.0"


def test_evaluate_nothing_pending_and_an_image_without_the_security_suite() -> None:
    clean = f"{M} release trixie\n{M} added trixie-security\n{M} update-exit 0\n0 upgraded\n{M} simulate-exit 0\n"
    r = debian.evaluate(clean, 0, {}, NOW)
    assert r.status == OK and r.findings == [] and r.facts["os.updated"] == "unknown"
    assert r.notes == ["the image does not list trixie-security in its apt sources; audited against it anyway"]


@pytest.mark.parametrize("update", [
    "Err:2 http://deb.debian.org/debian-security bookworm-security InRelease\n  Could not resolve 'deb.debian.org'\n"
    "W: Some index files failed to download. They have been ignored, or old ones used instead.\n"
    f"{M} update-exit 0\n",  # apt-get update exits 0 and only warns: never "nothing pending"
    f"E: Could not get lock /var/lib/apt/lists/lock\n{M} update-exit 100\n",
])
def test_a_failed_update_fails_the_audit(update: str) -> None:
    out = f"{M} release bookworm\n{update}0 upgraded\n{M} simulate-exit 0\n"
    r = debian.evaluate(out, 0, LABELS, NOW)
    assert r.status == FAILED and "apt-get update failed" in r.error


def test_a_failed_simulation_after_a_good_update_is_named_as_such() -> None:
    """apt's errors after the update's mark are the simulation's: the failure names dist-upgrade,
    not the update that went well."""
    out = (f"{M} release bookworm\nReading package lists...\n{M} update-exit 0\n"
           f"E: Unable to correct problems, you have held broken packages.\n{M} simulate-exit 100\n")
    r = debian.evaluate(out, 100, LABELS, NOW)
    assert r.status == FAILED
    assert r.error.startswith("apt-get -s dist-upgrade failed (container exit 100)"), r.error


def test_a_container_that_died_fails_the_audit() -> None:
    r = debian.evaluate(f"{M} release bookworm\n/bin/sh: 1: apt-get: not found\n", 127, {}, NOW)
    assert r.status == FAILED


class AuditEngine:
    """What the audit uses: the image's attributes and one container run (recorded)."""

    def __init__(self, output: str = SIMULATION) -> None:
        self.output = output
        self.runs: list[dict[str, Any]] = []
        self.cleaned = False

    def image_exists(self, ref: str) -> bool:
        return ref.startswith("pt-multi-gpu:")

    def image_attrs(self, ref: str) -> dict[str, Any] | None:
        if not self.image_exists(ref) and not ref.startswith("sha256:"):
            return None
        return {"Id": "sha256:" + "9" * 64, "Config": {"Labels": LABELS}}

    def run(self, image: str, command: list[str], **kw: Any) -> RunResult:
        self.runs.append({"image": image, "command": command, **kw})
        return RunResult(0, self.output)

    def cleanup_session(self) -> None:
        self.cleaned = True


def test_the_audit_runs_apt_as_root_in_a_throwaway_container(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PTMG_DEBIAN_SECURITY_MIRROR", "http://sec.local/debian-security")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    engine = AuditEngine()
    r = debian.audit(engine, Target("pt-multi-gpu:x"))  # type: ignore[arg-type]
    (run,) = engine.runs
    assert run["user"] == "0" and run["entrypoint"] == ["/bin/sh"] and run["image"] == "sha256:" + "9" * 64
    assert "apt-get -s" in run["command"][-1] and "apt-get update" in run["command"][-1]
    assert run["environment"] == {"PTMG_SECURITY_MIRROR": "http://sec.local/debian-security",
                                  "http_proxy": "http://proxy:3128"}
    assert r.status == FINDINGS


def test_audit_verb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import builder.cli.main as cli

    engine = AuditEngine()
    monkeypatch.setattr("builder.cli.context.Engine", lambda: engine)
    report = tmp_path / "out" / "audit.json"
    rc = cli.main(["audit", "--config", str(write_matrix(tmp_path / "m")), "--image", "pt-multi-gpu:old",
                   "--section", "debian", "--report", str(report)])  # (python has its own tests)
    out = capsys.readouterr().out
    assert rc == 1, "pending security updates"
    assert "libssl3" in out and "3.0.20-1~deb12u2" in out and "3.0.22-1~deb12u2" in out and "tzdata" not in out
    data = json.loads(report.read_text())
    assert data["ok"] is False and data["images"][0]["sections"]["debian"]["status"] == FINDINGS
    engine.output = SIMULATION.split("NOTE:", maxsplit=1)[0] + f"0 upgraded\n{M} simulate-exit 0\n"
    assert cli.main(["audit", "--config", str(write_matrix(tmp_path / "m")), "--image", "pt-multi-gpu:new",
                     "--section", "debian"]) == 0
    capsys.readouterr()
    # Cells: those built here are audited, the others named; none built is a failure.
    rc = cli.main(["audit", "--config", str(write_matrix(tmp_path / "m")), "--json", "--section", "debian"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(data["images"]) == 3 and data["images"][0]["cell"]
    with pytest.raises(SystemExit) as bad:
        cli.main(["audit", "--config", str(write_matrix(tmp_path / "m")), "--section", "nope"])
    assert bad.value.code == 2


def test_rows_and_json_have_one_section_each() -> None:
    audit = ImageAudit("pt-multi-gpu:a", "a", "sha256:1", {
        "debian": SectionResult("debian", FINDINGS, [{"package": "libssl3", "installed": "1", "fixed": "2"}])})
    broken = ImageAudit("pt-multi-gpu:b", "b", "sha256:2", {"debian": SectionResult("debian", FAILED, error="down\nx")})
    pad = [""] * (max(len(s.columns) for s in SECTIONS.values()) - 4)  # as wide as the widest section
    assert rows([audit, broken], SECTIONS) == [["pt-multi-gpu:a", "debian", "libssl3", "1", "2", "", *pad],
                                               ["pt-multi-gpu:b", "debian", "FAILED: down", "", "", "", *pad]]
    assert json.loads(report_json([audit, broken]))["images"][1]["sections"]["debian"]["error"] == "down\nx"


# --- images.yaml: audit: ---------------------------------------------------------------------
def test_audit_policy_defaults_and_values(tmp_path: Path) -> None:
    assert small_matrix(tmp_path / "a").audit.debian.max_pending_days == 14
    m = small_matrix(tmp_path / "b", SEED_MATRIX + "audit:\n  debian: {max_pending_days: 3}\n  python:\n")
    assert m.audit.debian.max_pending_days == 3 and m.audit.python.fail_on == "any"  # (python's own keys)


@pytest.mark.parametrize(("text", "where", "message"), [
    ("audit: 14\n", ":26:8:", "audit must be a mapping, e.g. audit: {debian: {max_pending_days: 14}}, got a number"),
    ("audit:\n  debain: {}\n", ":27:3:", "unknown key 'debain' in audit (did you mean 'debian'?)"),
    ("audit:\n  debian: {max_pending_days: two}\n", ":27:30:", "max_pending_days must be a whole number of days"),
    ("audit:\n  debian: {max_pending_days: true}\n", ":27:30:", "max_pending_days must be a whole number"),
    ("audit:\n  python: {max_days: 3}\n", ":27:12:", "unknown key 'max_days' in audit.python"),
    ("audit:\n  debian: [14]\n", ":27:11:", "audit.debian must be a mapping"),
])
def test_audit_policy_errors_are_located(tmp_path: Path, text: str, where: str, message: str) -> None:
    with pytest.raises(ProblemsError) as exc:
        small_matrix(tmp_path, SEED_MATRIX + text)
    (line,) = [x for x in exc.value.lines if message in x]
    assert where in line, line
