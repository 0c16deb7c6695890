"""Whose turn it is on an engine's BuildKit solver: a `--no-cache` build runs alone.

BuildKit merges the identical steps of builds that run at once on one engine (the same base, the same
user RUN, the same build-Python stage). When one of those builds is `--no-cache` and another is not, the
merge can leave the solver without an edge it still needs, and Debian 12's dockerd 20.10 (BuildKit 0.8)
dies of it: ``panic: failed to get edge`` (solver/scheduler.go), taking every running build and container
with it (moby/moby#42414, moby/buildkit#2303: "parallel requests of same vertexes when some builds use
--no-cache and some don't"). Seen here: the docker tier's `--no-cache` build of the 2.7.0 cell beside
the background build of the other cells, from an empty build cache.

So every BuildKit build on one engine and platform holds a lock file: shared for a cached build (any
number run at once, as before), exclusive for a `--no-cache` one, which waits until the builds running
there end and keeps new ones waiting until it ends. Across processes and threads (``flock``: the kernel
drops a dead holder's lock). Builds for another platform share no step, so they do not wait.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from builder.common import flock
from builder.common.log import log

DEFAULT_HOST = "unix:///var/run/docker.sock"


def lock_path(env: Mapping[str, str], platform: str | None) -> Path:
    """The lock of one engine (its DOCKER_HOST as the build's CLI gets it) and one platform."""
    host = env.get("DOCKER_HOST") or DEFAULT_HOST
    key = hashlib.sha256(host.encode()).hexdigest()
    return flock.lock_file("solver", f"{key}-{platform or 'native'}")


@contextmanager
def turn(env: Mapping[str, str], platform: str | None, no_cache: bool) -> Iterator[None]:
    """Hold this build's turn: shared, or exclusive for a ``no_cache`` build."""
    def waiting() -> None:
        if no_cache:
            log.info("a --no-cache build runs alone on its engine (BuildKit merges it with builds running at "
                     "once, and 20.10's solver can crash of it): waiting for the builds running there to end")
        else:
            log.info("waiting for a --no-cache build on this engine to end (it runs alone)")

    with flock.held(lock_path(env, platform), shared=not no_cache, on_wait=waiting):
        yield
