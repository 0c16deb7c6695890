"""compose.yaml, run for real with Compose: the service becomes healthy, Jupyter takes the
secret token (and only it), SSH takes the secret key, and the secrets stay out of the
container's environment.

Which Compose: Debian bookworm's `docker-compose` 1.29.2 (`apt-get install docker-compose`; the
v2 plugin is not packaged there). It understands `deploy.resources.reservations.devices` (since
1.28) and passes it to the engine as a GPU request, so on a host without the NVIDIA runtime the
service can't start. The test therefore runs a copy of compose.yaml with two changes, made here
in code and nothing else:

- the GPU reservation is dropped when the engine has no `nvidia` runtime (and a separate test
  checks that the untouched file does ask the engine for GPUs: it fails to start on such a host
  with the engine's "could not select device driver" error). An override file can't do this:
  Compose 1.29 merges lists and has no `!reset`, so an override can add a device, not remove one;
- host ports 8888 and 2222 become random ports on 127.0.0.1, so the test never collides with a
  Jupyter or sshd already on this host (same reason: an override would add ports, not replace them).

Everything runs under a unique project name, with this session's labels on the service, its
network and its volumes, and `down -v` removes it all in a finally.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest
import requests
import yaml

from tests.support import wait_until

ROOT = Path(__file__).resolve().parents[2]
LOCAL = "127.0.0.1"
TOKEN = "ptmg-compose-" + uuid.uuid4().hex
SSH_OPTS = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR"]
HEALTHY_TIMEOUT = 180  # the image's HEALTHCHECK: interval 15 s, start period 30 s; a busy 2-core host


def compose_bin() -> str:
    found = shutil.which("docker-compose")
    if not found:
        pytest.fail("docker-compose is not installed. Fix: apt-get install -y docker-compose "
                    "(Debian bookworm ships 1.29.2)", pytrace=False)
    return found


def has_nvidia_runtime(client: docker.DockerClient) -> bool:
    return "nvidia" in (client.info().get("Runtimes") or {})


def derive(doc: dict[str, Any], labels: dict[str, str], keep_gpus: bool) -> dict[str, Any]:
    """compose.yaml as this host can run it (see the module docstring); labels on everything."""
    out = copy.deepcopy(doc)
    svc = out["services"]["pt"]
    if not keep_gpus:
        reservations = svc["deploy"]["resources"]["reservations"]
        del reservations["devices"]
        if not reservations:
            del svc["deploy"]
    published = {str(p).split(":")[-1]: p for p in svc["ports"]}
    assert set(published) == {"8888", "22"}, f"compose.yaml publishes {svc['ports']}"
    svc["ports"] = [f"{LOCAL}::8888", f"{LOCAL}::22"]
    svc["labels"] = {**svc.get("labels", {}), **labels}
    for section in ("volumes", "networks"):
        for item in out.get(section, {}).values():
            item["labels"] = {**item.get("labels", {}), **labels}
    return out


@dataclass
class Project:
    compose: str
    name: str
    file: Path
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [self.compose, "--ansi", "never", "-p", self.name, "-f", str(self.file), *args]
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def port(self, container_port: int) -> int:
        out = self.run("port", "pt", str(container_port)).stdout.strip()  # "127.0.0.1:49153"
        return int(out.rsplit(":", 1)[1])


@pytest.fixture
def secrets(tmp_path: Path) -> dict[str, Path]:
    token = tmp_path / "jupyter_token"
    token.write_text(TOKEN + "\n")
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ptmg-compose-test", "-f", str(key)],
                   check=True)
    return {"token": token, "key": key, "pub": key.with_suffix(".pub")}


def make_project(tmp_path: Path, test_image: str, secrets: dict[str, Path], labels: dict[str, str],
                 keep_gpus: bool) -> Project:
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    derived = tmp_path / "compose.yaml"
    derived.write_text(yaml.safe_dump(derive(doc, labels, keep_gpus), sort_keys=False))
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "PTMG_IMAGE": test_image,
           "PTMG_JUPYTER_TOKEN_FILE": str(secrets["token"]),
           "PTMG_SSH_AUTHORIZED_KEYS_FILE": str(secrets["pub"])}
    for var in ("DOCKER_HOST", "HOME"):
        if var in os.environ:
            env[var] = os.environ[var]
    return Project(compose_bin(), f"ptmg-test-{uuid.uuid4().hex[:10]}", derived, env)


@pytest.fixture
def project(tmp_path: Path, test_image: str, secrets: dict[str, Path], session_labels: dict[str, str],
            docker_client: docker.DockerClient) -> Iterator[Project]:
    proj = make_project(tmp_path, test_image, secrets, session_labels, keep_gpus=has_nvidia_runtime(docker_client))
    try:
        yield proj
    finally:
        down = proj.run("down", "-v", "--remove-orphans", "-t", "10", check=False)
        if down.returncode != 0:
            print(f"docker-compose down failed:\n{down.stderr}")


def container_of(client: docker.DockerClient, project: Project) -> Any:
    (c,) = client.containers.list(all=True, filters={"label": f"com.docker.compose.project={project.name}"})
    return c


def test_compose_service_is_healthy_and_takes_the_secret_token_and_key(
        project: Project, secrets: dict[str, Path], docker_client: docker.DockerClient) -> None:
    project.run("up", "-d")
    c = container_of(docker_client, project)

    def healthy() -> bool:
        c.reload()
        state = c.attrs["State"]
        if state["Status"] != "running":
            raise AssertionError(f"container stopped ({state}):\n{c.logs().decode(errors='replace')[-3000:]}")
        return bool(state.get("Health", {}).get("Status") == "healthy")

    try:
        wait_until(healthy, HEALTHY_TIMEOUT, interval=2, what="the compose service to become healthy")
    except AssertionError:
        print(c.logs().decode(errors="replace")[-4000:])
        raise

    # Jupyter: the secret token logs in; no token and a wrong one don't.
    url = f"http://{LOCAL}:{project.port(8888)}"
    ok = requests.get(f"{url}/api/status", headers={"Authorization": f"token {TOKEN}"}, timeout=10)
    assert ok.status_code == 200, ok.text
    assert requests.get(f"{url}/api/contents", timeout=10).status_code == 403
    bad = requests.get(f"{url}/api/contents", headers={"Authorization": "token wrong"}, timeout=10)
    assert bad.status_code == 403
    contents = requests.get(f"{url}/api/contents", headers={"Authorization": f"token {TOKEN}"}, timeout=10)
    assert contents.status_code == 200

    # SSH: the secret public key logs in as pt, in /workspace (the volume).
    ssh = subprocess.run(["ssh", *SSH_OPTS, "-i", str(secrets["key"]), "-p", str(project.port(22)),
                          f"pt@{LOCAL}", "id -un; pwd; touch /workspace/from-ssh && echo wrote"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert ssh.returncode == 0, ssh.stderr
    assert ssh.stdout.split() == ["pt", "/workspace", "wrote"]

    # The secrets are files, not environment; the token is in neither the env nor the labels.
    c.reload()
    assert not any(TOKEN in e for e in c.attrs["Config"]["Env"])
    mounts = {m["Destination"]: m for m in c.attrs["Mounts"]}
    assert {"/run/secrets/jupyter_token", "/run/secrets/ssh_authorized_keys"} <= set(mounts)
    assert mounts["/workspace"]["Type"] == "volume"
    assert mounts["/var/lib/pt-multi-gpu/ssh-host-keys"]["Type"] == "volume"
    assert c.attrs["HostConfig"]["ShmSize"] == 8 * 1024**3
    assert c.labels["project"] == "pt-multi-gpu"


def test_compose_file_asks_the_engine_for_gpus(tmp_path: Path, test_image: str, secrets: dict[str, Path],
                                               session_labels: dict[str, str],
                                               docker_client: docker.DockerClient) -> None:
    """The untouched GPU reservation reaches the engine: on a host without the NVIDIA runtime
    the engine refuses to start the service, naming the missing driver. On a GPU host the
    container gets a device request for every GPU."""
    proj = make_project(tmp_path, test_image, secrets, session_labels, keep_gpus=True)
    try:
        up = proj.run("up", "--no-start", check=False)
        assert up.returncode == 0, up.stderr
        c = container_of(docker_client, proj)
        requests_ = c.attrs["HostConfig"].get("DeviceRequests") or []
        assert [(r["Driver"], r["Count"], r["Capabilities"]) for r in requests_] == [("nvidia", -1, [["gpu"]])]
        if not has_nvidia_runtime(docker_client):
            start = proj.run("start", check=False)
            assert start.returncode != 0
            assert "could not select device driver" in (start.stderr + start.stdout)
    finally:
        proj.run("down", "-v", "--remove-orphans", "-t", "5", check=False)
