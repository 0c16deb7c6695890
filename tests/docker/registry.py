"""A real Docker registry (Debian's docker-registry, distribution 2.x) as a test helper.

`LocalRegistry` writes a config (filesystem storage under a directory the test
owns, listening on 127.0.0.1:<free port>, or another address of this host,
optionally htpasswd auth with a bcrypt file), starts `docker-registry serve`,
waits until /v2/ answers, and can be killed and started again on the same port
and storage (fault tests). dockerd talks plain HTTP to 127.0.0.0/8 registries
without configuration (another address needs a client told so: skopeo
--dest-tls-verify=false).

Needs: apt docker-registry; pip bcrypt (for the htpasswd file).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import requests

from tests.support import wait_until

REGISTRY_BIN = os.environ.get("PTMG_REGISTRY_BIN", "/usr/bin/docker-registry")
FIX = ("the test registry needs Debian's docker-registry package (`apt-get install -y docker-registry`) "
       "and python bcrypt (`pip install bcrypt`)")


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def write_htpasswd(path: Path, user: str, password: str) -> None:
    """A bcrypt htpasswd line (the only hash the registry accepts). Cost 5 keeps the
    registry's per-request check fast; the test is about the protocol, not the hash."""
    import bcrypt

    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)).decode()
    path.write_text(f"{user}:{hashed}\n")


class LocalRegistry:
    def __init__(self, root: Path, *, auth: tuple[str, str] | None = None, address: str = "127.0.0.1") -> None:
        """address: where it listens (e.g. a Docker network's gateway, for containers to reach it)."""
        self.root = root
        self.storage = root / "storage"
        self.storage.mkdir(parents=True, exist_ok=True)
        self.port = free_port(address)
        self.host = f"{address}:{self.port}"
        self.url = f"http://{self.host}"
        self.auth = auth
        self.log_path = root / "registry.log"
        self.proc: subprocess.Popen[bytes] | None = None
        config = [
            "version: 0.1",
            "log:",
            "  level: info",
            "storage:",
            "  filesystem:",
            f"    rootdirectory: {self.storage}",
            "  delete:",
            "    enabled: true",
            "http:",
            f"  addr: {self.host}",
        ]
        if auth is not None:
            htpasswd = root / "htpasswd"
            write_htpasswd(htpasswd, *auth)
            config += ["auth:", "  htpasswd:", "    realm: ptmg-test", f"    path: {htpasswd}"]
        self.config = root / "config.yml"
        self.config.write_text("\n".join(config) + "\n")

    def start(self) -> LocalRegistry:
        if not Path(REGISTRY_BIN).exists() and not shutil.which("docker-registry"):
            raise RuntimeError(FIX)
        log = self.log_path.open("ab")
        # Its own process group, so a kill reaches it and nothing else.
        self.proc = subprocess.Popen([REGISTRY_BIN, "serve", str(self.config)], stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()

        def answers() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited {self.proc.returncode}: {self.log_tail()}")
            r = requests.get(f"{self.url}/v2/", timeout=2)
            return r.status_code in (200, 401)

        wait_until(answers, timeout=30, what=f"the registry on {self.host}")
        return self

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown (no chance to finish an upload)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # --- what the registry holds, read straight from its storage and its API ---
    def blobs(self) -> set[str]:
        """Digests of every blob in storage (layers, configs, manifests)."""
        base = self.storage / "docker/registry/v2/blobs/sha256"
        return {f"sha256:{d.name}" for d in base.glob("*/*") if (d / "data").exists()} if base.exists() else set()

    def snapshot(self) -> dict[str, tuple[int, str]]:
        """Every file under storage -> (size, sha256): equal snapshots mean nothing was written."""
        out: dict[str, tuple[int, str]] = {}
        for p in sorted(self.storage.rglob("*")):
            if p.is_file():
                data = p.read_bytes()
                out[str(p.relative_to(self.storage))] = (len(data), hashlib.sha256(data).hexdigest())
        return out

    def repositories(self) -> list[str]:
        base = self.storage / "docker/registry/v2/repositories"
        return sorted(str(p.parent.relative_to(base)) for p in base.rglob("_manifests")) if base.exists() else []

    def manifest_digest(self, repo_path: str, reference: str,
                        accept: str = "application/vnd.docker.distribution.manifest.v2+json") -> str | None:
        """Docker-Content-Digest for a tag, read with the v2 Accept header (None when absent); an OCI
        manifest (publish --compression zstd) is served only to a client that accepts its type."""
        r = requests.get(f"{self.url}/v2/{repo_path}/manifests/{reference}", headers={"Accept": accept},
                         auth=self.auth, timeout=10)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.headers["Docker-Content-Digest"]
