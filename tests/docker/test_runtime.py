"""The image runtime as a user meets it: start.sh, the supervisor, Jupyter, SSH,
TensorBoard, the healthcheck, uid remap and the start diagnostics.

Real image, real clients: requests + websocket-client against Jupyter's REST and
kernel protocol, headless Chromium over the DevTools protocol, the OpenSSH client.
Every port is published on 127.0.0.1 only, on a random host port.

    python -m pytest -m docker tests/integration/test_runtime.py
    PTMG_TEST_IMAGE=<tag> python -m pytest -m docker tests/integration/test_runtime.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
import time
import uuid
from pathlib import Path
from typing import IO, Any, cast

import docker
import pytest
import requests
import websocket

from tests.browser import BrowserMissing, Chrome
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


# ---------------------------------------------------------------------- helpers
def publish(*ports: str) -> dict[str, tuple[str, None]]:
    return {port: (LOCAL, None) for port in ports}


def lab_url(c: Any) -> str:
    return f"http://{LOCAL}:{host_port(c, '8888/tcp')}"


def logs(c: Any) -> str:
    return str(c.logs().decode(errors="replace"))


def exec_ok(c: Any, cmd: list[str] | str, user: str = "root") -> str:
    result = c.exec_run(cmd, user=user)
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


def host_key_fingerprints(port: int) -> set[str]:
    scan = subprocess.run(["ssh-keyscan", "-T", "5", "-p", str(port), LOCAL], capture_output=True,
                          text=True, timeout=20, check=True).stdout
    fps = subprocess.run(["ssh-keygen", "-l", "-f", "-"], input=scan, capture_output=True,
                         text=True, check=True).stdout
    return {line.split()[1] for line in fps.splitlines() if line.strip()}


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


def test_login_shell_as_pt_keeps_the_container_environment(container: Any) -> None:
    """Debian's /etc/profile resets PATH; /etc/profile.d/pt-multi-gpu.sh (written at start) restores it."""
    c = container.run(command=["sleep", "120"])
    wait_until(lambda: c.exec_run(["test", "-e", "/etc/profile.d/pt-multi-gpu.sh"]).exit_code == 0, 30,
               what="the profile hook")
    out = exec_ok(c, ["bash", "-lc", "command -v python; echo $PTMG_CELL"], user="pt").split()
    assert out[0] == "/opt/venv/bin/python"


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


def test_ssh_refuses_passwords_and_root(container: Any, ssh_key: tuple[Path, str]) -> None:
    key, pub = ssh_key
    c = container.run(environment={"JUPYTER": "off", "TENSORBOARD": "off", "SSH_AUTHORIZED_KEYS": pub},
                      ports=publish("22/tcp"))
    port = wait_ssh(c)
    pw = ssh(port, None, "true", extra=("-o", "PreferredAuthentications=password,keyboard-interactive",
                                        "-o", "PubkeyAuthentication=no"))
    assert pw.returncode == 255
    # The server lists what it accepts: publickey, nothing else.
    assert "Permission denied (publickey)." in pw.stderr, pw.stderr
    root = ssh(port, key, "true", user="root")
    assert root.returncode == 255 and "Permission denied (publickey)." in root.stderr, root.stderr
    assert ssh(port, key, "true").returncode == 0


def test_sshd_effective_policy(container: Any, ssh_key: tuple[Path, str]) -> None:
    _, pub = ssh_key
    c = container.run(environment={"JUPYTER": "off", "TENSORBOARD": "off", "SSH_AUTHORIZED_KEYS": pub},
                      ports=publish("22/tcp"))
    wait_ssh(c)
    argv = state(c)["services"]["sshd"]["argv"]  # exactly how the supervisor runs sshd
    effective = exec_ok(c, [argv[0], "-T", *[a for a in argv[1:] if a not in ("-D", "-e")]])
    policy = dict(line.split(" ", 1) for line in effective.splitlines() if " " in line)
    assert policy["passwordauthentication"] == "no"
    assert policy["kbdinteractiveauthentication"] == "no"
    assert policy["permitrootlogin"] == "no"
    assert policy["pubkeyauthentication"] == "yes"
    assert policy["allowusers"] == "pt"
    assert policy["permitemptypasswords"] == "no"
    assert policy["authenticationmethods"] == "publickey"


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
    assert len(fp_first) == 2 and len(fp_second) == 2  # ed25519 + rsa
    assert not fp_first & fp_second, "two containers from one image share a host key"
    for fp in fp_first:
        assert fp in logs(first), "host key fingerprints are printed at start"
    first.remove(force=True)
    again = container.run(environment=env, ports=publish("22/tcp"), volumes=keydir)
    assert host_key_fingerprints(wait_ssh(again)) == fp_first
    assert "sshd host key kept" in logs(again)


def test_no_ssh_host_key_in_any_image_layer(docker_client: docker.DockerClient, test_image: str) -> None:
    """docker save streams the image; every layer tar inside is scanned, streaming too."""
    image = docker_client.images.get(test_image)
    reader = _StreamReader(image.save(chunk_size=1 << 20))
    found: list[str] = []
    layers = 0
    with tarfile.open(fileobj=cast(IO[bytes], reader), mode="r|") as outer:
        for member in outer:
            if not member.isfile():
                continue
            f = outer.extractfile(member)
            if f is None:
                continue
            head = f.read(512)
            if not _looks_like_tar(head):
                continue
            layers += 1
            with tarfile.open(fileobj=cast(IO[bytes], _Prefixed(head, f)), mode="r|") as layer:
                found += [f"{member.name}: {m.name}" for m in layer if "ssh_host_" in Path(m.name).name]
    assert layers > 0, "no layer tar found in docker save output"
    assert not found, f"SSH host keys baked into the image: {found}"


def _looks_like_tar(head: bytes) -> bool:
    return len(head) == 512 and head[257:262] == b"ustar"


class _StreamReader:
    """File-like over docker-py's chunk iterator (tarfile stream mode needs only read())."""

    def __init__(self, chunks: Any):
        self.chunks = iter(chunks)
        self.buf = b""

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self.buf) < n:
            try:
                self.buf += next(self.chunks)
            except StopIteration:
                break
        if n < 0:
            n = len(self.buf)
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


class _Prefixed:
    def __init__(self, head: bytes, rest: Any):
        self.head, self.rest = head, rest

    def read(self, n: int = -1) -> bytes:
        if self.head:
            out = self.head if n < 0 else self.head[:n]
            self.head = self.head[len(out):]
            if n < 0 or len(out) < n:
                out += self.rest.read(-1 if n < 0 else n - len(out))
            return out
        return bytes(self.rest.read(n))


# ------------------------------------------------------------------ process model
def test_pid1_is_tini_and_services_run_as_pt(container: Any) -> None:
    c = start_lab(container)
    wait_jupyter(c)
    assert exec_ok(c, ["cat", "/proc/1/comm"]).strip() == "tini"
    assert "-g" in exec_ok(c, ["cat", "/proc/1/cmdline"]).split("\0")
    for name, entry in state(c)["services"].items():
        owner = exec_ok(c, ["ps", "-o", "user=", "-p", str(entry["pid"])]).strip()
        assert owner == "pt", f"{name} runs as {owner}"


def test_docker_stop_is_fast_and_clean(container: Any, ssh_key: tuple[Path, str]) -> None:
    _, pub = ssh_key
    c = start_lab(container, {"SSH_AUTHORIZED_KEYS": pub})
    url = wait_jupyter(c)
    wait_until(lambda: "ready: jupyter, tensorboard, sshd" in logs(c), START_TIMEOUT, what="all services ready")
    run_in_kernel(url, TOKEN, "print(1)")  # a live kernel makes Jupyter's shutdown real work
    t0 = time.monotonic()
    c.stop(timeout=10)
    took = time.monotonic() - t0
    c.reload()
    assert took <= 3.0, f"docker stop took {took:.2f} s"
    assert c.attrs["State"]["ExitCode"] == 0, logs(c)[-2000:]
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
        ["sh", "-c", "id -u; id -g; touch made-in-container; ls -ld /home/pt | awk '{print $3}'"],
        environment={"PT_UID": str(uid), "PT_GID": str(gid)},
        volumes={str(work): {"bind": "/workspace", "mode": "rw"}}, timeout=60)
    assert code == 0, out
    lines = [line for line in out.splitlines() if not line.startswith("[ptmg]")]
    assert lines[:3] == [str(uid), str(gid), "pt"], out
    made = (work / "made-in-container").stat()
    assert (made.st_uid, made.st_gid) == (uid, gid)


def test_non_root_user_skips_remap_and_sshd_but_serves(container: Any, ssh_key: tuple[Path, str]) -> None:
    _, pub = ssh_key
    code, out = container.run_and_wait(["id", "-u"], user="1000", timeout=60)
    assert code == 0 and "1000" in out.splitlines()
    assert "not root" in out
    c = start_lab(container, {"TENSORBOARD": "off", "SSH_AUTHORIZED_KEYS": pub}, user="1000")
    url = wait_jupyter(c)
    assert requests.get(f"{url}/api/status", headers=auth(TOKEN), timeout=10).status_code == 200
    assert "sshd needs root" in logs(c)
    health_out = wait_until(lambda: (r := c.exec_run([f"{ENTRYPOINT}/healthcheck"])).exit_code == 0
                            and r.output.decode(), 30, what="healthcheck as uid 1000")
    assert "jupyter: ok" in health_out


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
