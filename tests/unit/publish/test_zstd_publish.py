"""`build.py publish --compression zstd` against fakes: the whole run (immutable tags, then floating,
verified by reading back), reruns "unchanged", the immutable-tag guard, a multi-platform tag (an OCI
index of the zstd manifests), the report's compression, and the flag's bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from builder.engine import capabilities
from builder.matrix import Matrix
from builder.publish import address, client, faults, manifest_list, publisher
from builder.publish import report as publish_report
from builder.publish.zstdpush import ZSTD_LAYER, ZstdPusher
from builder.smoke import passes
from tests.support import LATEST, MID, SEED_MATRIX, small_matrix, write_matrix
from tests.unit.publish.test_manifest_list import MATRIX as TWO_PLATFORMS
from tests.unit.publish.test_publisher import FakeEngine, FakeRegistry
from tests.unit.publish.test_zstdpush import BlobStore, config_of, layer_tar, save_2010, served_layers, sha

ROOT = Path(__file__).resolve().parents[3]
A, B = MID, LATEST
BASE = layer_tar({"etc/os-release": b"ID=debian\n"})
LAYERS_A = [BASE, layer_tar({"torch": b"a" * 4000})]
LAYERS_B = [BASE, layer_tar({"torch": b"b" * 4000})]
CONFIG_A, CONFIG_B = config_of(LAYERS_A), config_of(LAYERS_B)
IMG_A, IMG_B = sha(CONFIG_A), sha(CONFIG_B)
TAGS_A = (f"{A}-20261130", f"{A}-4a29724")
FLOAT_A = (A, "2.7-cuda12.6")


class SavingEngine(FakeEngine):
    """The publisher's fake engine that also saves images; `docker push` must never be called."""

    def __init__(self, registry: FakeRegistry) -> None:
        super().__init__(registry)
        self.saves: dict[str, bytes] = {}
        self.saved: list[str] = []

    def save(self, ref: str) -> Iterator[bytes]:
        self.saved.append(ref)
        yield self.saves[ref]

    def push(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("--compression zstd pushed through the engine")

    def cleanup_session(self) -> None:
        pass


class World:
    def __init__(self, matrix: Matrix, store: BlobStore | None = None) -> None:
        self.matrix = matrix
        self.store = store or BlobStore()
        self.engine = SavingEngine(FakeRegistry())
        self.engine.add(f"pt-multi-gpu:{A}", IMG_A, A)
        self.engine.add(f"pt-multi-gpu:{B}", IMG_B, B)
        self.engine.saves = {IMG_A: save_2010(LAYERS_A), IMG_B: save_2010(LAYERS_B)}
        self.sleeps: list[float] = []

    def run(self, only: tuple[str, ...] = (A, B)) -> publish_report.Report:
        cfg = publisher.PublishConfig(address.parse_registry("127.0.0.1:5000/ns"), retry=faults.RetryPolicy(attempts=3))
        p = publisher.Publisher(self.engine, self.store, cfg, repository="pt-multi-gpu",
                                smoke=lambda i: passes.SmokePass(i, "c", 9, 3, 1, "t"), sleep=self.sleeps.append,
                                rng=lambda: 1.0, zstd=ZstdPusher(self.engine, self.store))
        return p.run(self.matrix, [c for c in self.matrix.cells if c.name in only])


@pytest.fixture
def matrix(tmp_path: Path) -> Matrix:
    return small_matrix(tmp_path / "m")


def _tags(report: publish_report.Report) -> dict[str, publish_report.TagResult]:
    return {t.tag: t for c in report.cells for t in c.tags}


def test_every_tag_is_pushed_as_zstd_verified_and_reported(matrix: Matrix) -> None:
    w = World(matrix)
    r = w.run()
    assert r.ok, publish_report.report_markdown(r)
    tags = _tags(r)
    assert {t.status for t in tags.values()} == {"pushed"} and {t.compression for t in tags.values()} == {"zstd"}
    assert all("verified: the registry serves" in t.message for t in tags.values())
    for tag in (*TAGS_A, *FLOAT_A):
        assert served_layers(w.store, tag) == LAYERS_A, tag
        assert w.store.manifest(tag).config_digest == IMG_A  # the local image ID: "unchanged" next time
    assert len(w.store.uploads) == len(set(w.store.uploads)) == 5, "a blob went up twice"  # BASE once, for both
    assert len(tags[TAGS_A[0]].layers_uploaded) == 2 and tags[TAGS_A[1]].layers_uploaded == []
    assert w.engine.saved.count(IMG_A) == 1  # its other tags only asked the registry (HEAD)
    assert r.compression == "zstd"
    md = publish_report.report_markdown(r)
    assert "compression of new pushes: zstd" in md and "| zstd |" in md
    assert json.loads(publish_report.report_json(r))["cells"][0]["tags"][0]["compression"] == "zstd"


def test_a_rerun_is_unchanged_and_sends_nothing(matrix: Matrix) -> None:
    w = World(matrix)
    first = w.run()
    uploads, puts, saves = list(w.store.uploads), list(w.store.puts), list(w.engine.saved)
    again = World(matrix, w.store).run()  # a new run: nothing remembered but what the registry holds
    assert again.ok and {t.status for t in _tags(again).values()} == {"unchanged"}
    assert {t.compression for t in _tags(again).values()} == {"zstd"}
    assert (w.store.uploads, w.store.puts, w.engine.saved) == (uploads, puts, saves)
    assert [c.digest for c in again.cells] == [c.digest for c in first.cells]


def test_an_immutable_tag_holding_another_image_is_never_overwritten(matrix: Matrix) -> None:
    store = BlobStore()
    other = World(matrix, store)
    other.engine.images[f"pt-multi-gpu:{A}"]["Id"] = sha(config_of(LAYERS_B))
    other.engine.saves[sha(config_of(LAYERS_B))] = save_2010(LAYERS_B)
    assert other.run(only=(A,)).ok  # the registry holds another image under A's immutable tags
    held = {t: store.manifests[t] for t in TAGS_A}
    uploads, puts = list(store.uploads), list(store.puts)
    w = World(matrix, store)
    r = w.run(only=(A,))
    tags = _tags(r)
    assert not r.ok and {tags[t].status for t in TAGS_A} == {"refused"}
    assert "never overwritten" in tags[TAGS_A[0]].message
    assert {tags[t].status for t in FLOAT_A} == {"held"}
    assert {t: store.manifests[t] for t in TAGS_A} == held
    assert (store.uploads, store.puts, w.engine.saved) == (uploads, puts, []), "something of the refused cell went up"


def test_a_tag_held_with_gzip_stays_unchanged_and_says_so(matrix: Matrix) -> None:
    """Same image, other compression: the tag is not pushed again (an immutable tag never changes
    its manifest); the report says what the registry serves."""
    store = BlobStore()
    gzipped = {"schemaVersion": 2, "mediaType": client.MANIFEST_V2,
               "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": IMG_A, "size": 1},
               "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                           "digest": "sha256:" + "3" * 64, "size": 9}]}
    for tag in (*TAGS_A, *FLOAT_A):
        store.put_manifest(tag, client.MANIFEST_V2, json.dumps(gzipped).encode())
    r = World(matrix, store).run(only=(A,))
    assert r.ok and {(t.status, t.compression) for t in _tags(r).values()} == {("unchanged", "gzip")}
    assert store.uploads == []


def test_a_transient_fault_mid_layer_is_retried_and_resumes(matrix: Matrix) -> None:
    store = BlobStore(break_upload={2: faults.Fault("network", "connection reset", True)})
    w = World(matrix, store)
    r = w.run(only=(A,))
    first = _tags(r)[TAGS_A[0]]
    assert r.ok and first.status == "pushed" and first.attempts == 2 and len(w.sleeps) == 1
    assert len(store.uploads) == len(set(store.uploads)) == 3  # two layers and the config, each once
    assert served_layers(store, TAGS_A[0]) == LAYERS_A


def test_a_multi_platform_tag_of_zstd_manifests_is_an_oci_index(tmp_path: Path) -> None:
    matrix = small_matrix(tmp_path / "m", TWO_PLATFORMS)
    arm = f"{LATEST}-arm64"
    layers_arm = [layer_tar({"arm": b"x" * 3000})]
    config_arm = config_of(layers_arm, architecture="arm64")
    w = World(matrix)
    w.engine.add(f"pt-multi-gpu:{arm}", sha(config_arm), arm)
    w.engine.saves[sha(config_arm)] = save_2010(layers_arm, config_arm)
    r = w.run(only=(B, arm))
    assert r.ok, publish_report.report_markdown(r)
    index = json.loads(w.store.manifests[LATEST])
    assert index["mediaType"] == client.OCI_INDEX
    assert {m["mediaType"] for m in index["manifests"]} == {client.OCI_MANIFEST}
    children = dict(manifest_list.platforms_of(w.store.manifest(LATEST)))
    assert w.store.manifest(children["linux/arm64"]).config_digest == sha(config_arm)
    assert w.store.manifest(children["linux/amd64"]).config_digest == IMG_B
    for digest in children.values():
        assert {x["mediaType"] for x in json.loads(w.store.manifests[digest])["layers"]} == {ZSTD_LAYER}
    again = World(matrix, w.store)
    again.engine.add(f"pt-multi-gpu:{arm}", sha(config_arm), arm)
    again.engine.saves[sha(config_arm)] = w.engine.saves[sha(config_arm)]
    assert {t.status for t in _tags(again.run(only=(B, arm))).values()} == {"unchanged"}


# --- the flag ---------------------------------------------------------------------------------
def _build_py(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PTMG_")}
    return subprocess.run([sys.executable, str(ROOT / "build.py"), *args], cwd=cwd, env={**clean, **(env or {})},
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize(("args", "env"), [
    (["--compression", "xz"], {}),
    (["--compression", "ZSTD"], {}),
    (["--compression", ""], {}),
    ([], {"PTMG_PUBLISH_COMPRESSION": "brotli"}),
], ids=["xz", "upper-case", "empty", "env"])
def test_a_bad_compression_is_one_line_and_exit_2(tmp_path: Path, args: list[str], env: dict[str, str]) -> None:
    r = _build_py(["publish", "--registry", "127.0.0.1:5000", *args], tmp_path, env)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith("build.py publish: argument --compression: ") and "must be gzip or zstd" in line, line


def test_zstd_is_refused_in_one_line_on_a_containerd_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    import builder.cli.main as cli
    from tests.unit.publish.test_client_auth import FakeResponse, FakeSession
    from tests.unit.publish.test_faults import _err

    engine = SavingEngine(FakeRegistry())
    engine.add(f"pt-multi-gpu:{A}", IMG_A, A)
    engine.store_as = capabilities.Store(capabilities.CONTAINERD, "overlayfs")
    monkeypatch.setattr("builder.cli.context.Engine", lambda: engine)
    monkeypatch.setattr(requests, "Session", lambda: FakeSession(lambda *a: FakeResponse(404, _err("NAME_UNKNOWN"))))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))
    monkeypatch.setenv("PTMG_STATE_DIR", str(tmp_path / "state"))
    config = write_matrix(tmp_path / "matrix", SEED_MATRIX)
    rc = cli.main(["publish", "--config", str(config), "--only", A, "--registry", "127.0.0.1:5000/ns",
                   "--report-dir", str(tmp_path / "report"), "--allow-stale-os", "--compression", "zstd"])
    _out, err = capfd.readouterr()
    assert rc == 2 and "Traceback" not in err
    assert "--compression zstd: this engine keeps its images in the containerd store" in err
    assert engine.saved == [] and not (tmp_path / "report").exists()
