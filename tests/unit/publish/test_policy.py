"""The publish decisions (builder/publish/policy.py): the overwrite decision for an immutable tag
and the floating-tag gate (no daemon, no registry)."""

from __future__ import annotations

from builder.publish import client, policy, push
from builder.publish import report as publish_report

# --- decisions --------------------------------------------------------------------------
IMG = "sha256:" + "a" * 64
OTHER = "sha256:" + "b" * 64


def test_decide() -> None:
    same = client.Remote("sha256:d1", IMG, client.MANIFEST_V2, 10)
    other = client.Remote("sha256:d2", OTHER, client.MANIFEST_V2, 10)
    index = client.Remote("sha256:d3", None, client.OCI_INDEX)
    assert push.decide("immutable", client.Remote(), IMG)[0] == "push"
    assert push.decide("immutable", same, IMG)[0] == "unchanged"
    action, why = push.decide("immutable", other, IMG)
    assert action == "refuse" and "never overwritten" in why and "sha256:d2" in why and IMG in why
    assert push.decide("immutable", index, IMG)[0] == "refuse"  # a multi-arch index is not ours either
    assert push.decide("floating", other, IMG) == ("push", "moves from sha256:d2")
    assert push.decide("floating", same, IMG)[0] == "unchanged"


def _cell_report(name: str, statuses: tuple[str, ...], smoke: str = "passed", error: str = "") -> publish_report.CellReport:
    return publish_report.CellReport(name, f"r:{name}", IMG, smoke={"status": smoke}, error=error,
                          tags=[publish_report.TagResult(f"{name}-{i}", "x", "immutable", s) for i, s in enumerate(statuses)])


def test_floating_gate() -> None:
    good = _cell_report("a", ("pushed", "unchanged"))
    assert policy.floating_gate([good, _cell_report("b", ("unchanged", "unchanged"))], False) == (True, [])
    is_open, why = policy.floating_gate([good, _cell_report("b", ("pushed", "failed"))], False)
    assert not is_open and why == ["b: immutable tags not published (b-1 failed)"]
    is_open, why = policy.floating_gate([good, _cell_report("b", ("refused", "held"))], True)
    assert not is_open and "b-0 refused" in why[0]
    untested = _cell_report("b", ("pushed", "pushed"), smoke="missing")
    is_open, why = policy.floating_gate([good, untested], False)
    assert not is_open and "no smoke-test pass recorded" in why[0] and "build.py test --only b" in why[0]
    assert policy.floating_gate([good, untested], True) == (True, [])
    assert not policy.floating_gate([_cell_report("c", (), error="not built")], True)[0]
    assert not policy.floating_gate([], False)[0]


