"""Publishing against a REAL registry (Debian's docker-registry on 127.0.0.1, started and
stopped per test): credentials, idempotency, the immutable-tag guard, a registry crash
mid-push, and a real cell pushed, pulled back by digest and self-tested.

Small images (FROM scratch, a random blob, cell labels) stand in for cells wherever
the property doesn't need torch: they push in seconds. Only the last test pushes the
real cell image (`test_image`, several GB).

    python -m pytest tests/docker/test_publish.py
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest
import requests
import yaml

import ptmg_contract as contract
from builder.engine import Engine
from builder.matrix import Matrix, load_matrix, tags
from builder.publish import address, client, faults, publisher
from builder.smoke import passes
from tests.docker.pullengine import PullEngine
from tests.docker.registry import LocalRegistry

LOGGER = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
LATEST_CELL = "2.14.1-cuda13.0-cudnn9-runtime"  # images.yaml's latest: exercises all three floating kinds
OTHER_CELL = "2.7.0-cuda12.6-cudnn9-runtime"
USER = "ptmg-ci"
PASSWORD = f"pw-{uuid.uuid4().hex}"  # unique, so finding it anywhere is a real leak
NAMESPACE = "ptmg-test"
REVISION = "0123456789abcdef0123456789abcdef01234567"


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def repo_name() -> str:
    """A repository name of this run only: local test tags never touch pt-multi-gpu:*."""
    return f"ptmg-pubtest-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory, repo_name: str) -> Path:
    text = (ROOT / "images.yaml").read_text()
    assert "\nrepository: pt-multi-gpu\n" in text
    path = tmp_path_factory.mktemp("config") / "images.yaml"
    data = yaml.safe_load(text.replace("\nrepository: pt-multi-gpu\n", f"\nrepository: {repo_name}\n"))
    # One image per tag here: a cell's other platforms (one manifest list) are tests/docker/test_arm64.py's.
    data["include"] = [c for c in data["include"] if c.get("platform", "linux/amd64") == "linux/amd64"]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def matrix(config_file: Path) -> Matrix:
    return load_matrix(config_file)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A clean environment: smoke records in tmp, no registry settings or docker config of the host."""
    state = tmp_path / "state"
    monkeypatch.setenv("PTMG_STATE_DIR", str(state))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))
    # publish's vulnerability gate reads the tests' offline OSV snapshot (no live source here)
    monkeypatch.setenv("PTMG_OSV_DIR", str(ROOT / "tests" / "fixtures" / "osv"))
    for var in ("PTMG_REGISTRY", "PTMG_REGISTRY_USER", "PTMG_REGISTRY_PASSWORD", "PTMG_REGISTRY_PASSWORD_FILE",
                "PTMG_CONFIG", "PTMG_PUSH_ATTEMPTS"):
        monkeypatch.delenv(var, raising=False)
    return dict(os.environ)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Callable[..., LocalRegistry]]:
    """`registry(auth=None) -> LocalRegistry`, started; every one is stopped at teardown, pass or fail,
    and its storage deleted (a real cell pushed is ~3 GB that pytest would keep in its temp folders)."""
    started: list[LocalRegistry] = []

    def start(auth: tuple[str, str] | None = None) -> LocalRegistry:
        reg = LocalRegistry(tmp_path / f"registry-{len(started)}", auth=auth)
        started.append(reg)
        return reg.start()

    try:
        yield start
    finally:
        for reg in started:
            reg.stop()
            shutil.rmtree(reg.storage, ignore_errors=True)


class Images:
    """Builds labelled test images and removes them (and every ref this test made) at teardown.
    The real cell image is only ever tagged and untagged, never removed."""

    def __init__(self, client: docker.DockerClient, labels: Mapping[str, str], repo: str, matrix: Matrix,
                 workdir: Path) -> None:
        self.client = client
        self.labels = dict(labels)
        self.repo = repo
        self.matrix = matrix
        self.workdir = workdir
        self.built: list[str] = []
        self.refs: list[str] = []

    def cell_labels(self, cell: str) -> dict[str, str]:
        spec = next(c for c in self.matrix.cells if c.name == cell)
        return {**self.labels, "io.pt-multi-gpu.cell": cell, "io.pt-multi-gpu.torch": spec.torch,
                "io.pt-multi-gpu.torchvision": spec.torchvision, "io.pt-multi-gpu.cuda": spec.cuda,
                "io.pt-multi-gpu.cudnn": spec.cudnn, "io.pt-multi-gpu.python": spec.python,
                "org.opencontainers.image.created": "2026-11-30T12:00:00Z",
                "org.opencontainers.image.revision": REVISION}

    def small(self, cell: str, blob_bytes: int = 256 * 1024) -> str:
        """A FROM-scratch image of three layers (tiny, a random blob, tiny) with `cell`'s labels,
        tagged <repo>:<cell>. Random bytes don't compress, so the blob's upload takes real time."""
        ctx = self.workdir / f"ctx-{uuid.uuid4().hex[:8]}"
        ctx.mkdir(parents=True)
        (ctx / "a.txt").write_text(f"{uuid.uuid4()}\n")
        (ctx / "blob").write_bytes(os.urandom(blob_bytes))
        (ctx / "b.txt").write_text(f"{uuid.uuid4()}\n")
        (ctx / "Dockerfile").write_text(f"FROM scratch\n{_label_line(self.cell_labels(cell))}\n"
                                        "COPY a.txt /a.txt\nCOPY blob /blob\nCOPY b.txt /b.txt\n")
        return self._build(path=str(ctx), ref=f"{self.repo}:{cell}")

    def derived(self, base: str, ref: str) -> str:
        """`FROM base` plus one label, with the classic builder: a different image, same cell labels."""
        text = f"FROM {base}\n{_label_line({**self.labels, 'x': 'y'})}\n"
        return self._build(fileobj=io.BytesIO(text.encode()), ref=ref)

    def _build(self, *, ref: str, **kwargs: Any) -> str:
        # The labels are the Dockerfile's first instruction (not docker-py's labels=, which the classic
        # builder appends one LABEL step each, sorted): every intermediate image then carries the
        # session label, and the session's sweep (conftest.py) finds it even if this cleanup fails.
        image, _ = self.client.images.build(tag=ref, rm=True, forcerm=True, pull=False, **kwargs)
        self.built.append(str(image.id))
        self.refs.append(ref)
        return str(image.id)

    def tag(self, image_id: str, ref: str) -> None:
        repo, _, tag = ref.rpartition(":")
        self.client.images.get(image_id).tag(repo, tag)
        self.refs.append(ref)

    def forget_refs_of(self, repository: str) -> None:
        """Remove every local ref (tags and digests) of `repository`; images stay if other refs hold them."""
        for image in self.client.images.list(name=repository):
            tags = [t for t in image.tags or [] if t.rsplit(":", 1)[0] == repository]
            digests = [d for d in image.attrs.get("RepoDigests") or [] if d.split("@", 1)[0] == repository]
            for ref in tags + digests:
                _quietly(self.client.images.remove, ref, noprune=True)

    def cleanup(self, registries: list[str]) -> None:
        for ref in reversed(self.refs):
            _quietly(self.client.images.remove, ref, noprune=True)
        for host in registries:
            self.forget_refs_of(f"{host}/{NAMESPACE}/{self.repo}")
        for image_id in reversed(self.built):
            _quietly(self.client.images.remove, image_id, force=True)


def _label_line(labels: Mapping[str, str]) -> str:
    return "LABEL " + " ".join(f"{k}={json.dumps(v)}" for k, v in labels.items())


def _quietly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as exc:  # e.g. another session's container still uses the image
        LOGGER.warning("cleanup: %s", exc)


@pytest.fixture
def images(docker_client: docker.DockerClient, session_labels: dict[str, str], repo_name: str, matrix: Matrix,
           tmp_path: Path) -> Iterator[Images]:
    made = Images(docker_client, session_labels, repo_name, matrix, tmp_path)
    try:
        yield made
    finally:
        # Refs a publish may have left behind, on every registry port this test used.
        hosts = [line.split(":", 1)[1].strip() for cfg in tmp_path.glob("registry-*/config.yml")
                 for line in cfg.read_text().splitlines() if line.strip().startswith("addr:")]
        made.cleanup(hosts)


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    report: dict[str, Any]
    seconds: float
    report_dir: str = ""

    def tags(self, cell: str) -> dict[str, dict[str, Any]]:
        c = next(c for c in self.report["cells"] if c["cell"] == cell)
        return {t["tag"]: t for t in c["tags"]}

    def cell(self, cell: str) -> dict[str, Any]:
        return dict(next(c for c in self.report["cells"] if c["cell"] == cell))


@pytest.fixture
def publish(config_file: Path, tmp_path: Path, env: dict[str, str]) -> Callable[..., Run]:
    """Run `build.py publish` as a user would (a subprocess; credentials only in its environment)."""
    counter = iter(range(100))

    def run(reg: LocalRegistry, cell: str, *, extra_env: Mapping[str, str] | None = None,
            args: tuple[str, ...] = (), toy: bool = True) -> Run:
        report_dir = tmp_path / f"report-{next(counter)}"
        argv = [sys.executable, str(ROOT / "build.py"), "publish", "--config", str(config_file), "--only", cell,
                "--registry", f"{reg.host}/{NAMESPACE}", "--report-dir", str(report_dir), "--json", *args]
        if toy:  # the small stand-in images have no OS for the OS-freshness gate to audit (a real cell: toy=False)
            argv.append("--allow-stale-os")
        t0 = time.monotonic()
        p = subprocess.run(argv, cwd=ROOT, env={**env, **(extra_env or {})}, capture_output=True, text=True,
                           timeout=1800, check=False)
        seconds = time.monotonic() - t0
        path = report_dir / "publish-report.json"
        assert path.exists(), f"no report (exit {p.returncode}):\n{p.stderr[-3000:]}"
        files = path.read_text() + (report_dir / "publish-report.md").read_text()
        for where, text in (("stdout", p.stdout), ("stderr", p.stderr), ("report", files)):
            assert PASSWORD not in text, f"the password leaked into {where}"
        return Run(p.returncode, p.stdout, p.stderr, json.loads(path.read_text()), seconds, str(report_dir))

    return run


def _creds(password: str = PASSWORD) -> dict[str, str]:
    return {"PTMG_REGISTRY_USER": USER, "PTMG_REGISTRY_PASSWORD": password}


def _floating(matrix: Matrix, cell: str) -> set[str]:
    return set(tags.floating_tags(next(c for c in matrix.cells if c.name == cell), matrix.cells))


# ------------------------------------------------------------------------------ tests
def test_credentials_good_publish_bad_push_nothing(registry: Callable[..., LocalRegistry], images: Images,
                                                   publish: Callable[..., Run], matrix: Matrix,
                                                   tmp_path: Path) -> None:
    reg = registry(auth=(USER, PASSWORD))
    image_id = images.small(LATEST_CELL)
    passes.record_pass(ROOT, image_id, LATEST_CELL, passed=10, skipped=0)

    bad = publish(reg, LATEST_CELL, extra_env=_creds("wrong-" + PASSWORD))
    assert bad.rc == 1, bad.stderr
    statuses = {t: r["status"] for t, r in bad.tags(LATEST_CELL).items()}
    assert sorted(statuses.values()) == ["failed", "failed", "held", "held", "held"], statuses
    failed = [r["message"] for r in bad.tags(LATEST_CELL).values() if r["status"] == "failed"]
    assert all("HTTP 401" in m and "refused these credentials" in m for m in failed), failed
    assert "refused these credentials" in bad.stderr
    assert reg.repositories() == [] and reg.blobs() == set(), "a refused login must push nothing"

    anonymous = publish(reg, LATEST_CELL)
    assert anonymous.rc == 1 and "wants credentials and none are set" in anonymous.stderr
    assert reg.blobs() == set()

    pw_file = tmp_path / "registry-password"
    pw_file.write_text(PASSWORD + "\n")
    good = publish(reg, LATEST_CELL, extra_env={"PTMG_REGISTRY_USER": USER,
                                                "PTMG_REGISTRY_PASSWORD_FILE": str(pw_file)})
    assert good.rc == 0, good.stderr
    assert good.report["ok"] and good.report["credentials"] == "env PTMG_REGISTRY_USER + PTMG_REGISTRY_PASSWORD_FILE"
    tag_results = good.tags(LATEST_CELL)
    assert {t for t, r in tag_results.items() if r["kind"] == "floating"} == {LATEST_CELL, "2.14-cuda13.0", "latest"}
    assert {r["status"] for r in tag_results.values()} == {"pushed"}
    digest = good.cell(LATEST_CELL)["digest"]
    repo_path = f"{NAMESPACE}/{images.repo}"
    for tag in tag_results:
        assert reg.manifest_digest(repo_path, tag) == digest, tag
    # The immutable push sent the layers; every floating tag after it found them all there.
    first = tag_results[f"{LATEST_CELL}-20261130"]
    assert len(first["layers_uploaded"]) == 3
    for tag in _floating(matrix, LATEST_CELL):
        assert tag_results[tag]["layers_uploaded"] == [], tag
        assert sorted(tag_results[tag]["layers_existing"]) == sorted(first["layers_uploaded"]), tag


def test_rerun_with_nothing_changed_uploads_nothing(registry: Callable[..., LocalRegistry], images: Images,
                                                    publish: Callable[..., Run]) -> None:
    reg = registry()
    image_id = images.small(OTHER_CELL)
    passes.record_pass(ROOT, image_id, OTHER_CELL, passed=10, skipped=0)
    first = publish(reg, OTHER_CELL)
    assert first.rc == 0, first.stderr
    before = reg.snapshot()
    again = publish(reg, OTHER_CELL)
    assert again.rc == 0, again.stderr
    assert {r["status"] for r in again.tags(OTHER_CELL).values()} == {"unchanged"}
    assert all(r["layers_uploaded"] == [] for r in again.tags(OTHER_CELL).values())
    assert again.cell(OTHER_CELL)["digest"] == first.cell(OTHER_CELL)["digest"]
    assert reg.snapshot() == before, "the registry's storage changed on a rerun with nothing new"


SIGSTORE_JS = ("@sigstore/verify@4.1.3", "@sigstore/bundle@5.0.1", "@sigstore/core@4.0.1")


def sigstore_js() -> Path:
    """node_modules with sigstore-js, installed once into a cache outside the repository (npm)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pt-multi-gpu" / "sigstore-js"
    if not (cache / "node_modules" / "@sigstore" / "verify" / "package.json").is_file():
        if not shutil.which("npm") or not shutil.which("node"):
            raise AssertionError("the independent verifier needs node and npm (apt-get install -y nodejs npm)")
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", str(cache), "--no-audit", "--no-fund", *SIGSTORE_JS],
                       check=True, capture_output=True, timeout=300)
    return cache / "node_modules"


def test_signed_publish_verifies_with_build_py_and_sigstore_js_and_a_rerun_signs_nothing(
        registry: Callable[..., LocalRegistry], images: Images, publish: Callable[..., Run], config_file: Path,
        tmp_path: Path) -> None:
    """publish --sign-key: every digest it pushed gets its .att (provenance, gates; the toy image has no SBOM)
    and .sig; `build.py verify` accepts it; sigstore-js verifies each stored DSSE envelope with the public key
    alone (no transparency log); a rerun signs nothing and writes nothing."""
    reg = registry()
    image_id = images.small(OTHER_CELL)
    passes.record_pass(ROOT, image_id, OTHER_CELL, passed=10, skipped=0)
    made = subprocess.run([sys.executable, str(ROOT / "build.py"), "keygen", str(tmp_path / "signing")],
                          capture_output=True, text=True, check=False)
    assert made.returncode == 0, made.stderr
    first = publish(reg, OTHER_CELL, args=("--sign-key", str(tmp_path / "signing.key")))
    assert first.rc == 0, first.stderr
    digest = first.cell(OTHER_CELL)["digest"]
    [signed] = first.report["signed"]
    assert signed["digest"] == digest and (signed["att_status"], signed["sig_status"]) == ("signed", "signed")
    assert signed["predicate_types"] == ["https://slsa.dev/provenance/v1",
                                         "https://github.com/pt-multi-gpu/pt-multi-gpu/attestation/gates/v1"]
    LOGGER.info("signing took %.2f s for %s", signed["seconds"], digest)
    assert signed["seconds"] < 5
    secret = (tmp_path / "signing.key").read_text().splitlines()[1]
    assert secret not in first.stdout + first.stderr + json.dumps(first.report)

    ref = f"{reg.host}/{NAMESPACE}/{images.repo}:{OTHER_CELL}"
    ok = subprocess.run([sys.executable, str(ROOT / "build.py"), "verify", ref, "--key", str(tmp_path / "signing.pub"),
                         "--config", str(config_file)], cwd=ROOT, capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    assert f"{digest} ({OTHER_CELL}): verified" in ok.stdout
    # --rebuild on Debian's 20.10 (the classic image store, no buildx): the signatures verify first (the
    # engine is asked nothing before them), then the rebuild is refused in one line, exit 2, before any build
    t0 = time.monotonic()
    classic = subprocess.run([sys.executable, str(ROOT / "build.py"), "verify", ref, "--key",
                              str(tmp_path / "signing.pub"), "--config", str(config_file), "--rebuild"],
                             cwd=ROOT, capture_output=True, text=True, check=False, timeout=120)
    assert classic.returncode == 2, classic.stdout + classic.stderr
    assert f"{digest} ({OTHER_CELL}): verified" in classic.stdout, classic.stdout + classic.stderr
    assert len(classic.stderr.strip().splitlines()) == 1, classic.stdout + classic.stderr
    assert classic.stderr.startswith("verify --rebuild: ") and "Traceback" not in classic.stderr, classic.stderr
    assert time.monotonic() - t0 < 60

    path = f"{NAMESPACE}/{images.repo}"
    att = requests.get(f"{reg.url}/v2/{path}/manifests/{signed['attestations']}",
                       headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10).json()
    modules = sigstore_js()
    for i, layer in enumerate(att["layers"]):
        envelope = tmp_path / f"envelope-{i}.json"
        envelope.write_bytes(requests.get(f"{reg.url}/v2/{path}/blobs/{layer['digest']}", timeout=10).content)
        js = subprocess.run(["node", str(ROOT / "tests" / "docker" / "sigstore_verify.mjs"), str(modules),
                             str(envelope), str(tmp_path / "signing.pub")], capture_output=True, text=True,
                            timeout=60, check=False)
        assert js.returncode == 0 and js.stdout.strip() == "verified application/vnd.in-toto+json", js.stdout + js.stderr
        data = json.loads(envelope.read_text())
        body = bytearray(base64.b64decode(data["payload"]))
        body[len(body) // 2] ^= 1  # one payload byte changed, the signature kept
        data["payload"] = base64.b64encode(bytes(body)).decode()
        envelope.write_text(json.dumps(data))
        bad = subprocess.run(["node", str(ROOT / "tests" / "docker" / "sigstore_verify.mjs"), str(modules),
                              str(envelope), str(tmp_path / "signing.pub")], capture_output=True, text=True,
                             timeout=60, check=False)
        assert bad.returncode == 1 and "FAILED" in bad.stdout, bad.stdout + bad.stderr

    before = reg.snapshot()
    again = publish(reg, OTHER_CELL, args=("--sign-key", str(tmp_path / "signing.key")))
    assert again.rc == 0, again.stderr
    assert [(s["att_status"], s["sig_status"]) for s in again.report["signed"]] == [("unchanged", "unchanged")]
    assert reg.snapshot() == before, "a rerun that changed nothing wrote to the registry"


def test_immutable_tag_never_overwritten(registry: Callable[..., LocalRegistry], images: Images,
                                         publish: Callable[..., Run], docker_client: docker.DockerClient) -> None:
    reg = registry()
    old_id = images.small(OTHER_CELL)
    passes.record_pass(ROOT, old_id, OTHER_CELL, passed=10, skipped=0)
    first = publish(reg, OTHER_CELL)
    assert first.rc == 0, first.stderr
    repo_path = f"{NAMESPACE}/{images.repo}"
    held = {tag: reg.manifest_digest(repo_path, tag) for tag in first.tags(OTHER_CELL)}

    # Same labels (so the same date and sha tags), one more label: another image under the same tag.
    new_id = images.derived(old_id, f"{images.repo}:{OTHER_CELL}")
    assert new_id != old_id and docker_client.images.get(f"{images.repo}:{OTHER_CELL}").id == new_id
    passes.record_pass(ROOT, new_id, OTHER_CELL, passed=10, skipped=0)  # tested: only the overwrite rule may refuse
    blobs = reg.blobs()
    second = publish(reg, OTHER_CELL)
    assert second.rc == 1
    results = second.tags(OTHER_CELL)
    assert {r["status"] for t, r in results.items() if r["kind"] == "immutable"} == {"refused"}
    assert {r["status"] for t, r in results.items() if r["kind"] == "floating"} == {"held"}
    msg = results[f"{OTHER_CELL}-20261130"]["message"]
    assert "never overwritten" in msg and held[f"{OTHER_CELL}-20261130"] in msg and new_id in msg
    assert "never overwritten" in second.stderr
    assert {tag: reg.manifest_digest(repo_path, tag) for tag in held} == held
    assert reg.blobs() == blobs, "nothing of the refused cell may be pushed"


def test_zstd_publish_serves_the_images_diff_ids_pulls_as_the_same_image_and_reruns_unchanged(
        registry: Callable[..., LocalRegistry], images: Images, publish: Callable[..., Run],
        docker_client: docker.DockerClient, tmp_path: Path) -> None:
    """`publish --compression zstd` to a registry that wants credentials (given as publish always takes
    them; the fixture checks the password is in no output or report): every tag an OCI manifest of zstd
    layers whose plain tars hash to the image's diff_ids, its config the local image; a rerun writes
    nothing; Docker 28 pulls it back as the same image ID; the system engine pulls it too if it can
    (Docker >= 23), or refuses as 20.10 does."""
    import zstandard

    reg = registry(auth=(USER, PASSWORD))
    image_id = images.small(OTHER_CELL, blob_bytes=4 * 1024 * 1024)
    diff_ids = docker_client.images.get(image_id).attrs["RootFS"]["Layers"]
    passes.record_pass(ROOT, image_id, OTHER_CELL, passed=10, skipped=0)
    run = publish(reg, OTHER_CELL, args=("--compression", "zstd"), extra_env=_creds())
    assert run.rc == 0, run.stderr
    results = run.tags(OTHER_CELL)
    assert {(r["status"], r["compression"]) for r in results.values()} == {("pushed", "zstd")}, results
    assert run.report["compression"] == "zstd" and "| zstd |" in (Path(run.report_dir) / "publish-report.md").read_text()
    first = results[f"{OTHER_CELL}-20261130"]
    assert len(first["layers_uploaded"]) == len(diff_ids)
    assert all(r["layers_uploaded"] == [] for t, r in results.items() if t != f"{OTHER_CELL}-20261130")
    digest = run.cell(OTHER_CELL)["digest"]
    repo_path = f"{NAMESPACE}/{images.repo}"
    for tag in results:
        assert reg.manifest_digest(repo_path, tag, accept=client.OCI_MANIFEST) == digest, tag
    manifest = requests.get(f"{reg.url}/v2/{repo_path}/manifests/{digest}", headers={"Accept": client.OCI_MANIFEST},
                            auth=reg.auth, timeout=10).json()
    assert manifest["mediaType"] == client.OCI_MANIFEST and manifest["config"]["digest"] == image_id
    served = []
    for layer in manifest["layers"]:
        assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+zstd"
        blob = requests.get(f"{reg.url}/v2/{repo_path}/blobs/{layer['digest']}", auth=reg.auth, timeout=60).content
        assert "sha256:" + hashlib.sha256(blob).hexdigest() == layer["digest"] and blob[:4] == b"\x28\xb5\x2f\xfd"
        plain = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob), read_across_frames=True).read()
        served.append("sha256:" + hashlib.sha256(plain).hexdigest())
    assert served == diff_ids

    before = reg.snapshot()
    again = publish(reg, OTHER_CELL, args=("--compression", "zstd"), extra_env=_creds())
    assert again.rc == 0, again.stderr
    assert {(r["status"], r["compression"]) for r in again.tags(OTHER_CELL).values()} == {("unchanged", "zstd")}
    assert reg.snapshot() == before, "the registry's storage changed on a rerun with nothing new"

    ref = f"{reg.host}/{repo_path}@{digest}"
    with PullEngine(tmp_path) as engine:
        engine.docker("login", "--username", USER, "--password-stdin", reg.host, stdin=PASSWORD)
        engine.docker("pull", ref, timeout=600)
        assert engine.image_id(ref) == image_id, f"Docker {engine.version()} pulled another image"

    # The system engine, without the image (else a pull finds it and downloads nothing).
    images.forget_refs_of(f"{reg.host}/{NAMESPACE}/{images.repo}")
    docker_client.images.remove(image_id, force=True)
    major = int(str(docker_client.version()["Version"]).split(".")[0])
    subprocess.run(["docker", "login", "--username", USER, "--password-stdin", reg.host], input=PASSWORD,
                   capture_output=True, text=True, timeout=60, check=True)  # into this test's DOCKER_CONFIG
    pull = subprocess.run(["docker", "pull", ref], capture_output=True, text=True, timeout=600, check=False)
    if pull.returncode == 0:
        images.refs.append(ref)
        assert major >= 23 and docker_client.images.get(ref).id == image_id
    else:  # 20.10 reads the zstd blob as a plain tar
        assert major < 23, f"Docker {major} should pull zstd layers: {pull.stderr}"
        assert "Error processing tar file" in pull.stderr, pull.stderr


@pytest.mark.slow
def test_registry_crash_mid_push_then_resume(registry: Callable[..., LocalRegistry], images: Images,
                                             publish: Callable[..., Run], matrix: Matrix, config_file: Path,
                                             env: dict[str, str]) -> None:
    reg = registry()
    image_id = images.small(OTHER_CELL, blob_bytes=96 * 1024 * 1024)
    passes.record_pass(ROOT, image_id, OTHER_CELL, passed=10, skipped=0)
    registry_ = address.parse_registry(f"{reg.host}/{NAMESPACE}")
    cfg = publisher.PublishConfig(registry_, retry=faults.RetryPolicy(attempts=3))
    sleeps: list[float] = []
    seen: dict[str, str] = {}
    killed: dict[str, Any] = {}

    def on_event(ref: str, ev: Mapping[str, Any]) -> None:
        lid, status = ev.get("id"), str(ev.get("status") or "")
        if not lid or killed:
            return
        seen[str(lid)] = status
        detail = ev.get("progressDetail") or {}
        uploading = status == "Pushing" and int(detail.get("current") or 0) > 0
        done = [x for x, s in seen.items() if s == "Pushed"]
        if uploading and done and lid not in done:
            reg.kill()
            killed.update(at=time.monotonic(), done=done, uploading=str(lid))

    run = publisher.Publisher(Engine(), client.RegistryClient(registry_, images.repo, None), cfg,
                              repository=images.repo, smoke=functools.partial(passes.smoke_pass, ROOT),
                              sleep=sleeps.append, on_event=on_event)
    t0 = time.monotonic()
    report = run.run(matrix, [c for c in matrix.cells if c.name == OTHER_CELL])
    took = time.monotonic() - t0
    assert killed, f"the push finished before the registry could be killed: {seen}"
    assert not report.ok
    results = {t.tag: t for t in report.cells[0].tags}
    first = results[f"{OTHER_CELL}-20261130"]
    assert first.status == "failed" and first.attempts == 3, first
    assert "connection refused" in first.message.lower(), first.message
    assert len(sleeps) == 2 and sleeps[1] > sleeps[0] / 2  # retried, with backoff
    assert results[f"{OTHER_CELL}-{REVISION[:7]}"].status == "held"
    assert {t.status for t in report.cells[0].tags if t.kind == "floating"} == {"held"}
    assert report.floating_gate["open"] is False
    print(f"\ncrash run: {took:.1f} s (dockerd retries each layer itself for ~50 s before giving up)")

    reg.start()  # same port, same storage
    repo_path = f"{NAMESPACE}/{images.repo}"
    for tag in _floating(matrix, OTHER_CELL):
        assert reg.manifest_digest(repo_path, tag) is None, f"floating tag {tag} points at a half-pushed cell"

    rerun = publish(reg, OTHER_CELL)
    assert rerun.rc == 0, rerun.stderr
    again = rerun.tags(OTHER_CELL)[f"{OTHER_CELL}-20261130"]
    assert again["status"] == "pushed"
    sent_before = set(killed["done"])
    assert sent_before <= set(again["layers_existing"]), (killed, again)
    assert not sent_before & set(again["layers_uploaded"]), "a layer the registry already had was sent again"
    assert killed["uploading"] in again["layers_uploaded"]
    for tag in rerun.tags(OTHER_CELL):
        assert reg.manifest_digest(repo_path, tag) == rerun.cell(OTHER_CELL)["digest"], tag


@pytest.mark.slow
def test_publish_real_cell_pull_by_digest_and_run_it(registry: Callable[..., LocalRegistry], images: Images,
                                                       publish: Callable[..., Run], matrix: Matrix,
                                                       test_image: str, docker_client: docker.DockerClient,
                                                       container: Any) -> None:
    local = docker_client.images.get(test_image)
    cell = (local.labels or {}).get("io.pt-multi-gpu.cell", "")
    if cell not in {c.name for c in matrix.cells}:
        pytest.fail(f"test_image {test_image} is not a cell image of images.yaml (cell label {cell!r}); "
                    "set PTMG_TEST_IMAGE to a `build.py build` image", pytrace=False)
    images.tag(str(local.id), f"{images.repo}:{cell}")
    passes.record_pass(ROOT, str(local.id), cell, passed=1, skipped=0)
    reg = registry()

    run = publish(reg, cell, toy=False)
    assert run.rc == 0, run.stderr
    digest = run.cell(cell)["digest"]
    repo = f"{reg.host}/{NAMESPACE}/{images.repo}"
    for tag, result in run.tags(cell).items():
        assert result["status"] == "pushed"
        assert reg.manifest_digest(f"{NAMESPACE}/{images.repo}", tag) == digest, tag
    c = run.cell(cell)
    assert c["uncompressed_size"] == local.attrs["Size"] and 0 < c["compressed_size"] < c["uncompressed_size"]
    assert c["versions"]["torch"] == local.labels["io.pt-multi-gpu.torch"]
    first = next(r for r in run.tags(cell).values() if r["kind"] == "immutable")
    print(f"\nreal cell {cell}: {human(c['uncompressed_size'])} -> {human(c['compressed_size'])} compressed, "
          f"first push {first['seconds']:.0f} s, whole publish {run.seconds:.0f} s")

    # A clean state for this repository: no local ref of it left, then pull by digest.
    images.forget_refs_of(repo)
    assert not docker_client.images.list(name=repo)
    pulled = docker_client.images.pull(f"{repo}@{digest}")
    images.refs.append(f"{repo}@{digest}")
    assert pulled.id == local.id  # the same config digest: the very image test_smoke's full selftest ran
    # ... and it runs from the registry's reference: the version checks (torch, CUDA, cuDNN, NCCL
    # against the labels), not the whole selftest again (test_smoke runs that on this image id).
    code, output = container.run_and_wait(["selftest", "-k", "test_versions"], image=f"{repo}@{digest}",
                                          timeout=900, shm_size=contract.SMOKE_SHM_SIZE)
    assert code == 0 and " 0 failed" in output, output[-4000:]


def human(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"
