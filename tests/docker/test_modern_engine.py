"""The users' engine: Docker 28 with buildx, in both image stores, beside the system's 20.10.

`scripts/engine28.sh` fetches Debian forky's docker.io 28, docker-cli and docker-buildx (a private
apt configuration; the system's sources are untouched), and starts a second dockerd with its own
data-root, exec-root, socket, containerd and bridge. The module runs once per store: the classic
overlay2 store, then the containerd image store (Docker 29's default for new installs), one at a time
(one cell on disk, about 19 GB at the containerd store's peak), and stops the engine and deletes its data-root after each,
also when a test fails. On it, with nothing but DOCKER_HOST (and the engine's CLI on PATH) pointing
there, in both stores: the seed cell builds through buildx and the wheel server, `make images` then
skips it, its labels, probe and what its ID names are right. What is the store's own: in the classic
store `build.py repro` refuses in one line. In both, patch day (an OS-only rebuild with the layer cache)
keeps the layers below the OS layer under their chain IDs and costs a node at most 10% of the image
anew (the classic store's unpacked bytes, the containerd store's compressed blobs). In the containerd store (Docker 29's default for new
installs) the selftest and a 2-rank DDP job pass, publish to a real registry verifies the manifest
digest the store calls the image and a rerun is 'unchanged', and `diff`, `sbom` and `audit` work. The
containerd store's two cold builds of `build.py repro` are `tests/docker/test_reproducible.py`'s (`make test-repro`).

Part of `make test`, after the modules that use the native cells and test_arm64 (conftest.py). Alone:
`.venv/bin/python -m pytest tests/docker -m modern_engine` (as root on Debian).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
import requests

import ptmg_contract as contract
from builder.engine import capabilities
from builder.lock import model
from builder.publish.client import ACCEPT

from .cellimage import ROOT
from .engine28 import CELL, TIMES, Modern, started
from .registry import LocalRegistry

sys.path.insert(0, str(ROOT / "bench"))
import pulllib  # bench/pulllib.py: chain IDs, and what a node stores anew

pytestmark = pytest.mark.modern_engine

NAMESPACE = "modern"
#: Patch day (an OS-only change): what a node that holds the image before must store (classic) or fetch
#: (containerd) anew.
PATCH_DAY_SHARE = 0.10
#: The layers below the weekly OS layer: the CUDA wheels, torch's shared files, the base, the user, the venv,
#: torch, tools (docs/image-layout.md).
BELOW_OS = 7
#: What the containerd store alone runs: the image in containers, publish, and diff, sbom and audit. In the classic
#: store they would run the same code on the same engine as the containerd store's run or 20.10's
#: (test_publish.py, test_hpc.py), so there the module proves only what is the store's own.
CONTAINERD_ONLY = pytest.mark.parametrize("modern", ["containerd"], indirect=True)


#: The classic store's pass (marker classic_store, so that it can be selected or left out alone; every
#: `make test` runs it): what it proves that the containerd pass does not is the store's own (buildx's build
#: and `make images`' skip in it, repro's refusal, patch day in unpacked bytes).
CLASSIC = pytest.param("overlay2", marks=pytest.mark.classic_store)


@pytest.fixture(scope="module", params=[CLASSIC, "containerd"])
def modern(request: pytest.FixtureRequest, docker_client: docker.DockerClient,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Modern]:
    with started(str(request.param), docker_client, tmp_path_factory) as engine:
        yield engine


def test_the_engine_is_what_the_test_asked_for(modern: Modern) -> None:
    info = modern.client.info()
    assert capabilities.image_store(info).kind == (capabilities.CONTAINERD if modern.store == "containerd"
                                                   else capabilities.CLASSIC)
    assert str(info.get("DockerRootDir", "")).startswith("/var/lib/pt-multi-gpu-engine28")
    p = modern.build_py("doctor")
    out = p.stdout + p.stderr
    assert "builder: " in out and "buildx" in out and "rewrite-timestamp (bit-identical layers): yes" in out, out
    assert f"image store: {'containerd' if modern.store == 'containerd' else 'classic'}" in out, out


@pytest.mark.parametrize("modern", [CLASSIC], indirect=True)
def test_repro_in_the_classic_store_refuses_in_one_line_with_the_fix(modern: Modern) -> None:
    """`build.py repro CELL` exactly as a user types it, in the classic store, whose docker driver exports
    no OCI layout: one line with the fix, exit 2 (the containerd store's two builds: tests/docker/test_reproducible.py)."""
    p = modern.build_py("repro", CELL, timeout=600, PTMG_LOG_DIR=str(modern.tmp / "repro-logs"))
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert "containerd image store" in lines[0] and "Fix:" in lines[0] and "Traceback" not in p.stderr


def test_cell_builds_then_make_images_skips_it(modern: Modern) -> None:
    p = modern.build_py("build", "--only", CELL, timeout=3600)
    assert p.returncode == 0, p.stderr[-4000:]
    log = (ROOT / "build-logs" / f"{CELL}.log").read_text(errors="replace")
    assert " buildx build --load" in log.splitlines()[0]  # the buildx path, not 20.10's DOCKER_BUILDKIT=1
    image_id = modern.image().id
    # `make images` with this as the only engine there is (DOCKER_HOST names it): its own checks pass and
    # the cell is unchanged, so the second build skips. The Debian archive is read live: where its security
    # suite moved in the minutes between the two (it publishes several times a day), the rebuild is right
    # (patch day) and shows in the OS snapshot label; then the next `make images` must skip.
    for attempt in (1, 2):
        snapshot = modern.image().labels[contract.LABEL_OS_SNAPSHOT]
        t0 = time.monotonic()
        m = subprocess.run(["make", "--no-print-directory", "images", f"ARGS=--only {CELL}"], cwd=ROOT,
                           env=modern.env, capture_output=True, text=True, timeout=900, check=False)
        TIMES[f"{modern.store} make images (skip)"] = time.monotonic() - t0
        assert m.returncode == 0, (m.stdout + m.stderr)[-4000:]
        if "skipped" in m.stdout + m.stderr and modern.image().id == image_id:
            return
        moved = modern.image().labels[contract.LABEL_OS_SNAPSHOT]
        assert attempt == 1 and moved != snapshot, (
            f"make images rebuilt an unchanged cell (OS snapshot {snapshot} then {moved}):\n"
            + (m.stdout + m.stderr)[-4000:])
        print(f"\nthe Debian archive moved between the builds ({snapshot} -> {moved}): rebuilt, as patch day does")
        image_id = modern.image().id


def _held_layers(modern: Modern) -> list[pulllib.Layer]:
    """The cell image's layers, each with what a node pays for it in this store: in the classic store its
    unpacked size (the layer database: what the node stores under the chain ID); in the containerd store
    its compressed blob (the manifest in containerd's content store, which the image's ID names: what the
    node fetches and keeps beside the snapshot)."""
    ref = f"pt-multi-gpu:{CELL}"
    if modern.store == "overlay2":
        return pulllib.read_layers(ref, pulllib.layer_store(modern.env), modern.env)
    root = Path(modern.client.info()["DockerRootDir"])

    def blob(digest: str) -> Any:
        (path,) = root.glob(f"containerd/*/io.containerd.content.v1.content/blobs/sha256/{digest.removeprefix('sha256:')}")
        return json.loads(path.read_bytes())

    manifest = blob(str(modern.image().id))
    diffs = [str(d) for d in blob(manifest["config"]["digest"])["rootfs"]["diff_ids"]]
    return [pulllib.Layer(d, c, int(b["size"]), "?", str(b["digest"]), int(b["size"]))
            for d, c, b in zip(diffs, pulllib.chain_ids(diffs), manifest["layers"], strict=True)]


def test_patch_day_renews_the_os_layer_and_keeps_the_venv_below_it(modern: Modern) -> None:
    """A newer security suite (another OS snapshot key, as test_security_updates.py simulates it; nothing else
    changed), built with the layer cache as a CI builder has it: the CUDA wheels, torch's shared files, the base,
    the user, the venv, torch and the tools keep their chain IDs, and a node that holds the image before pays at most 10% of it anew."""
    try:
        held = _held_layers(modern)
        r = modern.build_py("build", "--only", CELL, "--json", timeout=1800,
                            **{contract.OS_SNAPSHOT_ARG: f"test-newer-suite-{uuid.uuid4().hex[:8]}"})
        assert r.returncode == 0, r.stderr[-4000:]
        assert json.loads(r.stdout)[0]["status"] == "built"
        cost = pulllib.cost(held, _held_layers(modern))
        kept = [not lay["new_chain"] for lay in cost["layers"]]
        assert kept[:BELOW_OS] == [True] * BELOW_OS and not kept[BELOW_OS], cost["layers"]
        if modern.store == "overlay2":
            kinds = [lay["kind"] for lay in cost["layers"][:BELOW_OS + 1]]
            assert kinds == ["CUDA wheels", "torch's shared files", "base", "user", "venv", "torch", "tools",
                             "OS (apt)"], kinds
        new = [(lay["kind"], lay["size"]) for lay in cost["layers"] if lay["new_chain"]]
        assert cost["new_by_chain_share"] <= PATCH_DAY_SHARE, (
            f"{modern.store}: patch day costs {cost['new_by_chain'] / 1e6:,.1f} MB of {cost['size'] / 1e6:,.1f} MB "
            f"({cost['new_by_chain_share']:.1%}): {new}")
        print(f"\n{modern.store}: patch day costs {cost['new_by_chain'] / 1e6:,.1f} of {cost['size'] / 1e6:,.1f} MB "
              f"({cost['new_by_chain_share']:.1%}, {'unpacked' if modern.store == 'overlay2' else 'compressed'})")
    finally:
        # The build cache (the wheel context's copy, the layers' cache) has done its work: dropped here, so
        # the peak of the steps after (publish's registry) is the image alone, not the image and its cache.
        prune = subprocess.run(["docker", "builder", "prune", "--all", "--force"], env=modern.env,
                               capture_output=True, text=True, timeout=600, check=False)
        assert prune.returncode == 0, prune.stderr[-2000:]


def test_labels_probe_and_what_the_id_names(modern: Modern) -> None:
    image = modern.image()
    labels = image.labels
    assert labels[contract.LABEL_CELL] == CELL and labels.get(contract.LABEL_INPUTS_HASH)
    assert labels[f"{contract.LABEL_NS}.torch"].startswith("2.7.0")  # written from the probe of the image
    assert labels[f"{contract.LABEL_NS}.cuda"] == "12.6" and labels[f"{contract.LABEL_NS}.python"].startswith("3.11")
    descriptor = image.attrs.get("Descriptor") or {}
    if modern.store == "containerd":  # the ID is the manifest's digest: one manifest (no attestation index)
        assert descriptor.get("digest") == image.id
        assert descriptor.get("mediaType") == "application/vnd.oci.image.manifest.v1+json", descriptor
    else:
        # The classic store has no Descriptor (the API fills it only from a multi-platform store), and its ID
        # is the config's digest: the config file under the data-root hashes to the ID and lists the layers.
        assert "Descriptor" not in image.attrs, image.attrs.get("Descriptor")
        root = Path(modern.client.info()["DockerRootDir"])
        config = (root / "image" / "overlay2" / "imagedb" / "content" / "sha256" / image.id.removeprefix("sha256:"))
        raw = config.read_bytes()
        assert "sha256:" + hashlib.sha256(raw).hexdigest() == image.id
        assert json.loads(raw)["rootfs"]["diff_ids"] == image.attrs["RootFS"]["Layers"]


@CONTAINERD_ONLY
def test_selftest_and_two_rank_ddp(modern: Modern) -> None:
    p = modern.build_py("test", "--only", CELL, "--json", timeout=1800)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    # stdout is the verb's report and nothing else (builder/cli/verbs/test.py, --json): one entry for the cell,
    # its selftest without a failure, the plan without GPUs (one node, two gloo ranks: builder/smoke/gpus.py
    # plan_run), and the DDP job's verdict and rank 0's result (builder/smoke/results.py).
    (cell,) = json.loads(p.stdout)
    image = modern.image()
    assert (cell["cell"], cell["image_id"], cell["ok"], cell["emulated"]) == (CELL, image.id, True, ""), cell
    counts = cell["selftest"]
    assert counts["failed"] == counts["errors"] == 0 and counts["passed"] > 0, counts
    assert cell["selftest_failures"] == [], cell["selftest_failures"]
    assert (cell["plan"]["nodes"], cell["plan"]["nproc_per_node"], cell["plan"]["backend"]) == (1, 2, "gloo")
    ddp = cell["ddp"]
    assert (ddp["ok"], ddp["verdict"], ddp["world_size"], ddp["problems"]) == (True, "passed", 2, []), ddp
    result = ddp["result"]
    assert (result["ok"], result["backend"], result["world_size"], result["nodes"]) == (True, "gloo", 2, 1), result
    assert result["loss_decreased"] is True and result["params_identical"] is True, result
    assert result["torch"].split("+")[0] == image.labels[f"{contract.LABEL_NS}.torch"], result


def _manifest(reg: LocalRegistry, tag: str) -> tuple[str, dict[str, Any]]:
    r = requests.get(f"{reg.url}/v2/{NAMESPACE}/pt-multi-gpu/manifests/{tag}", headers={"Accept": ACCEPT},
                     timeout=10)
    r.raise_for_status()
    return r.headers["Docker-Content-Digest"], r.json()


@CONTAINERD_ONLY
def test_publish_verifies_the_stores_digest_and_a_rerun_is_unchanged(modern: Modern) -> None:
    reg = LocalRegistry(modern.tmp / "registry").start()
    try:
        runs = []
        # 1: pushes; 2: the weekly rerun, skipped whole by the registry's labels (store-blind); 3: the same
        # with --publish-unchanged, so each tag is compared with what this store calls the image.
        for n, extra in ((1, ()), (2, ()), (3, ("--publish-unchanged",))):
            out = modern.tmp / f"report-{n}"
            p = modern.build_py("publish", "--only", CELL, "--registry", f"{reg.host}/{NAMESPACE}",
                                "--report-dir", str(out), "--json", "--allow-stale-os", *extra, timeout=1800)
            assert p.returncode == 0, p.stderr[-4000:]
            runs.append(json.loads((out / "publish-report.json").read_text()))
        image_id = modern.image().id
        first = runs[0]["cells"][0]
        assert {t["status"] for t in first["tags"]} == {"pushed"}, first["tags"]
        digest, manifest = _manifest(reg, first["tags"][0]["tag"])
        assert first["digest"] == digest
        assert digest == image_id  # the containerd store's ID is the manifest digest
        assert len(manifest["layers"]) == len(modern.image().attrs["RootFS"]["Layers"]), manifest["layers"]
        again, forced = runs[1]["cells"][0], runs[2]["cells"][0]
        assert again["unchanged_since"].startswith("unchanged since") and again["tags"] == [], again
        assert forced["tags"] and {t["status"] for t in forced["tags"]} == {"unchanged"}, forced["tags"]
        assert {t["digest"] for t in forced["tags"]} == {digest}, forced["tags"]
    finally:
        reg.stop()
        shutil.rmtree(reg.root, ignore_errors=True)  # its blobs (the image, compressed), not kept by pytest


@CONTAINERD_ONLY
def test_diff_sbom_and_audit(modern: Modern) -> None:
    d = modern.build_py("diff", "--json", CELL, "debian:bookworm-slim", timeout=1200)
    assert d.returncode == 0, d.stderr[-3000:]
    facts = json.loads(d.stdout)  # builder/diff/compare.py: diff()
    image = modern.image()
    assert facts["a"] == {"ref": f"pt-multi-gpu:{CELL}", "id": image.id, "size": image.attrs["Size"]}, facts["a"]
    assert facts["b"]["ref"] == "debian:bookworm-slim"
    venv = facts["python"]  # the base has no venv: every distribution of the cell's is "removed" going to it
    assert venv["added"] == venv["changed"] == venv["same"] == [], venv
    removed = {p["name"]: p["version"] for p in venv["removed"]}
    lock = model.read(model.lock_path(ROOT, CELL))
    assert len(removed) == len(lock.packages), (len(removed), len(lock.packages))
    assert removed["torch"].split("+")[0] == image.labels[f"{contract.LABEL_NS}.torch"], removed["torch"]
    s = modern.build_py("sbom", "--only", CELL, "--summary", timeout=600)
    assert s.returncode == 0 and "torch" in s.stdout + s.stderr, (s.stdout + s.stderr)[-3000:]
    # The Python audit against the offline OSV snapshot (PTMG_OSV_DIR: tests/fixtures/osv), which lists no
    # advisory for the locked versions: exit 0, "ok", every locked distribution audited. Once from the lock
    # (--only: no engine), once from the image's SBOM on this engine (--image).
    osv = str(ROOT / "tests" / "fixtures" / "osv")
    for how, args, image_id, cell in (("lock", ("--only", CELL), "", CELL),
                                      ("sbom", ("--image", f"pt-multi-gpu:{CELL}"), image.id, "")):
        a = modern.build_py("audit", *args, "--section", "python", "--json", timeout=1200)
        assert a.returncode == 0, (how, a.stdout[-2000:], a.stderr[-3000:])
        report = json.loads(a.stdout)  # builder/audit/report.py: report_json
        (audited,) = report["images"]
        python = audited["sections"]["python"]
        assert report["ok"] is True and (audited["image"], audited["cell"], audited["image_id"]) == (
            f"pt-multi-gpu:{CELL}", cell, image_id), (how, audited)
        assert (python["status"], python["findings"], python["error"]) == ("ok", [], ""), (how, python)
        assert python["facts"]["packages"] == str(len(lock.packages)), (how, python["facts"])
        assert python["facts"]["source"] == f"offline OSV snapshot {osv}", (how, python["facts"])
