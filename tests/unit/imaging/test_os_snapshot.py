"""The Debian archive's state as the OS layer's cache key and part of the inputs hash.

The key changes when a suite's packages for the architecture change (a new security upload),
not when a Release file is merely re-signed with a new Date; the override simulates a newer
suite; offline, the key recorded on the existing image keeps an unchanged matrix a no-op.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from builder.common.errors import InputError
from builder.imaging import inputs, os_snapshot

SHA = {"amd64": "a" * 64, "arm64": "b" * 64}


def release(suite: str, date: str = "Sun, 29 Nov 2026 00:53:13 UTC", amd64: str = SHA["amd64"],
            signed: bool = True) -> str:
    """An InRelease as deb.debian.org serves it (trimmed): clearsigned, MD5Sum then SHA256."""
    body = (f"Origin: Debian\nLabel: Debian-Security\nSuite: oldstable-security\nVersion: 12\nCodename: {suite}\n"
            f"Date: {date}\nValid-Until: Sun, 06 Dec 2026 00:53:13 UTC\nArchitectures: amd64 arm64\n"
            "Components: updates/main updates/contrib\nDescription: Debian 12 - Security Updates\nMD5Sum:\n"
            f" {'c' * 32}  2560365 main/binary-amd64/Packages\nSHA256:\n"
            f" {amd64}  2560365 main/binary-amd64/Packages\n"
            f" {'d' * 64}   383424 main/binary-amd64/Packages.xz\n"
            f" {SHA['arm64']}  2564372 main/binary-arm64/Packages\n")
    if not signed:
        return body
    return "-----BEGIN PGP SIGNED MESSAGE-----\nHash: SHA256\n\n" + body + \
        "-----BEGIN PGP SIGNATURE-----\n\n iQIzBAEBCAAdFiEE\n-----END PGP SIGNATURE-----\n"


def test_parse_release() -> None:
    s = os_snapshot.parse_release(release("bookworm-security"), "bookworm-security", "amd64")
    assert s == os_snapshot.SuiteState("bookworm-security", "2026-11-29T00:53:13Z", SHA["amd64"])
    assert os_snapshot.parse_release(release("bookworm-security"), "bookworm-security", "arm64").packages == SHA["arm64"]
    xz_only = release("bookworm-security", signed=False).replace(f" {SHA['amd64']}  2560365 main/binary-amd64/Packages\n",
                                                                 "")
    assert os_snapshot.parse_release(xz_only, "bookworm-security", "amd64").packages == "d" * 64


@pytest.mark.parametrize(("text", "match"), [
    (release("trixie-security"), "Codename: trixie-security"),
    (release("bookworm-security").replace("Date:", "Dated:"), "no Date"),
    (release("bookworm-security").replace("binary-amd64", "binary-i386"), "no main/binary-amd64"),
    ("<html>captive portal</html>", "no Date"),
])
def test_parse_release_refuses(text: str, match: str) -> None:
    with pytest.raises(os_snapshot.SnapshotError, match=match):
        os_snapshot.parse_release(text, "bookworm-security", "amd64")


class Mirror:
    """A fake mirror: suite -> InRelease text; counts GETs; down when asked."""

    def __init__(self) -> None:
        self.suites = {s: release(s) for s in ("bookworm", "bookworm-updates", "bookworm-security")}
        self.gets: list[str] = []
        self.down = False

    def get(self, url: str) -> str:
        self.gets.append(url)
        if self.down:
            raise os_snapshot.SnapshotError(f"GET {url}: ConnectionError")
        return self.suites[url.split("/dists/")[1].split("/", maxsplit=1)[0]]


def test_the_key_follows_packages_not_dates() -> None:
    m = Mirror()
    first = os_snapshot.fetch("bookworm", "amd64", get=m.get)
    assert sorted(u.rsplit("/dists/", 1)[0] for u in m.gets) == ["http://deb.debian.org/debian"] * 2 + \
        ["http://deb.debian.org/debian-security"]  # asked together: in any order
    m.suites["bookworm-security"] = release("bookworm-security", date="Sun, 06 Dec 2026 00:53:13 UTC")
    resigned = os_snapshot.fetch("bookworm", "amd64", get=m.get)
    assert resigned.key == first.key, "a re-signed Release with the same packages is no change"
    assert resigned.suites[2].date == "2026-12-06T00:53:13Z"
    m.suites["bookworm-security"] = release("bookworm-security", amd64="e" * 64)
    assert os_snapshot.fetch("bookworm", "amd64", get=m.get).key != first.key, "a new security upload"
    assert os_snapshot.fetch("bookworm", "arm64", get=m.get).key != first.key, "each architecture its own"


def test_mirrors_are_settings() -> None:
    urls = os_snapshot.suite_urls("trixie", "http://127.0.0.1:8000/debian/", "http://sec.local/debian-security")
    assert urls == {"trixie": "http://127.0.0.1:8000/debian/dists/trixie/InRelease",
                    "trixie-updates": "http://127.0.0.1:8000/debian/dists/trixie-updates/InRelease",
                    "trixie-security": "http://sec.local/debian-security/dists/trixie-security/InRelease"}
    s = os_snapshot.Snapshots(environ={"PTMG_DEBIAN_SECURITY_MIRROR": "http://sec.local/x"})
    assert s.security_mirror == "http://sec.local/x"


def test_one_lookup_per_release_and_arch_per_run() -> None:
    m = Mirror()
    snaps = os_snapshot.Snapshots(environ={}, get=m.get)
    a = snaps.for_base("debian:bookworm-slim", "bookworm", "amd64", None, "pt:a")
    b = snaps.for_base("debian:bookworm", "bookworm", "amd64", "sha256:old", "pt:b")
    assert a == b and a.source == "mirror" and len(m.gets) == 3


def test_override_simulates_a_newer_suite() -> None:
    m = Mirror()
    snaps = os_snapshot.Snapshots(environ={"PTMG_OS_SNAPSHOT": "test-20261207"}, get=m.get)
    got = snaps.for_base("debian:bookworm-slim", "bookworm", "amd64", "sha256:old", "pt:a")
    assert got.key == "test-20261207" and got.source == "PTMG_OS_SNAPSHOT" and m.gets == []


@pytest.mark.parametrize("bad", ["two words", "x" * 201, "tab\there", "nl\n"])
def test_override_is_checked(bad: str) -> None:
    with pytest.raises(InputError, match="PTMG_OS_SNAPSHOT"):
        os_snapshot.Snapshots(environ={"PTMG_OS_SNAPSHOT": bad})


def test_offline_keeps_the_recorded_snapshot(caplog: pytest.LogCaptureFixture) -> None:
    m = Mirror()
    m.down = True
    snaps = os_snapshot.Snapshots(environ={}, get=m.get)
    kept = snaps.for_base("debian:bookworm-slim", "bookworm", "amd64", "sha256:recorded", "pt:a")
    assert kept.key == "sha256:recorded" and "recorded on pt:a" in kept.source
    assert "did not answer" in caplog.text and "offline" in caplog.text
    asked = sorted(m.gets)
    fresh = snaps.for_base("debian:bookworm-slim", "bookworm", "amd64", None, "pt:new")
    assert fresh.key == "unknown"
    # The suites are asked together (each once); a mirror that is down is asked once per run, not once per cell.
    assert sorted(m.gets) == asked == sorted(set(asked)) and len(asked) == 3, m.gets


def test_only_debian_bases_are_tracked() -> None:
    snaps = os_snapshot.Snapshots(environ={}, get=Mirror().get)
    assert snaps.for_base("ubuntu:24.04", "noble", "amd64", None, "pt:u").key == ""


def test_age_days() -> None:
    now = dt.datetime(2026, 12, 15, 12, tzinfo=dt.timezone.utc)
    assert os_snapshot.age_days("2026-12-01T12:00:00Z", now) == 14.0
    assert os_snapshot.age_days("", now) is None and os_snapshot.age_days("yesterday", now) is None


def test_the_snapshot_is_part_of_the_inputs_hash_and_not_of_the_recipe(tmp_path: Path) -> None:
    (tmp_path / "entrypoint").mkdir()
    (tmp_path / "entrypoint" / "start.sh").write_text("echo hi\n")
    files = inputs.context_files(tmp_path)
    plain = inputs.inputs_hash("FROM x", files, "sha256:base", tmp_path)
    assert inputs.inputs_hash("FROM x", files, "sha256:base", tmp_path, "") == plain  # untracked: the hash without a snapshot key
    one = inputs.inputs_hash("FROM x", files, "sha256:base", tmp_path, "sha256:one")
    two = inputs.inputs_hash("FROM x", files, "sha256:base", tmp_path, "sha256:two")
    assert len({plain, one, two}) == 3
    recipe = inputs.recipe_hash("FROM x", files, tmp_path)
    assert recipe not in (plain, one, two)
    assert inputs.recipe_hash("FROM y", files, tmp_path) != recipe
    (tmp_path / "entrypoint" / "start.sh").write_text("echo bye\n")
    assert inputs.recipe_hash("FROM x", files, tmp_path) != recipe
