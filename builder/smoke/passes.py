"""Smoke-test passes, recorded per exact image id, so publishing can demand one.

A record is only ever written by `build.py test` after the whole suite passed
for that image id (the config digest: any change to a layer or label changes
it). Stored as JSON under the state dir (default .ptmg-state/, env PTMG_STATE_DIR).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from builder.common import flock


def state_dir(root: Path) -> Path:
    """Where the records live: $PTMG_STATE_DIR, else the project's .ptmg-state/."""
    return Path(os.environ.get("PTMG_STATE_DIR") or root / ".ptmg-state")


@dataclass(frozen=True)
class SmokePass:
    image_id: str
    cell: str
    passed: int
    skipped: int
    nodes: int
    at: str
    #: The DDP run's verdict (passed | skipped (one GPU) | skipped (one rank)), its backend and
    #: world size: a pass on one GPU says so (older records: "").
    ddp: str = ""
    backend: str = ""
    world_size: int = 0


def _path(root: Path) -> Path:
    return state_dir(root) / "smoke-passes.json"


def _load(root: Path) -> dict[str, dict[str, object]]:
    try:
        data = json.loads(_path(root).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_pass(root: Path, image_id: str, cell: str, passed: int, skipped: int, nodes: int = 1, *,
                ddp: str = "", backend: str = "", world_size: int = 0) -> SmokePass:
    rec = SmokePass(image_id, cell, passed, skipped, nodes, dt.datetime.now(dt.timezone.utc).isoformat(),
                    ddp, backend, world_size)
    path = _path(root)
    # One writer at a time (two `build.py test` at once, on two cells): each reads the records and
    # writes them back with its own, so without the lock the last to write drops the other's record.
    # Readers need none: the file is replaced whole.
    with flock.exclusive(path.with_suffix(".lock")):
        data = _load(root)
        data[image_id] = asdict(rec)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
        os.replace(fh.name, path)
    return rec


def smoke_pass(root: Path, image_id: str) -> SmokePass | None:
    raw = _load(root).get(image_id)
    if not isinstance(raw, dict):
        return None
    try:
        return SmokePass(**raw)  # type: ignore[arg-type]
    except TypeError:
        return None
