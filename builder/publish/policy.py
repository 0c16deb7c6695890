"""Which tags may move, and the facts about an image that name its tags (pure)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import ptmg_contract as contract
from builder.matrix import tags
from builder.publish.report import OK_STATUSES, CellReport


def floating_gate(cells: Sequence[CellReport], allow_untested: bool) -> tuple[bool, list[str]]:
    """Floating tags move only when EVERY selected cell published its immutable tags and has a
    smoke-test pass recorded for its exact image id (the latter waived by --allow-untested)."""
    reasons: list[str] = []
    for c in cells:
        if not c.immutable_ok:
            bad = [f"{t.tag} {t.status}" for t in c.tags if t.kind == "immutable" and t.status not in OK_STATUSES]
            reasons.append(f"{c.cell}: immutable tags not published ({'; '.join(bad) or c.error or 'none'})")
        if c.image_id and c.smoke.get("status") != "passed" and not allow_untested and not c.unchanged_since:
            reasons.append(f"{c.cell}: no smoke-test pass recorded for image {c.image_id}; "
                           f"run `python build.py test --only {c.cell}`")
    if not cells:
        reasons.append("no cells selected")
    return not reasons, reasons


def versions_from_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """io.pt-multi-gpu.* labels without the prefix (torch, cuda, cudnn, nccl, python, ...)."""
    prefix = contract.LABEL_NS + "."
    return {k[len(prefix):]: v for k, v in sorted(labels.items()) if k.startswith(prefix)}


def image_date(labels: Mapping[str, str], created: str | None) -> str:
    """YYYYMMDD of the image's build (its created label, else the engine's Created)."""
    for text in (labels.get(contract.OCI_CREATED), created):
        if text and re.match(r"^\d{4}-\d{2}-\d{2}", text):
            return text[:10].replace("-", "")
    raise tags.TagError("the image has no creation date (label org.opencontainers.image.created)")


def image_revision(labels: Mapping[str, str]) -> str:
    rev = labels.get(contract.OCI_REVISION, "")
    if not rev or rev == "unknown":
        raise tags.TagError("the image has no git revision label (org.opencontainers.image.revision); rebuild it "
                            "with `python build.py build` from a git checkout")
    return rev


