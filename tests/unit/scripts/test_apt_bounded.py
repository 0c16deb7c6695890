"""apt-get with a bound: a mirror that trickles its answer (a byte now and then, so apt's own timeout,
which counts silence, never fires) hangs a plain `apt-get update` for good. Both of our bounded forms,
the host's `scripts/apt-bounded.sh` and the shell functions every image RUN defines
(`dockerfile/_apt.j2`), give up after their tries, each a fresh connection, with a message.

Real apt-get (this is a Debian host) against a real socket on loopback, with a private apt
configuration: the host's sources, lists and cache are never touched."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.render.dockerfile import bounded_apt
from tests.support import ROOT

pytestmark = pytest.mark.skipif(shutil.which("apt-get") is None or shutil.which("timeout") is None,
                                reason="needs Debian's apt-get and coreutils' timeout")


class TricklingMirror:
    """Accepts every connection, reads the request, then sends a status line one byte every 0.3 s."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            for byte in b"HTTP/1.1 200 OK\r\nX-Stalled: " + b"x" * 100_000:
                if self.stop.wait(0.3):
                    return
                conn.sendall(bytes([byte]))

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def mirror() -> Iterator[TricklingMirror]:
    server = TricklingMirror()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def apt_env(tmp_path: Path, mirror: TricklingMirror) -> dict[str, str]:
    """An APT_CONFIG whose only source is the trickling mirror; lists and cache in tmp_path."""
    for sub in ("parts", "lists/partial", "cache/archives/partial"):
        (tmp_path / sub).mkdir(parents=True)
    (tmp_path / "sources.list").write_text(
        f"deb [trusted=yes] http://127.0.0.1:{mirror.port}/debian bookworm main\n")
    conf = tmp_path / "apt.conf"
    conf.write_text("\n".join([
        f'Dir::Etc::SourceList "{tmp_path}/sources.list";',
        f'Dir::Etc::SourceParts "{tmp_path}/parts";',
        f'Dir::State::Lists "{tmp_path}/lists";',
        f'Dir::Cache "{tmp_path}/cache";',
        'APT::Sandbox::User "root";',
        'Debug::NoLocking "true";',
        'Acquire::http::Proxy "DIRECT";',
        'Acquire::http::Timeout "2";',  # apt's own bound on silence: the trickle defeats it
        "",
    ]))
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["APT_CONFIG"] = str(conf)
    return env


def _run(argv: list[str], env: dict[str, str], limit: float) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=limit, check=False)
    return done, time.monotonic() - start


def _image_functions() -> str:
    """The text every image RUN inlines, with a short bound for the test."""
    return bounded_apt(seconds=2, tries=2, pause=1)


def test_a_trickling_mirror_hangs_plain_apt_get(apt_env: dict[str, str], mirror: TricklingMirror) -> None:
    """The hazard itself: apt's own timeout (2 s here) never fires on a connection that trickles."""
    with pytest.raises(subprocess.TimeoutExpired):
        _run(["apt-get", "-q", "update"], apt_env, limit=8)
    assert mirror.connections >= 1


def test_the_hosts_script_gives_up_after_its_tries(apt_env: dict[str, str], mirror: TricklingMirror) -> None:
    env = {**apt_env, "PTMG_APT_TRY_SECONDS": "2", "PTMG_APT_TRIES": "2", "PTMG_APT_PAUSE": "1"}
    done, took = _run([str(ROOT / "scripts" / "apt-bounded.sh"), "update", "-q"], env, limit=40)
    assert done.returncode != 0
    assert "apt-get update failed 2 times (each try bounded to 2 s)" in done.stderr, done.stderr
    assert "try 1 of 2" in done.stderr
    assert mirror.connections == 2, "each try must open a fresh connection"
    assert took < 30


def test_the_images_functions_give_up_after_their_tries(apt_env: dict[str, str], mirror: TricklingMirror) -> None:
    script = f"set -o pipefail; {_image_functions()} \\\n && apt_bounded update"
    done, took = _run(["bash", "-c", script], apt_env, limit=40)
    assert done.returncode != 0
    assert "apt-get update failed 2 times (each try bounded to 2 s)" in done.stderr, done.stderr
    assert mirror.connections == 2, "each try must open a fresh connection"
    assert took < 30


@pytest.mark.parametrize("command", ["install", "upgrade"])
def test_install_and_upgrade_fetch_bounded_then_apply_from_the_cache(tmp_path: Path, command: str) -> None:
    """The apply step must never reach the network: it runs with --no-download after a bounded fetch.
    A stand-in apt-get on PATH records every call."""
    fake = tmp_path / "bin"
    fake.mkdir()
    log = tmp_path / "calls"
    (fake / "apt-get").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (fake / "apt-get").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    for argv in ([str(ROOT / "scripts" / "apt-bounded.sh"), command, "-y", "pkg"],
                 ["bash", "-c", f"{_image_functions()} \\\n && apt_bounded {command} -y pkg"]):
        log.unlink(missing_ok=True)
        done, _ = _run(argv, env, limit=20)
        assert done.returncode == 0, done.stderr
        fetch, apply = (line.split() for line in log.read_text().splitlines())
        assert fetch[-4:] == [command, "-y", "pkg", "--download-only"], argv
        assert "--no-download" in apply and command in apply and "--download-only" not in apply, argv


UNBOUNDED = re.compile(r"\bapt-get(\s+-\S+)*\s+(update|install|upgrade|dist-upgrade|full-upgrade|download)\b")


def test_every_image_apt_step_is_bounded() -> None:
    """No rendered Dockerfile calls apt-get's network steps but through the bounded functions."""
    dockerfiles = sorted((ROOT / "docker").glob("*/Dockerfile"))
    assert dockerfiles
    for dockerfile in dockerfiles:
        text = "\n".join(line for line in dockerfile.read_text().splitlines() if not line.startswith("#"))
        assert "apt_bounded update" in text, dockerfile
        assert not UNBOUNDED.search(text), f"{dockerfile}: {UNBOUNDED.search(text)}"


def test_the_test_clusters_apt_steps_are_bounded() -> None:
    from tests.docker import pyxis_cluster, slurm_cluster

    for name, text in (("slurm_cluster", slurm_cluster.dockerfile_text("bookworm")),
                       ("pyxis_cluster", pyxis_cluster.TAIL)):
        assert "apt_bounded update" in text, name
        assert not UNBOUNDED.search(text), f"{name}: {UNBOUNDED.search(text)}"
