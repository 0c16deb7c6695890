"""The state of a Debian release's archive: the OS layer's cache key and part of the inputs hash.

Every build runs `apt-get upgrade` in the OS layer. For that layer to be rebuilt when Debian
publishes fixes, and only then, the host reads each suite the image lists (the release,
``-updates`` from the main mirror, ``-security`` from the security mirror) from its
``InRelease`` file at build time and keys on what the suite holds for the image's
architecture: the sha256 of ``main/binary-<arch>/Packages`` as the (signed) Release file lists
it. A re-signed Release with the same packages (a new ``Date:``, e.g. a weekly ``Valid-Until``
refresh) is no change; a new security upload, point release or stable update is.

The key goes into the build as the ``PTMG_OS_SNAPSHOT`` build arg, which the OS layer's RUN
declares (BuildKit keys that RUN's cache on it), and into the inputs hash, so `build.py build`
skips an unchanged cell on an unchanged archive and rebuilds from the OS layer up after a new
security release. It never reaches the rendered Dockerfiles (they would drift weekly).

Offline (a mirror does not answer, or not within ``DEADLINE`` seconds for the whole lookup, its
requests in parallel; a wait past a second is named on stderr): the key recorded on the existing image is used, so an
unchanged matrix stays a no-op and a changed one still reuses the cached OS layer; it is logged.
``PTMG_OS_SNAPSHOT`` in the environment overrides the key (tests simulate a newer suite so).
"""

from __future__ import annotations

import datetime as dt
import email.utils
import hashlib
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import requests

import ptmg_contract as contract
from builder.common.errors import InputError, StepFailed
from builder.common.log import log
from builder.common.waiting import announced
from builder.imaging.apt_sources import DEFAULT_MIRROR, DEFAULT_SECURITY_MIRROR, ENV_SECURITY_MIRROR, required_suites

ENV_OVERRIDE = contract.OS_SNAPSHOT_ARG  # the same name in the host's environment
TIMEOUT = (5.0, 20.0)  # connect, read (seconds): one request's limits
DEADLINE = 10.0  # seconds for a whole lookup (its InRelease files in parallel); past it, as offline
#: What get() returns: the body of an InRelease file; raises SnapshotError when it cannot.
Getter = Callable[[str], str]


class SnapshotError(StepFailed):
    """A suite's Release file could not be read or understood."""


@dataclass(frozen=True)
class SuiteState:
    suite: str  # e.g. bookworm-security
    date: str  # the Release file's Date, UTC ISO 8601
    packages: str  # sha256 of main/binary-<arch>/Packages (or its compressed form) as listed there


@dataclass(frozen=True)
class Snapshot:
    key: str  # "" when not tracked (not a Debian base)
    suites: tuple[SuiteState, ...] = ()
    source: str = "mirror"  # mirror | PTMG_OS_SNAPSHOT | recorded on <ref> | unknown | not tracked

    def describe(self) -> str:
        dates = ", ".join(f"{s.suite} {s.date}" for s in self.suites)
        return f"{self.key or '-'} ({self.source}{': ' + dates if dates else ''})"

    def epoch(self) -> int | None:
        """SOURCE_DATE_EPOCH for this snapshot: its newest suite's Release date (None: not known)."""
        stamps = []
        for suite in self.suites:
            try:
                stamps.append(dt.datetime.strptime(suite.date, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc))
            except ValueError:
                continue
        return int(max(stamps).timestamp()) if stamps else None


def iso_date(text: str) -> str:
    """``Sun, 29 Nov 2026 00:53:13 UTC`` -> ``2026-11-29T00:53:13Z``."""
    try:
        when = email.utils.parsedate_to_datetime(text.strip())
    except (TypeError, ValueError):
        raise SnapshotError(f"not an RFC 2822 date: {text!r}") from None
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def age_days(updated: str, now: dt.datetime) -> float | None:
    """Days since an `os.updated` label (ISO 8601 UTC); None when absent or unreadable."""
    try:
        when = dt.datetime.strptime(updated, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return None
    return (now - when).total_seconds() / 86400


def parse_release(text: str, suite: str, arch: str) -> SuiteState:
    """A suite's state from its (In)Release text: the Date and the sha256 of main's Packages for arch."""
    fields: dict[str, str] = {}
    sha256: dict[str, str] = {}
    section = ""
    for line in text.splitlines():
        if line.startswith("-----BEGIN PGP SIGNATURE"):
            break
        if line[:1] in (" ", "\t"):
            parts = line.split()
            if section == "sha256" and len(parts) == 3:
                sha256[parts[2]] = parts[0]
            continue
        key, sep, value = line.partition(":")
        if sep:
            section = key.strip().lower()
            fields[section] = value.strip()
    codename = fields.get("codename", "")
    if codename and codename != suite:
        raise SnapshotError(f"the Release file for {suite} says Codename: {codename}")
    if "date" not in fields:
        raise SnapshotError(f"the Release file for {suite} has no Date:")
    for name in ("Packages", "Packages.xz", "Packages.gz"):
        digest = sha256.get(f"main/binary-{arch}/{name}")
        if digest and re.fullmatch(r"[0-9a-f]{64}", digest):
            return SuiteState(suite, iso_date(fields["date"]), digest)
    raise SnapshotError(f"the Release file for {suite} lists no main/binary-{arch}/Packages (SHA256)")


def key_for(release: str, arch: str, suites: tuple[SuiteState, ...]) -> str:
    """The cache key: what each suite holds for arch (never the dates)."""
    h = hashlib.sha256(f"debian\0{release}\0{arch}\0".encode())
    for s in suites:
        h.update(f"{s.suite}\0{s.packages}\0".encode())
    return "sha256:" + h.hexdigest()


def http_get(url: str) -> str:
    try:
        r = requests.get(url, timeout=TIMEOUT)
    except requests.exceptions.RequestException as exc:
        raise SnapshotError(f"GET {url}: {type(exc).__name__}: {str(exc)[:200]}") from None
    if r.status_code != 200:
        raise SnapshotError(f"GET {url}: HTTP {r.status_code}")
    return r.text


def suite_urls(release: str, mirror: str, security_mirror: str) -> dict[str, str]:
    """suite -> its InRelease URL (the release and -updates from the mirror, -security from its own)."""
    main, updates, security = required_suites(release)
    return {main: f"{mirror.rstrip('/')}/dists/{main}/InRelease",
            updates: f"{mirror.rstrip('/')}/dists/{updates}/InRelease",
            security: f"{security_mirror.rstrip('/')}/dists/{security}/InRelease"}


def fetch(release: str, arch: str, mirror: str = DEFAULT_MIRROR, security_mirror: str = DEFAULT_SECURITY_MIRROR,
          get: Getter = http_get, deadline: float = DEADLINE) -> Snapshot:
    """The archive's state now, from the mirrors (SnapshotError when one does not answer in time)."""
    urls = suite_urls(release, mirror, security_mirror)
    bodies = get_all(urls, get, deadline)
    suites = tuple(parse_release(bodies[suite], suite, arch) for suite in urls)
    return Snapshot(key_for(release, arch, suites), suites, "mirror")


def get_all(urls: Mapping[str, str], get: Getter, deadline: float = DEADLINE) -> dict[str, str]:
    """Each suite's InRelease body, the requests in parallel and all of them within ``deadline`` seconds
    (one request's own limits are 5 s to connect and 20 s per read, which a trickle never hits); past a
    second, one line on stderr names the URLs still awaited. The first suite's error (SnapshotError), or a
    SnapshotError naming those that did not answer in time (their threads are left to end on their own)."""
    got: dict[str, str | Exception] = {}
    lock = threading.Lock()
    finished = threading.Event()

    def one(suite: str, url: str) -> None:
        body: str | Exception
        try:
            body = get(url)
        except Exception as exc:  # raised again below, in the caller's thread (anything but SnapshotError is a bug)
            body = exc
        with lock:
            got[suite] = body
            if len(got) == len(urls):
                finished.set()

    def pending() -> list[str]:
        with lock:
            return [url for suite, url in urls.items() if suite not in got]

    for suite, url in urls.items():
        threading.Thread(target=one, args=(suite, url), name=f"inrelease-{suite}", daemon=True).start()
    with announced(lambda: f"the Debian archive's state (at most {deadline:g} s): GET {', '.join(pending())}"):
        in_time = finished.wait(deadline) if urls else True
    if not in_time:
        raise SnapshotError(f"no answer within {deadline:g} s from {', '.join(pending())}")
    for suite in urls:
        body = got[suite]
        if isinstance(body, Exception):
            raise body
    return {suite: str(got[suite]) for suite in urls}


def override(environ: Mapping[str, str]) -> str | None:
    """PTMG_OS_SNAPSHOT from the environment: one line of printable text, or None when unset."""
    value = environ.get(ENV_OVERRIDE)
    if value is None or value == "":
        return None
    if len(value) > 200 or not re.fullmatch(r"[\x21-\x7e]+", value):
        raise InputError(f"{ENV_OVERRIDE}={value[:60]!r}: must be printable ASCII without spaces, at most 200 "
                         "characters, e.g. sha256:... or test-20261201")
    return value


class Snapshots:
    """One lookup per (release, arch, mirrors) per run, shared by the cells (thread-safe)."""

    def __init__(self, mirror: str = DEFAULT_MIRROR, security_mirror: str | None = None,
                 environ: Mapping[str, str] | None = None, get: Getter = http_get, deadline: float = DEADLINE) -> None:
        env = environ or {}
        self.mirror = mirror
        self.security_mirror = security_mirror or env.get(ENV_SECURITY_MIRROR) or DEFAULT_SECURITY_MIRROR
        self.forced = override(env)
        self.get = get
        self.deadline = deadline
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], Snapshot | SnapshotError] = {}

    def _lookup(self, release: str, arch: str) -> Snapshot | SnapshotError:
        with self._lock:
            if (release, arch) not in self._seen:
                snap: Snapshot | SnapshotError
                try:
                    snap = fetch(release, arch, self.mirror, self.security_mirror, self.get, self.deadline)
                    log.info("Debian %s/%s archive: %s", release, arch, snap.describe())
                except SnapshotError as exc:
                    snap = exc
                self._seen[(release, arch)] = snap
            return self._seen[(release, arch)]

    def for_base(self, base: str, release: str, arch: str, recorded: str | None, ref: str) -> Snapshot:
        """The snapshot for a cell on `base`; `recorded` is the key on its existing image `ref`."""
        if not base.startswith("debian:"):
            return Snapshot("", (), "not tracked (not a Debian base)")
        if self.forced is not None:
            return Snapshot(self.forced, (), ENV_OVERRIDE)
        got = self._lookup(release, arch)
        if isinstance(got, Snapshot):
            return got
        if recorded:
            log.warning("the Debian mirror did not answer (%s); offline: keeping the OS snapshot recorded on %s "
                        "(%s). Security updates published since are not applied until the mirror answers.",
                        got, ref, recorded)
            return Snapshot(recorded, (), f"recorded on {ref}")
        log.warning("the Debian mirror did not answer (%s) and no earlier image of %s records a snapshot; "
                    "building with the key 'unknown' (apt in the build needs the mirror too)", got, ref)
        return Snapshot("unknown", (), "unknown (mirror unreachable)")
