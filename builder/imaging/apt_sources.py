"""A base image's apt sources: what the official image of the release has, and the check (pure).

Docker's official ``debian:<release>-slim`` images list three suites in
``/etc/apt/sources.list.d/debian.sources`` (deb822): the release and ``<release>-updates``
from the main mirror, and ``<release>-security`` from the security mirror. debootstrap
writes only ``deb <mirror> <release> main``, so an image made from its output never gets
a security fix published after the last point release. :func:`debian_sources`
writes the official file; :func:`missing_suites` checks any base's sources.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_MIRROR = "http://deb.debian.org/debian"
ENV_SECURITY_MIRROR = "PTMG_DEBIAN_SECURITY_MIRROR"
DEFAULT_SECURITY_MIRROR = "http://deb.debian.org/debian-security"
#: Where the sources live in an image (one-line format and deb822).
SOURCES_FILES = ("/etc/apt/sources.list", "/etc/apt/sources.list.d/*.list", "/etc/apt/sources.list.d/*.sources")
DEB822_PATH = "etc/apt/sources.list.d/debian.sources"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"


@dataclass(frozen=True)
class Source:
    """One `deb` entry: a URI, a suite and its components."""

    uri: str
    suite: str
    components: tuple[str, ...]


def required_suites(release: str) -> tuple[str, str, str]:
    """The suites the official image of `release` lists: release, -updates, -security."""
    return release, f"{release}-updates", f"{release}-security"


def debian_sources(release: str, mirror: str, security_mirror: str = DEFAULT_SECURITY_MIRROR) -> str:
    """The deb822 file the official debian:<release> image has, for these mirrors."""
    return (
        "# Like Docker's official debian images (written by `build.py base`): the release,\n"
        "# its -updates and its -security suites.\n"
        "Types: deb\n"
        f"URIs: {mirror}\n"
        f"Suites: {release} {release}-updates\n"
        "Components: main\n"
        f"Signed-By: {KEYRING}\n"
        "\n"
        "Types: deb\n"
        f"URIs: {security_mirror}\n"
        f"Suites: {release}-security\n"
        "Components: main\n"
        f"Signed-By: {KEYRING}\n"
    )


def _one_line(line: str) -> list[Source]:
    # deb [ options ] uri suite component...
    text = re.sub(r"\[[^\]]*\]", " ", line.split("#", 1)[0]).split()
    if len(text) < 3 or text[0] != "deb":
        return []
    return [Source(text[1], text[2], tuple(text[3:]))]


def _deb822(block: str) -> list[Source]:
    fields: dict[str, str] = {}
    key = ""
    for line in block.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if line[0] in " \t" and key:
            fields[key] += " " + line.strip()
            continue
        key, _, value = line.partition(":")
        key = key.strip().lower()
        fields[key] = value.strip()
    if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
        return []
    comps = tuple(fields.get("components", "").split())
    return [Source(uri, suite, comps) for uri in fields.get("uris", "").split()
            for suite in fields.get("suites", "").split()]


def parse_sources(text: str) -> list[Source]:
    """Every `deb` entry in a mix of one-line sources.list text and deb822 stanzas."""
    out: list[Source] = []
    for block in re.split(r"\n\s*\n", text):
        if re.search(r"^(Types|URIs|Suites)\s*:", block, re.M | re.I):
            out += _deb822(block)
        else:
            for line in block.splitlines():
                out += _one_line(line)
    return out


def missing_suites(sources: Iterable[Source], release: str) -> list[str]:
    """The required suites of `release` with no `deb` entry that has the main component."""
    have = {s.suite for s in sources if "main" in s.components}
    return [s for s in required_suites(release) if s not in have]


def fix_text(base: str, release: str, missing: list[str]) -> str:
    """The message for a base without the security or updates suite, with the fix."""
    return (f"base image {base} lacks {', '.join(missing)} in its apt sources: no build on it ever gets "
            f"a security fix published after {release}'s last point release.\n"
            f"  fix: `python build.py base --rebootstrap --only <a cell on {base}>` (bootstraps it again with the "
            "official image's sources: main, updates and security), or `docker pull` the official image")
