"""A base's apt sources are the official image's (release, -updates, -security), and
`build.py base` refuses a base that lacks them, with the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ptmg_contract as contract
from builder.engine.model import RunResult
from builder.imaging import apt_sources, base_image
from tests.support import MID, cell, small_matrix

#: What debootstrap leaves (one line, main only), and the official images' deb822 file.
DEBOOTSTRAP = "deb http://deb.debian.org/debian bookworm main\n"
OFFICIAL = """\
Types: deb
# http://snapshot.debian.org/archive/debian/20240101T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
# http://snapshot.debian.org/archive/debian-security/20240101T000000Z
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


@pytest.mark.parametrize(("text", "release", "missing"), [
    (DEBOOTSTRAP, "bookworm", ["bookworm-updates", "bookworm-security"]),
    (OFFICIAL, "bookworm", []),
    (OFFICIAL.replace("bookworm", "trixie"), "trixie", []),
    (OFFICIAL, "trixie", ["trixie", "trixie-updates", "trixie-security"]),
    # one-line format with options and comments, as older images have it
    ("deb [arch=amd64 signed-by=/k.gpg] http://m/debian bookworm main contrib\n"
     "# deb http://security.debian.org/debian-security bookworm-security main\n"
     "deb http://m/debian bookworm-updates main\n", "bookworm", ["bookworm-security"]),
    # a disabled stanza and a stanza without main do not count
    (OFFICIAL.replace("Suites: bookworm-security\n", "Suites: bookworm-security\nEnabled: no\n"), "bookworm",
     ["bookworm-security"]),
    (OFFICIAL.replace("Suites: bookworm-security\nComponents: main", "Suites: bookworm-security\nComponents: contrib"),
     "bookworm", ["bookworm-security"]),
    ("deb-src http://m/debian-security bookworm-security main\n" + DEBOOTSTRAP, "bookworm",
     ["bookworm-updates", "bookworm-security"]),
])
def test_missing_suites(text: str, release: str, missing: list[str]) -> None:
    assert apt_sources.missing_suites(apt_sources.parse_sources(text), release) == missing


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_written_sources_are_the_official_images(release: str) -> None:
    text = apt_sources.debian_sources(release, "http://deb.debian.org/debian")
    official = OFFICIAL.replace("bookworm", release)
    assert apt_sources.parse_sources(text) == apt_sources.parse_sources(official)
    assert apt_sources.missing_suites(apt_sources.parse_sources(text), release) == []
    assert "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" in text


def _rootfs(tmp_path: Path, sources: str = DEBOOTSTRAP) -> Path:
    root = tmp_path / "rootfs"
    (root / "etc/apt/sources.list.d").mkdir(parents=True)
    (root / "etc/apt/sources.list").write_text(sources)
    (root / "usr/share/doc/libc6").mkdir(parents=True)
    (root / "usr/share/doc/libc6/changelog.gz").write_text("x")
    (root / "usr/share/doc/libc6/copyright").write_text("c")
    return root


def test_trim_gives_every_bootstrapped_base_the_official_sources(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """_trim is what every platform's bootstrap (base_image, base_foreign) runs on the rootfs."""
    monkeypatch.delenv(apt_sources.ENV_SECURITY_MIRROR, raising=False)
    root = _rootfs(tmp_path, "deb http://127.0.0.1:8000/debian trixie main\n")
    base_image._trim(root)
    assert not (root / "etc/apt/sources.list").exists()
    deb822 = (root / apt_sources.DEB822_PATH).read_text()
    found = apt_sources.parse_sources(deb822)
    assert {(s.uri, s.suite) for s in found} == {("http://127.0.0.1:8000/debian", "trixie"),
                                                  ("http://127.0.0.1:8000/debian", "trixie-updates"),
                                                  (apt_sources.DEFAULT_SECURITY_MIRROR, "trixie-security")}
    assert (root / apt_sources.DEB822_PATH).stat().st_mode & 0o777 == 0o644
    assert not (root / "usr/share/doc/libc6/changelog.gz").exists()  # still trimmed


def test_security_mirror_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(apt_sources.ENV_SECURITY_MIRROR, "http://sec.example/debian-security")
    root = _rootfs(tmp_path)
    base_image._trim(root)
    assert "URIs: http://sec.example/debian-security" in (root / apt_sources.DEB822_PATH).read_text()
    root2 = _rootfs(tmp_path / "2")
    base_image._trim(root2, "http://given/debian-security")  # an explicit one (build.py base --security-mirror) wins
    assert "URIs: http://given/debian-security" in (root2 / apt_sources.DEB822_PATH).read_text()


def test_trim_refuses_a_rootfs_without_a_deb_line(tmp_path: Path) -> None:
    root = _rootfs(tmp_path, "# nothing\n")
    with pytest.raises(base_image.BaseError, match="no `deb` line"):
        base_image._trim(root)


class FakeEngine:
    """What check_sources and ensure use: labels of a local image, and one throwaway container."""

    def __init__(self, labels: dict[str, str], sources: str = "") -> None:
        self.labels = labels
        self.sources = sources
        self.runs: list[dict[str, Any]] = []

    def image_exists(self, ref: str) -> bool:
        return True

    def image_labels(self, ref: str) -> dict[str, str]:
        return self.labels

    def run(self, image: str, command: list[str], **kw: Any) -> RunResult:
        self.runs.append({"image": image, "command": command, **kw})
        return RunResult(0, self.sources)


def test_check_sources_reads_the_label_of_a_bootstrapped_base() -> None:
    ok = FakeEngine({contract.LABEL_BASE_APT_SUITES: "bookworm bookworm-updates bookworm-security"})
    base_image.check_sources(ok, "debian:bookworm-slim", "bookworm")  # type: ignore[arg-type]
    assert ok.runs == []  # no container needed


def test_check_sources_reads_any_other_base_in_a_container_as_root() -> None:
    pulled = FakeEngine({}, OFFICIAL)
    base_image.check_sources(pulled, "debian:bookworm-slim", "bookworm")  # type: ignore[arg-type]
    (run,) = pulled.runs
    assert run["user"] == "0" and run["entrypoint"] == ["/bin/sh"]
    assert "/etc/apt/sources.list.d/*.sources" in run["command"][-1]


def test_a_base_without_the_security_suites_is_refused_with_the_fix(tmp_path: Path) -> None:
    """A debootstrapped base without the official sources: no label, one `deb ... bookworm main`."""
    spec = cell(small_matrix(tmp_path), MID)
    old = FakeEngine({contract.LABEL_BASE_MADE_BY: "debootstrap --variant=minbase bookworm"}, DEBOOTSTRAP)
    with pytest.raises(base_image.BaseError) as exc:
        base_image.ensure(old, spec)  # type: ignore[arg-type]
    text = str(exc.value)
    assert "debian:bookworm-slim lacks bookworm-updates, bookworm-security" in text
    assert "fix: `python build.py base --rebootstrap" in text
    labelled_wrong = FakeEngine({contract.LABEL_BASE_APT_SUITES: "bookworm"})
    with pytest.raises(base_image.BaseError, match="lacks bookworm-updates, bookworm-security"):
        base_image.check_sources(labelled_wrong, spec.base, spec.os)  # type: ignore[arg-type]
