"""BuildKit's cache on the engine: what `build` and `repro` leave there, and dropping it."""

from __future__ import annotations

import time
from typing import Any

from builder.common.log import log
from builder.engine.capabilities import CONTAINERD, Store
from builder.engine.translate import _translated

#: What marks a shared tree's stage in a cache record's description (its RUN's last command).
SHARED_STAGE_MARKS = ("/ptmg-build/shared-tree.sh cuda ", "/ptmg-build/shared-tree.sh torch ")
#: The build cache's listing, asked again after this many seconds each time it fails on a snapshot that is
#: gone: right after a build, Docker 28's containerd image store can list a record whose read-only view
#: (`<id>-view`, a bind mount's) BuildKit is still removing, and refuses the whole listing ("snapshot
#: ...-view does not exist: not found"; moby/buildkit#3599). Seen after `build.py repro`'s builds;
#: 10 s later the same listing answered.
LISTING_RETRIES = (1.0, 2.0, 4.0, 8.0)


class BuildCache:
    """The engine's build-cache calls (a part of :class:`builder.engine.docker.Engine`)."""

    client: Any

    def store(self) -> Store:  # the engine's image store (Engine: asked of `docker info` once)
        raise NotImplementedError

    @_translated
    def drop_build_contexts(self) -> int:
        """Drop the build contexts BuildKit keeps after its builds (a cell's holds its ~3 GB of
        wheels), never one a running build uses; the bytes freed. In the classic store the layer
        cache stays whole: a step's cache key is the checksum of what it mounts, so the next build
        sends its context again (a local copy) and still reuses every unchanged layer. Docker 28's
        containerd image store drops the whole layer cache with a pruned context (even one pruned by
        its own ID: the next build reran every RUN, so patch day rebuilt the venv), so there they stay
        and nothing is freed."""
        if self.store().kind == CONTAINERD:
            log.info("the build contexts stay in the build cache: pruning one in the containerd image store "
                     "drops the whole layer cache with it")
            return 0
        out = self.client.api.prune_builds(filters={"type": "source.local"})
        return int((out or {}).get("SpaceReclaimed") or 0)

    @_translated
    def drop_shared_stages(self) -> int:
        """Drop what the shared trees' stages leave in the cache (dockerfile/07-shared.j2: the CUDA wheels
        unpacked, 3.4 GB for CUDA 13, and torch's shared files, ~0.8 GB), never one a running build uses;
        the bytes freed. The image holds its own copy of each (the COPY that makes its first layers), so
        the stage's is a second one, kept for nothing but the stage's next run: without it the next build
        runs the stage again (half a minute: uv unpacks, imagebuild/shared-tree.sh seals) and gets the same bytes, so
        its COPY is a cache hit (BuildKit keys a COPY on a checksum of what it copies) and every layer
        above it too. In the classic store only, for the reason drop_build_contexts gives."""
        if self.store().kind == CONTAINERD:
            return 0
        ids = {str(r["ID"]) for r in self._build_cache()
               if r.get("Type") == "regular" and not r.get("InUse")
               and any(mark in str(r.get("Description") or "") for mark in SHARED_STAGE_MARKS)}
        return self.drop_build_records(ids) if ids else 0

    def _build_cache(self) -> list[dict[str, Any]]:
        """The engine's build cache records (`docker system df`), asked again while it names a snapshot
        that is gone (LISTING_RETRIES: at most 15 s more); any other refusal at once."""
        import docker.errors

        waits = iter(LISTING_RETRIES)
        while True:
            try:
                return list(self.client.df().get("BuildCache") or [])
            except docker.errors.APIError as exc:
                why = str(getattr(exc, "explanation", None) or exc)
                wait = next(waits, None) if "snapshot" in why and "does not exist" in why else None
                if wait is None:
                    raise
                log.info("the engine's build cache listing named a snapshot that is gone (%s); asking again in "
                         "%.0f s", why, wait)
                time.sleep(wait)

    @_translated
    def build_records(self) -> set[str]:
        """The IDs of the layer records in BuildKit's cache now (not cache mounts, not contexts)."""
        return {str(r["ID"]) for r in self._build_cache() if r.get("Type") == "regular"}

    @_translated
    def drop_build_records(self, ids: set[str]) -> int:
        """Drop these layer records (what one build made, by :meth:`build_records` before and after it),
        never another's; the bytes freed. The engine takes one ID per prune, and removes a record
        only once nothing built on it is left, so it goes round until a round frees nothing (at most
        one round per record)."""
        freed, left = 0, set(ids)
        for _round in range(len(ids)):  # bounded: a round that frees anything frees one record at least
            gone: set[str] = set()
            for rid in sorted(left):
                out = self.client.api.prune_builds(filters={"id": [rid]}, all=True) or {}
                freed += int(out.get("SpaceReclaimed") or 0)
                gone |= {str(d) for d in out.get("CachesDeleted") or []}
            if not gone & left:
                break
            left -= gone
        return freed
