"""The host's wheel store: every wheel any lock names, each verified against the lock's sha256.

One folder of wheel files by their (immutable) filenames, shared by every cell and every build on
the host: a torch wheel is downloaded once per machine. ``PTMG_WHEEL_STORE`` moves it (CI's
publish job points it at an empty folder, so a release is built from fresh downloads); the
default is ``$XDG_CACHE_HOME/pt-multi-gpu/wheels`` (``~/.cache/pt-multi-gpu/wheels``).

- A file is verified when first stored (download to ``.tmp-*``, hash and size checked, then
  renamed; a killed fetch leaves no partial wheel under a real name) and again whenever its
  (size, mtime, inode) differ from when it was last verified (``.verified.json``), so an
  unchanged store costs a stat per file, not a hash of 3 GB.
- A stored file whose hash is wrong is an error (never silently replaced): someone or something
  wrote to the store. The build stops with the file, both hashes and the fix.
- A download whose hash or size is wrong (a changed file on an index, a broken mirror) is an
  error and is never kept.
- The builds check again: uv verifies every wheel against the lock inside every install RUN.

Files are read-only (0444), and their mtime is SOURCE_DATE_EPOCH's (uv records a wheel's mtime in
the dist-info's uv_cache.json, so this keeps the installed files the same on every machine); the
build contexts hold hard links to them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from http.client import HTTPException
from pathlib import Path
from typing import TypeVar

from builder.common import flock
from builder.common.errors import StepFailed
from builder.common.log import log
from builder.common.paths import cache_dir, sha256_file
from builder.lock.model import Wheel
from builder.lock.net import Http, NetConfig, check_whole, redact, transient
from builder.render.dockerfile import SOURCE_DATE_EPOCH

EPOCH = int(SOURCE_DATE_EPOCH)

STORE_ENV = "PTMG_WHEEL_STORE"
STAMPS = ".verified.json"
# A source that fails transiently (net.transient) is tried again after each of these waits, so a
# DNS hiccup among a cold build's 136 downloads costs seconds, not the build; then the next source.
RETRY_WAITS_S = (1.0, 4.0)

T = TypeVar("T")


class SourceFailed(Exception):
    """One source (an index, a URL) failed for good: the reason, worded for the error message."""


def _tried(what: str, fn: Callable[[], T]) -> T:
    """fn(), tried again after each of RETRY_WAITS_S while it fails transiently (net.transient).
    SourceFailed when it fails otherwise, or still; a hash mismatch is never tried again."""
    attempt = 1
    while True:
        try:
            return fn()
        except (OSError, HTTPException) as exc:  # URLError, HTTPError, timeouts, a body cut short
            why = str(exc) or type(exc).__name__
            if attempt > len(RETRY_WAITS_S) or not transient(exc):
                raise SourceFailed(f"{why} (after {attempt} attempts)" if attempt > 1 else why) from None
            wait = RETRY_WAITS_S[attempt - 1]
            attempt += 1
            log.warning("%s: %s; trying again in %.0f s (attempt %d of %d)", what, why, wait, attempt,
                        len(RETRY_WAITS_S) + 1)
            time.sleep(wait)


def default_store() -> Path:
    given = os.environ.get(STORE_ENV)
    if given:
        return Path(given).expanduser()
    return cache_dir() / "wheels"


class HashMismatch(StepFailed):
    pass


@dataclass
class FetchStats:
    present: int = 0
    downloaded: int = 0
    bytes_downloaded: int = 0
    seconds: float = 0.0


class Store:
    def __init__(self, path: Path, net: NetConfig | None = None, jobs: int = 4) -> None:
        self.path = path
        self.net = net or NetConfig()
        self.jobs = jobs
        self._names: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def file(self, wheel: Wheel) -> Path:
        return self.path / wheel.filename

    # --- stamps: what was verified, and when the file looked like that ---------------------
    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return flock.exclusive(self.path / ".lock")

    def _stamps(self) -> dict[str, list[object]]:
        try:
            data = json.loads((self.path / STAMPS).read_text(encoding="utf-8"))
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _save_stamps(self, updates: dict[str, list[object]]) -> None:
        if not updates:
            return
        with self._locked():
            stamps = self._stamps()
            stamps.update(updates)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-stamps-", dir=self.path)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(stamps, f, sort_keys=True)
            os.replace(tmp, self.path / STAMPS)

    @staticmethod
    def _stamp(st: os.stat_result, sha: str) -> list[object]:
        return [st.st_size, st.st_mtime_ns, st.st_ino, sha]

    # --- verify and fetch ----------------------------------------------------------------
    def verify_present(self, wheels: Sequence[Wheel]) -> tuple[list[Wheel], dict[str, list[object]]]:
        """Check every wheel already in the store; (the missing ones, new stamps). HashMismatch on a bad file."""
        stamps = self._stamps()
        missing: list[Wheel] = []
        updates: dict[str, list[object]] = {}
        bad: list[str] = []
        for w in wheels:
            f = self.file(w)
            try:
                st = f.stat()
            except FileNotFoundError:
                missing.append(w)
                continue
            if stamps.get(w.filename) == self._stamp(st, w.sha256) and st.st_mtime == EPOCH:
                continue
            sha = sha256_file(f)
            if sha != w.sha256 or st.st_size != w.size:
                bad.append(f"  {f}\n    Expected: sha256:{w.sha256} ({w.size} bytes)\n"
                           f"    Computed: sha256:{sha} ({st.st_size} bytes)")
            else:
                os.utime(f, (EPOCH, EPOCH))
                updates[w.filename] = self._stamp(f.stat(), sha)
        if bad:
            raise HashMismatch("hash mismatch in the wheel store: a stored wheel is not the file the lock names "
                               "(it was changed after it was verified):\n" + "\n".join(bad) +
                               "\nfix: delete the file(s) (`rm` the paths above) and build again to download them "
                               f"fresh; find out what wrote to {self.path}")
        return missing, updates

    def _name_lock(self, name: str) -> threading.Lock:
        with self._guard:
            return self._names.setdefault(name, threading.Lock())

    def _download(self, http: Http, w: Wheel) -> tuple[int, list[object]]:
        dest = self.file(w)
        with self._name_lock(w.filename):
            if dest.exists():  # another thread or process fetched it meanwhile: verify, don't trust
                missing, stamps = self.verify_present([w])
                if not missing:
                    return 0, stamps.get(w.filename) or self._stamp(dest.stat(), w.sha256)
            errors: list[str] = []
            for url in self._candidates(http, w, errors):
                try:
                    return _tried(f"{w.filename} from {redact(url)}", partial(self._fetch, http, w, url))
                except SourceFailed as exc:
                    errors.append(f"{redact(url)}: {exc}")  # the next source
            raise StepFailed(f"cannot download {w.filename}:\n  " + "\n  ".join(errors or ["no source"]))

    def _fetch(self, http: Http, w: Wheel, url: str) -> tuple[int, list[object]]:
        """One download of `w` from `url` into the store: hash and size checked before it gets its name."""
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.path)
        try:
            h, n = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as out, http.open(url) as r:
                while chunk := r.read(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
                    n += len(chunk)
                check_whole(r, n)
            if h.hexdigest() != w.sha256 or n != w.size:
                raise HashMismatch(
                    f"hash mismatch downloading {w.filename} from {redact(url)}\n"
                    f"    Expected: sha256:{w.sha256} ({w.size} bytes)\n"
                    f"    Computed: sha256:{h.hexdigest()} ({n} bytes)\n"
                    "the index serves another file than the one locked: nothing was kept. If the change is "
                    "legitimate (a re-upload), re-lock: `build.py lock --upgrade-package "
                    f"{w.filename.split('-')[0]}`")
            os.chmod(tmp, 0o444)
            os.utime(tmp, (EPOCH, EPOCH))
            dest = self.file(w)
            os.replace(tmp, dest)
            return n, self._stamp(dest.stat(), w.sha256)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _candidates(self, http: Http, w: Wheel, errors: list[str]) -> Iterable[str]:
        """The configured indexes first (a mirror, PIP_INDEX_URL), then the URL in the lock."""
        project = w.filename.split("-", 1)[0]
        for index in self.net.indexes():
            try:
                url = _tried(f"{redact(index)} ({project})", partial(http.find_file, index, project, w.filename))
            except SourceFailed as exc:
                errors.append(f"{redact(index)}: {exc}")
                continue
            if url:
                yield url
            else:
                errors.append(f"{redact(index)}: does not list {w.filename}")
        yield w.url

    def ensure(self, wheels: Sequence[Wheel], on_ready: Callable[[str, str | None], None] | None = None) -> FetchStats:
        """Every wheel present and verified; downloads what is missing (in parallel, biggest first).

        ``on_ready(filename, error)`` (a build's wheel server) hears of each wheel as soon as
        it is in the store and verified (error None), or failed (error: why), before the others are."""
        start = time.monotonic()
        unique = list({w.filename: w for w in wheels}.values())
        self.path.mkdir(parents=True, exist_ok=True)
        missing, updates = self.verify_present(unique)
        stats = FetchStats(present=len(unique) - len(missing))
        if on_ready is not None:
            gone = {w.filename for w in missing}
            for w in unique:
                if w.filename not in gone:
                    on_ready(w.filename, None)
        if missing:
            total = sum(w.size for w in missing)
            log.info("wheel store %s: downloading %d wheel(s), %.2f GB", self.path, len(missing), total / 1e9)
            http = Http(self.net)
            with ThreadPoolExecutor(max_workers=max(1, self.jobs)) as pool:
                futures = {pool.submit(self._download, http, w): w.filename
                           for w in sorted(missing, key=lambda w: -w.size)}
                errors: list[BaseException] = []
                for fut in as_completed(futures):  # as each lands: a waiting install takes it at once
                    name = futures[fut]
                    try:
                        n, stamp = fut.result()
                    except StepFailed as exc:
                        errors.append(exc)
                        if on_ready is not None:
                            on_ready(name, str(exc).splitlines()[0])
                        continue
                    stats.downloaded += 1
                    stats.bytes_downloaded += n
                    updates[name] = stamp
                    if on_ready is not None:
                        on_ready(name, None)
            self._save_stamps(updates)
            if errors:
                mismatch = [e for e in errors if isinstance(e, HashMismatch)]
                first = (mismatch or errors)[0]
                raise type(first)("\n".join(str(e) for e in (mismatch or errors)))
        else:
            self._save_stamps(updates)
        stats.seconds = time.monotonic() - start
        return stats

    def prune(self, keep: Iterable[str]) -> tuple[int, int]:
        """Remove stored wheels no lock names any more; (files, bytes) removed."""
        wanted = set(keep)
        files = n = 0
        with self._locked():
            stamps = self._stamps()
            for f in sorted(self.path.glob("*.whl")):
                if f.name not in wanted:
                    n += f.stat().st_size
                    files += 1
                    f.unlink()
                    stamps.pop(f.name, None)
            (self.path / STAMPS).write_text(json.dumps(stamps, sort_keys=True), encoding="utf-8")
        return files, n
