"""`build.py repro` on the users' engine: two cold builds of the seed cell in Docker 28's containerd image
store give one manifest digest. Not in `make test` (two uncached builds of a 5.8 GB image: about 16
minutes on 2 cores, over the tier's budget; docs/testing.md): `make test-repro`, as root on Debian."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import docker
import pytest

from .cellimage import ROOT
from .engine28 import CELL, TIMES, Modern, started

pytestmark = pytest.mark.repro


@pytest.fixture(scope="module")
def modern(docker_client: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Modern]:
    with started("containerd", docker_client, tmp_path_factory) as engine:
        yield engine


def test_repro_builds_twice_from_scratch_and_the_digests_match(modern: Modern) -> None:
    """`build.py repro CELL` exactly as a user types it: two uncached builds give one manifest digest (exit 0),
    and nothing of them stays in the engine (their layer records are dropped after each)."""
    logs = modern.tmp / "repro-logs"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(ROOT / "build.py"), "repro", CELL], cwd=ROOT,
                       env={**modern.env, "PTMG_LOG_DIR": str(logs)}, capture_output=True, text=True, timeout=3600,
                       check=False)
    TIMES[f"{modern.store} build.py repro"] = time.monotonic() - t0
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    report = json.loads((logs / f"{CELL}.repro.json").read_text())
    (a, b) = report["builds"]
    assert report["same"] and a["manifest"] == b["manifest"] and a["config"] == b["config"], report
    assert f"bit-identical ({a['manifest']})" in p.stdout and p.stdout.count(a["manifest"]) >= 3, p.stdout
    # Nothing of the two builds stays in the engine: no image, no layer record (the cache mounts may).
    assert not modern.client.images.list(name="pt-multi-gpu")
    records = [r for r in modern.client.df().get("BuildCache") or [] if r.get("Type") == "regular"]
    assert sum(int(r.get("Size") or 0) for r in records) < 1e9, records


