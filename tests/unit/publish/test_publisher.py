"""The whole publish run against fakes (builder/publish/publisher.py): a fake registry and engine,
immutable tags before floating ones, reruns "unchanged", the overwrite refusal, read and push
faults retried or final, the untested-cell gate, verification by reading back, the report, and a
push without a digest settled only by the containerd store."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from builder.engine import EngineError, capabilities
from builder.matrix import Matrix, tags
from builder.publish import address, client, credentials, faults, policy, publisher, push
from builder.publish import report as publish_report
from builder.smoke import passes
from tests.support import LATEST, MID, small_matrix
from tests.unit.publish.test_address import PASSWORD
from tests.unit.publish.test_faults import _digest, _manifest
from tests.unit.publish.test_policy import OTHER


# --- the whole run against fakes ------------------------------------------------------------
class FakeRegistry:
    """Tags -> (digest, image id); scripted faults per tag are served before the real answer."""

    def __init__(self) -> None:
        self.tags: dict[str, tuple[str, str]] = {}
        self.faults: dict[str, list[faults.Fault]] = {}
        self.reads: list[str] = []
        self.blobs: set[str] = set()
        self.lie: dict[str, str] = {}  # tag -> digest to answer instead of the truth

    def manifest(self, reference: str) -> client.Remote:
        self.reads.append(reference)
        queue = self.faults.get(reference)
        if queue:
            return client.Remote(fault=queue.pop(0))
        if reference not in self.tags:
            return client.Remote()
        digest, image_id = self.tags[reference]
        return client.Remote(self.lie.get(reference, digest), image_id, client.MANIFEST_V2, 1234)

    def put_manifest(self, reference: str, media_type: str, body: bytes) -> str | faults.Fault:
        """Manifest lists: tests/unit/publish/test_manifest_list.py's registry holds them; none here."""
        return faults.Fault("protocol", f"this fake holds no manifest lists ({reference})", False)


def manifest_digest(image_id: str) -> str:
    """The digest of the manifest a registry holds for `image_id` (the body _manifest() makes)."""
    return _digest(_manifest(image_id))


class FakeEngine:
    STORE = capabilities.CLASSIC  # what its image IDs name (the publisher is told, as the verb tells it)

    def __init__(self, registry: FakeRegistry) -> None:
        self.registry = registry
        self.images: dict[str, dict[str, Any]] = {}
        self.tagged: dict[str, str] = {}
        self.pushes: list[tuple[str, Mapping[str, str] | None]] = []
        self.push_errors: list[str] = []  # served one per push, before real pushes

    def add(self, ref: str, image_id: str, cell: str, layers: tuple[str, ...] = ("l1", "l2")) -> None:
        self.images[ref] = {"Id": image_id, "Size": 5000, "Created": "2026-11-29T10:00:00.1Z", "layers": layers,
                            "Config": {"Labels": {"io.pt-multi-gpu.cell": cell, "io.pt-multi-gpu.torch": "2.7.0",
                                                  "org.opencontainers.image.created": "2026-11-30T03:52:14Z",
                                                  "org.opencontainers.image.revision": "4a297245bf90"}}}

    def image_attrs(self, ref: str) -> dict[str, Any] | None:
        return self.images.get(ref)

    def store(self) -> capabilities.Store:
        return self.store_as

    store_as = capabilities.Store(capabilities.CLASSIC, "overlay2")

    def tag(self, image_id: str, ref: str) -> None:
        self.tagged[ref] = image_id

    def untag(self, ref: str) -> None:
        self.tagged.pop(ref, None)

    def push(self, ref: str, auth_config: Mapping[str, str] | None,
             on_event: Callable[[Mapping[str, Any]], None]) -> None:
        self.pushes.append((ref, auth_config))
        if self.push_errors:
            err = self.push_errors.pop(0)
            if err.startswith("raise:"):
                raise EngineError(err[6:])
            on_event({"status": "Pushing", "progressDetail": {"current": 1, "total": 9}, "id": "l1"})
            on_event({"errorDetail": {"message": err}, "error": err})
            return
        image_id = self.tagged[ref]
        attrs = next(a for a in self.images.values() if a["Id"] == image_id)
        for layer in attrs["layers"]:
            on_event({"status": "Layer already exists" if layer in self.registry.blobs else "Pushed", "id": layer})
            self.registry.blobs.add(layer)
        tag = ref.rpartition(":")[2]
        self.registry.tags[tag] = (manifest_digest(image_id), image_id)
        on_event({"aux": {"Tag": tag, "Digest": manifest_digest(image_id), "Size": 900}})


A = MID
B = LATEST  # the matrix's latest: its floating tags include `latest`
IMG_A = "sha256:" + "1" * 64
IMG_B = "sha256:" + "2" * 64
TAGS_A = (f"{A}-20261130", f"{A}-4a29724")
FLOAT_A = (A, "2.7-cuda12.6")
FLOAT_B = (B, "2.14-cuda13.0", "latest")


@pytest.fixture
def matrix(tmp_path: Path) -> Matrix:
    return small_matrix(tmp_path / "matrix")


class World:
    def __init__(self, matrix: Matrix, *, tested: tuple[str, ...] = (IMG_A, IMG_B), allow_untested: bool = False,
                 attempts: int = 4, creds: credentials.Credentials | None = None,
                 engine: type[FakeEngine] | None = None) -> None:
        self.matrix = matrix
        self.registry = FakeRegistry()
        self.engine = (engine or FakeEngine)(self.registry)
        self.engine.add(f"pt-multi-gpu:{A}", IMG_A, A)
        self.engine.add(f"pt-multi-gpu:{B}", IMG_B, B, layers=("l1", "l3"))
        self.tested = set(tested)
        self.sleeps: list[float] = []
        self.cfg = publisher.PublishConfig(address.parse_registry("127.0.0.1:5000/ns"), allow_untested=allow_untested,
                                     retry=faults.RetryPolicy(attempts=attempts))
        self.creds = creds

    def smoke(self, image_id: str) -> passes.SmokePass | None:
        return passes.SmokePass(image_id, "c", 12, 3, 1, "2026-11-30T04:00:00Z") if image_id in self.tested else None

    def run(self, only: tuple[str, ...] = (A, B)) -> publish_report.Report:
        p = publisher.Publisher(self.engine, self.registry, self.cfg, repository="pt-multi-gpu", creds=self.creds,
                          smoke=self.smoke, sleep=self.sleeps.append, rng=lambda: 1.0,
                          store=self.engine.STORE)
        return p.run(self.matrix, [c for c in self.matrix.cells if c.name in only])


def _status(report: publish_report.Report) -> dict[str, str]:
    return {t.tag: t.status for c in report.cells for t in c.tags}


def test_publish_happy_path_immutable_before_floating(matrix: Matrix) -> None:
    w = World(matrix)
    report = w.run()
    assert report.ok and report.floating_gate == {"open": True, "reasons": []}
    assert set(_status(report).values()) == {"pushed"}
    pushed = [ref.rpartition(":")[2] for ref, _ in w.engine.pushes]
    assert set(pushed) == {*TAGS_A, *FLOAT_A, f"{B}-20261130", f"{B}-4a29724", *FLOAT_B}
    first_floating = min(pushed.index(t) for t in (*FLOAT_A, *FLOAT_B))
    assert all(pushed.index(t) < first_floating for t in (*TAGS_A, f"{B}-20261130", f"{B}-4a29724"))
    a = report.cells[[c.cell for c in report.cells].index(A)]
    assert a.digest == manifest_digest(IMG_A) and a.compressed_size == 1234 and a.uncompressed_size == 5000
    assert a.versions["torch"] == "2.7.0" and a.smoke["status"] == "passed"
    assert w.engine.tagged == {}  # registry tags are removed locally after each push
    # Floating pushes after the immutable ones upload nothing new.
    assert all(not t.layers_uploaded for t in a.tags if t.kind == "floating")


class ContainerdStoreEngine(FakeEngine):
    """The containerd image store: a local image ID is the digest of the manifest that a push sends,
    which names the config (the classic store's ID) inside it."""

    STORE = capabilities.CONTAINERD

    def add(self, ref: str, image_id: str, cell: str, layers: tuple[str, ...] = ("l1", "l2")) -> None:
        super().add(ref, manifest_digest(image_id), cell, layers)
        self.images[ref]["config"] = image_id

    def push(self, ref: str, auth_config: Mapping[str, str] | None,
             on_event: Callable[[Mapping[str, Any]], None]) -> None:
        self.pushes.append((ref, auth_config))
        attrs = next(a for a in self.images.values() if a["Id"] == self.tagged[ref])
        tag = ref.rpartition(":")[2]
        self.registry.tags[tag] = (attrs["Id"], attrs["config"])
        # Docker 28.5.2's containerd store ends a successful push with no aux Digest (seen on the real
        # engine: tests/docker/test_modern_engine.py), only the layers' progress.
        on_event({"status": "Pushed", "id": "l1", "progressDetail": {}})
        if self.STORE == capabilities.CLASSIC:  # a classic engine reports what it pushed
            on_event({"aux": {"Tag": tag, "Digest": attrs["Id"], "Size": 900}})


def test_containerd_store_verifies_the_manifest_digest_and_a_rerun_is_unchanged(matrix: Matrix) -> None:
    w = World(matrix, engine=ContainerdStoreEngine, tested=(manifest_digest(IMG_A), manifest_digest(IMG_B)))
    report = w.run()
    assert report.ok and set(_status(report).values()) == {"pushed"}, _status(report)
    assert report.cells[0].digest == report.cells[0].image_id == manifest_digest(IMG_A)
    n = len(w.engine.pushes)
    again = w.run()
    assert again.ok and set(_status(again).values()) == {"unchanged"} and len(w.engine.pushes) == n
    # A registry that serves another manifest under the tag is caught in this store too.
    w.registry.tags[TAGS_A[0]] = ("sha256:" + "9" * 64, IMG_A)
    refused = w.run(only=(A,))
    assert not refused.ok and _status(refused)[TAGS_A[0]] == "refused"


def test_containerd_store_image_read_as_classic_fails_verification(matrix: Matrix) -> None:
    """The same pushes judged by the classic store's rule (config digest == image ID) fail: the store
    decides, so publish must ask the engine which one it is."""
    w = World(matrix, engine=ContainerdStoreEngine, tested=(manifest_digest(IMG_A), manifest_digest(IMG_B)))
    w.engine.STORE = capabilities.CLASSIC
    report = w.run(only=(A,))
    assert not report.ok and "describes image" in report.cells[0].tags[0].message


def test_rerun_is_unchanged_and_pushes_nothing(matrix: Matrix) -> None:
    w = World(matrix)
    assert w.run().ok
    n = len(w.engine.pushes)
    report = w.run()
    assert report.ok and set(_status(report).values()) == {"unchanged"} and len(w.engine.pushes) == n


def test_immutable_overwrite_refused_nothing_pushed_for_that_cell(matrix: Matrix) -> None:
    w = World(matrix)
    w.registry.tags[TAGS_A[1]] = ("sha256:old", OTHER)  # another image already under A's sha tag
    report = w.run()
    st = _status(report)
    assert st[TAGS_A[1]] == "refused" and st[TAGS_A[0]] == "held"
    assert not [ref for ref, _ in w.engine.pushes if f":{A}" in ref or ":2.7-" in ref]
    assert w.registry.tags[TAGS_A[1]] == ("sha256:old", OTHER)
    refused = next(t for c in report.cells for t in c.tags if t.status == "refused")
    assert "never overwritten" in refused.message and "sha256:old" in refused.message
    # B's immutable tags still go up; nobody's floating tags move.
    assert st[f"{B}-20261130"] == "pushed"
    assert all(st[t] == "held" for t in (*FLOAT_A, *FLOAT_B))
    assert not report.ok and not report.floating_gate["open"]


@pytest.mark.parametrize("fault", [
    faults.Fault("auth", "HTTP 401", False),
    faults.Fault("protocol", "HTTP 404 without a registry error", False),
    faults.Fault("tls", "bad cert", False),
])
def test_permanent_read_faults_fail_at_once_and_never_push(matrix: Matrix, fault: faults.Fault) -> None:
    w = World(matrix)
    w.registry.faults[TAGS_A[0]] = [fault] * 10
    report = w.run(only=(A,))
    st = _status(report)
    assert st[TAGS_A[0]] == "failed" and st[TAGS_A[1]] == "held"
    assert w.engine.pushes == [] and w.sleeps == []
    assert w.registry.reads.count(TAGS_A[0]) == 1
    assert fault.message in next(t.message for t in report.cells[0].tags if t.status == "failed")
    assert not report.ok


@pytest.mark.parametrize("fault", [
    faults.Fault("rate-limit", "HTTP 429", True),
    faults.Fault("server", "HTTP 503", True),
    faults.Fault("network", "connection refused", True),
])
def test_transient_read_faults_retried_then_fail_without_push(matrix: Matrix, fault: faults.Fault) -> None:
    w = World(matrix, attempts=4)
    w.registry.faults[TAGS_A[0]] = [fault] * 10
    report = w.run(only=(A,))
    assert _status(report)[TAGS_A[0]] == "failed" and w.engine.pushes == []
    assert w.registry.reads.count(TAGS_A[0]) == 4
    assert w.sleeps == [1.0, 2.0, 4.0]  # exponential (rng pinned to the top of the jitter)


def test_transient_read_fault_recovers(matrix: Matrix) -> None:
    w = World(matrix)
    w.registry.faults[TAGS_A[0]] = [faults.Fault("server", "HTTP 502", True)]
    report = w.run(only=(A,))
    assert report.ok and w.sleeps == [1.0]


def test_transient_push_error_retried_then_pushed(matrix: Matrix) -> None:
    w = World(matrix)
    w.engine.push_errors = ["received unexpected HTTP status: 503 Service Unavailable"]
    report = w.run(only=(A,))
    assert report.ok
    first = report.cells[0].tags[0]
    assert first.status == "pushed" and first.attempts == 2 and w.sleeps == [1.0]


def test_push_errors_exhaust_attempts(matrix: Matrix) -> None:
    w = World(matrix, attempts=3)
    w.engine.push_errors = ["dial tcp 127.0.0.1:5000: connect: connection refused"] * 3
    report = w.run(only=(A,))
    first = report.cells[0].tags[0]
    assert first.status == "failed" and first.attempts == 3 and "connection refused" in first.message
    assert len(w.engine.pushes) == 3 and w.sleeps == [1.0, 2.0]
    # The cell's next immutable tag is not tried against a registry that just failed, nor are floating tags.
    assert report.cells[0].tags[1].status == "held" and "failed before it" in report.cells[0].tags[1].message
    assert all(t.status == "held" for t in report.cells[0].tags if t.kind == "floating")
    assert not report.ok


def test_auth_push_error_not_retried(matrix: Matrix) -> None:
    w = World(matrix)
    w.engine.push_errors = ["unauthorized: authentication required"]
    report = w.run(only=(A,))
    assert report.cells[0].tags[0].status == "failed" and len(w.engine.pushes) == 1 and w.sleeps == []


def test_engine_failure_is_a_failed_tag(matrix: Matrix) -> None:
    w = World(matrix)
    w.engine.push_errors = ["raise:push of x refused: no such image"]
    report = w.run(only=(A,))
    assert report.cells[0].tags[0].status == "failed" and "no such image" in report.cells[0].tags[0].message


def test_retry_after_push_that_landed_reads_unchanged(matrix: Matrix) -> None:
    """A push whose stream broke after the manifest landed: the retry's re-read says unchanged."""
    w = World(matrix)
    real_push = w.engine.push

    def push_then_break(ref: str, auth_config: Mapping[str, str] | None,
                        on_event: Callable[[Mapping[str, Any]], None]) -> None:
        real_push(ref, auth_config, lambda ev: None)
        if len(w.engine.pushes) == 1:
            on_event({"error": "EOF", "errorDetail": {"message": "EOF"}})
        else:
            real_push(ref, auth_config, on_event)

    w.engine.push = push_then_break  # type: ignore[method-assign]
    report = w.run(only=(A,))
    assert report.cells[0].tags[0].status == "unchanged" and report.ok


def test_verify_mismatch_fails(matrix: Matrix) -> None:
    w = World(matrix)
    w.registry.lie[TAGS_A[0]] = "sha256:someone-else"
    report = w.run(only=(A,))
    t = report.cells[0].tags[0]
    assert t.status == "failed" and "sha256:someone-else" in t.message and not report.ok


def test_untested_cell_holds_every_floating_tag(matrix: Matrix) -> None:
    w = World(matrix, tested=(IMG_B,))
    report = w.run()
    st = _status(report)
    assert all(st[t] == "pushed" for t in (*TAGS_A, f"{B}-20261130"))
    assert all(st[t] == "held" for t in (*FLOAT_A, *FLOAT_B))  # B is tested, but A holds the gate
    assert report.floating_gate["reasons"] == [
        f"{A}: no smoke-test pass recorded for image {IMG_A}; run `python build.py test --only {A}`"]
    assert not report.ok


def test_allow_untested_moves_floating_and_says_so(matrix: Matrix) -> None:
    w = World(matrix, tested=(), allow_untested=True)
    report = w.run(only=(A,))
    assert report.ok and report.allow_untested
    assert report.cells[0].smoke["status"] == "untested (--allow-untested)"
    assert "WARNING: --allow-untested" in publish_report.report_markdown(report)


def test_missing_or_foreign_local_image(matrix: Matrix) -> None:
    w = World(matrix)
    del w.engine.images[f"pt-multi-gpu:{B}"]
    w.engine.images[f"pt-multi-gpu:{A}"]["Config"]["Labels"]["io.pt-multi-gpu.cell"] = "dev-cpu"
    report = w.run()
    assert w.engine.pushes == [] and not report.ok
    errors = {c.cell: c.error for c in report.cells}
    assert "not built here" in errors[B] and "'dev-cpu'" in errors[A]


def test_missing_revision_label(matrix: Matrix) -> None:
    w = World(matrix)
    w.engine.images[f"pt-multi-gpu:{A}"]["Config"]["Labels"]["org.opencontainers.image.revision"] = "unknown"
    report = w.run(only=(A,))
    assert "no git revision label" in report.cells[0].error and w.engine.pushes == []


def test_dry_run_contacts_nothing(matrix: Matrix) -> None:
    w = World(matrix)
    w.cfg = publisher.PublishConfig(w.cfg.registry, dry_run=True)
    report = w.run()
    assert report.ok and w.engine.pushes == [] and w.registry.reads == []
    assert set(_status(report).values()) == {"planned"}


def test_credentials_reach_the_push_but_never_the_report(matrix: Matrix, tmp_path: Path) -> None:
    creds = credentials.Credentials("bob", credentials.Secret(PASSWORD), "env PTMG_REGISTRY_USER + PTMG_REGISTRY_PASSWORD")
    w = World(matrix, creds=creds)
    # An engine that echoes the password in its error (some proxies do) must not leak it either.
    w.engine.push_errors = [f"unauthorized: bad password {PASSWORD}"]
    report = w.run(only=(A,))
    assert w.engine.pushes[0][1] == {"username": "bob", "password": PASSWORD, "serveraddress": "127.0.0.1:5000"}
    jpath, mpath = publish_report.write_report(report, tmp_path, creds.secrets())
    for text in (jpath.read_text(), mpath.read_text(), repr(report)):
        assert PASSWORD not in text
    assert "bad password ***" in jpath.read_text()
    assert json.loads(jpath.read_text())["credentials"] == "env PTMG_REGISTRY_USER + PTMG_REGISTRY_PASSWORD"


def test_report_rendering(matrix: Matrix, tmp_path: Path) -> None:
    w = World(matrix, tested=(IMG_B,))
    report = w.run()
    jpath, mpath = publish_report.write_report(report, tmp_path / "out")
    data = json.loads(jpath.read_text())
    assert data["ok"] is False and data["floating_gate"]["open"] is False
    cell = next(c for c in data["cells"] if c["cell"] == B)
    assert cell["digest"] == manifest_digest(IMG_B) and cell["compressed_size"] == 1234
    assert cell["uncompressed_size"] == 5000 and cell["versions"]["torch"] == "2.7.0"
    assert {t["status"] for t in cell["tags"]} == {"pushed", "held"}
    assert {"tag", "ref", "kind", "status", "digest", "message", "attempts", "layers_uploaded"} <= set(cell["tags"][0])
    md = mpath.read_text()
    assert md.startswith("# Publish report: 127.0.0.1:5000/ns/pt-multi-gpu")
    assert "- result: **FAILED**" in md and "- floating tags: **held**" in md
    assert f"| {B} | `{manifest_digest(IMG_B)[:19]}` | 1.23 KB | 5.00 KB | 2.7.0 |" in md
    assert f"| `{B}-20261130` | immutable | pushed |" in md
    assert "| `latest` | floating | held |" in md


def test_image_date_revision_and_versions() -> None:
    assert policy.image_date({"org.opencontainers.image.created": "2026-11-30T03:52:14Z"}, None) == "20261130"
    assert policy.image_date({}, "2026-01-02T10:00:00.123456789Z") == "20260102"
    with pytest.raises(tags.TagError, match="no creation date"):
        policy.image_date({}, None)
    with pytest.raises(tags.TagError, match="no git revision label"):
        policy.image_revision({"org.opencontainers.image.revision": "unknown"})
    labels = {"io.pt-multi-gpu.torch": "2.7.0", "io.pt-multi-gpu.cuda": "12.6", "project": "pt-multi-gpu",
              "org.opencontainers.image.version": "x"}
    assert policy.versions_from_labels(labels) == {"cuda": "12.6", "torch": "2.7.0"}


def test_a_push_that_reports_no_digest_is_settled_only_by_the_containerd_store() -> None:
    """Docker 28's containerd store ends a push with no aux Digest: what it sent is its image's own
    target (the image ID). The classic store always reports one, so there silence stays a fault;
    an index it could not push whole names the manifest it sent instead."""
    image_id = manifest_digest(IMG_A)
    silent = push.PushTracker()
    silent.feed({"status": "Pushed", "id": "l1", "progressDetail": {}})
    assert silent.settle(capabilities.CLASSIC, image_id) is None
    assert silent.settle(capabilities.CONTAINERD, image_id) == image_id
    failed = push.PushTracker()
    failed.feed({"errorDetail": {"message": "denied"}, "error": "denied"})
    assert failed.settle(capabilities.CONTAINERD, image_id) is None
    one = push.PushTracker()
    one.feed({"aux": {"ManifestPushedInsteadOfIndex": True, "OriginalIndex": {"digest": image_id},
                      "SelectedManifest": {"digest": "sha256:" + "5" * 64}}})
    assert one.settle(capabilities.CONTAINERD, image_id) == "sha256:" + "5" * 64
