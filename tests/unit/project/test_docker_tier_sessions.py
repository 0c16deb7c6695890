"""What a killed docker-tier session leaves is removed by the next one, and nothing of a live one is
(tests/docker/sessions.py). The liveness is the kernel's: a real flock held by a real process, then that
process SIGKILLed; the engine is a fake that records removals (the real engine: docker/test_sessions.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.docker import sessions

HOLDER = """
import fcntl, sys, time
f = open(sys.argv[1], "ab"); fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True); time.sleep(600)
"""


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    live, scratch, temp = tmp_path / "live", tmp_path / "scratch", tmp_path / "tmp"
    for d in (live, scratch, temp):
        d.mkdir()
    monkeypatch.setattr(sessions, "LIVE_DIR", live)
    monkeypatch.setattr(sessions, "SCRATCH_DIR", scratch)
    monkeypatch.setattr(sessions, "TEMP_DIR", temp)
    return live, scratch


def _holder(lock: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


class _Obj:
    def __init__(self, kind: str, name: str, session: str, removed: list[str]) -> None:
        self.kind, self.name, self.short_id, self.removed = kind, name, name, removed
        labels = {"project": "pt-multi-gpu", "session": session}
        if kind in ("container", "image"):
            self.labels = labels
        self.attrs: dict[str, Any] = {"Labels": labels, "Created": name[:2]}  # i1 before i2
        self.id = name

    def remove(self, **_: Any) -> None:
        self.removed.append(f"{self.kind} {self.name}")


class _Coll:
    def __init__(self, objs: list[_Obj], removed: list[str]) -> None:
        self.objs, self.removed = objs, removed

    def list(self, **_: Any) -> list[_Obj]:
        return self.objs

    def remove(self, image_id: str, **_: Any) -> None:
        self.removed.append(f"image {image_id}")


class _Client:
    def __init__(self, by_kind: dict[str, list[tuple[str, str]]]) -> None:
        self.removed: list[str] = []
        for kind, plural in (("container", "containers"), ("network", "networks"), ("volume", "volumes"),
                             ("image", "images")):
            objs = [_Obj(kind, name, session, self.removed) for name, session in by_kind.get(kind, [])]
            setattr(self, plural, _Coll(objs, self.removed))


def test_a_killed_sessions_objects_folders_and_lock_go_and_a_live_ones_stay(dirs: tuple[Path, Path]) -> None:
    live_dir, scratch = dirs
    dead, live = str(uuid.uuid4()), str(uuid.uuid4())
    killed, holder = _holder(live_dir / f"{dead}.lock"), _holder(live_dir / f"{live}.lock")
    try:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        assert not sessions.alive(dead) and sessions.alive(live)
        for sid in (dead, live, sessions.SESSION):
            folder = scratch / f"ptmg-{sid}-enroot-abc"
            (folder / "home").mkdir(parents=True)
        (scratch / "ptmg-export-sqsh-legacy").mkdir()  # no session in its name: not ours to judge
        temp = sessions.TEMP_DIR  # a stranger's TMPDIR in the host's /tmp, named after its scratch home
        for sid in (dead, live):
            (temp / f"ptmg-{sid}-home-xyz").mkdir()
        client = _Client({"container": [("c-dead", dead), ("c-live", live), ("c-own", sessions.SESSION)],
                          "network": [("n-dead", dead), ("n-live", live)],
                          "volume": [("v-dead", dead)],
                          "image": [("i1-dead-parent", dead), ("i2-dead-child", dead), ("i3-live", live)]})
        lines: list[str] = []
        gone = sessions.sweep(client, lines.append)
        # containers before the networks and images they use; a child image (newer) before its parent
        assert client.removed == ["container c-dead", "network n-dead", "volume v-dead", "image i2-dead-child",
                                  "image i1-dead-parent"]
        assert sorted(p.name for p in scratch.iterdir()) == sorted(
            [f"ptmg-{live}-enroot-abc", f"ptmg-{sessions.SESSION}-enroot-abc", "ptmg-export-sqsh-legacy"])
        assert [p.name for p in temp.iterdir()] == [f"ptmg-{live}-home-xyz"]
        assert not (live_dir / f"{dead}.lock").exists() and (live_dir / f"{live}.lock").exists()
        assert len(gone) == 7 and all(line.startswith("removed what a killed test session left: ") for line in lines)
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_objects_of_a_session_that_never_held_a_lock_are_a_dead_sessions(dirs: tuple[Path, Path]) -> None:
    """A run from before the locks (or one whose lock folder went with a reboot) is dead."""
    old = str(uuid.uuid4())
    client = _Client({"container": [("c-old", old)]})
    assert sessions.sweep(client, lambda _: None) == ["container c-old"]


def test_this_sessions_own_lock_reads_alive_and_is_never_swept(dirs: tuple[Path, Path]) -> None:
    sid = str(uuid.uuid4())
    sessions.hold(sid)
    try:
        assert sessions.alive(sid)
        client = _Client({"container": [("c-mine", sid)]})
        assert sessions.sweep(client, lambda _: None) == []
    finally:
        for f in sessions._held:
            f.close()
        sessions._held.clear()


def test_a_scratch_folder_carries_the_session_in_its_name(dirs: tuple[Path, Path]) -> None:
    folder = sessions.scratch("export-sqsh")
    assert folder.is_dir() and folder.name.startswith(f"ptmg-{sessions.SESSION}-export-sqsh-")
    assert sessions.sweep(_Client({}), lambda _: None) == []
