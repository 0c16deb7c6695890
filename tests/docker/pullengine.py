"""A private, throwaway Docker engine that only pulls: Debian's Docker 28 (the binaries
scripts/engine28.sh fetches into $PTMG_E28_HOME; `scripts/engine28.sh install` on first use), with a data-root, exec-root, socket, managed
containerd and bridge of its own, and no iptables rules or forwarding settings. Nothing of the system
engine or of the second engine (scripts/engine28.sh's, /run/ptmg-e28) is shared or touched; no
container runs.

Never ``--bridge=none``: a dockerd started with it deletes the host's ``docker0`` interface (moby's
removeDefaultBridgeInterface), which is the system engine's default bridge. This engine gets a
bridge of its own instead (``ptmgpull<hex>`` on a free 10.213.x.0/24), deleted when it stops.

Why it exists: the system engine is Docker 20.10, which can't unpack zstd layers (moby added zstd
decompression in 23.0), and it holds every layer of the cells already, so a pull there of a cell
image finds the image and downloads nothing. A fresh engine pulls for real, gzip and zstd alike.

    with PullEngine(tmp_path) as engine:
        engine.docker("pull", "127.0.0.1:5000/ns/img@sha256:...")
        engine.image_id("127.0.0.1:5000/ns/img@sha256:...")
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path
from types import TracebackType

from tests.support import wait_until

E28_HOME = Path(os.environ.get("PTMG_E28_HOME", "/var/cache/pt-multi-gpu/engine28"))
DOCKER_CLI = "/usr/bin/docker"
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "engine28.sh"
FIX = (f"the pull engine runs Debian's Docker 28 from {E28_HOME}/root (usr/sbin/dockerd, usr/bin/containerd), "
       "and `scripts/engine28.sh install` could not fetch it: {why}")


class PullEngine:
    def __init__(self, workdir: Path, *, store: str = "overlay2") -> None:
        """store: the image store, "overlay2" (the classic store, keyed by chain ID) or "containerd" (the
        containerd snapshotter: compressed blobs in its content store, unpacked snapshots by chain ID)."""
        if store not in ("overlay2", "containerd"):
            raise ValueError(f"store {store!r}: overlay2 or containerd")
        self.store = store
        self.root = E28_HOME / "root"
        self.data = workdir / "pull-engine-data"
        self.run_dir = Path(f"/run/ptmg-pull-{uuid.uuid4().hex[:8]}")  # a short path: a socket's limit is 108
        self.host = f"unix://{self.run_dir}/docker.sock"
        self.log = workdir / "pull-engine.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.bridge = f"ptmgpull{uuid.uuid4().hex[:6]}"  # an interface name has at most 15 characters
        self.bridge_made = False

    def _bridge_up(self) -> None:
        routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout
        octet = next(n for n in range(100, 200) if f"10.213.{n}." not in routes)
        subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], check=True)
        self.bridge_made = True
        subprocess.run(["ip", "addr", "add", f"10.213.{octet}.1/24", "dev", self.bridge], check=True)
        subprocess.run(["ip", "link", "set", self.bridge, "up"], check=True)

    def start(self) -> PullEngine:
        dockerd = self.root / "usr/sbin/dockerd"
        if not dockerd.exists() or not (self.root / "usr/bin/containerd").exists():
            # A fresh machine: the test tier fetches the packages itself (once; kept in PTMG_E28_HOME).
            got = subprocess.run(["bash", str(SCRIPT), "install"], capture_output=True, text=True, timeout=900,
                                 check=False)
            if got.returncode != 0 or not dockerd.exists():
                raise RuntimeError(FIX.format(why=got.stderr[-2000:] or f"exit {got.returncode}"))
        self.run_dir.mkdir(mode=0o700)
        self.data.mkdir(parents=True)
        config = self.run_dir / "daemon.json"
        config.write_text(json.dumps({"features": {"containerd-snapshotter": self.store == "containerd"}}))
        self._bridge_up()
        argv = [str(dockerd), "--config-file", str(config), "--data-root", str(self.data),
                "--exec-root", str(self.run_dir / "exec"), "--pidfile", str(self.run_dir / "dockerd.pid"),
                "-H", self.host, f"--bridge={self.bridge}", "--iptables=false", "--ip6tables=false",
                "--ip-forward=false", "--ip-masq=false"]
        env = {**os.environ, "PATH": f"{self.root}/usr/bin:{self.root}/usr/sbin:{os.environ.get('PATH', '')}"}
        with self.log.open("ab") as log:  # its own process group: the stop reaches it and its containerd only
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

        def answers() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the pull engine's dockerd exited {self.proc.returncode}: {self.log_tail()}")
            return self.docker("version", "--format", "{{.Server.Version}}", check=False).returncode == 0

        wait_until(answers, timeout=60, what="the pull engine")
        return self

    def docker(self, *args: str, timeout: float = 1800, check: bool = True,
               stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "DOCKER_HOST": self.host}
        r = subprocess.run([DOCKER_CLI, *args], env=env, input=stdin, capture_output=True, text=True, timeout=timeout,
                           check=False)
        if check and r.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} on the pull engine: exit {r.returncode}: {r.stderr[-2000:]}")
        return r

    def image_id(self, ref: str) -> str:
        return self.docker("image", "inspect", "--format", "{{.Id}}", ref).stdout.strip()

    def version(self) -> str:
        return self.docker("version", "--format", "{{.Server.Version}}").stdout.strip()

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to its process group (dockerd and the containerd it runs), then its folders and bridge go."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                  if line.split()[1].startswith((str(self.data), str(self.run_dir)))]
        for point in sorted(mounts, reverse=True):  # none when it stopped cleanly; never leave one behind
            subprocess.run(["umount", "-l", point], check=False)
        shutil.rmtree(self.data, ignore_errors=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.bridge_made:
            subprocess.run(["ip", "link", "del", self.bridge], check=False)
            self.bridge_made = False

    def __enter__(self) -> PullEngine:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
