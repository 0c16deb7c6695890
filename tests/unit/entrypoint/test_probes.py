"""entrypoint/probes.py against tiny servers on 127.0.0.1 started here: an HTTP server that
wants a token, and SSH-like servers that send a banner (or something else)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

import probes

TOKEN = "t0ken-abc"


class _Handler(BaseHTTPRequestHandler):
    seen: ClassVar[list[dict[str, str]]] = []

    def do_GET(self) -> None:
        type(self).seen.append({"path": self.path, **{k: v for k, v in self.headers.items()}})
        if self.path == "/broken":
            status = 503
        elif self.headers.get("Authorization") == f"token {TOKEN}":
            status = 200
        else:
            status = 403  # what Jupyter answers on /api/status without a token
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_port() -> Iterator[int]:
    _Handler.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_http_answer_below_500_is_alive(http_port: int) -> None:
    assert probes.http_alive(http_port, "/api/status", 2.0) == (True, f"GET :{http_port}/api/status -> 403")
    assert _Handler.seen[-1]["User-Agent"] == "pt-multi-gpu-healthcheck"
    assert "Authorization" not in _Handler.seen[-1]


def test_http_with_the_token_file_sends_the_token(http_port: int, tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(f"{TOKEN}\n")
    assert probes.http_alive(http_port, "/api/status", 2.0, str(f)) == (True, f"GET :{http_port}/api/status -> 200")
    assert _Handler.seen[-1]["Authorization"] == f"token {TOKEN}"


@pytest.mark.parametrize("content", [None, "", "a\nb", "with space", "caf\u00e9", "a\x00b"])
def test_http_without_a_usable_token_sends_none(http_port: int, tmp_path: Path, content: str | None) -> None:
    f = tmp_path / "token"
    if content is not None:
        f.write_text(content)
    ok, _ = probes.http_alive(http_port, "/api/status", 2.0, str(f))  # a newline used to raise ValueError
    assert ok and "Authorization" not in _Handler.seen[-1]


def test_a_directory_as_token_file_is_no_token(http_port: int, tmp_path: Path) -> None:
    ok, _ = probes.http_alive(http_port, "/api/status", 2.0, str(tmp_path))
    assert ok and "Authorization" not in _Handler.seen[-1]


def test_http_5xx_is_not_alive(http_port: int) -> None:
    assert probes.http_alive(http_port, "/broken", 2.0) == (False, f"GET :{http_port}/broken -> 503")


def test_http_nothing_listening() -> None:
    port = _closed_port()
    ok, detail = probes.http_alive(port, "/", 2.0)
    assert not ok and detail.startswith(f"GET :{port}/: ") and "refused" in detail.lower()


@pytest.fixture
def banner_server() -> Iterator[Callable[[bytes], tuple[int, list[bytes]]]]:
    """`start(reply) -> (port, received)`: accepts one connection, records what the client sent
    first, answers `reply` and closes."""
    threads: list[threading.Thread] = []
    socks: list[socket.socket] = []

    def start(reply: bytes) -> tuple[int, list[bytes]]:
        listener = socket.create_server(("127.0.0.1", 0))
        socks.append(listener)
        received: list[bytes] = []

        def serve() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(5)
                received.append(conn.recv(256))
                conn.sendall(reply)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        threads.append(thread)
        return int(listener.getsockname()[1]), received

    try:
        yield start
    finally:
        for s in socks:
            s.close()
        for t in threads:
            t.join(timeout=10)


def test_ssh_banner(banner_server: Callable[[bytes], tuple[int, list[bytes]]]) -> None:
    port, received = banner_server(b"SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3\r\n")
    assert probes.ssh_banner(port, 2.0) == (True, f"ssh :{port} -> 'SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3'")
    assert received == [probes.HEALTHCHECK_IDENT]  # our identification first: sshd logs one quiet line


def test_something_else_on_the_ssh_port(banner_server: Callable[[bytes], tuple[int, list[bytes]]]) -> None:
    port, _ = banner_server(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    assert probes.ssh_banner(port, 2.0) == (False, f"ssh :{port} -> 'HTTP/1.1 400 Bad Request'")


def test_ssh_nothing_listening() -> None:
    port = _closed_port()
    ok, detail = probes.ssh_banner(port, 2.0)
    assert not ok and detail.startswith(f"ssh :{port}: ")


def test_probe_dispatches_on_the_state_entry(http_port: int, tmp_path: Path,
                                             banner_server: Callable[[bytes], tuple[int, list[bytes]]]) -> None:
    f = tmp_path / "token"
    f.write_text(TOKEN)
    entry: dict[str, object] = {"check": "http", "port": http_port, "path": "/api/status", "token_file": str(f)}
    assert probes.probe(entry) == (True, f"GET :{http_port}/api/status -> 200")
    assert probes.probe({"check": "http", "port": str(http_port)})[1] == f"GET :{http_port}/ -> 403"
    port, _ = banner_server(b"SSH-2.0-x\r\n")
    assert probes.probe({"check": "ssh", "port": port})[0] is True
    assert probes.probe({"check": "pending"}) == (False, "enabled, still starting")
    assert probes.probe({"check": "failed"}) == (False, "enabled, but it could not be started (see the container log)")
    assert probes.probe({"check": "carrier-pigeon", "port": 1}) == (False, "unknown check 'carrier-pigeon'")
    assert probes.probe({"check": "http", "port": "eighty"}) == (False, "bad port 'eighty'")
