"""A killed test session's leftovers go at the next session's start; a live session's stay.

A stand-in session, in a process of its own, marks itself alive as the tier does (sessions.hold), makes
what a tier session makes (a container, a network, a volume and an image with its `session` label, and a
scratch folder under /var/tmp) and is SIGKILLed, as CI kills a run past its time: nothing of its own
cleanup runs. A second one stays alive. Then a new `pytest` session of this tier starts, as a user's
next `make test` does, and runs one trivial test; when it has ended, the killed session's things and
lock are gone and the live session's are all there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

from . import sessions
from .cellimage import ROOT

#: The stand-in session: holds its lock, makes its things with the `docker` CLI, says what they are, waits.
STAND_IN = r"""
import json, subprocess, sys, time
from tests.docker import sessions
sessions.SESSION = sid = sys.argv[1]
sessions.hold(sid)
label = ["--label", "project=pt-multi-gpu", "--label", f"session={sid}"]
def docker(*args, stdin=None):
    return subprocess.run(["docker", *args], input=stdin, capture_output=True, check=True).stdout.decode().strip()
image = f"ptmg-stand-in:{sid}"
docker("import", "--change", f"LABEL project=pt-multi-gpu session={sid}", "-", image, stdin=bytes(10240))
made = {"image": image,
        "volume": docker("volume", "create", *label),
        "network": docker("network", "create", *label, f"ptmg-stand-in-{sid[:8]}"),
        "container": docker("create", *label, "--network", f"ptmg-stand-in-{sid[:8]}", image, "/nothing"),
        "folder": str(sessions.scratch("stand-in"))}
print(json.dumps(made), flush=True)
time.sleep(900)
"""


def _stand_in(sid: str, procs: list[subprocess.Popen[str]]) -> dict[str, str]:
    """Start a stand-in session (added to `procs` at once, for the caller's cleanup) and read what it made."""
    p = subprocess.Popen([sys.executable, "-c", STAND_IN, sid], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    procs.append(p)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line, f"the stand-in session {sid} made nothing (exit {p.poll()})"
    made: dict[str, str] = json.loads(line)
    return made


def _exists(client: docker.DockerClient, kind: str, ref: str) -> bool:
    if kind == "folder":
        return Path(ref).exists()
    getter: Any = {"image": client.images, "volume": client.volumes, "network": client.networks,
                   "container": client.containers}[kind]
    try:
        getter.get(ref)
    except docker.errors.NotFound:
        return False
    return True


@pytest.fixture
def two_sessions(docker_client: docker.DockerClient) -> Iterator[tuple[dict[str, str], dict[str, str]]]:
    ids = [str(uuid.uuid4()), str(uuid.uuid4())]  # the one to kill, the one that lives
    procs: list[subprocess.Popen[str]] = []
    made: list[dict[str, str]] = []
    try:
        for sid in ids:
            made.append(_stand_in(sid, procs))
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(timeout=30)
        yield made[0], made[1]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)
        removers: dict[str, Callable[[str], Any]] = {
            "container": lambda r: docker_client.containers.get(r).remove(force=True),
            "network": lambda r: docker_client.networks.get(r).remove(),
            "volume": lambda r: docker_client.volumes.get(r).remove(force=True),
            "image": lambda r: docker_client.images.remove(r, force=True)}
        for things in made:  # whatever a failed test left
            for kind, remove in removers.items():
                with contextlib.suppress(docker.errors.NotFound):
                    remove(things[kind])
            shutil.rmtree(things["folder"], ignore_errors=True)
        for sid in ids:
            (sessions.LIVE_DIR / f"{sid}.lock").unlink(missing_ok=True)


def test_the_engine_answers(docker_client: docker.DockerClient) -> None:
    """The trivial test the next session runs (and a check of its own)."""
    assert docker_client.ping()


def test_the_next_session_removes_a_killed_sessions_leftovers_and_keeps_a_live_ones(
        docker_client: docker.DockerClient, two_sessions: tuple[dict[str, str], dict[str, str]]) -> None:
    killed, live = two_sessions
    assert all(_exists(docker_client, kind, ref) for made in (killed, live) for kind, ref in made.items())
    nxt = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                          f"{Path(__file__).relative_to(ROOT)}::test_the_engine_answers"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
                         env={**os.environ, "PYTEST_ADDOPTS": ""})  # not this session's JUnit file
    assert nxt.returncode == 0, nxt.stdout[-3000:] + nxt.stderr[-2000:]
    left = [f"{kind} {ref}" for kind, ref in killed.items() if _exists(docker_client, kind, ref)]
    assert not left, f"the killed session's leftovers survived the next session's start: {left}\n{nxt.stdout[-2000:]}"
    assert "removed what a killed test session left: container" in nxt.stdout, nxt.stdout[-2000:]
    lost = [f"{kind} {ref}" for kind, ref in live.items() if not _exists(docker_client, kind, ref)]
    assert not lost, f"the next session removed a live session's things: {lost}"
