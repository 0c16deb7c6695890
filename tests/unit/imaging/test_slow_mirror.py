"""A no-op `build.py build` stays quick or says why: the Debian archive's state (three InRelease files,
asked together) is bounded as a whole, and a wait past a second is named on stderr, once
(builder/imaging/os_snapshot.py, builder/common/waiting.py). Against a real, slow HTTP server on 127.0.0.1."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from builder.common import waiting
from builder.imaging import os_snapshot
from tests.unit.imaging.test_os_snapshot import release


class _Mirror(ThreadingHTTPServer):
    daemon_threads = True
    delay = 0.0
    release_all = threading.Event()


class _Handler(BaseHTTPRequestHandler):
    server: _Mirror

    def do_GET(self) -> None:
        if self.server.delay:
            self.server.release_all.wait(self.server.delay)  # a mirror that takes its time (ended at teardown)
        body = release(self.path.split("/dists/")[1].split("/", 1)[0]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def mirror(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Mirror]:
    for name in ("NO_PROXY", "no_proxy"):  # the host's proxy settings must not take 127.0.0.1 elsewhere
        monkeypatch.setenv(name, "127.0.0.1,localhost")
    server = _Mirror(("127.0.0.1", 0), _Handler)
    server.release_all = threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release_all.set()
    server.shutdown()
    server.server_close()


def _snapshots(server: _Mirror, deadline: float) -> os_snapshot.Snapshots:
    base = f"http://127.0.0.1:{server.server_address[1]}"
    return os_snapshot.Snapshots(f"{base}/debian", f"{base}/debian-security", environ={}, deadline=deadline)


def test_a_slow_mirror_is_bounded_as_a_whole_and_named_on_stderr(mirror: _Mirror,
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    mirror.delay = 8.0  # each request; one after the other that was 24 s, each within its own 25 s limits
    start = time.monotonic()
    snap = _snapshots(mirror, deadline=2.0).for_base("debian:bookworm-slim", "bookworm", "amd64",
                                                     "sha256:recorded", "pt:a")
    took = time.monotonic() - start
    assert snap.key == "sha256:recorded" and snap.source == "recorded on pt:a"  # as offline: the no-op stays one
    assert 2.0 <= took < 3.5, took
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("waiting for")]
    port = mirror.server_address[1]
    assert lines == [f"waiting for the Debian archive's state (at most 2 s): GET "
                     f"http://127.0.0.1:{port}/debian/dists/bookworm/InRelease, "
                     f"http://127.0.0.1:{port}/debian/dists/bookworm-updates/InRelease, "
                     f"http://127.0.0.1:{port}/debian-security/dists/bookworm-security/InRelease"], lines


def test_a_quick_mirror_says_nothing_and_gives_the_archives_state(mirror: _Mirror,
                                                                   capfd: pytest.CaptureFixture[str]) -> None:
    snap = _snapshots(mirror, deadline=10.0).for_base("debian:bookworm-slim", "bookworm", "amd64",
                                                      "sha256:recorded", "pt:a")
    assert snap.source == "mirror" and [s.suite for s in snap.suites] == [
        "bookworm", "bookworm-updates", "bookworm-security"]
    assert snap.key == os_snapshot.key_for("bookworm", "amd64", snap.suites) != "sha256:recorded"
    assert "waiting for" not in capfd.readouterr().err


def test_a_suite_that_answers_late_but_within_the_deadline_counts(mirror: _Mirror,
                                                                   capfd: pytest.CaptureFixture[str]) -> None:
    mirror.delay = 1.5  # past the notice, within the bound: named once, then the mirror's answer
    snap = _snapshots(mirror, deadline=6.0).for_base("debian:bookworm-slim", "bookworm", "amd64", None, "pt:a")
    assert snap.source == "mirror"
    assert sum(line.startswith("waiting for the Debian archive") for line in capfd.readouterr().err.splitlines()) == 1


def test_announced_names_a_long_wait_once_and_a_short_one_never() -> None:
    said: list[str] = []
    with waiting.announced("the quick thing", after=0.5, say=said.append):
        pass
    with waiting.announced(lambda: "the slow thing, asked late", after=0.1, say=said.append):
        time.sleep(0.6)
    assert said == ["waiting for the slow thing, asked late"]


def test_a_getter_that_raises_something_else_is_a_bug_and_keeps_its_type() -> None:
    def broken(url: str) -> str:
        raise KeyError(url)

    with pytest.raises(KeyError):
        os_snapshot.fetch("bookworm", "amd64", get=broken)


def test_a_slow_noop_says_why() -> None:
    assert waiting.slow_noop(1.9, 0.8, 9.0, 2) is None  # under the bound: nothing to say
    assert waiting.slow_noop(5.6, 0.9, 5.7, 2) == (
        "nothing to build, yet this took 5.6 s (0.9 s on a CPU, 4.7 s waiting): the host is busy (load average "
        "5.7 on 2 cores): most of the wait was for a CPU")
    assert waiting.slow_noop(12.0, 0.8, 0.3, 2) == (
        "nothing to build, yet this took 12.0 s (0.8 s on a CPU, 11.2 s waiting): waiting on the network or the "
        "engine (each wait past a second is named above)")


def test_the_process_times_count_from_the_process_start() -> None:
    import subprocess
    import sys

    code = ("import time; exec('while time.process_time() < 0.5: pass'); time.sleep(0.5)\n"
            "from builder.common import waiting; w, c = waiting.process_times(); print(w, c)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    wall, cpu = map(float, out.stdout.split())
    # The busy loop and the sleep before the import count. The wall time comes from /proc in clock ticks
    # (10 ms at 100 Hz: the start and uptime each rounded), so it may read up to two ticks short.
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert cpu >= 0.5 and wall >= cpu + 0.5 - 2 * tick, (wall, cpu)
