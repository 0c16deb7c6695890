"""Security updates on real images: the release's security suite in every default image, nothing pending right
after a build, a second build a no-op, a newer security suite rebuilds from the OS layer up and keeps
the venv below it (a node that holds the image before stores under 10% of it anew), and `build.py audit`
lists what an image from an older snapshot lacks.

Everything this module makes (a test matrix's images, a test-only layer) carries the project and
session labels and is removed at the end, also on failure.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import pytest

import ptmg_contract as contract
from builder.engine import BuildRequest, Engine, find_buildkit_cli
from builder.imaging import apt_sources
from builder.matrix import load_matrix
from tests.support import SEED_MATRIX, build_py, write_matrix

from .cellimage import ROOT, BuiltCell

sys.path.insert(0, str(ROOT / "bench"))
import pulllib  # bench/pulllib.py: chain IDs, and what a node stores anew

BUILD_TIMEOUT = 3600
#: Patch day (an OS-only change): what a node that holds the image before stores anew, by chain ID.
PATCH_DAY_SHARE = 0.10



def as_root(client: docker.DockerClient, image: str, script: str, labels: dict[str, str]) -> str:
    """Run `script` as root (--user 0: the image's user is pt) in a throwaway container; its output."""
    out = client.containers.run(image, ["-c", script], entrypoint=["/bin/sh"], user="0", remove=True, labels=labels)
    return bytes(out).decode()


def pending_security(simulation: str) -> list[str]:
    return [line for line in simulation.splitlines() if line.startswith("Inst ") and "-security" in line]


# --- the images of the default matrix -------------------------------------------------------------
def test_every_default_image_lists_the_security_suite(docker_client: docker.DockerClient,
                                                      session_labels: dict[str, str]) -> None:
    cells = load_matrix(ROOT / "images.yaml").cells
    here = [c for c in cells if _exists(docker_client, c.ref)]
    assert here, "no image of images.yaml is built here; `make images` first"
    for c in here:
        text = as_root(docker_client, c.ref, "cat " + " ".join(apt_sources.SOURCES_FILES) + " 2>/dev/null; true",
                       session_labels)
        found = apt_sources.parse_sources(text)
        assert apt_sources.missing_suites(found, c.os) == [], f"{c.ref}:\n{text}"
        labels = docker_client.images.get(c.ref).labels
        assert labels.get(contract.LABEL_OS_UPDATED), f"{c.ref} has no patch-level label (built before images recorded one?)"
        assert f"{c.os}-security@" in labels.get(contract.LABEL_OS_SUITES, ""), labels


def test_nothing_is_pending_right_after_the_build(test_image: str, docker_client: docker.DockerClient,
                                                  session_labels: dict[str, str]) -> None:
    """`apt-get -s upgrade` in the image as built: no security update (the build applied them all)."""
    out = as_root(docker_client, test_image, "apt-get update -q >/dev/null && apt-get -s upgrade", session_labels)
    assert "Inst " not in out or not pending_security(out), pending_security(out)
    # And the patch level the labels state comes from the OS layer itself.
    record = as_root(docker_client, test_image, f"cat {contract.OS_PATCH_FILE}", session_labels)
    labels = docker_client.images.get(test_image).labels
    assert f"updated: {labels[contract.LABEL_OS_UPDATED]}" in record
    assert f"snapshot: {labels[contract.LABEL_OS_SNAPSHOT]}" in record


def test_a_second_build_is_a_no_op(built_cell: BuiltCell) -> None:
    """Right after a build, the same `build.py build` skips the cell: same matrix, same Debian.
    (The time it takes is measured in BENCHMARKS.md, not asserted here.)"""
    first = build_py("build", "--only", built_cell.cell, "--json", timeout=BUILD_TIMEOUT)
    assert first.returncode == 0, first.stderr[-3000:]
    second = build_py("build", "--only", built_cell.cell, "--json", timeout=BUILD_TIMEOUT)
    assert second.returncode == 0, second.stderr[-3000:]
    (result,) = json.loads(second.stdout)
    assert result["status"] == "skipped", result


# --- a newer security suite -------------------------------------------------------------------------
@pytest.fixture
def test_matrix(tmp_path: Path, docker_client: docker.DockerClient) -> Iterator[tuple[Path, str]]:
    """The 2.7.0 seed cell under a repository of its own (tests build their own small matrices);
    its images are removed afterwards."""
    repo = f"ptmg-test-debsec-{uuid.uuid4().hex[:8]}"
    text = SEED_MATRIX.replace("repository: pt-multi-gpu", f"repository: {repo}")
    path = write_matrix(tmp_path / "matrix", text)
    cell = "2.7.0-cuda12.6-cudnn9-runtime"  # its committed lock beside the matrix: builds install from it
    shutil.copytree(ROOT / "locks" / cell, path.parent / "locks" / cell)
    shutil.copy(ROOT / "locks" / "pylock.uv.toml", path.parent / "locks" / "pylock.uv.toml")  # the uv that installs
    try:
        yield path, repo
    finally:
        for image in docker_client.images.list(name=repo):
            for tag in image.tags:
                _quietly_remove(docker_client, tag)


def _steps(log: str) -> dict[str, list[str]]:
    """BuildKit's plain progress: step id -> its lines ("#8 [ 2/10] RUN ...", "#8 CACHED", "#8 DONE 3.1s")."""
    out: dict[str, list[str]] = {}
    for line in log.splitlines():
        m = re.match(r"^#(\d+) ", line)
        if m:
            out.setdefault(m.group(1), []).append(line)
    return out


def _step(steps: dict[str, list[str]], marker: str) -> list[str]:
    found = [lines for lines in steps.values() if any(" RUN " in x and marker in x for x in lines[:3])]
    assert found, f"no build step with {marker!r}"
    return found[-1]


def test_a_newer_security_suite_rebuilds_from_the_os_layer(test_matrix: tuple[Path, str],
                                                           docker_client: docker.DockerClient) -> None:
    config, repo = test_matrix
    cell = "2.7.0-cuda12.6-cudnn9-runtime"
    logs = config.parent / "logs"
    # As the archive is now: the same layers as the shared cell (built by this session or before).
    now = build_py("build", "--config", str(config), "--only", cell, "--log-dir", str(logs), "--json", timeout=BUILD_TIMEOUT)
    assert now.returncode == 0, now.stderr[-3000:]
    replaced = docker_client.images.get(f"{repo}:{cell}")
    before = replaced.labels
    db = pulllib.layer_store()
    held = pulllib.read_layers(f"{repo}:{cell}", db)  # what a node pulled last week
    # A newer security suite (simulated: another snapshot key), nothing else changed.
    newer = f"test-newer-suite-{uuid.uuid4().hex[:8]}"
    r = build_py("build", "--config", str(config), "--only", cell, "--log-dir", str(logs), "--json",
                 env={contract.OS_SNAPSHOT_ARG: newer}, timeout=BUILD_TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    (result,) = json.loads(r.stdout)
    assert result["status"] == "built", result
    steps = _steps(Path(result["log"]).read_text())
    # apt ran again in the OS stage, and the image's OS layer applied what it changed.
    for marker in ("apt_bounded upgrade", "os-layer.sh apply"):
        os_step = _step(steps, marker)
        assert not any(x.endswith(" CACHED") for x in os_step), f"the {marker!r} step came from the cache"
        assert any(re.search(r" DONE \d", x) for x in os_step)
    # The CUDA wheels and the venv sit below the OS layer (07-cuda, 25-cuda, 30-torch, 40-tools): they came from the cache, and the image
    # keeps their layers under the same chain IDs, so a node that holds the image before stores only the OS
    # layer and what is above it anew.
    for marker in ("python3 -m venv", "import torch, torchvision", "pip check"):
        assert any(x.endswith(" CACHED") for x in _step(steps, marker)), f"the {marker!r} layer was rebuilt"
    # The wheels came from the host's wheel store without a download: the store logs every download.
    assert "wheel(s) downloaded" not in r.stderr, r.stderr[-2000:]
    cost = pulllib.cost(held, pulllib.read_layers(f"{repo}:{cell}", db))
    kept = [lay["kind"] for lay in cost["layers"] if not lay["new_chain"]]
    assert kept[:7] == ["CUDA wheels", "torch's shared files", "base", "user", "venv", "torch", "tools"], cost["layers"]
    assert cost["new_by_chain_share"] <= PATCH_DAY_SHARE, (
        f"patch day stores {cost['new_by_chain'] / 1e6:,.1f} MB of {cost['size'] / 1e6:,.1f} MB anew "
        f"({cost['new_by_chain_share']:.1%}): {[(lay['kind'], lay['size']) for lay in cost['layers'] if lay['new_chain']]}")
    after = docker_client.images.get(f"{repo}:{cell}").labels
    assert after[contract.LABEL_OS_SNAPSHOT] == newer and before[contract.LABEL_OS_SNAPSHOT] != newer
    assert after[contract.LABEL_OS_UPDATED] >= before[contract.LABEL_OS_UPDATED]
    assert after[contract.LABEL_INPUTS_HASH] != before[contract.LABEL_INPUTS_HASH]
    assert after[contract.LABEL_RECIPE_HASH] == before[contract.LABEL_RECIPE_HASH]
    # The image the rebuild replaced is removed (a dangling 6 GB per cell per security release
    # otherwise), unless another tag still names it.
    if set(replaced.tags) == {f"{repo}:{cell}"}:
        assert not _exists(docker_client, str(replaced.id)), "the replaced image was left behind"
    else:
        assert _exists(docker_client, str(replaced.id)), f"{replaced.tags} still name the replaced image"


# --- the audit of an image from an older snapshot ---------------------------------------------------
OLD_SNAPSHOT = """\
FROM debian:bookworm-slim
# libssl3 from the release as published (its last point release), without -updates and -security:
# an image from before the security fixes. Then the image's own sources are put back.
RUN cp /etc/apt/sources.list.d/debian.sources /root/debian.sources \\
 && awk -v RS= -v ORS='\\n\\n' 'NR == 1' /root/debian.sources | sed 's/^Suites: .*/Suites: bookworm/' \\
      > /etc/apt/sources.list.d/debian.sources \\
 && apt-get update -q && apt-get install -y -q --no-install-recommends libssl3 \\
 && mv /root/debian.sources /etc/apt/sources.list.d/debian.sources \\
 && rm -rf /var/lib/apt/lists/*
"""


@pytest.fixture
def old_snapshot_image(tmp_path: Path, docker_client: docker.DockerClient,
                       session_labels: dict[str, str]) -> Iterator[str]:
    ref = f"ptmg-test-debsec-old:{uuid.uuid4().hex[:8]}"
    (tmp_path / "Dockerfile").write_text(OLD_SNAPSHOT)
    engine = Engine(labels=session_labels)
    req = BuildRequest(tmp_path, tmp_path / "Dockerfile", session_labels, {}, tmp_path / "build.log")
    outcome = engine.build(req, lambda _line: None, find_buildkit_cli())
    assert outcome.ok and outcome.image_id, (outcome.failed_step, outcome.tail)
    engine.tag(outcome.image_id, ref)
    try:
        yield ref
    finally:
        _quietly_remove(docker_client, ref)


def test_audit_lists_what_an_older_snapshot_lacks(old_snapshot_image: str) -> None:
    r = build_py("audit", "--image", old_snapshot_image, "--json", timeout=1200)
    assert r.returncode == 1, f"pending updates must fail the audit:\n{r.stderr[-3000:]}"
    (image,) = json.loads(r.stdout)["images"]
    section = image["sections"]["debian"]
    assert section["status"] == "findings", section
    libssl3 = [f for f in section["findings"] if f["package"] == "libssl3"]
    assert libssl3, section["findings"]
    (f,) = libssl3
    assert f["installed"] != f["fixed"] and "-security" in f["origin"], f
    assert "libssl3" in r.stderr or "pending" in r.stderr


def _exists(client: docker.DockerClient, ref: str) -> bool:
    try:
        client.images.get(ref)
    except docker.errors.ImageNotFound:
        return False
    return True


def _quietly_remove(client: docker.DockerClient, ref: str) -> None:
    try:
        client.images.remove(ref, force=True)
    except docker.errors.ImageNotFound:
        pass
    except docker.errors.APIError as exc:
        print(f"cleanup: {ref}: {exc}")
