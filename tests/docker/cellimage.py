"""The real cell image the docker tier tests: built once per session through `build.py build`.

It is built the way a corporate user builds: with extra CA certificates and
pip-index and proxy settings that carry credentials, so the layer scan in
test_build.py has real secrets to look for. `--no-cache` makes every RUN
execute with those secrets mounted (a cached layer would prove nothing); pip's
BuildKit cache mount still saves the downloads.

Env:
  PTMG_TEST_CELL   the cell to build (default: the 2.7.0 seed cell)
  PTMG_TEST_IMAGE  use this image instead and build nothing (fast local runs;
                   the leak scan then has no planted secrets and only checks CAs)

The other native cells of images.yaml (test_supply and test_training_features test them) and the arm64
cell are built in the background from the session's start (conftest.py, background.py), alongside
this one: a base missing on a fresh machine is bootstrapped once (build.py holds a per-base lock
across processes), and each build has its own context folder (.build/context-N, locked likewise).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import ssl
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.docker.background import Job

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CELL = "2.7.0-cuda12.6-cudnn9-runtime"


@dataclass(frozen=True)
class BuiltCell:
    ref: str
    cell: str
    markers: tuple[bytes, ...]  # secrets planted in the build; none may be in the image
    build_seconds: float | None
    #: SHA-256 fingerprints of CAs the build was given (the test CA when this session built it,
    #: else the host's extra CAs): the build log's canary line must name them.
    ca_fingerprints: tuple[str, ...] = ()
    log: Path | None = None  # the build log (build.py writes build-logs/<cell>.log)


def make_test_ca(tmp: Path, marker: str) -> Path:
    """A real self-signed CA (pip must still parse the bundle), unique to this run."""
    key, crt = tmp / "ca.key", tmp / "ca.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", f"/CN={marker}", "-keyout", str(key), "-out", str(crt)],
                   check=True, capture_output=True)
    return crt


def fingerprints(path: Path) -> list[str]:
    """SHA-256 of every certificate (DER) in a PEM file, as entrypoint/build_canary.py prints them."""
    pems = re.findall(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", path.read_text(), re.S)
    return [hashlib.sha256(ssl.PEM_cert_to_DER_cert(p)).hexdigest() for p in pems]


def pem_lines(path: Path) -> list[bytes]:
    """Distinctive lines of every certificate in a PEM file (the base64 bodies)."""
    lines = [ln.strip() for ln in path.read_bytes().splitlines()]
    return [ln for ln in lines if len(ln) >= 60 and not ln.startswith(b"-----")]


#: The session's background jobs (tests/docker/background.py), by name; conftest.py starts them.
JOBS: dict[str, Job] = {}
NATIVE = "native cells"
ARM64 = "arm64 cell"


def building() -> list[str]:
    """The background jobs building images now."""
    return [name for name, job in JOBS.items() if job.building]


def wait_for_native_cells() -> None:
    """Until the background build of the other native cells ended. A failure is not raised here: each
    test's own `build.py build` of a cell it needs then fails with the build's message."""
    job = JOBS.get(NATIVE)
    if job is None:
        return
    job.wait()
    failed = job.failed_step()
    if failed is not None:
        print(f"\nbackground build of the native cells failed (exit {failed.returncode}); see {job.log}")


def build(tmp: Path) -> BuiltCell:
    given = os.environ.get("PTMG_TEST_IMAGE")
    cell = os.environ.get("PTMG_TEST_CELL", DEFAULT_CELL)
    host_cas = sorted(Path("/usr/local/share/ca-certificates").rglob("*.crt"))
    ca_markers = [line for p in host_cas for line in pem_lines(p)[1:3]]
    host_fps = tuple(fp for p in host_cas for fp in fingerprints(p))
    if given:
        log = ROOT / "build-logs" / f"{cell}.log"
        return BuiltCell(given, cell, tuple(ca_markers), None, host_fps, log if log.is_file() else None)
    token = f"ptmg-leak-{uuid.uuid4().hex[:12]}"
    test_ca = make_test_ca(tmp, token)
    env = {
        **os.environ,
        # Credentials in the index URL: PyPI ignores them, the image must not keep them.
        "PIP_INDEX_URL": f"https://__token__:{token}-index@pypi.org/simple",
        "PIP_TRUSTED_HOST": f"{token}-trusted.invalid",
        # A proxy with credentials that nothing uses (NO_PROXY=*; apt's http mirror ignores https_proxy).
        "HTTPS_PROXY": f"http://user:{token}-proxy@proxy.invalid:3128",
        "NO_PROXY": "*",
    }
    argv = [sys.executable, str(ROOT / "build.py"), "build", "--only", cell, "--force", "--no-cache",
            "--ca-cert", str(test_ca), "--json"]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"building {cell} failed (exit {r.returncode}):\n{r.stderr[-4000:]}\n{r.stdout}")
    (result,) = json.loads(r.stdout)
    repository = "pt-multi-gpu"
    markers = [token.encode(), *pem_lines(test_ca)[1:3], *ca_markers]
    build_log = ROOT / str(result["log"]) if result.get("log") else None
    return BuiltCell(f"{repository}:{cell}", cell, tuple(markers), float(result["seconds"]),
                     tuple(fingerprints(test_ca)), build_log)
