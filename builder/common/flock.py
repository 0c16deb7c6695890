"""Cross-process exclusive locks on files (``flock``): the kernel drops a dead holder's lock.

For work two `build.py` processes must not do at once on one host: `make images` in one
terminal and `build.py build --only X` in another (or the docker test tier's background
builds) both finding a base image missing must bootstrap it once, not twice.
"""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from builder.common.paths import cache_dir


def lock_file(kind: str, name: str) -> Path:
    """``<cache>/locks/<kind>-<name>.lock``, the name made safe for a file name."""
    return cache_dir() / "locks" / f"{kind}-{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}.lock"


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (made if missing), waiting for another holder first."""
    with held(path, shared=False):
        yield


@contextmanager
def held(path: Path, *, shared: bool, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold a shared (any number at once) or exclusive (alone) lock on ``path`` (made if missing).
    ``on_wait`` is called once, before blocking, when the lock is not free at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # releases the lock
