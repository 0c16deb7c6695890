"""A small image for pyxis's registry path (test_pyxis), and the registry it is pulled from.

The 5.8 GB cell takes minutes to push and to import on two nodes (docs/testing.md); this image is
the cell's Debian base (already on the engine: the cell build made or pulled it) plus a few files,
about 75 MB, which enroot pulls, caches and unpacks on both nodes in seconds:

- /etc/ptmg-probe: a marker unique to this build, read by the job;
- ENV PTMG_PROBE_IMAGE=from-image (the job exports another value: the image's must win, as the
  script passes no --container-env) and PYTORCH_VERSION (what makes enroot's PyTorch hook write
  MASTER_ADDR and the rest);
- WORKDIR /workspace, as the cell's;
- ENTRYPOINT /opt/probe/entrypoint.sh: exports PTMG_PROBE_ENTRYPOINT=ran, then runs its arguments;
- /opt/venv/bin/torchrun: NOT torch's (the image has no torch; the real DDP job runs from the cell's
  export): a shell script that prints what the job gave it, one `[probe NODE] KEY=VALUE` line each
  (argv, working directory, HOME and whether it is a mount, the variables above and the hook's, the
  marker, the dataset mount), and writes a file into HOME and into the job's directory.

The registry is `LocalRegistry` with htpasswd auth, listening on the cluster network's gateway
(the host's address there), so the nodes reach it; the image goes there with skopeo, since dockerd
speaks plain HTTP to 127.0.0.0/8 registries only. `requests()` reads its access log: who fetched
what, so a test can tell a pull from a cache hit.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import docker
import requests

from .registry import LocalRegistry

REPO = "ptmg-pyxis-probe"
TORCHRUN = r"""#!/bin/bash
# NOT torch's torchrun (this image has no torch): it reports what the job gave it.
node="$(cat /proc/sys/kernel/hostname)"
say() { printf '[probe %s] %s=%s\n' "${node}" "$1" "$2"; }
say argv "$*"
say pwd "$(pwd)"
say home "${HOME-}"
for v in PTMG_PROBE_IMAGE PTMG_PROBE_JOB PTMG_PROBE_ENTRYPOINT PYTORCH_VERSION MASTER_ADDR MASTER_PORT \
         WORLD_SIZE RANK LOCAL_RANK; do
    say "env.${v}" "${!v-<unset>}"
done
say marker "$(cat /etc/ptmg-probe)"
say dataset "$(cat /data/sample.txt)"
say home-mounted "$(mountpoint -q "${HOME}" && echo yes || echo no)"
say home-write "$(echo "${node}" > "${HOME}/.ptmg-probe-${SLURM_JOB_ID}" && echo ok)"
say jobdir-write "$(echo "${node}" > "${PTMG_JOB_DIR}/probe-${node}" && echo ok)"
"""
ENTRYPOINT = """#!/bin/sh
# The probe's ENTRYPOINT: marks the environment of whatever a runtime starts through it.
export PTMG_PROBE_ENTRYPOINT=ran
exec "$@"
"""
DOCKERFILE = """FROM {base}
COPY torchrun /opt/venv/bin/torchrun
COPY entrypoint.sh /opt/probe/entrypoint.sh
COPY marker /etc/ptmg-probe
ENV PTMG_PROBE_IMAGE=from-image PYTORCH_VERSION=probe
WORKDIR /workspace
ENTRYPOINT ["/opt/probe/entrypoint.sh"]
"""
#: One line of the registry's access log (combined format).
ACCESS = re.compile(r'^(?P<ip>\S+) \S+ \S+ \[[^\]]+\] "(?P<method>[A-Z]+) (?P<path>\S+) [^"]*" (?P<status>\d{3}) ')


@dataclass(frozen=True)
class Probe:
    registry: LocalRegistry
    tag: str
    marker: str
    netrc: str  # the line of enroot's .credentials (netrc) that logs in
    layers: tuple[str, ...]  # the config's and the layers' digests, as the registry serves them

    @property
    def docker_ref(self) -> str:
        return f"{self.registry.host}/{REPO}:{self.tag}"

    @property
    def enroot_ref(self) -> str:
        return f"{self.registry.host}#{REPO}:{self.tag}"

    def requests(self, since: int = 0) -> list[tuple[str, str, str, int]]:
        """(client ip, method, path, status) of each request to the probe's repository logged after
        byte ``since`` of the log (``log_size()`` before the job)."""
        text = self.registry.log_path.read_bytes()[since:].decode(errors="replace")
        out = []
        for line in text.splitlines():
            m = ACCESS.match(line)
            if m and m["path"].startswith(f"/v2/{REPO}/"):
                out.append((m["ip"], m["method"], m["path"], int(m["status"])))
        return out

    def log_size(self) -> int:
        return self.registry.log_path.stat().st_size


def base_of(dockerfile: Path) -> str:
    """The first FROM of the cell's Dockerfile: its Debian base, on the engine once the cell is built."""
    for line in dockerfile.read_text().splitlines():
        if line.startswith("FROM "):
            return line.split()[1]
    raise RuntimeError(f"{dockerfile}: no FROM line")


def build_and_push(client: docker.DockerClient, base: str, labels: Mapping[str, str], root: Path,
                   address: str) -> Probe:
    """Start the registry on ``address`` (with a login), build the probe FROM ``base``, push it there
    and remove it from the engine. The caller stops ``probe.registry``."""
    user, password = "ptmg-probe", uuid.uuid4().hex
    registry = LocalRegistry(root, auth=(user, password), address=address).start()
    tag, marker = uuid.uuid4().hex[:8], f"{REPO} {uuid.uuid4().hex}"
    local = f"{REPO}:{tag}"
    try:
        with tempfile.TemporaryDirectory(prefix="ptmg-probe-ctx-") as tmp:
            ctx = Path(tmp)
            for name, text in {"torchrun": TORCHRUN, "entrypoint.sh": ENTRYPOINT, "marker": f"{marker}\n",
                               "Dockerfile": DOCKERFILE.format(base=base)}.items():
                (ctx / name).write_text(text)
                (ctx / name).chmod(0o755)
            client.images.build(path=str(ctx), tag=local, labels=dict(labels), rm=True, forcerm=True, pull=False)
        try:
            r = subprocess.run(["skopeo", "copy", "--quiet", "--format", "v2s2", "--dest-tls-verify=false",
                                "--dest-creds", f"{user}:{password}", f"docker-daemon:{local}",
                                f"docker://{registry.host}/{REPO}:{tag}"],
                               capture_output=True, text=True, timeout=300, check=False)
        finally:
            client.images.remove(local, force=True)
        if r.returncode != 0:
            raise RuntimeError(f"skopeo copy {local} to {registry.host} failed ({r.returncode}): {r.stderr[-2000:]}")
        manifest = requests.get(f"{registry.url}/v2/{REPO}/manifests/{tag}", auth=(user, password), timeout=10,
                                headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"})
        manifest.raise_for_status()
        body = manifest.json()
        layers = (body["config"]["digest"], *(layer["digest"] for layer in body["layers"]))
    except BaseException:
        registry.stop()
        raise
    host = address  # enroot looks the login up by the registry's host, without its port
    return Probe(registry=registry, tag=tag, marker=marker, netrc=f"machine {host} login {user} password {password}",
                 layers=layers)
