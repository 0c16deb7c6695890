"""`build.py repro` on the users' engine: two cold builds of the seed cell in Docker 28's containerd image
store give one manifest digest; and `build.py verify --rebuild`: the cell built, published signed (its provenance
naming the digest repro proved for the same inputs), and rebuilt cold: the rebuild has that digest byte for byte,
and its files equal the published image's. Not in `make test` (three uncached builds of a 5.8 GB image and one
cached: about 22 minutes on 2 cores, over the tier's budget; docs/testing.md): `make test-repro`, as root on
Debian."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

import ptmg_contract as contract

from .cellimage import ROOT
from .engine28 import CELL, TIMES, Modern, started
from .registry import LocalRegistry

pytestmark = pytest.mark.repro


@pytest.fixture(scope="module")
def modern(docker_client: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Modern]:
    with started("containerd", docker_client, tmp_path_factory) as engine:
        yield engine


@pytest.fixture(scope="module")
def repro_run(modern: Modern) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`build.py repro CELL` exactly as a user types it, once for the module: (the run, its log folder)."""
    logs = modern.tmp / "repro-logs"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(ROOT / "build.py"), "repro", CELL], cwd=ROOT,
                       env={**modern.env, "PTMG_LOG_DIR": str(logs)}, capture_output=True, text=True, timeout=3600,
                       check=False)
    TIMES[f"{modern.store} build.py repro"] = time.monotonic() - t0
    return p, logs


def test_repro_builds_twice_from_scratch_and_the_digests_match(modern: Modern, repro_run: Any) -> None:
    """`build.py repro CELL` exactly as a user types it: two uncached builds give one manifest digest (exit 0),
    its report names the inputs hash the builds had, and nothing of them stays in the engine (their layer records
    are dropped after each)."""
    p, logs = repro_run
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    report = json.loads((logs / f"{CELL}.repro.json").read_text())
    (a, b) = report["builds"]
    assert report["same"] and a["manifest"] == b["manifest"] and a["config"] == b["config"], report
    assert report["inputs"].startswith("sha256:") and len(report["inputs"]) == 71, report
    assert f"bit-identical ({a['manifest']})" in p.stdout and p.stdout.count(a["manifest"]) >= 3, p.stdout
    # Nothing of the two builds stays in the engine: no image, no layer record (the cache mounts may).
    assert not modern.client.images.list(name="pt-multi-gpu")
    records = [r for r in modern.client.df().get("BuildCache") or [] if r.get("Type") == "regular"]
    assert sum(int(r.get("Size") or 0) for r in records) < 1e9, records




def test_verify_rebuild_has_the_digest_repro_proved_and_the_published_images_files(modern: Modern,
                                                                                    repro_run: Any) -> None:
    """The cell built (loaded into the engine: its files keep the build's times), published signed to a real
    registry (--allow-untested: no smoke run here, test_modern_engine.py runs the selftest) with repro's report
    at hand, so its provenance names the digest repro proved for the same inputs; then `build.py verify REF --key
    PUB --rebuild` exactly as a user types it: the signatures and the provenance verify, one cold reproducible
    build of the cell has the signed digest byte for byte, and its files equal the published image's layer by
    layer but for their times (exit 0)."""
    p, logs = repro_run
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    proven = json.loads((logs / f"{CELL}.repro.json").read_text())["builds"][0]["manifest"]
    reg = LocalRegistry(modern.tmp / "registry").start()
    try:
        b = modern.build_py("build", "--only", CELL, timeout=3600)
        assert b.returncode == 0, b.stderr[-4000:]
        # the image repro's report is about: the same inputs (Dockerfile, our files, lock, base, Debian snapshot)
        labels = modern.client.images.get(f"pt-multi-gpu:{CELL}").labels
        assert labels[contract.LABEL_INPUTS_HASH] == json.loads((logs / f"{CELL}.repro.json").read_text())["inputs"]
        keygen = modern.build_py("keygen", str(modern.tmp / "signing"), timeout=60)
        assert keygen.returncode == 0, keygen.stderr
        out = modern.tmp / "rebuild-report"
        p = modern.build_py("publish", "--only", CELL, "--registry", f"{reg.host}/rebuild", "--report-dir", str(out),
                            "--json", "--allow-stale-os", "--allow-untested", "--sign-key", str(modern.tmp / "signing.key"),
                            "--repro-dir", str(logs), timeout=1800)
        assert p.returncode == 0, p.stderr[-4000:]
        report = json.loads((out / "publish-report.json").read_text())
        cell = report["cells"][0]
        digest, tag = cell["digest"], cell["tags"][0]["tag"]
        assert [s["digest"] for s in report["signed"]] == [digest], report["signed"]
        assert report["signed"][0]["reproducible"] == {CELL: proven}, report["signed"]
        # Only the registry's copy is compared: the engine's image and build cache go (disk), the rebuild is cold.
        modern.client.images.remove(f"pt-multi-gpu:{CELL}", force=True)
        prune = subprocess.run(["docker", "builder", "prune", "--all", "--force"], env=modern.env,
                               capture_output=True, text=True, timeout=600, check=False)
        assert prune.returncode == 0, prune.stderr[-2000:]
        ref = f"{reg.host}/rebuild/pt-multi-gpu:{tag}"
        t0 = time.monotonic()
        v = subprocess.run([sys.executable, str(ROOT / "build.py"), "verify", ref, "--key",
                            str(modern.tmp / "signing.pub"), "--rebuild"], cwd=ROOT,
                           env={**modern.env, "PTMG_LOG_DIR": str(modern.tmp / "rebuild-logs")}, capture_output=True,
                           text=True, timeout=3600, check=False)
        TIMES[f"{modern.store} build.py verify --rebuild"] = time.monotonic() - t0
        assert v.returncode == 0, (v.stdout + v.stderr)[-6000:]
        assert f"{digest} ({CELL}): verified" in v.stdout, v.stdout
        assert f"{CELL}: {digest}: the rebuild matches the published image" in v.stdout, v.stdout
        assert f"provenance signs {proven} as the reproducible digest of {CELL}" in v.stdout, v.stdout
        assert f"{CELL}: the rebuild's manifest digest {proven} is the reproducible digest the provenance signs: " \
               "bit-identical" in v.stdout, v.stdout
        assert not modern.client.images.list(name="pt-multi-gpu")  # the rebuild left no image in the engine
    finally:
        reg.stop()
        shutil.rmtree(reg.root, ignore_errors=True)
