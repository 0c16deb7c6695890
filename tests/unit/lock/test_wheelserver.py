"""The build's wheel server (builder.lock.wheelserver): it serves exactly the lock's wheels by
layer, waits for one still being fetched (bounded), answers 503 with the reason for one whose fetch
failed, and is gone (port closed, secret removed) after the build; and the build's side
(supply.served, orchestrate): the context carries no wheel, a failed fetch fails the build with its
own error, a buildx build gets the server on the engine's bridge address while 20.10's (or one whose
bridge is not on this host) keeps the wheels in its context, and a build that never reached the
server says so with the fix."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from builder.common.errors import InputError, StepFailed
from builder.engine import BuildkitCli, BuildOutcome, BuildRequest
from builder.host import doctor
from builder.imaging import orchestrate, os_snapshot, supply
from builder.lock import wheelserver
from builder.lock.model import CellLock, Package
from builder.lock.net import NetConfig
from builder.lock.store import FetchStats, HashMismatch, Store
from builder.lock.target import Target
from builder.matrix import ImageSpec
from tests.support import MID, ROOT, cell, small_matrix
from tests.unit.imaging.test_orchestrate import FakeEngine
from tests.unit.imaging.test_os_snapshot import Mirror
from tests.unit.lock.test_store import SIX, SIX_NAME, Files, server, six  # noqa: F401 - `server` is a fixture
from tests.unit.supply_fakes import FAKE_CLI, lock_for, write_lock

TORCH, TOOL = "torch-2.7.0-cp311-cp311-manylinux_2_28_x86_64.whl", "jupyterlab-4.6.6-py3-none-any.whl"


def get(url: str, path: str, method: str = "GET", timeout: float = 10) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@pytest.fixture
def store(tmp_path: Path) -> Path:
    (tmp_path / TORCH).write_bytes(b"torch bytes" * 1000)
    (tmp_path / TOOL).write_bytes(b"tool bytes")
    (tmp_path / "secret.txt").write_text("not a wheel of the lock")
    return tmp_path


@pytest.fixture
def served(store: Path) -> Iterator[wheelserver.WheelServer]:
    with wheelserver.serve(store, {"torch": [TORCH], "tools": [TOOL]}, wait_s=5) as srv:
        yield srv


def test_a_layer_page_lists_exactly_that_layers_wheels(served: wheelserver.WheelServer) -> None:
    code, body = get(served.url, "/torch/")
    assert code == 200 and TORCH in body.decode() and TOOL not in body.decode()
    assert served.url.startswith("http://127.0.0.1:") and served.secret.read_text() == served.url + "\n"


@pytest.mark.parametrize("path", ["/", "/torch", "/nope/", f"/tools/{TORCH}", "/torch/secret.txt",
                                  "/torch/../secret.txt", "/torch/%2e%2e%2fsecret.txt", "/../secret.txt",
                                  f"/torch/{TORCH}/x", "/tools/../torch/"])
def test_nothing_but_a_layers_own_wheel_is_served(served: wheelserver.WheelServer, path: str) -> None:
    served.ready(TORCH)
    served.ready(TOOL)
    code, body = get(served.url, path)
    assert code == 404 and b"secret" not in body and b"torch bytes" not in body


def test_a_wheel_is_served_once_it_is_in_the_store(served: wheelserver.WheelServer, store: Path) -> None:
    got: list[tuple[int, bytes]] = []
    asker = threading.Thread(target=lambda: got.append(get(served.url, f"/torch/{TORCH}")))
    asker.start()
    time.sleep(0.3)
    assert asker.is_alive() and not got, "a wheel still being fetched was answered"
    served.ready(TORCH)
    asker.join(5)
    assert got == [(200, (store / TORCH).read_bytes())]
    assert get(served.url, f"/torch/{TORCH}", "HEAD")[0] == 200
    # A file counts once its handler's sendfile has returned, which can come just after the
    # client has read the last byte (9 in 300 tries on a loaded host): wait for it, bounded.
    sent, deadline = (1, (store / TORCH).stat().st_size), time.monotonic() + 5
    while served.served != sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.served == sent
    assert served.requests == 2  # what the "never reached the server" hint reads (counted on arrival)


def test_a_head_answers_the_headers_alone_and_the_connection_goes_on(served: wheelserver.WheelServer,
                                                                     store: Path) -> None:
    """uv asks HEAD and GET on one kept-alive connection: a HEAD that sent the body would leave it
    in the stream, where the next answer's status line is read."""
    served.ready(TORCH)
    host, port = served.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        answers = []
        for method, path in (("HEAD", f"/torch/{TORCH}"), ("HEAD", "/torch/"), ("HEAD", "/nope/"),
                             ("GET", f"/torch/{TORCH}")):
            conn.request(method, path)
            r = conn.getresponse()
            answers.append((method, r.status, r.read()))
            if path == f"/torch/{TORCH}":
                assert r.getheader("Content-Length") == str((store / TORCH).stat().st_size)
    finally:
        conn.close()
    assert answers == [("HEAD", 200, b""), ("HEAD", 200, b""), ("HEAD", 404, b""),
                       ("GET", 200, (store / TORCH).read_bytes())]


def test_a_wheel_gone_from_the_store_answers_503(served: wheelserver.WheelServer, store: Path) -> None:
    (store / TORCH).unlink()
    served.ready(TORCH)
    code, body = get(served.url, f"/torch/{TORCH}")
    assert code == 503 and b"No such file or directory" in body


def test_two_servers_at_once_have_their_own_ports(store: Path) -> None:
    """Parallel builds (--jobs 2) each run one."""
    with wheelserver.serve(store, {"torch": [TORCH]}) as a, wheelserver.serve(store, {"tools": [TOOL]}) as b:
        assert a.url != b.url
        assert get(a.url, "/torch/")[0] == 200 and get(b.url, "/tools/")[0] == 200


def test_a_failed_fetch_answers_503_with_the_reason(served: wheelserver.WheelServer) -> None:
    served.ready(TORCH, "hash mismatch downloading torch")
    code, body = get(served.url, f"/torch/{TORCH}")
    assert code == 503 and b"hash mismatch downloading torch" in body
    served.fail_all("the fetch stopped")
    code, body = get(served.url, f"/tools/{TOOL}")
    assert code == 503 and b"the fetch stopped" in body


def test_the_wait_for_a_wheel_is_bounded(store: Path) -> None:
    with wheelserver.serve(store, {"torch": [TORCH]}, wait_s=0.2) as srv:
        start = time.monotonic()
        code, body = get(srv.url, f"/torch/{TORCH}")
    assert code == 503 and b"not in the wheel store after" in body and time.monotonic() - start < 3


def test_after_the_build_the_server_and_its_secret_are_gone(store: Path) -> None:
    with wheelserver.serve(store, {"torch": [TORCH]}) as srv:
        url, secret = srv.url, srv.secret
        assert secret.is_file()
    assert not secret.exists()
    with pytest.raises(OSError):
        get(url, "/torch/", timeout=2)


# --- the build's side ----------------------------------------------------------------------------------
@pytest.fixture
def spec(tmp_path: Path) -> ImageSpec:
    return cell(small_matrix(tmp_path / "m"), MID)


def test_transport_default_and_choice() -> None:
    assert supply.transport(True, {}) == "server" and supply.transport(False, {}) == "context"
    assert supply.transport(True, {"PTMG_WHEEL_TRANSPORT": "context"}) == "context"
    assert supply.transport(False, {"PTMG_WHEEL_TRANSPORT": "server"}) == "server"
    with pytest.raises(InputError, match="PTMG_WHEEL_TRANSPORT='ftp': not a wheel transport; use context or server"):
        supply.transport(True, {"PTMG_WHEEL_TRANSPORT": "ftp"})


def test_bindable_is_an_address_of_this_host() -> None:
    assert wheelserver.bindable("127.0.0.1")
    assert not wheelserver.bindable("192.0.2.254")  # TEST-NET-1: no interface of this host has it


def _lock_state(wheel_url: str, data: bytes = SIX) -> supply.LockState:
    """A lock whose one wheel (six, in the tools layer) is on the test's index."""
    lock = CellLock("c", Target("3.11", "x86_64-manylinux_2_36", "i"), {},
                    (Package("six", "1.17.0", "tools", six(wheel_url, data)),))
    return supply.LockState(lock, Path("locks/c/pylock.toml"), "sha256:lock", "sha256:uv")


def _served(spec: ImageSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The context folder; uv and the SBOM input are not what is tested (no uv download)."""
    monkeypatch.setattr(supply, "_context_files", lambda *a: (b"uv", {}))
    return tmp_path / "ctx"


def test_the_context_has_no_wheel_and_the_server_hands_out_the_fetched_one(
        spec: ImageSpec, tmp_path: Path, server: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    state = _lock_state(server)
    ctx = _served(spec, tmp_path, monkeypatch)
    with supply.served(spec, state, ctx, ROOT, tmp_path / "locks", [], NetConfig(), tmp_path / "store") as srv:
        code, body = get(srv.url, f"/tools/{SIX_NAME}")
        assert (code, body) == (200, SIX)
        assert not [p for p in (ctx / "wheelhouse").rglob("*.whl")], "a wheel went into the build context"
        assert "six==1.17.0" in (ctx / "wheelhouse" / "tools.txt").read_text()  # the install lock stays
    assert (tmp_path / "store" / SIX_NAME).read_bytes() == SIX


def test_a_failed_fetch_fails_the_build_with_its_own_error(
        spec: ImageSpec, tmp_path: Path, server: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    state = _lock_state(server, data=b"what the lock was made from")
    ctx = _served(spec, tmp_path, monkeypatch)
    seen: list[tuple[int, bytes]] = []
    with pytest.raises(HashMismatch, match=f"hash mismatch downloading {SIX_NAME}"), \
            supply.served(spec, state, ctx, ROOT, tmp_path / "locks", [], NetConfig(), tmp_path / "store") as srv:
        seen.append(get(srv.url, f"/tools/{SIX_NAME}"))
    (code, body), = seen
    assert code == 503 and b"hash mismatch" in body  # what the RUN's uv sees: it fails at once
    assert not (tmp_path / "store" / SIX_NAME).exists()


def test_a_wrong_file_already_in_the_store_fails_every_wheel_with_the_reason(
        spec: ImageSpec, tmp_path: Path, server: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    state = _lock_state(server)
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / SIX_NAME).write_bytes(b"planted")
    ctx = _served(spec, tmp_path, monkeypatch)
    seen: list[tuple[int, bytes]] = []
    with pytest.raises(HashMismatch, match="hash mismatch in the wheel store"), \
            supply.served(spec, state, ctx, ROOT, tmp_path / "locks", [], NetConfig(), tmp_path / "store") as srv:
        seen.append(get(srv.url, f"/tools/{SIX_NAME}"))
    (code, body), = seen
    assert code == 503 and b"hash mismatch in the wheel store" in body


def test_a_fetch_that_crashes_fails_the_build_and_never_leaves_a_run_waiting(
        spec: ImageSpec, tmp_path: Path, server: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    def crash(self: Store, wheels: object, on_ready: object = None) -> FetchStats:
        raise RuntimeError("a bug")

    state = _lock_state(server)
    ctx = _served(spec, tmp_path, monkeypatch)
    monkeypatch.setattr(Store, "ensure", crash)
    seen: list[tuple[int, bytes]] = []
    with pytest.raises(StepFailed, match="the host's wheel fetch stopped: RuntimeError"), \
            supply.served(spec, state, ctx, ROOT, tmp_path / "locks", [], NetConfig(), tmp_path / "store") as srv:
        seen.append(get(srv.url, f"/tools/{SIX_NAME}", timeout=5))
    (code, body), = seen
    assert code == 503 and b"the host's wheel fetch stopped: RuntimeError" in body


BUILDX = BuildkitCli("/nonexistent/docker", ("buildx", "build", "--load"), {})


def _cell_build(spec: ImageSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: BuildkitCli,
                gateway: str | None, fail: str = "") -> tuple[orchestrate.CellResult, FakeEngine, list[str], list[str]]:
    """One `build.py build` of the cell against a fake engine whose bridge is ``gateway``: (the result,
    the engine, the wheel-server URL each build got ("" for none), what went the context way)."""
    context: list[str] = []
    monkeypatch.setattr(orchestrate, "find_buildkit_cli", lambda: cli)
    monkeypatch.setattr(supply, "prepare", lambda *a, **k: context.append("context"))
    monkeypatch.setattr(supply, "_context_files", lambda *a: (b"uv", {}))
    monkeypatch.setattr(Store, "ensure", lambda self, wheels, on_ready=None: FetchStats())
    monkeypatch.delenv("PTMG_WHEEL_TRANSPORT", raising=False)
    write_lock(tmp_path / "lock-root", lock_for(spec))
    engine = FakeEngine(spec)
    engine.bridge_gateway = lambda: gateway  # type: ignore[method-assign]
    urls: list[str] = []
    real_build = engine.build

    def build(req: BuildRequest, on_line: Callable[[str], None], cli: object) -> BuildOutcome:
        secret = req.secrets.get("wheel-server")
        urls.append(secret.read_text().strip() if secret else "")
        if fail:
            engine.builds.append(req)
            return BuildOutcome(False, None, "buildkit", "ERROR: the install failed", (fail,))
        return real_build(req, on_line, cli)

    engine.build = build  # type: ignore[method-assign]
    cfg = orchestrate.BuildConfig(root=ROOT, docker_dir=tmp_path / "docker", log_dir=tmp_path / "logs",
                                  os_snapshots=os_snapshot.Snapshots(environ={}, get=Mirror().get),
                                  lock_root=tmp_path / "lock-root", wheel_store=tmp_path / "store")
    (result,) = orchestrate.build_all(engine, [spec], cfg, lambda _c, _l: None)  # type: ignore[arg-type]
    return result, engine, urls, context


def test_a_buildx_build_gets_the_server_on_the_engines_bridge(spec: ImageSpec, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    result, engine, urls, context = _cell_build(spec, tmp_path, monkeypatch, BUILDX, "127.0.0.1")
    assert result.status == "built", result.message
    assert len(engine.builds) == 1 and urls[0].startswith("http://127.0.0.1:") and context == []


@pytest.mark.parametrize(("cli", "gateway"), [(FAKE_CLI, "127.0.0.1"), (BUILDX, "192.0.2.254"), (BUILDX, None)])
def test_otherwise_the_wheels_go_in_the_context(spec: ImageSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                cli: BuildkitCli, gateway: str | None) -> None:
    """20.10's CLI (exactly as before), an engine whose bridge is not on this host, or one without a bridge."""
    result, engine, urls, context = _cell_build(spec, tmp_path, monkeypatch, cli, gateway)
    assert result.status == "built", result.message
    (req,) = engine.builds
    assert urls == [""] and "wheel-server" not in req.secrets and context == ["context"]


def test_a_build_that_never_reached_the_server_says_so_with_the_fix(spec: ImageSpec, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    line = "12.1 error: Failed to read `--find-links` URL: http://127.0.0.1:41234/torch/"
    result, *_ = _cell_build(spec, tmp_path, monkeypatch, BUILDX, "127.0.0.1", fail=line)
    assert result.status == "failed" and line in result.message
    assert "never reached the wheel server" in result.message and "PTMG_WHEEL_TRANSPORT=context" in result.message


class _DoctorEngine:
    def __init__(self, gateway: str | None) -> None:
        self.gateway = gateway

    def version(self) -> dict[str, str]:
        return {"ApiVersion": "1.51"}

    def bridge_gateway(self) -> str | None:
        return self.gateway


@pytest.mark.parametrize(("cli", "gateway", "env", "want"), [
    (BUILDX, "127.0.0.1", "", "wheels: from build.py's wheel server on the engine's bridge address (127.0.0.1)"),
    (BUILDX, "192.0.2.254", "", "wheels: in the build context: the engine's bridge address (192.0.2.254) is not"),
    (BUILDX, "127.0.0.1", "context", "wheels: in the build context (PTMG_WHEEL_TRANSPORT=context)"),
    (FAKE_CLI, "127.0.0.1", "", "wheels: in the build context (Debian 12's 20.10 CLI)"),
])
def test_doctor_says_how_the_wheels_reach_the_build(monkeypatch: pytest.MonkeyPatch, cli: BuildkitCli,
                                                    gateway: str, env: str, want: str) -> None:
    monkeypatch.setattr(doctor, "find_buildkit_cli", lambda: cli)
    monkeypatch.setattr(doctor, "buildx_facts", lambda _cli: ("0.29.1", "v0.25.1"))
    monkeypatch.setenv("PTMG_WHEEL_TRANSPORT", env)
    found = doctor.builder_findings(_DoctorEngine(gateway))  # type: ignore[arg-type]
    assert [f for f in found if f.what.startswith(want) and f.level == "ok"], [f.what for f in found]


def test_doctor_fails_a_wheel_transport_it_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "find_buildkit_cli", lambda: BUILDX)
    monkeypatch.setattr(doctor, "buildx_facts", lambda _cli: ("0.29.1", "v0.25.1"))
    monkeypatch.setenv("PTMG_WHEEL_TRANSPORT", "ftp")
    (_, bad) = doctor.builder_findings(_DoctorEngine("127.0.0.1"))  # type: ignore[arg-type]
    assert bad.level == "fail" and "not a wheel transport; use context or server" in bad.what
