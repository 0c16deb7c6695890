"""The image runtime as a user meets it: start.sh, the supervisor, Jupyter, SSH,
TensorBoard, the healthcheck, uid remap and the start diagnostics, and the boundaries
around them that a client can probe (tests/docker/test_root_boundary.py attacks the
root boundary from inside).

Real image, real clients: requests + websocket-client against Jupyter's REST and
kernel protocol, headless Chromium over the DevTools protocol, the OpenSSH client,
paramiko (to really send a password), ssh-audit. Every port is published on 127.0.0.1
only, on a random host port.

    python -m pytest tests/docker/test_runtime.py
    PTMG_TEST_IMAGE=<tag> python -m pytest tests/docker/test_runtime.py
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any

import docker
import paramiko
import pytest
import requests
import websocket

import ptmg_contract as contract
from tests.browser import BrowserMissing, Chrome
from tests.docker.layerscan import SavedImage
from tests.support import host_port, wait_until

LOCAL = "127.0.0.1"
ENTRYPOINT = "/opt/pt-multi-gpu/entrypoint"
STATE_FILE = "/run/pt-multi-gpu/state.json"
START_TIMEOUT = 90  # seconds for services to answer; generous for a busy 2-core CI host
TOKEN = "ptmg-test-token-0123456789abcdef"
PASSWORD = "correct horse battery staple"
ARTIFACTS = Path(os.environ.get("PTMG_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
SSH_OPTS = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR"]
NS = 1_000_000_000  # docker healthcheck durations are in nanoseconds
#: How the docs start a container as root (only for PT_UID/PT_GID): see docs/security.md.
ROOT_MODE: dict[str, Any] = {"user": "0", "working_dir": contract.ROOT_WORKDIR}
ROOT_MODE_ENV = {"PATH": contract.ROOT_PATH}
#: What a root `docker exec` in a test runs with: absolute paths and this environment.
ROOT_EXEC_ENV = {"PATH": contract.ROOT_PATH}


# ---------------------------------------------------------------------- helpers
def publish(*ports: str) -> dict[str, tuple[str, None]]:
    return {port: (LOCAL, None) for port in ports}


def lab_url(c: Any) -> str:
    return f"http://{LOCAL}:{host_port(c, '8888/tcp')}"


def logs(c: Any) -> str:
    return str(c.logs().decode(errors="replace"))


def exec_ok(c: Any, cmd: list[str] | str, user: str = contract.USER) -> str:
    """`docker exec` as pt (the image's user); as root only with absolute paths and a root-only PATH."""
    env = ROOT_EXEC_ENV if user in ("0", "root") else None
    result = c.exec_run(cmd, user=user, environment=env, workdir="/" if env else None)
    out = str(result.output.decode(errors="replace"))
    assert result.exit_code == 0, f"{cmd!r} in {c.name} exited {result.exit_code}: {out}"
    return out


def state(c: Any) -> dict[str, Any]:
    return dict(json.loads(exec_ok(c, ["cat", STATE_FILE])))


def wait_jupyter(c: Any, timeout: float = START_TIMEOUT) -> str:
    """Jupyter answers on its published port (any auth answer counts); return its base URL."""
    url = lab_url(c)

    def answers() -> bool:
        c.reload()
        if c.status == "exited":
            raise AssertionError(f"container exited:\n{logs(c)[-3000:]}")
        return requests.get(f"{url}/api/status", timeout=3).status_code in (200, 403)

    wait_until(answers, timeout, what=f"Jupyter on {url}")
    return url


def token_from_logs(c: Any) -> str:
    found = re.findall(r"/lab\?token=([0-9a-f]{48})\b", logs(c))
    assert len(found) == 1, f"expected the login URL exactly once in the logs, found {found}"
    return str(found[0])


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"token {token}"}


def health(c: Any) -> str:
    c.reload()
    return str(c.attrs["State"].get("Health", {}).get("Status"))


def start_lab(container: Any, env: dict[str, str] | None = None, **kwargs: Any) -> Any:
    """Service mode with a known token, Jupyter (and by default TensorBoard) on."""
    return container.run(environment={"JUPYTER_TOKEN": TOKEN, **(env or {})},
                         ports=publish("8888/tcp", *kwargs.pop("extra_ports", ())), **kwargs)


@pytest.fixture(scope="session")
def image_attrs(docker_client: docker.DockerClient, test_image: str) -> dict[str, Any]:
    return dict(docker_client.images.get(test_image).attrs)


@pytest.fixture(scope="session")
def expected_torch(image_attrs: dict[str, Any], docker_client: docker.DockerClient,
                   test_image: str, session_labels: dict[str, str]) -> str:
    """The label io.pt-multi-gpu.torch, else PTMG_TORCH from the image config, else
    whatever torch reports in a plain `docker run IMAGE python -c ...`."""
    config = image_attrs["Config"]
    label = (config.get("Labels") or {}).get("io.pt-multi-gpu.torch")
    if label:
        return str(label)
    env = dict(item.split("=", 1) for item in config.get("Env") or [])
    if env.get("PTMG_TORCH"):
        return str(env["PTMG_TORCH"])
    out = docker_client.containers.run(test_image, ["python", "-c", "import torch; print(torch.__version__)"],
                                       remove=True, labels=session_labels, stderr=False)
    return str(out.decode().strip().splitlines()[-1])


@pytest.fixture(scope="session")
def password_hash(docker_client: docker.DockerClient, test_image: str,
                  session_labels: dict[str, str]) -> str:
    """A hash made the documented way: jupyter_server.auth.passwd() in the image."""
    out = docker_client.containers.run(
        test_image, ["python", "-c", f"from jupyter_server.auth import passwd; print(passwd({PASSWORD!r}))"],
        remove=True, labels=session_labels, stderr=False)
    return str(out.decode().strip().splitlines()[-1])


@pytest.fixture
def ssh_key(tmp_path: Path) -> tuple[Path, str]:
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ptmg-test", "-f", str(key)],
                   check=True)
    return key, (tmp_path / "id_ed25519.pub").read_text().strip()


def ssh(port: int, key: Path | None, *command: str, user: str = "pt", extra: tuple[str, ...] = (),
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    argv = ["ssh", *SSH_OPTS, *extra, "-p", str(port)]
    if key is not None:
        argv += ["-i", str(key), "-o", "IdentitiesOnly=yes"]
    return subprocess.run([*argv, f"{user}@{LOCAL}", *command], capture_output=True, text=True,
                          timeout=timeout, check=False)


def wait_ssh(c: Any) -> int:
    port = host_port(c, "22/tcp")

    def banner() -> bool:
        c.reload()
        if c.status == "exited":
            raise AssertionError(f"container exited:\n{logs(c)[-3000:]}")
        out = subprocess.run(["ssh-keyscan", "-T", "3", "-p", str(port), LOCAL],
                             capture_output=True, text=True, timeout=10, check=False)
        return "ssh-ed25519" in out.stdout

    wait_until(banner, START_TIMEOUT, interval=0.5, what=f"sshd on port {port}")
    return port


#: The host keys the entrypoint makes (entrypoint/services.ensure_host_keys).
HOST_KEY_TYPES = ("ed25519", "rsa")


def host_key_fingerprints(port: int) -> set[str]:
    """The fingerprint of each of the server's host keys, one per type. ssh-keyscan silently
    leaves out a type whose connection does not answer within -T (it happened on a loaded 2-core
    CI machine), so a missing type is asked again, for a bounded time: a server without that key
    still fails the test, with its name."""
    found: dict[str, str] = {}

    def scan() -> bool:
        for kind in HOST_KEY_TYPES:
            if kind in found:
                continue
            keys = subprocess.run(["ssh-keyscan", "-T", "10", "-t", kind, "-p", str(port), LOCAL],
                                  capture_output=True, text=True, timeout=30, check=False).stdout
            fps = subprocess.run(["ssh-keygen", "-l", "-f", "-"], input=keys, capture_output=True,
                                 text=True, check=False).stdout.split()
            if keys.strip() and len(fps) > 1:
                found[kind] = fps[1]
        missing = [kind for kind in HOST_KEY_TYPES if kind not in found]
        if missing:
            raise LookupError(f"no {', '.join(missing)} host key offered (have: {', '.join(found) or 'none'})")
        return True

    wait_until(scan, 120, interval=1, what=f"the {' and '.join(HOST_KEY_TYPES)} host keys on port {port}")
    # ... and no other kind: one scan of every type (one that times out here only hides, never adds).
    offered = subprocess.run(["ssh-keyscan", "-T", "10", "-p", str(port), LOCAL], capture_output=True, text=True,
                             timeout=60, check=False).stdout
    kinds = {line.split()[1] for line in offered.splitlines() if line.strip() and not line.startswith("#")}
    assert kinds <= {f"ssh-{kind}" for kind in HOST_KEY_TYPES}, f"unexpected host key types: {sorted(kinds)}"
    return set(found.values())


# ------------------------------------------------------------------------ Jupyter
AUTH_MODES = ["generated", "empty-token", "env-token", "token-file", "password-hash", "password-hash-file"]


@pytest.mark.parametrize("mode", AUTH_MODES)
def test_jupyter_auth_is_always_on(container: Any, tmp_path: Path, password_hash: str, mode: str) -> None:
    env: dict[str, str] = {"TENSORBOARD": "off"}
    volumes: dict[str, dict[str, str]] = {}
    secret = tmp_path / "secret"
    if mode == "empty-token":
        env["JUPYTER_TOKEN"] = ""
    elif mode == "env-token":
        env["JUPYTER_TOKEN"] = TOKEN
    elif mode == "token-file":
        secret.write_text(TOKEN + "\n")  # a trailing newline, as secret files have
        volumes[str(secret)] = {"bind": "/run/secrets/jupyter_token", "mode": "ro"}
        env["JUPYTER_TOKEN_FILE"] = "/run/secrets/jupyter_token"
    elif mode == "password-hash":
        env["JUPYTER_PASSWORD_HASH"] = password_hash
    elif mode == "password-hash-file":
        secret.write_text(password_hash + "\n")
        volumes[str(secret)] = {"bind": "/run/secrets/jupyter_password_hash", "mode": "ro"}
        env["JUPYTER_PASSWORD_HASH_FILE"] = "/run/secrets/jupyter_password_hash"
    c = container.run(environment=env, volumes=volumes, ports=publish("8888/tcp"))
    url = wait_jupyter(c)

    anon = requests.get(f"{url}/api/status", timeout=10)
    assert anon.status_code == 403, anon.text
    lab = requests.get(f"{url}/lab", allow_redirects=False, timeout=10)
    assert lab.status_code == 302 and "/login" in lab.headers["Location"], lab.headers
    assert requests.get(f"{url}/api/status", headers=auth("wrong"), timeout=10).status_code == 403

    if mode.startswith("password"):
        s = requests.Session()
        s.get(f"{url}/login", timeout=10)
        wrong = s.post(f"{url}/login", data={"password": "nope", "_xsrf": s.cookies["_xsrf"]},
                       allow_redirects=False, timeout=10)
        assert wrong.status_code != 302 or "/login" in wrong.headers.get("Location", "")
        ok = s.post(f"{url}/login", data={"password": PASSWORD, "_xsrf": s.cookies["_xsrf"]},
                    allow_redirects=False, timeout=10)
        assert ok.status_code == 302, ok.text[:500]
        assert s.get(f"{url}/api/status", timeout=10).status_code == 200
        assert not re.search(r"token=[0-9a-f]{48}", logs(c)), "password mode must not print a token"
        return
    token = token_from_logs(c) if mode in ("generated", "empty-token") else TOKEN
    assert requests.get(f"{url}/api/status", headers=auth(token), timeout=10).status_code == 200
    if mode == "empty-token":
        assert "JUPYTER_TOKEN is empty" in logs(c)
    if mode in ("env-token", "token-file"):
        assert TOKEN not in logs(c), "a user-supplied token must not be printed"


def test_jupyter_runs_as_pt_without_allow_root_or_wildcard_origin(container: Any) -> None:
    c = start_lab(container, {"TENSORBOARD": "off"})
    url = wait_jupyter(c)
    # A browser session (login cookie, as ?token= sets it) is refused for another origin:
    # allow_origin is not '*'. (Jupyter does echo the Origin for requests that carry the
    # token itself in an Authorization header: a page that holds the token is trusted.)
    browser = requests.Session()
    assert browser.get(f"{url}/lab?token={TOKEN}", timeout=10).status_code == 200
    assert browser.get(f"{url}/api/status", timeout=10).status_code == 200
    for path in ("/api/status", "/api/contents"):
        r = browser.get(f"{url}{path}", headers={"Origin": "http://evil.example"}, timeout=10)
        assert r.status_code in (403, 404), f"cross-origin {path} answered {r.status_code}"
        assert "Access-Control-Allow-Origin" not in r.headers
    pid = state(c)["services"]["jupyter"]["pid"]
    cmdline = exec_ok(c, ["cat", f"/proc/{pid}/cmdline"]).split("\0")
    assert "--allow-root" not in cmdline
    status = exec_ok(c, ["cat", f"/proc/{pid}/status"])
    assert re.search(r"^Uid:\s+1000\s+1000\s+1000\s+1000$", status, re.M), status
    kernel_env = exec_ok(c, ["cat", f"/proc/{pid}/environ"], user="pt")
    assert "JUPYTER_TOKEN=" not in kernel_env, "the token must not be in Jupyter's (kernels') env"
    sessions = requests.get(f"{url}/api/contents", headers=auth(TOKEN), timeout=10).json()
    assert sessions["path"] == "" and sessions["type"] == "directory"  # root_dir /workspace


def run_in_kernel(url: str, token: str, code: str, timeout: float = 120) -> str:
    """Execute `code` in a new kernel through Jupyter's REST API and kernel websocket
    (the jupyter messaging protocol, as JupyterLab speaks it); return its stdout."""
    kernel = requests.post(f"{url}/api/kernels", headers=auth(token), json={"name": "python3"},
                           timeout=30)
    assert kernel.status_code == 201, kernel.text
    kid = kernel.json()["id"]
    ws_url = url.replace("http://", "ws://") + f"/api/kernels/{kid}/channels"
    ws = wait_until(lambda: websocket.create_connection(ws_url, header=auth(token), timeout=timeout),
                    60, interval=1, what="kernel websocket")
    try:
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "test",
                       "session": uuid.uuid4().hex, "version": "5.3", "date": ""},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": False,
                        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
        }))
        out: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = json.loads(ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "error":
                raise AssertionError(f"kernel error: {content['ename']}: {content['evalue']}")
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(out)
        raise AssertionError(f"no idle status within {timeout} s; output so far: {out}")
    finally:
        ws.close()
        requests.delete(f"{url}/api/kernels/{kid}", headers=auth(token), timeout=30)


SECRET_FILE = "ptmg-secret.txt"
SECRET_TEXT = "ptmg-route-secret-" + uuid.uuid4().hex
#: Every route class Jupyter serves here, by method; the token (or the login cookie) is the
#: only way in. `GET /api` (the server version) and /static are public by design.
ROUTES_GET = ["/api/kernels", "/api/sessions", "/api/contents", f"/api/contents/{SECRET_FILE}", "/api/terminals",
              "/api/kernelspecs", "/api/me", "/api/status", "/api/config/notebook", "/lab/api/settings",
              f"/files/{SECRET_FILE}", f"/view/{SECRET_FILE}", f"/proxy/{contract.TENSORBOARD_PORT}/",
              "/tensorboard/", "/tensorboard/data/runs", "/lab",
              "/lab/tree/x", "/metrics"]
ROUTES_POST = ["/api/kernels", "/api/sessions", "/api/contents", "/api/terminals", "/api/shutdown"]


def _refused(r: requests.Response) -> bool:
    """403/401, or a redirect to the login page; never the content."""
    if SECRET_TEXT in r.text:
        return False
    return r.status_code in (401, 403) or (r.status_code in (301, 302, 303, 307)
                                           and "/login" in r.headers.get("Location", ""))


def _ws_status(url: str, headers: dict[str, str] | None = None, cookie: str | None = None,
               origin: str | None = None) -> int:
    try:
        ws = websocket.create_connection(url, header=headers or {}, cookie=cookie, origin=origin, timeout=15)
    except websocket.WebSocketBadStatusException as exc:
        return int(exc.status_code)
    ws.close()
    return 101


def test_jupyter_refuses_every_route_without_the_token(container: Any) -> None:
    """REST, websockets (kernel channels, terminals, events), files, the server proxy and
    TensorBoard behind it, the Lab UI: without a token and with a wrong one (header and
    query), all refused; with the token, each one answers (so a refusal is not a 404).
    A cross-origin POST with the login cookie but no XSRF token is refused too."""
    c = start_lab(container, extra_ports=())
    url = wait_jupyter(c)
    exec_ok(c, ["sh", "-c", f"echo {SECRET_TEXT} > /workspace/{SECRET_FILE}"])
    wait_until(lambda: requests.get(f"{url}/tensorboard/", headers=auth(TOKEN), timeout=10).status_code == 200,
               START_TIMEOUT, what="TensorBoard behind the proxy")
    kid = requests.post(f"{url}/api/kernels", headers=auth(TOKEN), json={"name": "python3"}, timeout=60).json()["id"]
    term = requests.post(f"{url}/api/terminals", headers=auth(TOKEN), timeout=60).json()["name"]
    table: list[str] = []
    try:
        for path in ROUTES_GET:
            good = requests.get(f"{url}{path}", headers=auth(TOKEN), allow_redirects=False, timeout=30)
            assert good.status_code in (200, 302) and not _refused(good), f"GET {path} with the token: {good.status_code}"
            for how, kwargs in (("no token", {}), ("wrong token", {"headers": auth("wrong")}),
                                ("wrong ?token=", {"params": {"token": "wrong"}})):
                r = requests.get(f"{url}{path}", allow_redirects=False, timeout=30, **kwargs)  # type: ignore[arg-type]
                table.append(f"GET {path} {how}: {r.status_code}")
                assert _refused(r), f"GET {path} ({how}) answered {r.status_code}: {r.text[:200]}"
        for path in ROUTES_POST:
            for how, headers in (("no token", {}), ("wrong token", auth("wrong"))):
                r = requests.post(f"{url}{path}", headers=headers, json={}, allow_redirects=False, timeout=30)
                table.append(f"POST {path} {how}: {r.status_code}")
                assert _refused(r), f"POST {path} ({how}) answered {r.status_code}"
        ws_base = url.replace("http://", "ws://")
        for path in (f"/api/kernels/{kid}/channels", f"/terminals/websocket/{term}", "/api/events/subscribe"):
            assert _ws_status(ws_base + path, auth(TOKEN)) == 101, f"WS {path} with the token"
            attempts: list[tuple[str, dict[str, str] | None]] = [("no token", None), ("wrong token", auth("wrong"))]
            for how, ws_headers in attempts:
                status = _ws_status(ws_base + path, ws_headers)
                table.append(f"WS {path} {how}: {status}")
                assert status in (401, 403), f"WS {path} ({how}) answered {status}"
            status = _ws_status(ws_base + path + "?token=wrong")
            table.append(f"WS {path}?token=wrong: {status}")
            assert status in (401, 403)
        # A browser session (cookie from ?token=) from another origin, without the XSRF token.
        browser = requests.Session()
        assert browser.get(f"{url}/lab?token={TOKEN}", timeout=30).status_code == 200
        xsrf = browser.cookies.get("_xsrf")
        assert xsrf, "the login sets an _xsrf cookie"
        evil = {"Origin": "http://evil.example", "Referer": "http://evil.example/"}
        for path in ("/api/contents", "/api/kernels", "/api/terminals"):
            r = browser.post(f"{url}{path}", headers=evil, json={}, timeout=30)
            table.append(f"POST {path} cross-origin, cookie, no XSRF: {r.status_code}")
            assert r.status_code in (403, 404), f"cross-origin POST {path} answered {r.status_code}"
            r = browser.post(f"{url}{path}", json={}, timeout=30)
            table.append(f"POST {path} same-origin, cookie, no XSRF: {r.status_code}")
            assert r.status_code == 403, f"POST {path} without XSRF answered {r.status_code}"
        cookie = "; ".join(f"{k}={v}" for k, v in browser.cookies.items())
        status = _ws_status(f"{ws_base}/api/kernels/{kid}/channels", cookie=cookie, origin="http://evil.example")
        table.append(f"WS kernel channels cross-origin with the cookie: {status}")
        assert status in (401, 403)
        # The control: the same session with the XSRF token, same origin, is let in.
        ok = browser.post(f"{url}/api/contents", headers={"X-XSRFToken": xsrf}, json={"type": "notebook"}, timeout=30)
        assert ok.status_code == 201, ok.text
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "jupyter-routes.txt").write_text("\n".join(table) + "\n")
        requests.delete(f"{url}/api/kernels/{kid}", headers=auth(TOKEN), timeout=30)
        requests.delete(f"{url}/api/terminals/{term}", headers=auth(TOKEN), timeout=30)


def test_kernel_imports_the_image_torch(container: Any, expected_torch: str) -> None:
    c = start_lab(container, {"TENSORBOARD": "off"})
    url = wait_jupyter(c)
    out = run_in_kernel(url, TOKEN, "import os, torch; print(torch.__version__.split('+')[0]); print(os.getuid(), os.getcwd())")
    version, ids = out.strip().splitlines()[-2:]
    assert version == expected_torch
    assert ids == "1000 /workspace"


# ------------------------------------------------------------------------ browser
@pytest.fixture
def chrome(tmp_path: Path) -> Any:
    try:
        browser = Chrome(tmp_path / "chromium-profile")
    except BrowserMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield browser
    finally:
        browser.close()


def test_browser_opens_jupyterlab_and_tensorboard_through_the_proxy(container: Any, chrome: Chrome) -> None:
    c = start_lab(container)
    url = wait_jupyter(c)
    exec_ok(c, ["python", "-c", WRITE_EVENTS], user="pt")  # something for TensorBoard to draw
    wait_until(lambda: requests.get(f"{url}/tensorboard/data/runs", headers=auth(TOKEN), timeout=10).json(),
               START_TIMEOUT, interval=1, what="a run in TensorBoard behind Jupyter's proxy")

    chrome.goto(f"{url}/lab?token={TOKEN}")
    wait_until(lambda: chrome.js("!!document.querySelector('#jp-main-dock-panel') && "
                                 "!!document.querySelector('.jp-Launcher')"),
               START_TIMEOUT, interval=0.5, what="JupyterLab's launcher in the DOM")
    assert "JupyterLab" in chrome.js("document.title")
    tiles = chrome.js("Array.from(document.querySelectorAll('.jp-LauncherCard-label')).map(e => e.textContent)")
    assert any("TensorBoard" in t for t in tiles), f"no TensorBoard tile in the launcher: {tiles}"
    assert chrome.screenshot(ARTIFACTS / "jupyterlab.png").stat().st_size > 10_000

    # The login cookie set by ?token= carries over to the proxied TensorBoard.
    chrome.goto(f"{url}/tensorboard/")
    wait_until(lambda: chrome.js("document.title === 'TensorBoard' && !!document.querySelector('tb-webapp') && "
                                 "document.body.innerText.includes('loss')"),
               START_TIMEOUT, interval=0.5, what="TensorBoard's scalar card 'loss' in the DOM")
    assert chrome.screenshot(ARTIFACTS / "tensorboard.png").stat().st_size > 10_000

    # Without the cookie the proxy asks for a login instead of serving TensorBoard.
    anon = requests.get(f"{url}/tensorboard/", allow_redirects=False, timeout=10)
    assert anon.status_code in (302, 403), anon.status_code


# -------------------------------------------------------------------- TensorBoard
WRITE_EVENTS = ("from torch.utils.tensorboard import SummaryWriter\n"
                "w = SummaryWriter('/workspace/runs/exp1')\n"
                "for step in range(3):\n"
                "    w.add_scalar('loss', 1.0 / (step + 1), step)\n"
                "w.close()\n")


def test_tensorboard_serves_event_files_from_workspace_runs(container: Any) -> None:
    c = start_lab(container)
    url = wait_jupyter(c)
    exec_ok(c, ["python", "-c", WRITE_EVENTS], user="pt")
    runs = wait_until(lambda: "exp1" in (r := requests.get(f"{url}/tensorboard/data/runs", headers=auth(TOKEN),
                                                           timeout=10).json()) and r,
                      START_TIMEOUT, interval=1, what="run exp1 in TensorBoard's /data/runs")
    assert runs == ["exp1"]
    scalars = requests.get(f"{url}/tensorboard/data/plugin/scalars/scalars",
                           params={"run": "exp1", "tag": "loss"}, headers=auth(TOKEN), timeout=10).json()
    assert [round(v, 3) for _, step, v in scalars] == [1.0, 0.5, 0.333]
    anon = requests.get(f"{url}/tensorboard/data/runs", allow_redirects=False, timeout=10)
    assert anon.status_code in (302, 403), "TensorBoard's API must sit behind Jupyter's login"


@pytest.mark.parametrize("mode,direct", [("on", False), ("port", True)])
def test_tensorboard_direct_port_is_opt_in(container: Any, mode: str, direct: bool) -> None:
    c = start_lab(container, {"TENSORBOARD": mode}, extra_ports=("6006/tcp",))
    url = wait_jupyter(c)
    wait_until(lambda: requests.get(f"{url}/tensorboard/", headers=auth(TOKEN), timeout=10).status_code == 200,
               START_TIMEOUT, what="TensorBoard behind Jupyter's proxy")
    direct_url = f"http://{LOCAL}:{host_port(c, '6006/tcp')}/"
    try:
        reachable = requests.get(direct_url, timeout=5).status_code == 200
    except requests.ConnectionError:
        reachable = False
    assert reachable is direct


# ---------------------------------------------------------------------------- SSH
KEY_SOURCES = ["env", "env-file", "secret", "home-mount"]


@pytest.mark.parametrize("source", KEY_SOURCES)
def test_ssh_login_gets_the_container_environment(container: Any, ssh_key: tuple[Path, str], tmp_path: Path,
                                                  expected_torch: str, image_attrs: dict[str, Any],
                                                  source: str) -> None:
    key, pub = ssh_key
    env = {"JUPYTER": "off", "TENSORBOARD": "off"}
    volumes: dict[str, dict[str, str]] = {}
    keyfile = tmp_path / "authorized_keys"
    keyfile.write_text(pub + "\n")
    keyfile.chmod(0o644)
    if source == "env":
        env["SSH_AUTHORIZED_KEYS"] = pub
    elif source == "env-file":
        volumes[str(keyfile)] = {"bind": "/keys/authorized_keys", "mode": "ro"}
        env["SSH_AUTHORIZED_KEYS_FILE"] = "/keys/authorized_keys"
    elif source == "secret":
        volumes[str(keyfile)] = {"bind": "/run/secrets/ssh_authorized_keys", "mode": "ro"}
    else:
        volumes[str(keyfile)] = {"bind": "/home/pt/.ssh/authorized_keys", "mode": "ro"}
    c = container.run(environment=env, volumes=volumes, ports=publish("22/tcp"))
    port = wait_ssh(c)
    r = ssh(port, key, 'python -c "import os, sys, torch; print(torch.__version__.split(chr(43))[0], os.getuid(), os.getcwd(), '
                       'sys.prefix, os.environ.get(\'PTMG_CELL\', \'-\'))"')
    assert r.returncode == 0, r.stderr
    image_env = dict(item.split("=", 1) for item in image_attrs["Config"].get("Env") or [])
    assert r.stdout.split() == [expected_torch, "1000", "/workspace", "/opt/venv", image_env.get("PTMG_CELL", "-")]
    # An interactive login shell (Debian's /etc/profile resets PATH) keeps the venv first.
    shell = subprocess.run(["ssh", *SSH_OPTS, "-tt", "-i", str(key), "-p", str(port), f"pt@{LOCAL}"],
                           input="command -v python; pwd; exit\n", capture_output=True, text=True, timeout=60,
                           check=False)
    assert "/opt/venv/bin/python" in shell.stdout and "/workspace" in shell.stdout, shell.stdout


def test_ssh_between_containers_on_a_network(container: Any, network: Any, ssh_key: tuple[Path, str],
                                             expected_torch: str) -> None:
    """Multi-node style: one container reaches another's sshd by name over a Docker network."""
    key, pub = ssh_key
    net = network()
    server = container.run(environment={"JUPYTER": "off", "TENSORBOARD": "off", "SSH_AUTHORIZED_KEYS": pub},
                           network=net.name, hostname="node0", name=f"node0-{uuid.uuid4().hex[:8]}")
    wait_until(lambda: "ready: sshd" in logs(server), START_TIMEOUT, what="sshd ready on node0")
    os.chown(key, 1000, 1000)  # the client runs as pt and ssh wants its key private
    code, out = container.run_and_wait(
        ["ssh", *SSH_OPTS, "-i", "/keys/id", f"pt@{server.name}", "python -c 'import torch; print(torch.__version__.split(chr(43))[0])'"],
        network=net.name, volumes={str(key): {"bind": "/keys/id", "mode": "ro"}}, timeout=120)
    assert code == 0, out
    assert out.strip().splitlines()[-1] == expected_torch


PASSWORD_FOR_PT = "ptmg-" + uuid.uuid4().hex  # set on pt in the container, sent by a real client


def _password_auth(port: int, user: str, password: str) -> str:
    """Send `password` for `user` over a real SSH transport (paramiko); return how it ended."""
    transport = paramiko.Transport((LOCAL, port))
    try:
        transport.start_client(timeout=30)
        try:
            transport.auth_password(user, password)
        except paramiko.BadAuthenticationType as exc:
            return f"refused, server allows only {exc.allowed_types}"
        except paramiko.AuthenticationException as exc:
            return f"refused: {exc}"
        return "ACCEPTED"
    finally:
        transport.close()


def test_ssh_refuses_a_real_password_and_root_with_an_authorized_key(container: Any,
                                                                     ssh_key: tuple[Path, str]) -> None:
    """Can fail: pt gets a real password (proved by `su`), root gets the key that logs pt in,
    in every place sshd could look for it; both are then really tried, and refused."""
    key, pub = ssh_key
    c = container.run(environment={"JUPYTER": "off", "TENSORBOARD": "off", "SSH_AUTHORIZED_KEYS": pub},
                      ports=publish("22/tcp"))
    port = wait_ssh(c)
    # The image keeps no setuid program; this throwaway container gets su's bit back only so that
    # pt can prove the password works.
    exec_ok(c, ["/bin/sh", "-c", f"echo 'pt:{PASSWORD_FOR_PT}' | /usr/sbin/chpasswd && /bin/chmod u+s /bin/su"],
            user="0")
    proof = c.exec_run(["/bin/sh", "-c", f"echo '{PASSWORD_FOR_PT}' | /bin/su -c 'id -un' pt"], user=contract.USER)
    assert proof.exit_code == 0 and b"pt" in proof.output, f"the password was not set: {proof.output!r}"
    # Root: the same key, in root's own authorized_keys and in the file sshd reads for %u=root.
    keys_file = state(c)["services"]["sshd"]["argv"]
    keys_dir = next(a.split()[1].rsplit("/", 1)[0] for a in keys_file if a.startswith("AuthorizedKeysFile "))
    exec_ok(c, ["/bin/sh", "-c", f"/usr/bin/install -d -m 700 /root/.ssh && echo '{pub}' > /root/.ssh/authorized_keys"
                f" && echo '{pub}' > {keys_dir}/root"], user="0")

    assert _password_auth(port, "pt", PASSWORD_FOR_PT) == "refused, server allows only ['publickey']"
    assert _password_auth(port, "root", PASSWORD_FOR_PT).startswith("refused")
    pw = ssh(port, None, "true", extra=("-o", "PreferredAuthentications=password,keyboard-interactive",
                                        "-o", "PubkeyAuthentication=no"))
    assert pw.returncode == 255 and "Permission denied (publickey)." in pw.stderr, pw.stderr
    root = ssh(port, key, "true", user="root")
    assert root.returncode == 255 and "Permission denied (publickey)." in root.stderr, root.stderr
    assert ssh(port, key, "id -un").stdout.strip() == "pt"  # the same key, for pt: in


def test_sshd_runs_as_pt_with_the_hardened_policy(container: Any, ssh_key: tuple[Path, str]) -> None:
    _, pub = ssh_key
    c = container.run(environment={"JUPYTER": "off", "TENSORBOARD": "off", "SSH_AUTHORIZED_KEYS": pub},
                      ports=publish("22/tcp"))
    wait_ssh(c)
    entry = state(c)["services"]["sshd"]
    argv = entry["argv"]  # exactly how the supervisor runs sshd
    status = exec_ok(c, ["cat", f"/proc/{entry['pid']}/status"])
    assert re.search(r"^Uid:\s+1000\s+1000\s+1000\s+1000$", status, re.M), "sshd must run as pt, not root"
    effective = exec_ok(c, [argv[0], "-T", *[a for a in argv[1:] if a not in ("-D", "-e")]])
    policy = dict(line.split(" ", 1) for line in effective.splitlines() if " " in line)
    expected = {
        "passwordauthentication": "no", "kbdinteractiveauthentication": "no", "permitrootlogin": "no",
        "pubkeyauthentication": "yes", "allowusers": "pt", "permitemptypasswords": "no",
        "authenticationmethods": "publickey", "usepam": "no", "allowagentforwarding": "no",
        "allowstreamlocalforwarding": "no", "x11forwarding": "no", "permittunnel": "no",
        "allowtcpforwarding": "local", "gatewayports": "no", "permitlisten": "none", "permituserrc": "no",
        "permitopen": "127.0.0.1:8888 localhost:8888", "persourcemaxstartups": "4", "port": "22",
    }
    assert {k: policy.get(k) for k in expected} == expected
    for weak in ("ecdh-sha2-nistp", "hmac-sha1", "diffie-hellman-group14", "umac-64"):
        assert weak not in policy["kexalgorithms"] + policy["macs"], weak


def test_ssh_audit_finds_nothing_that_fails(container: Any, ssh_key: tuple[Path, str]) -> None:
    """ssh-audit (PyPI) against the running container: no algorithm or setting it fails."""
    _, pub = ssh_key
    c = container.run(environment={"JUPYTER": "off", "TENSORBOARD": "off", "SSH_AUTHORIZED_KEYS": pub},
                      ports=publish("22/tcp"))
    port = wait_ssh(c)
    audit = Path(sys.executable).with_name("ssh-audit")
    if not audit.exists():
        pytest.fail(f"{audit} is missing. Fix: pip install -e '.[dev]' (ssh-audit is a dev dependency)",
                    pytrace=False)
    r = subprocess.run([str(audit), "-j", "-p", str(port), LOCAL], capture_output=True, text=True, timeout=300,
                       check=False)
    report = json.loads(r.stdout)
    fails = [(kind, a["algorithm"], n) for kind in ("kex", "key", "enc", "mac") for a in report.get(kind, [])
             for n in (a.get("notes") or {}).get("fail", [])]
    warns = [(kind, a["algorithm"]) for kind in ("kex", "key", "enc", "mac") for a in report.get(kind, [])
             if (a.get("notes") or {}).get("warn")]
    text = subprocess.run([str(audit), "-n", "-p", str(port), LOCAL], capture_output=True, text=True, timeout=300,
                          check=False).stdout
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "ssh-audit.txt").write_text(text)
    print(f"ssh-audit: {len(fails)} fail, {len(warns)} warn: {warns}")
    assert not fails, f"ssh-audit fails: {fails}"
    assert report["banner"]["software"].startswith("OpenSSH")


def _end_tunnel(proc: subprocess.Popen[str]) -> str:
    """Stop an `ssh -N` tunnel and return its stderr. SIGTERM first; OpenSSH 9.2 has been seen (once in CI)
    still running 30 s after it, with its forward refused, so SIGKILL after 10 s: how it exits is not what
    these tests check."""
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    return err or ""


def _ssh_forward(port: int, key: Path, spec: list[str], command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ssh", *SSH_OPTS, "-i", str(key), "-o", "IdentitiesOnly=yes", "-o", "ExitOnForwardFailure=yes",
                           *spec, "-p", str(port), f"pt@{LOCAL}", command],
                          capture_output=True, text=True, timeout=120, check=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCAL, 0))
        return int(s.getsockname()[1])


def test_ssh_forwards_only_local_tunnels_to_jupyter_and_tensorboard(container: Any, ssh_key: tuple[Path, str],
                                                                     tmp_path: Path) -> None:
    key, pub = ssh_key
    c = container.run(environment={"JUPYTER_TOKEN": TOKEN, "SSH_AUTHORIZED_KEYS": pub}, ports=publish("22/tcp"))
    port = wait_ssh(c)
    wait_until(lambda: "ready: jupyter, tensorboard, sshd" in logs(c), START_TIMEOUT, what="all services ready")

    def tunnel(target: str) -> tuple[subprocess.Popen[str], int]:
        local = _free_port()
        # LogLevel INFO (the first value wins): the client logs a refused channel at INFO.
        proc = subprocess.Popen(["ssh", "-o", "LogLevel=INFO", *SSH_OPTS, "-i", str(key), "-o", "IdentitiesOnly=yes", "-N",
                                 "-L", f"{local}:{target}", "-p", str(port), f"pt@{LOCAL}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return proc, local

    # The tunnels the docs describe work (probed from the host while the session lives).
    for target, path in ((f"127.0.0.1:{contract.JUPYTER_PORT}", "/api/status"),
                         (f"localhost:{contract.TENSORBOARD_PORT}", "/")):
        proc, local = tunnel(target)
        try:
            url = f"http://{LOCAL}:{local}{path}"
            status = wait_until(lambda u=url: requests.get(u, headers=auth(TOKEN), timeout=5).status_code,  # type: ignore[misc]
                                60, interval=0.5, what=f"ssh -L {target}")
            assert status == 200
        finally:
            _end_tunnel(proc)
    # Anywhere else: the channel is refused (PermitOpen).
    proc, local = tunnel("127.0.0.1:22")
    try:
        wait_until(lambda: socket.create_connection((LOCAL, local), timeout=2), 60, interval=0.5,
                   what="the local end of the tunnel")
        with socket.create_connection((LOCAL, local), timeout=10) as sock:
            sock.settimeout(10)
            assert sock.recv(64) == b"", "ssh -L to sshd's own port must be refused"
    finally:
        err = _end_tunnel(proc)
    assert "administratively prohibited" in err, err
    # Remote listeners, unix-socket forwarding and the agent: refused.
    remote = _ssh_forward(port, key, ["-R", "0:127.0.0.1:9"], "true")
    assert remote.returncode != 0 and "remote port forwarding failed" in remote.stderr, remote.stderr
    remote_sock = _ssh_forward(port, key, ["-R", "/tmp/ptmg-fwd.sock:127.0.0.1:9"], "true")
    assert remote_sock.returncode != 0 and "forwarding failed" in remote_sock.stderr, remote_sock.stderr
    local_sock = tmp_path / "s.sock"  # -L to a unix socket in the container: the channel is refused
    proc = subprocess.Popen(["ssh", "-o", "LogLevel=INFO", *SSH_OPTS, "-i", str(key), "-o", "IdentitiesOnly=yes", "-N",
                             "-L", f"{local_sock}:/run/pt-multi-gpu/any.sock", "-p", str(port), f"pt@{LOCAL}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(local_sock.exists, 60, interval=0.5, what="the local end of the unix-socket tunnel")
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(str(local_sock))
            assert sock.recv(64) == b"", "ssh -L to a unix socket must be refused"
    finally:
        err = _end_tunnel(proc)
    assert "open failed" in err, err
    agent = subprocess.run(["ssh-agent", "sh", "-c",
                            f"ssh-add -q {key} && ssh {' '.join(SSH_OPTS)} -A -i {key} -p {port} pt@{LOCAL} "
                            "'echo agent=${SSH_AUTH_SOCK:-none}'"],
                           capture_output=True, text=True, timeout=120, check=False)
    assert "agent=none" in agent.stdout, (agent.stdout, agent.stderr)


def test_sshd_stays_off_without_a_key(container: Any) -> None:
    c = container.run(environment={"JUPYTER": "off", "TENSORBOARD": "off", "SSH": "on"}, ports=publish("22/tcp"))
    wait_until(lambda: "SSH=on but no authorized key" in logs(c), 30, what="the no-key warning")
    assert "sshd" not in state(c)["services"]
    assert exec_ok(c, ["sh", "-c", "ls /var/lib/pt-multi-gpu/ssh-host-keys 2>/dev/null | wc -l"]).strip() == "0"


def test_ssh_host_keys_differ_per_container_and_persist_on_a_volume(
        container: Any, ssh_key: tuple[Path, str], docker_client: docker.DockerClient,
        session_labels: dict[str, str]) -> None:
    _, pub = ssh_key
    volume = docker_client.volumes.create(labels=session_labels)  # removed by the session finalizer
    env = {"JUPYTER": "off", "TENSORBOARD": "off", "SSH_AUTHORIZED_KEYS": pub}
    keydir = {volume.name: {"bind": "/var/lib/pt-multi-gpu/ssh-host-keys", "mode": "rw"}}
    first = container.run(environment=env, ports=publish("22/tcp"), volumes=keydir)
    second = container.run(environment=env, ports=publish("22/tcp"))
    fp_first = host_key_fingerprints(wait_ssh(first))
    fp_second = host_key_fingerprints(wait_ssh(second))
    assert len(fp_first) == len(fp_second) == len(HOST_KEY_TYPES)
    assert not fp_first & fp_second, "two containers from one image share a host key"
    for fp in fp_first:
        assert fp in logs(first), "host key fingerprints are printed at start"
    first.remove(force=True)
    again = container.run(environment=env, ports=publish("22/tcp"), volumes=keydir)
    assert host_key_fingerprints(wait_ssh(again)) == fp_first
    assert "sshd host key kept" in logs(again)


def test_no_ssh_host_key_in_any_image_layer(saved_image: SavedImage) -> None:
    """Every file of every layer of the saved image (read once per session: layerscan.py)."""
    assert len(saved_image.paths) > 1000, f"only {len(saved_image.paths)} files listed: the layers were not read"
    found = [f"{blob}: {path}" for blob, path in saved_image.paths if "ssh_host_" in Path(path).name]
    assert not found, f"SSH host keys baked into the image: {found}"


# ------------------------------------------------------------------ process model
def test_pid1_is_tini_and_services_run_as_pt(container: Any) -> None:
    c = start_lab(container)
    wait_jupyter(c)
    assert exec_ok(c, ["cat", "/proc/1/comm"]).strip() == "tini"
    assert "-g" in exec_ok(c, ["cat", "/proc/1/cmdline"]).split("\0")
    for name, entry in state(c)["services"].items():
        owner = exec_ok(c, ["ps", "-o", "user=", "-p", str(entry["pid"])]).strip()
        assert owner == "pt", f"{name} runs as {owner}"


def test_docker_stop_ends_every_service_on_sigterm(container: Any, ssh_key: tuple[Path, str]) -> None:
    _, pub = ssh_key
    c = start_lab(container, {"SSH_AUTHORIZED_KEYS": pub})
    url = wait_jupyter(c)
    wait_until(lambda: "ready: jupyter, tensorboard, sshd" in logs(c), START_TIMEOUT, what="all services ready")
    run_in_kernel(url, TOKEN, "print(1)")  # a live kernel makes Jupyter's shutdown real work
    t0 = time.monotonic()
    c.stop(timeout=10)
    took = time.monotonic() - t0
    c.reload()
    # Exit 0 means every service ended on SIGTERM within the 10 s grace (docker's SIGKILL after it
    # gives 137). How fast is a benchmark figure (BENCHMARKS.md), not a timed assertion.
    print(f"docker stop: {took:.2f} s")
    assert c.attrs["State"]["ExitCode"] == 0, f"after {took:.1f} s: {logs(c)[-2000:]}"
    assert "did not stop" not in logs(c)


ORPHANS = "for i in 1 2 3 4 5; do (sleep 0.2 &); done"


@pytest.mark.parametrize("where", ["command", "services"])
def test_orphans_are_reaped(container: Any, where: str) -> None:
    if where == "command":
        # The user's command leaves orphans behind and keeps running (tail, not another sleep).
        c = container.run(command=["bash", "-c", f"{ORPHANS}; touch /tmp/orphans-made; exec tail -f /dev/null"])
        wait_until(lambda: c.exec_run(["test", "-e", "/tmp/orphans-made"]).exit_code == 0, 60,
                   what="the command to have made its orphans")
    else:
        c = start_lab(container, {"TENSORBOARD": "off"})
        wait_jupyter(c)
        exec_ok(c, ["bash", "-c", ORPHANS], user="pt")  # the sleeps are re-parented to PID 1

    def orphans_gone_and_reaped() -> bool:
        table = exec_ok(c, ["ps", "-eo", "stat=,comm="])
        return "sleep" not in table and not re.search(r"^\s*Z", table, re.M)

    wait_until(orphans_gone_and_reaped, 10, what="orphans exited and reaped (no zombies)")


def test_killed_jupyter_is_restarted_and_health_follows(container: Any) -> None:
    hc = {"test": ["CMD", f"{ENTRYPOINT}/healthcheck"], "interval": NS // 2, "timeout": 3 * NS,
          "retries": 1, "start_period": 0}
    c = start_lab(container, {"TENSORBOARD": "off"}, healthcheck=hc)
    wait_jupyter(c)
    wait_until(lambda: health(c) == "healthy", START_TIMEOUT, what="healthy")
    pid = state(c)["services"]["jupyter"]["pid"]
    exec_ok(c, ["kill", "-KILL", str(pid)])
    wait_until(lambda: health(c) == "unhealthy", 30, interval=0.1, what="unhealthy after killing Jupyter")
    wait_until(lambda: health(c) == "healthy", START_TIMEOUT, what="healthy again after the restart")
    s = state(c)["services"]["jupyter"]
    assert s["restarts"] == 1 and s["pid"] != pid
    assert "jupyter killed by signal 9" in logs(c) and "restart #1 in 1 s" in logs(c)


def test_healthcheck_reflects_enabled_services(container: Any, ssh_key: tuple[Path, str]) -> None:
    _, pub = ssh_key
    c = start_lab(container, {"SSH_AUTHORIZED_KEYS": pub, "TENSORBOARD": "off"})
    wait_jupyter(c)
    out = wait_until(lambda: (r := c.exec_run([f"{ENTRYPOINT}/healthcheck"])).exit_code == 0
                     and r.output.decode(), START_TIMEOUT, what="healthcheck passing")
    assert sorted(line.split(":")[0] for line in out.splitlines()) == ["jupyter", "sshd"]
    quiet = container.run(command=["sleep", "60"])
    assert wait_until(lambda: quiet.exec_run([f"{ENTRYPOINT}/healthcheck"]).exit_code == 0, 30,
                      what="healthcheck of a plain command")


@pytest.mark.parametrize("uid,gid", [(4242, 4343), (1001, 100)])  # gid 100 already exists ("users")
def test_uid_remap_owns_files_on_a_bind_mount(container: Any, tmp_path: Path, uid: int, gid: int) -> None:
    work = tmp_path / "work"
    work.mkdir()
    os.chown(work, uid, gid)  # a host user's directory
    code, out = container.run_and_wait(
        ["sh", "-c", "id -u; id -g; pwd; touch made-in-container; ls -ld /home/pt | awk '{print $3}'"],
        environment={"PT_UID": str(uid), "PT_GID": str(gid), **ROOT_MODE_ENV},
        volumes={str(work): {"bind": "/workspace", "mode": "rw"}}, timeout=60, **ROOT_MODE)
    assert code == 0, out
    lines = [line for line in out.splitlines() if not line.startswith("[ptmg]")]
    assert lines[:4] == [str(uid), str(gid), "/workspace", "pt"], out
    made = (work / "made-in-container").stat()
    assert (made.st_uid, made.st_gid) == (uid, gid)


def _wheel(dest: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel (one module), made here: pip installs it with --no-index."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"__version__ = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: ptmg-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    out = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    out.chmod(0o644)
    return out


def test_pip_install_and_upgrade_as_pt_after_a_uid_and_gid_remap(container: Any, tmp_path: Path) -> None:
    """The venv is never re-owned (that would copy gigabytes into the container): pt keeps
    write access through the venv's group. A new package installs; a package from the image's
    own layers is replaced (an upgrade: pip deletes its files there, which needs the group's
    write access on those directories)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheels.chmod(0o755)
    new = _wheel(wheels, "ptmg_probe", "1.0")
    upgrade = _wheel(wheels, "iniconfig", "99.0.0")  # pytest's dependency, in the image's tools layer
    c = container.run(command=["sleep", "600"], environment={"PT_UID": "4242", "PT_GID": "4242", **ROOT_MODE_ENV},
                      volumes={str(wheels): {"bind": "/wheels", "mode": "ro"}}, **ROOT_MODE)
    wait_until(lambda: "4242" in exec_ok(c, ["id", "-u"]), 60, what="the remap")
    groups = exec_ok(c, ["id", "-G"]).split()
    assert groups[0] == "4242" and str(contract.VENV_GID) in groups, groups
    python, pip = f"{contract.VENV}/bin/python", f"{contract.VENV}/bin/pip"  # docker exec's PATH is root's here
    site = exec_ok(c, [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    assert exec_ok(c, ["stat", "-c", "%u %G", site]).split() == [str(contract.UID), contract.VENV_GROUP]
    before = exec_ok(c, [python, "-c", "import importlib.metadata as m; print(m.version('iniconfig'))"])
    out = exec_ok(c, [pip, "install", "--no-index", "--no-deps", f"/wheels/{new.name}", f"/wheels/{upgrade.name}"])
    assert "Successfully installed" in out, out
    after = exec_ok(c, [python, "-c", "import ptmg_probe, iniconfig; print(ptmg_probe.__version__, "
                                      "iniconfig.__version__)"]).split()
    assert after == ["1.0", "99.0.0"], (before, after)
    assert exec_ok(c, ["stat", "-c", "%u", f"{site}/ptmg_probe/__init__.py"]).strip() == "4242"


def test_arbitrary_user_serves_jupyter_without_sshd(container: Any, ssh_key: tuple[Path, str]) -> None:
    """--user UID:GID without a passwd entry (OpenShift style): Jupyter and the healthcheck
    work; sshd needs a user it can log in and stays off, saying why."""
    _, pub = ssh_key
    code, out = container.run_and_wait(["id", "-u"], user="4242:4242", timeout=60)
    assert code == 0 and "4242" in out.splitlines()
    c = start_lab(container, {"TENSORBOARD": "off", "SSH_AUTHORIZED_KEYS": pub}, user="4242:4242")
    url = wait_jupyter(c)
    assert requests.get(f"{url}/api/status", headers=auth(TOKEN), timeout=10).status_code == 200
    assert "has no entry in /etc/passwd" in logs(c)
    health_out = wait_until(lambda: (r := c.exec_run([f"{ENTRYPOINT}/healthcheck"])).exit_code == 0
                            and r.output.decode(), 30, what="healthcheck as uid 4242")
    assert "jupyter: ok" in health_out


# -------------------------------------------------------------- who runs as what
def test_docker_exec_without_u_is_pt_in_the_workspace(container: Any) -> None:
    c = container.run(command=["sleep", "120"])
    out = exec_ok(c, ["sh", "-c", "id -un; id -u; pwd; command -v python"], user="").split()
    assert out == ["pt", "1000", "/workspace", "/opt/venv/bin/python"]
    image_user = c.attrs["Config"]["User"]
    assert image_user == str(contract.UID), "the image's USER is pt (numeric: runAsNonRoot can check it)"


def test_root_start_needs_root_only_paths_and_runs_everything_as_pt(container: Any, ssh_key: tuple[Path, str]) -> None:
    """--user 0 with the image's PATH (/opt/venv/bin first, pt's) or WORKDIR (/workspace, pt's)
    is refused before anything runs; with the documented flags it remaps and every process
    but tini is pt, while `docker exec` (root there) gets only root-owned paths."""
    _, pub = ssh_key
    env = {"PT_UID": "4242", "PT_GID": "4242", "JUPYTER_TOKEN": TOKEN, "SSH_AUTHORIZED_KEYS": pub}
    code, out = container.run_and_wait(None, environment=env, user="0", timeout=60)
    assert code == 2, out
    assert "ERROR: started as root, but `docker exec` would run root with what pt controls: PATH entry /opt/venv/bin" in out
    assert f"-w {contract.ROOT_WORKDIR} -e PATH={contract.ROOT_PATH}" in out
    c = start_lab(container, {**env, **ROOT_MODE_ENV}, extra_ports=("22/tcp",), **ROOT_MODE)
    wait_jupyter(c)
    wait_until(lambda: "ready: jupyter, tensorboard, sshd" in logs(c), START_TIMEOUT, what="all services ready")
    table = exec_ok(c, ["/bin/ps", "-eo", "uid=,comm="], user="0")
    procs = {(line.split()[0], line.split(None, 1)[1]) for line in table.splitlines() if line.strip()}
    assert {name for uid, name in procs if uid == "0"} - {"ps"} == {"tini"}, table
    assert {("4242", "sshd"), ("4242", "jupyter-lab"), ("4242", "tensorboard")} <= procs, table
    exec_env = c.exec_run(["/usr/bin/env"]).output.decode()  # no -u: root in this container
    assert f"PATH={contract.ROOT_PATH}\n" in exec_env
    assert c.exec_run(["/bin/pwd"]).output.decode().strip() == contract.ROOT_WORKDIR
    assert c.exec_run(["/usr/bin/id", "-u"]).output.decode().strip() == "0"
    # pt's processes still have the venv first and work in /workspace; so does pt's login shell
    # (`docker exec -u pt` itself gets the container's root-only PATH).
    jupyter_pid = state(c)["services"]["jupyter"]["pid"]
    assert exec_ok(c, ["readlink", f"/proc/{jupyter_pid}/cwd"]).strip() == "/workspace"
    assert exec_ok(c, ["bash", "-lc", "command -v python"]).strip() == "/opt/venv/bin/python"
    health = exec_ok(c, [f"{ENTRYPOINT}/healthcheck"], user="0")
    assert "jupyter: ok" in health and "sshd: ok" in health


def test_login_shells_read_the_container_environment_for_pt_only(container: Any) -> None:
    """Debian's /etc/profile resets PATH; /etc/profile.d/pt-multi-gpu.sh restores it from the
    file pt's supervisor wrote, in pt's login shells only: root's never read a file of pt's."""
    c = container.run(command=["sleep", "120"])
    wait_until(lambda: c.exec_run(["test", "-e", "/run/pt-multi-gpu/session-env.sh"]).exit_code == 0, 30,
               what="the session environment")
    out = exec_ok(c, ["bash", "-lc", "command -v python; echo $PTMG_CELL"]).split()
    assert out[0] == "/opt/venv/bin/python"
    exec_ok(c, ["sh", "-c", "echo 'export PTMG_PLANTED=by-pt' >> /run/pt-multi-gpu/session-env.sh"])
    root = exec_ok(c, ["/bin/bash", "-lc", "echo PATH=$PATH; echo planted=${PTMG_PLANTED:-no}"], user="0")
    assert "planted=no" in root and "/opt/venv" not in root, root
    owner = exec_ok(c, ["/usr/bin/stat", "-c", "%U %a", "/etc/profile.d/pt-multi-gpu.sh"], user="0").split()
    assert owner == ["root", "644"]


# ------------------------------------------------------------------------ secrets
def test_secret_files_stay_out_of_docker_exec_and_win_over_variables(container: Any, tmp_path: Path) -> None:
    """A secret given as a variable is in `docker inspect` and in every `docker exec`'s
    environment (that is Docker's doing); given as a file it is in neither, and a file wins
    over a variable set as well (with a warning that names no value)."""
    secret = tmp_path / "jupyter_token"
    secret.write_text(TOKEN + "\n")
    secret.chmod(0o644)
    c = container.run(environment={"TENSORBOARD": "off", "JUPYTER_TOKEN": "env-value-not-used"},
                      volumes={str(secret): {"bind": "/run/secrets/jupyter_token", "mode": "ro"}},
                      ports=publish("8888/tcp"))
    url = wait_jupyter(c)
    assert requests.get(f"{url}/api/status", headers=auth(TOKEN), timeout=10).status_code == 200
    assert requests.get(f"{url}/api/status", headers=auth("env-value-not-used"), timeout=10).status_code == 403
    assert "JUPYTER_TOKEN is set but ignored: /run/secrets/jupyter_token is used" in logs(c)
    assert "env-value-not-used" not in logs(c) and TOKEN not in logs(c)
    pid = state(c)["services"]["jupyter"]["pid"]
    environ = exec_ok(c, ["cat", f"/proc/{pid}/environ"])
    assert TOKEN not in environ and "\0JUPYTER_TOKEN=" not in "\0" + environ
    quiet = container.run(environment={"TENSORBOARD": "off"}, ports=publish("8888/tcp"),
                          volumes={str(secret): {"bind": "/run/secrets/jupyter_token", "mode": "ro"}})
    wait_jupyter(quiet)
    assert TOKEN not in exec_ok(quiet, ["env"])
    assert not any(TOKEN in e for e in quiet.attrs["Config"]["Env"])


def test_tampered_token_files_neither_crash_nor_lock_out(container: Any) -> None:
    """pt owns Jupyter's token file (Jupyter reads it): a newline in it, or a directory in its
    place, must not take the supervisor down, nor stop the container from starting again."""
    hc = {"test": ["CMD", f"{ENTRYPOINT}/healthcheck"], "interval": NS, "timeout": 3 * NS, "retries": 3,
          "start_period": 0}
    c = start_lab(container, {"TENSORBOARD": "off"}, healthcheck=hc)
    wait_jupyter(c)
    token_file = f"{contract.STATE_DIR}/jupyter/token"
    exec_ok(c, ["sh", "-c", f"printf 'a\\nb' > {token_file}"])
    pid = state(c)["services"]["jupyter"]["pid"]
    exec_ok(c, ["kill", "-KILL", str(pid)])
    wait_until(lambda: state(c)["services"]["jupyter"]["restarts"] >= 1, 60, what="the supervisor restarting Jupyter")
    c.reload()
    assert c.status == "running", logs(c)[-2000:]
    check = c.exec_run([f"{ENTRYPOINT}/healthcheck"])
    assert check.exit_code in (0, 1) and b"Traceback" not in check.output, check.output  # an answer
    exec_ok(c, ["sh", "-c", f"rm -f {token_file} && mkdir {token_file}"])
    c.restart(timeout=10)
    url = wait_jupyter(c)
    assert requests.get(f"{url}/api/status", headers=auth(TOKEN), timeout=10).status_code == 200
    wait_until(lambda: health(c) == "healthy", START_TIMEOUT, what="healthy after the restart")


# -------------------------------------------------------------------- diagnostics
@pytest.mark.parametrize("shm,warned", [("64m", True), ("2g", False)])
def test_shm_warning(container: Any, shm: str, warned: bool) -> None:
    code, out = container.run_and_wait(["true"], shm_size=shm, timeout=60)
    assert code == 0
    assert ("--shm-size=8g (or --ipc=host)" in out) is warned, out


FAKE_SMI = "#!/bin/sh\necho '0, NVIDIA H100 80GB HBM3, {driver}, 81559 MiB'\necho '1, NVIDIA H100 80GB HBM3, {driver}, 81559 MiB'\n"


@pytest.mark.parametrize("driver,old", [("470.57.02", True), ("560.35.03", False)])
def test_driver_check_against_min_driver(container: Any, tmp_path: Path, driver: str, old: bool) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(driver=driver))
    smi.chmod(0o755)
    code, out = container.run_and_wait(
        ["true"], environment={"PTMG_MIN_DRIVER": "525.60.13", "PTMG_CUDA": "12.4", "PTMG_NCCL": "2.21.5"},
        volumes={str(smi): {"bind": "/usr/local/bin/nvidia-smi", "mode": "ro"}}, timeout=60)
    assert code == 0, out
    assert "2 GPU(s) visible: 0: NVIDIA H100 80GB HBM3" in out
    assert "NCCL 2.21.5" in out
    assert (f"NVIDIA driver {driver} is older than 525.60.13" in out) is old, out
    assert "no GPU visible" not in out


def test_no_gpu_warning_names_the_fix(container: Any) -> None:
    # void: hide GPUs even on a host whose default runtime is nvidia
    code, out = container.run_and_wait(["true"], environment={"PTMG_CUDA": "12.4", "NVIDIA_VISIBLE_DEVICES": "void"},
                                       timeout=60)
    assert code == 0
    assert "WARNING: no GPU visible: run with --gpus all" in out
    assert "NVIDIA Container Toolkit" in out


# ------------------------------------------------------------------------ modes
def test_command_exit_status_and_user(container: Any) -> None:
    code, _ = container.run_and_wait(["python", "-c", "import sys; sys.exit(3)"], timeout=60)
    assert code == 3
    code, out = container.run_and_wait(["sh", "-c", "id -u; pwd"], timeout=60)
    assert code == 0 and out.splitlines()[-2:] == ["1000", "/workspace"], out
    code, out = container.run_and_wait(["no-such-command-xyz"], timeout=60)
    assert code == 127, out


def test_command_with_a_service_beside_it(container: Any) -> None:
    c = start_lab(container, {"JUPYTER": "on"},
                  command=["bash", "-c", "until [ -e /tmp/go ]; do sleep 0.2; done; exit 5"])
    url = wait_jupyter(c)
    assert requests.get(f"{url}/api/status", headers=auth(TOKEN), timeout=10).status_code == 200
    assert "tensorboard" not in state(c)["services"]  # only what was asked for
    exec_ok(c, ["touch", "/tmp/go"])
    assert c.wait(timeout=30)["StatusCode"] == 5


def test_selftest_is_dispatched_as_pt(container: Any, tmp_path: Path) -> None:
    fake = tmp_path / "smoke"
    fake.mkdir()
    (fake / "selftest").write_text('#!/bin/sh\necho "selftest uid=$(id -u) args=$*"\nexit 7\n')
    (fake / "selftest").chmod(0o755)
    code, out = container.run_and_wait(
        ["selftest", "--quick", "-k", "ddp"], timeout=60,
        volumes={str(fake): {"bind": "/opt/pt-multi-gpu/smoke_tests", "mode": "ro"}})
    assert code == 7
    assert "selftest uid=1000 args=--quick -k ddp" in out


@pytest.mark.parametrize("env,named", [({"JUPYTER": "maybe"}, "JUPYTER"), ({"PT_UID": "abc"}, "PT_UID"),
                                       ({"TENSORBOARD": "yes please"}, "TENSORBOARD")])
def test_bad_settings_fail_fast_with_the_variable_named(container: Any, env: dict[str, str], named: str) -> None:
    code, out = container.run_and_wait(None, environment=env, timeout=60)
    assert code == 2
    assert f"ERROR: {named}=" in out
