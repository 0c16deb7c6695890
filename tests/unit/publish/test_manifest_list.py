"""A cell on two platforms published under one tag: per-platform images under immutable tags
of their own, then one manifest list under the cell's immutable and floating tags. Against fakes
(the publisher's own, plus a registry that holds lists): all or nothing, idempotent reruns,
digests read back, floating tags only after every platform's smoke pass."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from builder.matrix import Matrix
from builder.publish import address, client, faults, manifest_list, publisher
from builder.publish import report as publish_report
from builder.smoke import passes
from tests.support import LATEST, SEED_MATRIX, small_matrix
from tests.unit.publish.test_faults import _digest, _manifest
from tests.unit.publish.test_publisher import FakeEngine, FakeRegistry, manifest_digest

ARM = f"{LATEST}-arm64"
MATRIX = SEED_MATRIX + """\
  - torch: "2.14.1"
    torchvision: "0.29.1"
    cuda: "13.0"
    cudnn: 9
    platform: linux/arm64
"""
IMG_AMD = "sha256:" + "a" * 64
IMG_ARM = "sha256:" + "b" * 64
PER_ARCH = (f"{LATEST}-4a29724-amd64", f"{LATEST}-4a29724-arm64")
LIST_IMMUTABLE = (f"{LATEST}-20261130", f"{LATEST}-4a29724")
FLOATING = (LATEST, "2.14-cuda13.0", "latest")


class ListRegistry(FakeRegistry):
    """FakeRegistry plus manifest lists (PUT and GET) and lookups of a list's entries by digest."""

    def __init__(self) -> None:
        super().__init__()
        self.lists: dict[str, bytes] = {}
        self.puts: list[str] = []
        self.put_faults: dict[str, list[faults.Fault]] = {}

    def manifest(self, reference: str) -> client.Remote:
        if reference in self.lists and not self.faults.get(reference):
            self.reads.append(reference)
            body = self.lists[reference]
            return client.manifest_remote(200, {"Docker-Content-Digest": _digest(body)}, body, reference)
        if reference.startswith("sha256:"):  # a list's entry
            for digest, image_id in self.tags.values():
                if digest == reference:
                    return client.Remote(digest, image_id, client.MANIFEST_V2, 1234, size=len(_manifest(image_id)))
            return client.Remote()
        remote = super().manifest(reference)
        if remote.present and remote.config_digest:
            remote = dataclasses.replace(remote, size=len(_manifest(remote.config_digest)))
        return remote

    def put_manifest(self, reference: str, media_type: str, body: bytes) -> str | faults.Fault:
        self.puts.append(reference)
        queue = self.put_faults.get(reference)
        if queue:
            return queue.pop(0)
        assert json.loads(body)["mediaType"] == media_type
        self.lists[reference] = body
        self.tags.pop(reference, None)
        return _digest(body)


@pytest.fixture
def matrix(tmp_path: Path) -> Matrix:
    return small_matrix(tmp_path / "m", MATRIX)


class World:
    def __init__(self, matrix: Matrix, tested: tuple[str, ...] = (IMG_AMD, IMG_ARM)) -> None:
        self.matrix = matrix
        self.registry = ListRegistry()
        self.engine = FakeEngine(self.registry)
        self.engine.add(f"pt-multi-gpu:{LATEST}", IMG_AMD, LATEST, layers=("l1", "amd"))
        self.engine.add(f"pt-multi-gpu:{ARM}", IMG_ARM, ARM, layers=("l1-arm", "arm"))
        self.tested = set(tested)
        self.sleeps: list[float] = []

    def run(self, only: tuple[str, ...] = (LATEST, ARM), dry_run: bool = False) -> publish_report.Report:
        cfg = publisher.PublishConfig(address.parse_registry("127.0.0.1:5000/ns"), dry_run=dry_run,
                                      retry=faults.RetryPolicy(attempts=3))
        p = publisher.Publisher(self.engine, self.registry, cfg, repository="pt-multi-gpu",
                                smoke=lambda i: passes.SmokePass(i, "c", 9, 3, 1, "t") if i in self.tested else None,
                                sleep=self.sleeps.append, rng=lambda: 1.0)
        return p.run(self.matrix, [c for c in self.matrix.cells if c.name in only])


def _status(report: publish_report.Report) -> dict[str, str]:
    return {t.tag: t.status for c in report.cells for t in c.tags}


def _platforms(w: World, tag: str) -> dict[str, str]:
    return dict(manifest_list.platforms_of(w.registry.manifest(tag)))


def test_one_tag_two_platforms(matrix: Matrix) -> None:
    w = World(matrix)
    r = w.run()
    assert r.ok, publish_report.report_markdown(r)
    assert _status(r) == {t: "pushed" for t in (*PER_ARCH, *LIST_IMMUTABLE, *FLOATING)}
    assert [ref.rpartition(":")[2] for ref, _ in w.engine.pushes] == list(PER_ARCH)  # only images go via the engine
    assert w.registry.puts == [*LIST_IMMUTABLE, *FLOATING]  # the list: immutable tags first, floating last
    want = {"linux/amd64": manifest_digest(IMG_AMD), "linux/arm64": manifest_digest(IMG_ARM)}
    for tag in (*LIST_IMMUTABLE, *FLOATING):
        assert _platforms(w, tag) == want
    body = w.registry.lists[LATEST]
    assert json.loads(body)["mediaType"] == client.MANIFEST_LIST  # dockerd pushes Docker v2 manifests
    amd, arm = (c for c in r.cells)
    assert amd.digest == _digest(body) and arm.digest == manifest_digest(IMG_ARM)
    assert any("linux/arm64" in n for n in amd.notes) and any(LATEST in n for n in arm.notes)


def test_rerun_is_unchanged_and_puts_nothing(matrix: Matrix) -> None:
    w = World(matrix)
    w.run()
    pushes, puts = len(w.engine.pushes), len(w.registry.puts)
    r = w.run()
    assert r.ok and set(_status(r).values()) == {"unchanged"}
    assert (len(w.engine.pushes), len(w.registry.puts)) == (pushes, puts)


def test_list_bytes_are_canonical() -> None:
    a = manifest_list.Entry("linux/arm64", "sha256:" + "2" * 64, 500, client.MANIFEST_V2)
    b = manifest_list.Entry("linux/amd64", "sha256:" + "1" * 64, 400, client.MANIFEST_V2)
    body, media = manifest_list.list_body([a, b])
    assert (body, media) == manifest_list.list_body([b, a]) and media == client.MANIFEST_LIST
    doc = json.loads(body)
    assert [m["platform"]["architecture"] for m in doc["manifests"]] == ["amd64", "arm64"]
    oci = manifest_list.Entry("linux/arm64", a.digest, 500, client.OCI_MANIFEST)
    assert manifest_list.list_body([oci, dataclasses.replace(b, media_type=client.OCI_MANIFEST)])[1] == client.OCI_INDEX
    assert manifest_list.normal_platform("linux/arm64/v8") == "linux/arm64"


def test_floating_tags_wait_for_every_platforms_smoke_pass(matrix: Matrix) -> None:
    w = World(matrix, tested=(IMG_AMD,))
    r = w.run()
    status = _status(r)
    assert not r.ok and all(status[t] == "pushed" for t in (*PER_ARCH, *LIST_IMMUTABLE))
    assert all(status[t] == "held" for t in FLOATING) and not set(FLOATING) & set(w.registry.puts)
    assert any(ARM in reason for reason in r.floating_gate["reasons"])


def test_one_platform_alone_is_refused(matrix: Matrix) -> None:
    w = World(matrix)
    r = w.run(only=(LATEST,))
    assert not r.ok and not w.engine.pushes and not w.registry.puts
    assert ARM in r.cells[0].error and "--platforms all" in r.cells[0].error


def test_missing_platform_image_stops_the_whole_tag(matrix: Matrix) -> None:
    w = World(matrix)
    del w.engine.images[f"pt-multi-gpu:{ARM}"]
    r = w.run()
    assert not r.ok and not w.engine.pushes and not w.registry.puts
    assert "not ready" in r.cells[0].error and ARM in r.cells[0].error


def test_immutable_list_tag_holding_other_images_is_refused_and_nothing_pushed(matrix: Matrix) -> None:
    w = World(matrix)
    other = manifest_list.list_body([manifest_list.Entry("linux/amd64", manifest_digest("sha256:" + "9" * 64), 10,
                                                         client.MANIFEST_V2)])[0]
    w.registry.lists[LIST_IMMUTABLE[1]] = other
    r = w.run()
    status = _status(r)
    assert status[LIST_IMMUTABLE[1]] == "refused" and status[PER_ARCH[0]] == "held"
    assert not w.engine.pushes and not w.registry.puts and w.registry.lists[LIST_IMMUTABLE[1]] == other


def test_single_image_under_a_floating_tag_moves_to_the_list(matrix: Matrix) -> None:
    w = World(matrix)
    w.registry.tags[LATEST] = (manifest_digest(IMG_AMD), IMG_AMD)  # an amd64-only publish before arm64 existed
    r = w.run()
    assert r.ok and _status(r)[LATEST] == "pushed"
    assert set(_platforms(w, LATEST)) == {"linux/amd64", "linux/arm64"}


def test_transient_put_fault_is_retried(matrix: Matrix) -> None:
    w = World(matrix)
    w.registry.put_faults[LIST_IMMUTABLE[0]] = [faults.Fault("server", "503", True)]
    r = w.run()
    assert r.ok and w.registry.puts.count(LIST_IMMUTABLE[0]) == 2 and w.sleeps


def test_put_that_reads_back_another_digest_fails(matrix: Matrix) -> None:
    w = World(matrix)
    original = w.registry.manifest

    def lying(reference: str) -> client.Remote:
        remote = original(reference)
        if reference == LIST_IMMUTABLE[0] and remote.present:
            return dataclasses.replace(remote, digest="sha256:" + "f" * 64)
        return remote

    w.registry.manifest = lying  # type: ignore[method-assign]
    r = w.run()
    assert not r.ok and _status(r)[LIST_IMMUTABLE[0]] == "failed" and _status(r)[LIST_IMMUTABLE[1]] == "held"


def test_dry_run_plans_per_platform_and_list_tags(matrix: Matrix) -> None:
    w = World(matrix)
    r = w.run(dry_run=True)
    amd, arm = r.cells
    assert [t.tag for t in amd.tags] == [PER_ARCH[0], *LIST_IMMUTABLE, *FLOATING]
    assert [t.tag for t in arm.tags] == [PER_ARCH[1]]
    assert not w.engine.pushes and not w.registry.puts and not w.registry.reads
