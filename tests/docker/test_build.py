"""A real CUDA cell built by build.py: labels, user, files, the no-leak scan, skip-unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import docker

from builder.spec import ImageSpec, load_matrix
from tests.support import cell

from .cellimage import ROOT, BuiltCell


def cell_spec(name: str) -> ImageSpec:
    """The built cell's entry in the real images.yaml (what it was built from)."""
    return cell(load_matrix(ROOT / "images.yaml"), name)


def test_labels_match_what_runs_inside(built_cell: BuiltCell, docker_client: docker.DockerClient) -> None:
    labels = docker_client.images.get(built_cell.ref).labels
    for key in ("created", "revision", "source", "version", "title", "base.name"):
        assert labels.get(f"org.opencontainers.image.{key}"), key
    spec = cell_spec(built_cell.cell)
    assert labels["io.pt-multi-gpu.cell"] == spec.name
    assert labels["io.pt-multi-gpu.inputs-hash"].startswith("sha256:")
    assert labels["io.pt-multi-gpu.min-driver"] == spec.min_driver
    assert labels["io.pt-multi-gpu.cuda-arch-list"].split()[0].startswith("sm_")
    script = ("import json, sys, torch, torchvision, importlib.metadata as md;"
              "print(json.dumps({'torch': torch.__version__.split('+')[0],"
              "'torchvision': torchvision.__version__.split('+')[0],"
              "'cuda': torch.version.cuda, 'python': '%d.%d' % sys.version_info[:2]}))")
    out = docker_client.containers.run(built_cell.ref, entrypoint=["python", "-c", script], remove=True,
                                       labels={"project": "pt-multi-gpu"})
    inside = json.loads(out.decode().strip().splitlines()[-1])
    for key, value in inside.items():
        assert labels[f"io.pt-multi-gpu.{key}"] == value, key
    assert labels["io.pt-multi-gpu.torch"] == spec.torch


def test_user_workdir_and_files(built_cell: BuiltCell, docker_client: docker.DockerClient) -> None:
    image = docker_client.images.get(built_cell.ref)
    cfg = image.attrs["Config"]
    assert cfg["Entrypoint"][:3] == ["/usr/bin/tini", "-g", "--"]
    assert cfg["WorkingDir"] == "/workspace"
    assert cfg["Healthcheck"]["Test"][0] == "CMD"
    out = docker_client.containers.run(
        built_cell.ref, entrypoint=["bash", "-c",
                                    "id -u pt; id -g pt; stat -c %U /workspace /opt/venv;"
                                    "ls /opt/pt-multi-gpu/entrypoint/start.sh /opt/pt-multi-gpu/smoke_tests/selftest;"
                                    "ls /etc/ssh/ssh_host_* 2>/dev/null | wc -l"],
        remove=True, labels={"project": "pt-multi-gpu"}).decode().split()
    assert out[:4] == ["1000", "1000", "pt", "pt"]
    assert out[-1] == "0", "no SSH host key may be baked into the image"


def test_no_secret_in_any_layer_history_or_label(built_cell: BuiltCell, docker_client: docker.DockerClient,
                                                tmp_path: Path) -> None:
    """`docker save` is every layer tar plus the config (history, labels, env): scan all of it."""
    assert built_cell.markers, "nothing to look for"
    image = docker_client.images.get(built_cell.ref)
    found: dict[bytes, int] = {}
    longest = max(len(m) for m in built_cell.markers)
    tail = b""
    total = 0
    for chunk in image.save(named=True, chunk_size=8 * 1024 * 1024):
        window = tail + chunk
        for m in built_cell.markers:
            if m in window:
                found[m] = found.get(m, 0) + 1
        tail = window[-longest:]
        total += len(chunk)
    assert total > 1_000_000_000, "the saved image is suspiciously small"
    assert not found, f"secrets found in the saved image: {sorted(found)}"
    history = json.dumps(image.history())
    assert not [m for m in built_cell.markers if m.decode(errors="ignore") in history]


def test_unchanged_rebuild_is_skipped_fast(built_cell: BuiltCell) -> None:
    argv = [sys.executable, str(ROOT / "build.py"), "build", "--only", built_cell.cell, "--json"]
    # Bring the image up to date first (a no-op right after the session build; with
    # PTMG_TEST_IMAGE the working tree may have moved on since that image was built).
    first = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    assert first.returncode == 0, first.stderr
    start = time.monotonic()
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    elapsed = time.monotonic() - start
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert row["status"] == "skipped", row
    assert elapsed < 10  # the benchmark holds the real target (< 2 s); this only guards a regression


def test_dry_run_builds_nothing(built_cell: BuiltCell) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "build.py"), "build", "--only", built_cell.cell, "--dry-run",
                        "--force", "--json"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert row["status"] == "would-build"
