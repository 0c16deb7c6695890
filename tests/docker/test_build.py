"""A real CUDA cell built by build.py: labels, user, files, build secrets (present in the
build, absent from every decompressed layer, refused by the classic builder), skip-unchanged."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import docker
import pytest

import ptmg_contract as contract
from builder.engine import BuildRequest, Engine
from builder.matrix import ImageSpec, load_matrix
from tests.support import cell

from .cellimage import ROOT, BuiltCell
from .layerscan import SavedImage, Scanner, chunks, decompressed


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
    assert cfg["Entrypoint"][:4] == ["/usr/bin/tini", "-s", "-g", "--"]
    assert cfg["WorkingDir"] == "/workspace"
    assert cfg["User"] == "1000", "the image runs as pt; numeric, so Kubernetes' runAsNonRoot can check it"
    assert cfg["Healthcheck"]["Test"][0] == "CMD"
    out = docker_client.containers.run(
        built_cell.ref, entrypoint=["bash", "-c",
                                    "id -u pt; id -g pt; stat -c %U /workspace /opt/venv; stat -c '%G:%a' /opt/venv;"
                                    "ls /opt/pt-multi-gpu/entrypoint/start.sh /opt/pt-multi-gpu/smoke_tests/selftest;"
                                    "ls /etc/ssh/ssh_host_* 2>/dev/null | wc -l"],
        remove=True, labels={"project": "pt-multi-gpu"}).decode().split()
    assert out[:5] == ["1000", "1000", "pt", "pt", "users:2775"]
    # The root boundary's venv scheme: everything in it in the group, group-writable, every directory setgid
    # (pip as pt after a PT_UID/PT_GID remap goes through the group; nothing is ever re-owned).
    odd = docker_client.containers.run(
        built_cell.ref, entrypoint=["find", "/opt/venv", "(", "!", "-group", "users", "-o", "!", "-type", "l", "!",
                                    "-perm", "-g+w", "-o", "-type", "d", "!", "-perm", "-g+s", ")", "-print"],
        remove=True, labels={"project": "pt-multi-gpu"}).decode().split()
    assert odd == [], f"{len(odd)} venv entries outside the scheme, e.g. {odd[:5]}"
    assert out[-1] == "0", "no SSH host key may be baked into the image"
    # The cell file the native Slurm launcher's preflight reads (root's, like the rest of the prefix).
    owner, name = docker_client.containers.run(
        built_cell.ref, entrypoint=["sh", "-c", f"stat -c '%U %a' {contract.CELL_FILE} && cat {contract.CELL_FILE}"],
        remove=True, labels={"project": "pt-multi-gpu"}).decode().splitlines()
    assert (owner, name) == ("root 644", built_cell.cell)


def test_the_image_carries_the_one_contract_its_entrypoint_and_smoke_tests_import(
        built_cell: BuiltCell, docker_client: docker.DockerClient) -> None:
    """The contract is written once: the image's copy is this repository's file, and the
    entrypoint's and the smoke tests' modules, imported from their installed paths, use that copy."""
    code = ("import hashlib, sys; sys.path[:0] = [sys.argv[1], sys.argv[2], sys.argv[3]];"
            "import ptmg_contract as c, common, smokelib;"
            "print(c.__file__, common.contract is c, smokelib.contract is c,"
            " hashlib.sha256(open(c.__file__, 'rb').read()).hexdigest())")
    out = docker_client.containers.run(
        built_cell.ref, entrypoint=["/usr/bin/python3", "-I", "-c", code, contract.PREFIX, contract.ENTRYPOINT_DIR,
                                    contract.SMOKE_DIR],
        remove=True, labels={"project": "pt-multi-gpu"}).decode().split()
    ours = hashlib.sha256((ROOT / "ptmg_contract.py").read_bytes()).hexdigest()
    assert out == [contract.CONTRACT_FILE, "True", "True", ours]


# ------------------------------------------------------------------ build secrets
def test_no_secret_in_any_layer_history_or_label(built_cell: BuiltCell, saved_image: SavedImage,
                                                 docker_client: docker.DockerClient) -> None:
    """Every layer decompressed and scanned, then the config and history: no marker anywhere.
    The markers are real secrets of the session's build (an index URL token, proxy credentials,
    a CA made for the run) plus the host's own extra CAs."""
    assert built_cell.markers, "nothing to look for"
    image = docker_client.images.get(built_cell.ref)
    formats, scanned = saved_image.formats, saved_image.scanned
    layers = len(image.attrs["RootFS"]["Layers"])
    assert sum(formats.values()) >= layers, f"scanned {formats} layer blobs, the image has {layers} layers"
    assert scanned > 1_000_000_000, f"only {scanned} bytes scanned: the layers were not read"
    assert not saved_image.found, f"secrets found in the saved image: {sorted(saved_image.found)}"
    history = json.dumps(image.history())
    assert not [m for m in built_cell.markers if m.decode(errors="ignore") in history]


def test_the_scan_finds_a_secret_in_a_compressed_layer(tmp_path: Path) -> None:
    """The scanner itself, on blobs made here: a marker inside a gzip and a zstd layer is found."""
    marker = b"ptmg-canary-" + uuid.uuid4().hex.encode()
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        data = b"x" * 100_000 + marker + b"y" * 100_000
        info = tarfile.TarInfo("etc/pip.conf")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    import zstandard

    for blob in (gzip.compress(layer.getvalue()), zstandard.ZstdCompressor().compress(layer.getvalue()),
                 layer.getvalue()):
        assert marker not in blob or blob == layer.getvalue(), "compressed, the marker is not visible as is"
        scanner = Scanner((marker,))
        for chunk in chunks(decompressed(io.BufferedReader(io.BytesIO(blob)))[1]):
            scanner.feed(chunk)
        assert scanner.found == {marker}


def test_the_build_had_its_secrets(built_cell: BuiltCell) -> None:
    """The canary: the build log says the secrets were mounted (variable names and CA
    fingerprints, never a value), so the scan above proves they stayed out, not that they
    were never there."""
    if built_cell.log is None:
        pytest.fail(f"no build log for {built_cell.cell} (build-logs/). Fix: build it with build.py, or unset "
                    "PTMG_TEST_IMAGE", pytrace=False)
    text = built_cell.log.read_text(errors="replace")
    env_lines = [ln for ln in text.splitlines() if "ptmg-build-secret build-env:" in ln]
    ca_lines = [ln for ln in text.splitlines() if "ptmg-build-secret ca-bundle:" in ln]
    assert env_lines and ca_lines, "no canary line in the build log (was the last RUN cached?)"
    assert "present" in env_lines[-1] and "present" in ca_lines[-1], (env_lines[-1], ca_lines[-1])
    if built_cell.build_seconds is not None:  # built by this session with its planted settings
        for name in ("PIP_INDEX_URL", "PIP_TRUSTED_HOST", "HTTPS_PROXY"):
            assert name in env_lines[-1], (name, env_lines[-1])
    assert built_cell.ca_fingerprints, "no CA to look for"
    assert any(fp in ca_lines[-1] for fp in built_cell.ca_fingerprints), (built_cell.ca_fingerprints, ca_lines[-1])
    assert not [m for m in built_cell.markers if m.decode(errors="ignore") in "\n".join(env_lines + ca_lines)]


def test_the_classic_builder_is_refused_secrets(docker_client: docker.DockerClient, tmp_path: Path,
                                                session_labels: dict[str, str]) -> None:
    """The classic builder has no secret mounts: Docker's own refuses a RUN --mount, and our
    engine refuses to build with CA or pip/proxy settings at all rather than pass them as build
    args or files (both end up in the image)."""
    secret = tmp_path / "build-env"
    secret.write_text("export PIP_INDEX_URL=https://user:ptmg-classic-secret@example.invalid/simple\n")
    (tmp_path / "Dockerfile").write_text("FROM debian:bookworm-slim\nRUN --mount=type=secret,id=build-env "
                                         "cat /run/secrets/build-env\n")
    classic = subprocess.run(["docker", "build", "-q", str(tmp_path)], env={**os.environ, "DOCKER_BUILDKIT": "0"},
                             capture_output=True, text=True, timeout=300, check=False)
    assert classic.returncode != 0 and "BuildKit" in classic.stderr, classic.stderr
    req = BuildRequest(context=tmp_path, dockerfile=tmp_path / "Dockerfile", labels=session_labels,
                       secrets={"build-env": secret}, log_path=tmp_path / "build.log")
    seen: list[str] = []
    outcome = Engine(docker_client).build(req, seen.append, cli=None)
    assert not outcome.ok and outcome.builder == "classic" and outcome.image_id is None
    assert "only BuildKit can carry without leaving them in the image" in outcome.failed_step
    assert seen == [] and not req.log_path.exists(), "nothing may have been sent to the builder"


def test_unchanged_rebuild_is_skipped(built_cell: BuiltCell) -> None:
    argv = [sys.executable, str(ROOT / "build.py"), "build", "--only", built_cell.cell, "--json"]
    # Bring the image up to date first (a no-op right after the session build; with
    # PTMG_TEST_IMAGE the working tree may have moved on since that image was built).
    first = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    assert first.returncode == 0, first.stderr
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert row["status"] == "skipped", row  # how fast: bench/bench_build.py (a benchmark, not a timed test)


def test_dry_run_builds_nothing(built_cell: BuiltCell) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "build.py"), "build", "--only", built_cell.cell, "--dry-run",
                        "--force", "--json"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert row["status"] == "would-build"
