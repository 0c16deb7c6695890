"""What decides an image, hashed: the rendered Dockerfile, every file the build copies, the base,
and the state of the Debian archive the OS layer upgrades from (builder/imaging/os_snapshot.py).

An image carries this hash as a label; a build whose inputs hash matches the existing
image is skipped (``make images`` twice is a no-op; after a new security release it is not).
The recipe hash is the same without the base's image id and the archive state: what publish
compares, with the package hashes of the built image (a re-bootstrapped base is not a change).
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from builder.common.errors import InputError

#: What a build can see of the project (mirrors .dockerignore): what the Dockerfile copies into
#: the image, and imagebuild/ (build-time scripts bind-mounted into RUNs, never copied).
COPIED = ("ptmg_contract.py", "entrypoint", "smoke_tests", "imagebuild")
IGNORED_PARTS = frozenset({"__pycache__", ".mypy_cache", ".pytest_cache"})  # .dockerignore's exclusions


def context_files(root: Path) -> list[Path]:
    """Every file the Dockerfile copies in, sorted (mirrors .dockerignore)."""
    files: list[Path] = []
    for name in COPIED:
        top = root / name
        for p in sorted(top.rglob("*")) if top.is_dir() else [top]:
            if p.is_file() and not IGNORED_PARTS.intersection(p.parts) and p.suffix != ".pyc":
                files.append(p)
    return files


def inputs_hash(dockerfile: str, files: Sequence[Path], base_id: str, root: Path, os_snapshot: str = "",
                lock: str = "") -> str:
    """sha256 of everything that decides the image: Dockerfile, copied files (path, mode, bytes), base,
    the OS snapshot key (the Debian archive's state the OS layer upgrades from) and the cell's lock
    (the lock file's digest and the uv that installs from it; the staged wheels are that lock's)."""
    h = hashlib.sha256()
    h.update(b"dockerfile\0" + dockerfile.encode() + b"\0base\0" + base_id.encode() + b"\0")
    if os_snapshot:
        h.update(b"os-snapshot\0" + os_snapshot.encode() + b"\0")
    if lock:
        h.update(b"lock\0" + lock.encode() + b"\0")
    _hash_files(h, files, root)
    return "sha256:" + h.hexdigest()


def recipe_hash(dockerfile: str, files: Sequence[Path], root: Path, lock: str = "") -> str:
    """sha256 of the recipe alone: the Dockerfile, the copied files and the lock's digest, not the base
    or the archive."""
    h = hashlib.sha256(b"recipe\0dockerfile\0" + dockerfile.encode() + b"\0")
    if lock:
        h.update(b"lock\0" + lock.encode() + b"\0")
    _hash_files(h, files, root)
    return "sha256:" + h.hexdigest()


def _hash_files(h: Any, files: Sequence[Path], root: Path) -> None:
    for p in files:
        rel = p.relative_to(root).as_posix()
        try:
            mode, data = p.stat().st_mode, p.read_bytes()
        except OSError as e:  # listed a moment ago: deleted, renamed or made unreadable since
            raise InputError(f"{p}: {e.strerror or e}: a file the image copies changed while the build read it",
                             "nothing was built; run the command again once the checkout is settled") from None
        h.update(f"file\0{rel}\0{mode & 0o777:o}\0".encode())
        h.update(hashlib.sha256(data).digest())


def git_revision(root: Path) -> str:
    try:
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                           check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    rev = r.stdout.strip() if r.returncode == 0 else "unknown"
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True,
                           check=False, timeout=10).stdout.strip()
    return rev + ("-dirty" if dirty and rev != "unknown" else "")


