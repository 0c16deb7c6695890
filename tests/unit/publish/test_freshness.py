"""The OS-freshness gates at publish: an unchanged cell publishes nothing (compared by recipe and packages with the
image its floating tag holds, not by image id); an image with Debian security updates pending
longer than audit.debian.max_pending_days is refused, with the fix and an override."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import ptmg_contract as contract
from builder.matrix import ImageSpec, Matrix
from builder.publish import freshness
from builder.publish import report as publish_report
from tests.unit.publish.test_client_auth import FakeResponse, FakeSession
from tests.unit.publish.test_faults import _digest, _err, _manifest
from tests.unit.publish.test_publisher import IMG_A, IMG_B, TAGS_A, A, B, World

NOW = dt.datetime(2026, 12, 15, 6, tzinfo=dt.timezone.utc)
SAME = {contract.LABEL_RECIPE_HASH: "sha256:r", contract.LABEL_OS_PACKAGES: "sha256:o",
        contract.LABEL_VENV_PACKAGES: "sha256:v"}


@pytest.fixture
def matrix(tmp_path: Path) -> Matrix:
    from tests.support import small_matrix

    return small_matrix(tmp_path / "matrix")


# --- unchanged ---------------------------------------------------------------------------------
def test_unchanged_is_by_recipe_and_packages() -> None:
    remote = {**SAME, contract.LABEL_OS_UPDATED: "2026-12-07T04:20:00Z", contract.LABEL_INPUTS_HASH: "sha256:other"}
    assert freshness.unchanged_since({**SAME, contract.LABEL_INPUTS_HASH: "sha256:mine"}, remote) == \
        "unchanged since 2026-12-07"
    assert freshness.unchanged_since(SAME, {**remote, contract.LABEL_OS_PACKAGES: "sha256:new-libssl3"}) is None
    assert freshness.unchanged_since(SAME, {**remote, contract.LABEL_VENV_PACKAGES: "sha256:new-jupyter"}) is None
    assert freshness.unchanged_since(SAME, None) is None  # nothing published yet
    # An image without the identity labels is never "the same".
    assert freshness.unchanged_since({}, {}) is None
    assert freshness.unchanged_since(SAME, {contract.OCI_CREATED: "2026-11-01T00:00:00Z"}) is None


def test_an_unchanged_week_publishes_nothing(matrix: Matrix) -> None:
    w = World(matrix)
    seen: list[tuple[str, str]] = []

    def unchanged(spec: ImageSpec, labels: Mapping[str, str]) -> str | None:
        seen.append((spec.name, labels[contract.LABEL_CELL]))
        return "unchanged since 2026-12-07"

    report = _run(w, unchanged=unchanged)
    assert report.ok and w.engine.pushes == [] and sorted(seen) == sorted([(A, A), (B, B)])
    assert all(c.unchanged_since == "unchanged since 2026-12-07" and not c.tags for c in report.cells)
    md = publish_report.report_markdown(report)
    assert "unchanged since 2026-12-07: the registry already holds this image; nothing published" in md


def test_a_changed_cell_publishes_and_an_unchanged_one_does_not(matrix: Matrix) -> None:
    w = World(matrix, tested=(IMG_A,))  # B is unchanged and was not smoke-tested again: no matter
    report = _run(w, unchanged=lambda spec, _labels: "unchanged since 2026-12-07" if spec.name == B else None)
    assert report.ok and report.floating_gate["open"]
    pushed = {ref.rpartition(":")[2] for ref, _ in w.engine.pushes}
    assert pushed == {*TAGS_A, A, "2.7-cuda12.6"}


# --- OS freshness --------------------------------------------------------------------------------
class Audit:
    def __init__(self, result: freshness.OsPending) -> None:
        self.result = result
        self.calls = 0

    def __call__(self) -> freshness.OsPending:
        self.calls += 1
        return self.result


PENDING = freshness.OsPending(("libssl3 3.0.20-1~deb12u2 -> 3.0.22-1~deb12u2",))


def test_a_young_os_layer_needs_no_audit() -> None:
    audit = Audit(PENDING)
    assert freshness.os_gate({contract.LABEL_OS_UPDATED: "2026-12-08T06:00:00Z"}, 14, NOW, audit) is None
    assert audit.calls == 0, "pending updates are at most as old as the OS layer: 7 days < 14"


def test_an_old_os_layer_with_pending_updates_is_refused_with_the_fix() -> None:
    why = freshness.os_gate({contract.LABEL_OS_UPDATED: "2026-11-20T06:00:00Z"}, 14, NOW, Audit(PENDING))
    assert why is not None
    assert "1 Debian security update(s) pending (libssl3 3.0.20-1~deb12u2 -> 3.0.22-1~deb12u2)" in why
    assert "25 days ago" in why and "max_pending_days is 14" in why
    assert "make images" in why and "--allow-stale-os" in why


def test_an_old_os_layer_with_nothing_pending_may_go() -> None:
    assert freshness.os_gate({contract.LABEL_OS_UPDATED: "2026-11-20T06:00:00Z"}, 14, NOW,
                             Audit(freshness.OsPending())) is None


def test_no_label_or_no_audit_is_refused() -> None:
    why = freshness.os_gate({}, 14, NOW, Audit(PENDING))
    assert why is not None and "unknown age" in why
    failed = freshness.os_gate({}, 14, NOW, Audit(freshness.OsPending(error="apt-get update failed:\nErr:1")))
    assert failed is not None and "could not run (apt-get update failed:)" in failed


def test_zero_days_refuses_any_pending_update() -> None:
    assert freshness.os_gate({contract.LABEL_OS_UPDATED: "2026-12-15T05:00:00Z"}, 0, NOW, Audit(PENDING))


def test_a_refused_cell_pushes_nothing_and_holds_the_floating_tags(matrix: Matrix) -> None:
    w = World(matrix)
    report = _run(w, os_gate=lambda spec, image_id, _l: "2 Debian security update(s) pending" if image_id == IMG_A
                  else None)
    assert not report.ok and not report.floating_gate["open"]
    a = next(c for c in report.cells if c.cell == A)
    assert "refused: 2 Debian security update(s) pending" in a.error
    assert not [ref for ref, _ in w.engine.pushes if f":{A}" in ref]
    assert all(t.status == "held" for c in report.cells for t in c.tags if t.kind == "floating")


def _run(w: World, **hooks: Any) -> publish_report.Report:
    from builder.publish import publisher

    p = publisher.Publisher(w.engine, w.registry, w.cfg, repository="pt-multi-gpu", creds=w.creds, smoke=w.smoke,
                            sleep=w.sleeps.append, rng=lambda: 1.0, **hooks)
    return p.run(w.matrix, list(w.matrix.cells[1:]))  # A (2.7.0) and B (2.14.1)


# --- the registry's labels -----------------------------------------------------------------------
def test_registry_labels_reads_the_config_blob() -> None:
    from builder.publish import address, client

    config = json.dumps({"architecture": "amd64", "config": {"Labels": SAME}}).encode()
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    body = _manifest(config_digest)

    def answer(url: str, params: dict[str, str], headers: dict[str, str]) -> FakeResponse:
        if "/blobs/" in url:
            return FakeResponse(200, config if url.endswith(config_digest) else b"{}")
        tag = url.rpartition("/manifests/")[2]
        if tag == "held":
            return FakeResponse(200, body, {"Docker-Content-Digest": _digest(body)})
        return FakeResponse(404, _err("MANIFEST_UNKNOWN"))

    c = client.RegistryClient(address.parse_registry("127.0.0.1:5000/ns"), "pt-multi-gpu", None,
                              session=FakeSession(answer))  # type: ignore[arg-type]
    read = freshness.registry_labels(c)
    assert read("held") == (SAME, "")
    assert read("new") == (None, "absent")
    assert IMG_B  # (the publish fakes are shared with test_publish_logic)


@pytest.mark.parametrize(("blob", "why"), [
    (b"not json", "the config blob of held is not JSON"),
    (b"[1, 2]", "the config blob of held is not JSON"),  # JSON, but not an image config
    (None, "ConnectionError"),  # the registry went away between the manifest and the blob
])
def test_a_config_blob_that_cannot_be_read_gives_no_labels_and_says_why(blob: bytes | None, why: str) -> None:
    import requests

    from builder.publish import address, client

    digest = "sha256:" + hashlib.sha256(blob or b"").hexdigest()
    body = _manifest(digest)

    def answer(url: str, params: dict[str, str], headers: dict[str, str]) -> FakeResponse:
        if "/blobs/" in url:
            if blob is None:
                raise requests.exceptions.ConnectionError("connection reset")
            return FakeResponse(200, blob)
        return FakeResponse(200, body, {"Docker-Content-Digest": _digest(body)})

    c = client.RegistryClient(address.parse_registry("127.0.0.1:5000/ns"), "pt-multi-gpu", None,
                              session=FakeSession(answer))  # type: ignore[arg-type]
    labels, reason = freshness.registry_labels(c)("held")
    assert labels is None and reason.endswith(why)


def test_unchanged_names_the_best_date_it_has() -> None:
    created = {**SAME, contract.OCI_CREATED: "2026-11-02T10:00:00Z"}
    assert freshness.unchanged_since(SAME, created) == "unchanged since 2026-11-02"
    assert (freshness.unchanged_since(SAME, SAME) or "").startswith("unchanged since ")  # no date at all: still unchanged


@pytest.mark.parametrize(("days", "pending_runs"), [(14, False), (15, True)])
def test_the_os_gate_audits_only_past_max_pending_days(days: int, pending_runs: bool) -> None:
    ran: list[bool] = []

    def pending() -> freshness.OsPending:
        ran.append(True)
        return freshness.OsPending(("libssl3 1 -> 2",))

    updated = (NOW - dt.timedelta(days=days)).strftime("%Y-%m-%dT%H:%M:%SZ")
    reason = freshness.os_gate({contract.LABEL_OS_UPDATED: updated}, 14, NOW, pending)
    assert bool(ran) is pending_runs and (reason is not None) is pending_runs
