"""The host side of a build: the wheel store (download, verify, refuse a changed file), the
host's index settings (a mirror with credentials that never show), and the staged build context."""

from __future__ import annotations

import hashlib
import http.client
import http.server
import io
import os
import socket
import ssl
import subprocess
import sys
import threading
import urllib.error
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from builder.common.errors import StepFailed
from builder.common.paths import sha256_file
from builder.imaging import supply
from builder.lock import model, net, staging, store, uvbin
from builder.lock.model import CellLock, Package, Wheel
from builder.lock.net import NetConfig
from builder.lock.store import HashMismatch, Store
from builder.lock.target import Target
from tests.support import ROOT

SIX = b"six wheel bytes " * 100
SIX_NAME = "six-1.17.0-py2.py3-none-any.whl"


class Files(http.server.BaseHTTPRequestHandler):
    """Serves /files/<name> and a PEP 503 index at /simple/<project>/ (links to the files); records
    the paths asked for and the Authorization header it saw. `before[path]` runs before that path
    is served (what another process does meanwhile). `faults[path]` lists what the next requests
    for that path get instead, one each: an HTTP status ("503") or "cut" (the headers promise the
    whole file, half of it comes, then the connection closes)."""

    files: ClassVar[dict[str, bytes]] = {}
    auth_seen: ClassVar[list[str]] = []
    paths_seen: ClassVar[list[str]] = []
    before: ClassVar[dict[str, Callable[[], object]]] = {}
    faults: ClassVar[dict[str, list[str]]] = {}

    def do_GET(self) -> None:
        self.auth_seen.append(self.headers.get("Authorization", ""))
        path = self.path
        self.paths_seen.append(path)
        if path in self.before:
            self.before.pop(path)()
        fault = self.faults.get(path, []).pop(0) if self.faults.get(path) else None
        if fault == "cut":
            body = self.files[path[7:]]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
            return
        if fault:
            self.send_error(int(fault))
            return
        if path.startswith("/files/") and path[7:] in self.files:
            body, kind = self.files[path[7:]], "application/octet-stream"
        elif path.startswith("/simple/"):
            project = path.split("/")[2]
            links = "".join(f'<a href="/files/{n}#sha256=x">{n}</a>' for n in self.files if n.startswith(project))
            body, kind = f"<html><body>{links}</body></html>".encode(), "text/html"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    Files.files = {SIX_NAME: SIX}
    Files.auth_seen = []
    Files.paths_seen = []
    Files.before = {}
    Files.faults = {}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    # A short poll: shutdown() waits for it, and the default (0.5 s) was most of this file's time.
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def six(base: str, data: bytes = SIX) -> Wheel:
    return Wheel(SIX_NAME, f"{base}/files/{SIX_NAME}", len(data), hashlib.sha256(data).hexdigest())


def test_download_verifies_and_stores_read_only(server: str, tmp_path: Path) -> None:
    s = Store(tmp_path / "cache" / "pt-multi-gpu" / "wheels")  # a new machine: no cache folder yet
    stats = s.ensure([six(server)])
    assert (stats.downloaded, stats.present) == (1, 0)
    f = s.file(six(server))
    assert f.read_bytes() == SIX and oct(f.stat().st_mode & 0o777) == "0o444"
    assert not list(s.path.glob(".tmp-*"))
    again = s.ensure([six(server)])  # once per machine: the second time is a stat
    assert (again.downloaded, again.present) == (0, 1)


def test_an_unchanged_store_is_not_hashed_again(server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Store(tmp_path / "store")
    s.ensure([six(server)])
    calls: list[Path] = []

    def counting(p: Path) -> str:
        calls.append(p)
        return "0" * 64

    monkeypatch.setattr(store, "sha256_file", counting)
    s.ensure([six(server)])
    assert calls == []  # size, mtime and inode as verified: no 3 GB re-hash on every build


def test_a_planted_wrong_wheel_in_the_store_stops_the_build(server: str, tmp_path: Path) -> None:
    s = Store(tmp_path / "store")
    s.ensure([six(server)])
    f = s.file(six(server))
    f.chmod(0o644)
    f.write_bytes(b"print('pwned')".ljust(len(SIX)))  # same name, same size
    with pytest.raises(HashMismatch) as exc:
        s.ensure([six(server)])
    text = str(exc.value)
    assert "hash mismatch in the wheel store" in text and str(f) in text
    assert f"Expected: sha256:{six(server).sha256}" in text and "Computed: sha256:" in text
    assert f.read_bytes().startswith(b"print('pwned')")  # never silently replaced


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The store's waits between tries, recorded instead of slept."""
    seen: list[float] = []
    monkeypatch.setattr("builder.lock.store.time.sleep", seen.append)
    return seen


def test_a_transient_failure_is_tried_again_and_the_wheel_stored(server: str, tmp_path: Path,
                                                                  waits: list[float]) -> None:
    """A 503 from the index, then a body cut short, then the file: one of a cold build's 136 downloads
    hiccuping costs two waits, not the build."""
    Files.faults[f"/files/{SIX_NAME}"] = ["503", "cut"]
    s = Store(tmp_path / "store")
    stats = s.ensure([six(server)])
    assert (stats.downloaded, Files.paths_seen.count(f"/files/{SIX_NAME}")) == (1, 3)
    assert s.file(six(server)).read_bytes() == SIX and not list(s.path.glob(".tmp-*"))
    assert waits == list(store.RETRY_WAITS_S) == [1.0, 4.0]


def test_a_source_that_keeps_failing_is_given_up_after_three_attempts(server: str, tmp_path: Path,
                                                                     waits: list[float]) -> None:
    Files.faults[f"/files/{SIX_NAME}"] = ["503"] * 5
    with pytest.raises(StepFailed) as exc:
        Store(tmp_path / "store").ensure([six(server)])
    assert f"cannot download {SIX_NAME}" in str(exc.value) and "503" in str(exc.value)
    assert "(after 3 attempts)" in str(exc.value)
    assert Files.paths_seen.count(f"/files/{SIX_NAME}") == 3 and len(waits) == 2
    assert not list((tmp_path / "store").glob(".tmp-*")) and not (tmp_path / "store" / SIX_NAME).exists()


def test_a_transfer_cut_short_is_not_called_a_changed_file(server: str, tmp_path: Path, waits: list[float]) -> None:
    """http.client hands back the short body without a word; it must not become a "hash mismatch" (a
    supply-chain alarm whose fix is to re-lock) but a network failure, tried again, then reported."""
    Files.faults[f"/files/{SIX_NAME}"] = ["cut"] * 3
    with pytest.raises(StepFailed) as exc:
        Store(tmp_path / "store").ensure([six(server)])
    assert not isinstance(exc.value, HashMismatch) and "hash mismatch" not in str(exc.value)
    assert f"the connection closed after {len(SIX) // 2} of {len(SIX)} bytes (after 3 attempts)" in str(exc.value)


def test_an_answer_after_a_hiccup_ends_the_tries(server: str, tmp_path: Path, waits: list[float]) -> None:
    """A 503, then a 404: the 404 is the answer, given with how many tries it took."""
    Files.faults[f"/files/{SIX_NAME}"] = ["503", "404"]
    with pytest.raises(StepFailed) as exc:
        Store(tmp_path / "store").ensure([six(server)])
    assert "404" in str(exc.value) and "(after 2 attempts)" in str(exc.value) and waits == [1.0]


@pytest.mark.parametrize("status", ["404", "403"])
def test_an_answer_is_not_tried_again(server: str, tmp_path: Path, waits: list[float], status: str) -> None:
    """A 404 or 403 is the index's answer: the next source is asked at once, and this one once only."""
    Files.faults[f"/files/{SIX_NAME}"] = [status]
    with pytest.raises(StepFailed) as exc:
        Store(tmp_path / "store").ensure([six(server)])
    assert status in str(exc.value) and "attempts" not in str(exc.value)
    assert Files.paths_seen.count(f"/files/{SIX_NAME}") == 1 and waits == []


def test_a_mirrors_index_page_is_tried_again_too(server: str, tmp_path: Path, waits: list[float]) -> None:
    """An air-gapped site has only its mirror: a 502 on the mirror's page must not send the fetch to PyPI."""
    Files.faults["/simple/six/"] = ["502"]
    net = NetConfig({"PIP_INDEX_URL": f"{server}/simple"})
    wheel = Wheel(SIX_NAME, "https://files.pythonhosted.org.invalid/six.whl", len(SIX), hashlib.sha256(SIX).hexdigest())
    assert Store(tmp_path / "store", net).ensure([wheel]).downloaded == 1
    assert Files.paths_seen == ["/simple/six/", "/simple/six/", f"/files/{SIX_NAME}"] and waits == [1.0]


@pytest.mark.parametrize(("exc", "again"), [
    (urllib.error.URLError(socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")), True),
    (urllib.error.URLError(socket.gaierror(socket.EAI_NONAME, "Name or service not known")), False),
    (urllib.error.URLError(TimeoutError("timed out")), True),
    (TimeoutError("The read operation timed out"), True),
    (ConnectionResetError(104, "Connection reset by peer"), True),
    (http.client.RemoteDisconnected("Remote end closed connection without response"), True),
    (http.client.IncompleteRead(b"x", 10), True),
    (net.CutShort("the connection closed after 1 of 2 bytes"), True),
    (urllib.error.URLError(ConnectionRefusedError(111, "Connection refused")), False),
    (urllib.error.URLError(ssl.SSLCertVerificationError("certificate verify failed")), False),
    (urllib.error.URLError("unknown url type: ftp"), False),
    (OSError("only http(s) URLs are fetched"), False),
    *[(urllib.error.HTTPError("u", code, "x", None, None), code in (408, 429, 500, 502, 503, 504))  # type: ignore[arg-type]
      for code in (400, 401, 403, 404, 408, 410, 429, 500, 501, 502, 503, 504)],
])
def test_what_counts_as_transient(exc: BaseException, again: bool) -> None:
    assert net.transient(exc) is again


def test_sha256_file_reads_the_whole_file(tmp_path: Path) -> None:
    data = bytes(range(256)) * (3 * 4096) + b"tail"  # 3 MiB and a bit: several chunks
    (tmp_path / "big").write_bytes(data)
    assert sha256_file(tmp_path / "big") == hashlib.sha256(data).hexdigest()


IDNA_NAME = "idna-3.20-py3-none-any.whl"
IDNA = b"idna wheel bytes"


def idna(base: str) -> Wheel:
    return Wheel(IDNA_NAME, f"{base}/files/{IDNA_NAME}", len(IDNA), hashlib.sha256(IDNA).hexdigest())


def _plant(f: Path, data: bytes) -> None:
    f.chmod(0o644)
    f.write_bytes(data)


def test_every_stored_wheel_is_checked_whatever_comes_before_it(server: str, tmp_path: Path) -> None:
    """A verified wheel, or a missing one, earlier in the list does not end the check of the rest."""
    Files.files[IDNA_NAME] = IDNA
    s = Store(tmp_path / "store")
    s.ensure([six(server), idna(server)])
    _plant(s.file(idna(server)), b"X" * len(IDNA))
    with pytest.raises(HashMismatch):
        s.ensure([six(server), idna(server)])  # six: verified before, skipped
    s.file(six(server)).unlink()
    with pytest.raises(HashMismatch):
        s.ensure([six(server), idna(server)])  # six: missing


def test_a_wheel_with_the_stores_mtime_but_not_its_stamp_is_hashed(server: str, tmp_path: Path) -> None:
    s = Store(tmp_path / "store")
    s.ensure([six(server)])
    f = s.file(six(server))
    _plant(f, b"print('pwned')")  # another size, and the mtime every stored wheel has
    os.utime(f, (store.EPOCH, store.EPOCH))
    with pytest.raises(HashMismatch):
        s.ensure([six(server)])


def test_a_good_wheel_without_its_stamp_is_hashed_and_kept(server: str, tmp_path: Path) -> None:
    s = Store(tmp_path / "store")
    s.ensure([six(server)])
    (tmp_path / "store" / store.STAMPS).unlink()
    again = s.ensure([six(server)])
    assert (again.downloaded, again.present) == (0, 1)


def test_a_changed_file_on_the_index_is_refused_and_not_kept(server: str, tmp_path: Path) -> None:
    locked = six(server, b"the file as it was when locked")
    s = Store(tmp_path / "store")
    with pytest.raises(HashMismatch) as exc:
        s.ensure([locked])
    assert f"hash mismatch downloading {SIX_NAME} from {server}/files/{SIX_NAME}" in str(exc.value)
    assert f"Expected: sha256:{locked.sha256}" in str(exc.value)
    assert not s.file(locked).exists() and not list((tmp_path / "store").glob(".tmp-*"))


def test_a_same_size_file_with_another_sha256_is_refused_and_not_kept(server: str, tmp_path: Path) -> None:
    """The index serves a file of the locked size but other bytes: the sha256 alone must catch it."""
    locked = six(server, bytes(reversed(SIX)))  # same length as what the server holds, other content
    assert locked.size == len(SIX) and locked.sha256 != hashlib.sha256(SIX).hexdigest()
    s = Store(tmp_path / "store")
    with pytest.raises(HashMismatch) as exc:
        s.ensure([locked])
    text = str(exc.value)
    assert f"hash mismatch downloading {SIX_NAME}" in text and f"Expected: sha256:{locked.sha256} ({len(SIX)} bytes)" \
        in text and f"Computed: sha256:{hashlib.sha256(SIX).hexdigest()} ({len(SIX)} bytes)" in text
    assert not s.file(locked).exists() and not list((tmp_path / "store").glob(".tmp-*"))


def test_a_mirror_from_pip_index_url_is_used_with_its_credentials_never_shown(server: str, tmp_path: Path) -> None:
    host = server.removeprefix("http://")
    net = NetConfig({"PIP_INDEX_URL": f"http://ci-bot:t0ken@{host}/simple"})
    wheel = Wheel(SIX_NAME, "https://files.pythonhosted.org.invalid/six.whl", len(SIX), hashlib.sha256(SIX).hexdigest())
    Store(tmp_path / "store", net).ensure([wheel])  # the lock's own URL does not resolve: the mirror served it
    assert any(a.startswith("Basic ") for a in Files.auth_seen)
    Files.files = {}
    missing = Wheel("idna-3.20-py3-none-any.whl", "http://127.0.0.1:9/idna.whl", 1, "0" * 64)
    with pytest.raises(StepFailed) as exc:
        Store(tmp_path / "store", net).ensure([missing])
    assert "t0ken" not in str(exc.value) and f"http://{host}/simple/" in str(exc.value)


def test_a_failing_mirror_falls_through_to_the_next_index_and_then_the_locks_own_url(
        server: str, tmp_path: Path) -> None:
    """The first mirror answers 404 for its whole index: its error is noted, and the next source is asked."""
    net = NetConfig({"PIP_INDEX_URL": f"{server}/broken-mirror/simple", "PIP_EXTRA_INDEX_URL": f"{server}/simple"})
    stats = Store(tmp_path / "store", net).ensure([six(server)])
    assert stats.downloaded == 1
    assert Files.paths_seen == ["/broken-mirror/simple/six/", "/simple/six/", f"/files/{SIX_NAME}"]
    net = NetConfig({"PIP_INDEX_URL": f"{server}/broken-mirror/simple"})
    Store(tmp_path / "other", net).ensure([six(server)])  # the lock's own URL after the last index
    assert Files.paths_seen[3:] == ["/broken-mirror/simple/six/", f"/files/{SIX_NAME}"]


def test_a_wheel_another_process_stored_meanwhile_is_verified_not_fetched_again(
        server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both wheels are missing when the fetch starts; while six downloads (the bigger, first, one job),
    another build on the machine stores idna. That copy is checked and kept, with its stamp."""
    Files.files[IDNA_NAME] = IDNA
    path = tmp_path / "store"
    Files.before[f"/files/{SIX_NAME}"] = lambda: Store(path).ensure([idna(server)])
    stats = Store(path, jobs=1).ensure([six(server), idna(server)])
    assert (stats.downloaded, stats.bytes_downloaded) == (2, len(SIX))  # idna's bytes came from the other process
    assert Files.paths_seen.count(f"/files/{IDNA_NAME}") == 1
    hashed: list[Path] = []

    def counting(p: Path) -> str:
        hashed.append(p)
        return "0" * 64

    monkeypatch.setattr(store, "sha256_file", counting)
    assert Store(path).ensure([six(server), idna(server)]).present == 2
    assert hashed == []  # both stamps were kept: no re-hash on the next build


def test_a_wrong_wheel_another_process_stored_meanwhile_is_refused(server: str, tmp_path: Path) -> None:
    Files.files[IDNA_NAME] = IDNA
    path = tmp_path / "store"
    Files.before[f"/files/{SIX_NAME}"] = lambda: (path / IDNA_NAME).write_bytes(b"X" * len(IDNA))
    with pytest.raises(HashMismatch) as exc:
        Store(path, jobs=1).ensure([six(server), idna(server)])
    assert str(path / IDNA_NAME) in str(exc.value)
    assert (path / IDNA_NAME).read_bytes() == b"X" * len(IDNA)  # neither trusted nor replaced
    assert f"/files/{IDNA_NAME}" not in Files.paths_seen


def test_a_waiting_build_hears_of_every_wheel_stored_or_present(server: str, tmp_path: Path) -> None:
    """on_ready (the build's wheel server) hears of each wheel: one already in the store at once, one
    downloaded when it lands. A wheel it never hears of would keep an install RUN waiting."""
    Files.files[IDNA_NAME] = IDNA
    s = Store(tmp_path / "store")
    s.ensure([idna(server)])
    heard: list[tuple[str, str | None]] = []
    s.ensure([six(server), idna(server)], on_ready=lambda name, error: heard.append((name, error)))
    assert heard == [(IDNA_NAME, None), (SIX_NAME, None)]


def test_a_failed_wheel_does_not_silence_the_others(server: str, tmp_path: Path) -> None:
    """six (the bigger, fetched first with one job) fails; idna is still fetched and announced, and the
    fetch then fails with six's reason."""
    Files.files[IDNA_NAME] = IDNA
    Files.faults[f"/files/{SIX_NAME}"] = ["404"]
    heard: list[tuple[str, str | None]] = []
    with pytest.raises(StepFailed) as exc:
        Store(tmp_path / "store", jobs=1).ensure([six(server), idna(server)],
                                                 on_ready=lambda name, error: heard.append((name, error)))
    assert [n for n, _ in heard] == [SIX_NAME, IDNA_NAME] and heard[1][1] is None
    assert heard[0][1] == f"cannot download {SIX_NAME}:" and "404" in str(exc.value)
    assert (tmp_path / "store" / IDNA_NAME).read_bytes() == IDNA


def test_prune_keeps_what_a_lock_names(server: str, tmp_path: Path) -> None:
    s = Store(tmp_path / "store")
    s.ensure([six(server)])
    (tmp_path / "store" / "old-1.0-py3-none-any.whl").write_bytes(b"x" * 10)
    assert s.prune({SIX_NAME}) == (1, 10)
    assert s.file(six(server)).exists()


def test_default_store_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(store.STORE_ENV, str(tmp_path / "empty"))
    assert store.default_store() == tmp_path / "empty"
    monkeypatch.delenv(store.STORE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert store.default_store() == tmp_path / "cache" / "pt-multi-gpu" / "wheels"


# --- staging ---------------------------------------------------------------------------------------
def _lock(tmp_path: Path) -> tuple[CellLock, dict[str, Path]]:
    files = {}
    pkgs = []
    for name, layer in (("torch", "torch"), ("jupyterlab", "tools")):
        fn = f"{name}-1.0-py3-none-any.whl"
        f = tmp_path / "store" / fn
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(name.encode())
        files[fn] = f
        pkgs.append(Package(name, "1.0", layer, Wheel(fn, "u", 1, hashlib.sha256(name.encode()).hexdigest())))
    return CellLock("c", Target("3.11", "x86_64-manylinux_2_36", "i"), {}, tuple(pkgs)), files


def test_stage_links_exactly_the_context_and_the_cells_wheels(tmp_path: Path) -> None:
    root = tmp_path / "project"
    (root / "entrypoint").mkdir(parents=True)
    (root / "entrypoint" / "start.sh").write_text("#!/bin/sh\n")
    (root / "ptmg_contract.py").write_text("X = 1\n")
    lock, wheels = _lock(tmp_path)
    ctx = staging.context_dir(root, 0)
    ctx.mkdir(parents=True)
    (ctx / "leftover.txt").write_text("from another cell")
    files = [root / "entrypoint" / "start.sh", root / "ptmg_contract.py"]
    staging.stage(ctx, root, files, lock, wheels, b"UVBIN", {"cell": "c"})
    got = sorted(p.relative_to(ctx).as_posix() for p in ctx.rglob("*") if p.is_file())
    assert got == ["entrypoint/start.sh", "ptmg_contract.py", "wheelhouse/cuda.txt", "wheelhouse/devel.txt",
                   "wheelhouse/pip-constraint.txt",
                   "wheelhouse/sbom-input.json",
                   "wheelhouse/tools.txt", "wheelhouse/tools/jupyterlab-1.0-py3-none-any.whl",
                   "wheelhouse/torch.txt", "wheelhouse/torch/torch-1.0-py3-none-any.whl", "wheelhouse/uv"]
    assert (ctx / "wheelhouse/torch/torch-1.0-py3-none-any.whl").stat().st_ino == wheels[
        "torch-1.0-py3-none-any.whl"].stat().st_ino  # a hard link into the store, no copy
    assert (ctx / "wheelhouse/torch.txt").read_text() == \
        f"torch==1.0 \\\n    --hash=sha256:{hashlib.sha256(b'torch').hexdigest()}\n"
    assert os.access(ctx / "wheelhouse/uv", os.X_OK)
    before = {p: p.stat().st_mtime_ns for p in ctx.rglob("*") if p.is_file()}
    staging.stage(ctx, root, files, lock, wheels, b"UVBIN", {"cell": "c"})  # again: nothing rewritten
    assert before == {p: p.stat().st_mtime_ns for p in ctx.rglob("*") if p.is_file()}


def test_parallel_builds_never_share_a_context(tmp_path: Path) -> None:
    slots = supply.Slots(tmp_path, jobs=2)
    with slots.slot() as a, slots.slot() as b:
        assert a != b and {a.name, b.name} == {"context-0", "context-1"}
    with slots.slot() as c:
        assert c.name in ("context-0", "context-1")


def test_two_build_processes_never_share_a_context(tmp_path: Path) -> None:
    """`make images` in one terminal and `build.py build --only X` in another: each process has its
    own Slots, so the slot must be locked across processes (a flock on .build/context-<n>.lock), or
    one would restage wheels into the context the other's BuildKit is still reading."""
    held = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[2]);"
         "from pathlib import Path; from builder.imaging import supply;"
         "cm = supply.Slots(Path(sys.argv[1]), jobs=1).slot(); ctx = cm.__enter__();"
         "print(ctx.name, flush=True); time.sleep(60)", str(tmp_path), str(ROOT)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout is not None
        theirs = held.stdout.readline().strip()
        with supply.Slots(tmp_path, jobs=1).slot() as mine:
            assert theirs == "context-0" and mine.name != theirs, (theirs, mine)
    finally:
        held.kill()
        held.wait()
    with supply.Slots(tmp_path, jobs=1).slot() as again:  # the other process is gone: its slot is free
        assert again.name == "context-0"


def test_uv_binary_comes_out_of_its_wheel(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("uv-0.13.9.data/scripts/uv", b"\x7fELF static")
        zf.writestr("uv/__init__.py", b"")
    (tmp_path / "uv.whl").write_bytes(buf.getvalue())
    assert uvbin.binary(tmp_path / "uv.whl") == b"\x7fELF static"


def test_the_committed_uv_lock_has_both_build_host_machines() -> None:
    version, wheels = uvbin.read(ROOT)
    assert version == uvbin.UV_VERSION and set(wheels) == {"x86_64", "aarch64"}
    assert all("musllinux" in w.filename and len(w.sha256) == 64 for w in wheels.values())
    assert model.LOCK_DIR == "locks"
