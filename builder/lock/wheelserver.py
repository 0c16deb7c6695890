"""The cell's wheels for the installing RUNs from a server on the host, instead of in the build context.

A build context is copied into BuildKit whole: for a cold build that is the 3 GB wheel set, a
second time, before any RUN starts (17 s of a 142 s cold build, and 3 GB more disk until the
context is dropped). Instead, the RUNs can download the wheels from this server, straight out of
the host's wheel store, and only while they install.

- Where it listens: the host's own address on the engine's default bridge (``docker network
  inspect bridge``'s gateway, e.g. 172.17.0.1), which is where a build's RUNs, on BuildKit's default
  network, reach the host. Not 127.0.0.1: that would need ``--network host`` for the whole build,
  and then every RUN (apt's maintainer scripts included) could reach every service on the host's
  loopback. On an engine whose bridge is not on this host (a remote engine, Docker Desktop's VM)
  the address cannot be bound, and the build keeps the wheels in the context (:func:`bindable`).
- It serves exactly the lock's wheels: ``/<layer>/`` is a link page of that layer's file names
  (uv's ``--find-links``), ``/<layer>/<file>`` the stored file. Anything else is a 404; no path
  is ever joined from the request.
- A wheel still on its way into the store is waited for (the fetch runs while the build's first
  RUNs do), up to ``wait_s``; a wheel whose fetch failed answers 503 with the reason, so the RUN fails
  at once and the build reports the fetch's own error.
- Nothing here needs trust: uv checks every file against the lock's sha256 (``--require-hashes``)
  as it does for a bind-mounted one. The files are public wheels.
- The URL reaches the RUNs as a build secret (``wheel-server``), never as a build argument: the port
  changes on every build and must not key the layer cache (the install lock in the context does).
"""

from __future__ import annotations

import html
import os
import socket
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from builder.render.dockerfile import WHEEL_SERVER_ID

#: The build secret that carries the server's URL into the installing RUNs (the template reads it).
SECRET_ID = WHEEL_SERVER_ID
#: How long a request waits for a wheel that is still being fetched (a cold fetch is 20-60 s).
WAIT_S = 1800.0


class _State:
    """What the server knows: each layer's file names, which are in the store, which failed."""

    def __init__(self, store: Path, layers: Mapping[str, Sequence[str]], wait_s: float) -> None:
        self.store = store
        self.layers = {layer: tuple(sorted(set(names))) for layer, names in layers.items()}
        self.wait_s = wait_s
        self.events = {n: threading.Event() for names in self.layers.values() for n in names}
        self.errors: dict[str, str] = {}
        self.lock = threading.Lock()
        self.requests = 0
        self.files = 0
        self.bytes = 0

    def ready(self, name: str, error: str | None) -> None:
        event = self.events.get(name)
        if event is None:  # the uv wheel, or another cell's: nothing here waits for it
            return
        if error is not None:
            self.errors[name] = error
        event.set()

    def fail_all(self, error: str) -> None:
        for name, event in self.events.items():
            if not event.is_set():
                self.errors[name] = error
                event.set()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass  # the build's own log shows what uv fetched

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        state = self.server.state
        with state.lock:
            state.requests += 1
        parts = unquote(urlsplit(self.path).path).split("/")
        if len(parts) == 3 and parts[0] == "" and parts[1] in state.layers:
            layer, name = parts[1], parts[2]
            if name == "":
                return self._page(layer, body)
            if name in state.layers[layer]:
                return self._file(name, body)
        self._plain(404, "not a wheel of this build\n", body)

    def _page(self, layer: str, body: bool) -> None:
        links = "".join(f'<a href="{html.escape(n)}">{html.escape(n)}</a>\n' for n in self.server.state.layers[layer])
        self._send(200, "text/html; charset=utf-8", f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n".encode(),
                   body)

    def _file(self, name: str, body: bool) -> None:
        state = self.server.state
        if not state.events[name].wait(state.wait_s):
            return self._plain(503, f"{name}: not in the wheel store after {state.wait_s:.0f} s\n", body)
        if name in state.errors:
            return self._plain(503, f"{name}: the host could not fetch it: {state.errors[name]}\n", body)
        try:
            f = (state.store / name).open("rb")
        except OSError as exc:
            return self._plain(503, f"{name}: {exc.strerror}\n", body)
        with f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            if body:
                self.wfile.flush()
                self.connection.sendfile(f)
                with state.lock:
                    state.files += 1
                    state.bytes += size

    def _plain(self, code: int, text: str, body: bool) -> None:
        self._send(code, "text/plain; charset=utf-8", text.encode(), body)

    def _send(self, code: int, kind: str, data: bytes, body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, state: _State) -> None:
        super().__init__((host, 0), _Handler)
        self.host = host
        self.state = state


class WheelServer:
    """A running server (see the module's docstring); made by :func:`serve`."""

    def __init__(self, server: _Server, secret: Path) -> None:
        self._server = server
        #: A file holding :attr:`url`: the ``wheel-server`` build secret.
        self.secret = secret

    @property
    def url(self) -> str:
        return f"http://{self._server.host}:{self._server.server_port}"

    def ready(self, name: str, error: str | None = None) -> None:
        """The fetch's report: ``name`` is in the store and verified (error None), or failed (error)."""
        self._server.state.ready(name, error)

    def fail_all(self, error: str) -> None:
        """The fetch stopped: every wheel it did not deliver answers 503 with ``error``."""
        self._server.state.fail_all(error)

    @property
    def served(self) -> tuple[int, int]:
        """(files, bytes) sent so far."""
        state = self._server.state
        with state.lock:
            return state.files, state.bytes

    @property
    def requests(self) -> int:
        """Requests answered so far (any path): none after a failed install means the RUN never got here."""
        with self._server.state.lock:
            return self._server.state.requests


def bindable(host: str) -> bool:
    """Whether this host can listen on ``host`` (an address of one of its interfaces)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
    except OSError:
        return False
    return True


@contextmanager
def serve(store: Path, layers: Mapping[str, Sequence[str]], host: str = "127.0.0.1",
          wait_s: float = WAIT_S) -> Iterator[WheelServer]:
    """A wheel server on ``host`` (a free port) for the files of ``layers`` (layer -> file names in
    ``store``), stopped and its secret file removed on exit."""
    server = _Server(host, _State(store, layers, wait_s))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="ptmg-wheel-server",
                              daemon=True)
    thread.start()
    try:
        with tempfile.TemporaryDirectory(prefix="ptmg-wheel-server-") as tmp:
            secret = Path(tmp) / SECRET_ID
            handle = WheelServer(server, secret)
            secret.write_text(handle.url + "\n", encoding="utf-8")
            yield handle
    finally:
        server.state.fail_all("the build's wheel server stopped")
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
