"""Which docker-tier sessions are alive, and what a dead one left behind.

Every container, network, volume and test image the tier makes carries `session=<id>`, and its scratch
folders under /var/tmp (and a test's folder in /tmp named after one) carry the id in their names
(:func:`scratch`). A session that ends removes them
itself, pass or fail. One that is killed (SIGKILL, a CI job past its time) cannot: the next session
removes them at its start (:func:`sweep`). A session is alive while it holds an flock on its own file
under LIVE_DIR; the kernel drops the lock of a killed process, so a leftover whose session's lock is
free belongs to nobody. A session running beside this one (another clone's `make test`) keeps its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import docker.errors

#: This process's session: the label on what it makes and the name of its lock.
SESSION = str(uuid.uuid4())
#: Shared by every user who runs the tier (sticky and world-writable, like /tmp itself), so that a root
#: session and a docker-group user's session each see the other alive.
LIVE_DIR = Path(os.environ.get("PTMG_TEST_SESSIONS_DIR", Path(tempfile.gettempdir()) / "pt-multi-gpu-test-sessions"))
SCRATCH_DIR = Path(os.environ.get("PTMG_TEST_SCRATCH_DIR", "/var/tmp"))
#: The host's /tmp, where a test may name a folder after one of its scratch folders (ch-run binds the host's
#: /tmp, so test_hpc_export's stranger gets its TMPDIR there): sweep() looks here too.
TEMP_DIR = Path(tempfile.gettempdir())
_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
#: A scratch folder's name: ptmg-<session>-<what>-<random>.
_SCRATCH = re.compile(rf"ptmg-({_UUID})-")
_held: list[IO[bytes]] = []


def hold(session: str | None = None) -> None:
    """Mark `session` (this process's SESSION by default) alive for as long as this process lives (its lock
    is never released before)."""
    session = session or SESSION
    try:
        LIVE_DIR.mkdir(parents=True)
        LIVE_DIR.chmod(0o1777)
    except FileExistsError:
        pass
    f = (LIVE_DIR / f"{session}.lock").open("ab")
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    _held.append(f)


def alive(session: str) -> bool:
    """Whether a process holds `session`'s lock (this one included)."""
    path = LIVE_DIR / f"{session}.lock"
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def label_flags(labels: dict[str, str]) -> list[str]:
    """A session's labels as the docker CLI takes them: --label k=v for each."""
    return [a for k, v in labels.items() for a in ("--label", f"{k}={v}")]


def scratch(what: str) -> Path:
    """A private folder under SCRATCH_DIR for this session's `what`, which sweep() finds if the session dies."""
    return Path(tempfile.mkdtemp(prefix=f"ptmg-{SESSION}-{what}-", dir=SCRATCH_DIR))


def dead_sessions(ids: Iterable[str]) -> set[str]:
    """Of these session ids, the ones no process holds (never this process's own)."""
    return {s for s in set(ids) if s and s != SESSION and not alive(s)}


def session_of(obj: Any) -> str:
    """The `session` label of a docker SDK container, image, network or volume ("" without one)."""
    labels = getattr(obj, "labels", None)  # containers and images; networks and volumes keep theirs in attrs
    if labels is None:
        labels = obj.attrs.get("Labels")
    return str((labels or {}).get("session", ""))


def sweep(client: Any, log: Callable[[str], None]) -> list[str]:
    """Remove what dead sessions left: their labelled containers, networks, volumes and images, their
    scratch folders (anything mounted in them unmounted first) and their lock files. Returns what went."""
    gone: list[str] = []
    flt = {"label": ["project=pt-multi-gpu", "session"]}
    containers = client.containers.list(all=True, filters=flt)
    networks = client.networks.list(filters=flt)
    volumes = client.volumes.list(filters=flt)
    images = client.images.list(all=True, filters=flt)

    folders = {p: m.group(1) for d in dict.fromkeys((SCRATCH_DIR, TEMP_DIR)) for p in d.glob("ptmg-*")
               if (m := _SCRATCH.match(p.name)) and p.is_dir()}
    locks = [p.stem for p in LIVE_DIR.glob("*.lock")] if LIVE_DIR.is_dir() else []
    dead = dead_sessions([session_of(o) for o in (*containers, *networks, *volumes, *images)]
                         + list(folders.values()) + locks)
    kinds: tuple[tuple[str, list[Any], Callable[[Any], Any]], ...] = (
        ("container", containers, lambda c: c.remove(force=True, v=True)),
        ("network", networks, lambda n: n.remove()),
        ("volume", volumes, lambda v: v.remove(force=True)),
        # newest first: a child image goes before the image it was built on
        ("image", sorted(images, key=lambda i: str(i.attrs.get("Created", "")), reverse=True),
         lambda i: client.images.remove(i.id, force=True)))
    for kind, objects, remove in kinds:
        for obj in objects:
            if session_of(obj) in dead:
                with contextlib.suppress(docker.errors.APIError):  # gone already, or in use: the next sweep's
                    remove(obj)
                gone.append(f"{kind} {getattr(obj, 'name', None) or obj.short_id}")
    for folder, session in folders.items():
        if session in dead:
            _unmount_under(folder)
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(f"folder {folder}")
    for session in dead:
        with contextlib.suppress(OSError):  # another user's, in the sticky folder: theirs to remove
            (LIVE_DIR / f"{session}.lock").unlink(missing_ok=True)
    for line in gone:
        log(f"removed what a killed test session left: {line}")
    return gone


def _unmount_under(folder: Path) -> None:
    """Lazily unmount every mount at or below `folder` (a killed run's squashfuse or overlay), deepest first,
    so that removing the folder never walks into an image."""
    root = str(folder.resolve())
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return
    points = [line.split()[4].replace("\\040", " ") for line in lines if len(line.split()) > 4]
    for point in sorted((p for p in points if p == root or p.startswith(root + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False, timeout=60)
