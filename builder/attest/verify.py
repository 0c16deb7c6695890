"""What a consumer checks of a digest (``build.py verify``): every failure is one line with the reason.

1. ``sha256-<hex>.sig``: a simple-signing layer whose signature this key made, naming this digest;
2. ``sha256-<hex>.att``: every layer a DSSE envelope this key signed (a changed byte, another key, an
   unsigned envelope: refused), every statement's subject this digest (a replayed attestation for another
   digest: refused), SLSA provenance, the gate results and (for an image that carries one) the SBOM present;
3. the provenance's inputs against this checkout: each cell is in images.yaml with the same entry, its
   lock has the same sha256, and the Debian snapshot is the one the image's own config records.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec

import ptmg_contract as contract
from builder.attest import dsse
from builder.attest.cosign_store import (
    DSSE_MEDIA_TYPE,
    PREDICATE_ANNOTATION,
    SIGNATURE_ANNOTATION,
    SIMPLE_SIGNING,
    Store,
    Tampered,
    read,
    tag_for,
)
from builder.attest.keys import ALGORITHM
from builder.attest.statements import GATES_V1, SLSA_PROVENANCE_V1, STATEMENT_V1, entry_sha256, reproducible_digests
from builder.common.errors import StepFailed


class VerifyFailed(StepFailed):
    """The digest does not verify: exit 1 with the reason."""


@dataclass(frozen=True)
class Checkout:
    """This checkout's side of the comparison."""

    cells: Mapping[str, Mapping[str, Any]]  # cell -> its images.yaml entry (statements.cell_entry)
    locks: Mapping[str, str]  # cell -> sha256 of its lock ("" when it has none)
    labels: Callable[[str], Mapping[str, str] | None]  # a platform digest -> its image config's labels


@dataclass
class Verified:
    digest: str
    checks: list[str] = field(default_factory=list)
    predicate_types: list[str] = field(default_factory=list)
    cells: list[str] = field(default_factory=list)
    #: cell -> the reproducible OCI manifest digest the provenance signed for it (``build.py repro``'s)
    reproducible: dict[str, str] = field(default_factory=dict)


def _layers(store: Store, tag: str, what: str) -> list[Any]:
    try:
        layers = read(store, tag)
    except Tampered as exc:
        raise VerifyFailed(f"{what}: {exc}") from None
    if layers is None:
        raise VerifyFailed(f"{what}: missing: the registry has no {tag} (unsigned, or signed for another digest)")
    return layers


def check_signature(store: Store, pub: ec.EllipticCurvePublicKey, digest: str) -> str:
    tag = tag_for(digest, "sig")
    layers = [x for x in _layers(store, tag, "signature") if x.media_type == SIMPLE_SIGNING]
    if not layers:
        raise VerifyFailed(f"signature: {tag} holds no simple-signing layer")
    named = []
    for x in layers:
        try:
            pub.verify(base64.b64decode(x.annotations.get(SIGNATURE_ANNOTATION, ""), validate=True), x.data, ALGORITHM)
        except (binascii.Error, ValueError, InvalidSignature):
            continue
        try:
            named.append(str(json.loads(x.data)["critical"]["image"]["docker-manifest-digest"]))
        except (ValueError, KeyError, TypeError):
            continue
        if named[-1] == digest:
            return f"{tag}: signed by this key for {digest}"
    if named:
        raise VerifyFailed(f"signature: {tag} is signed by this key for {', '.join(named)}, not {digest}")
    raise VerifyFailed(f"signature: no signature in {tag} verifies with this key (another key, or a changed byte)")


def open_attestations(store: Store, pub: ec.EllipticCurvePublicKey, digest: str) -> list[tuple[str, dict[str, Any]]]:
    """(predicateType, statement) of every layer of the digest's .att, each checked; VerifyFailed otherwise."""
    tag = tag_for(digest, "att")
    out = []
    for i, x in enumerate(_layers(store, tag, "attestation")):
        ptype = x.annotations.get(PREDICATE_ANNOTATION, "?")
        where = f"attestation {tag} layer {i} ({ptype})"
        if x.media_type != DSSE_MEDIA_TYPE:
            raise VerifyFailed(f"{where}: media type {x.media_type!r}, not a DSSE envelope")
        try:
            payload = dsse.open_envelope(x.data, pub).payload
        except dsse.EnvelopeError as exc:
            raise VerifyFailed(f"{where}: {exc} (another key, a changed byte, or unsigned)") from None
        try:
            st = json.loads(payload)
            assert isinstance(st, dict)
        except (ValueError, AssertionError):
            raise VerifyFailed(f"{where}: the signed payload is not a JSON statement") from None
        if st.get("_type") != STATEMENT_V1:
            raise VerifyFailed(f"{where}: _type {st.get('_type')!r}, not {STATEMENT_V1}")
        subjects = [f"{a}:{v}" for s in st.get("subject") or [] if isinstance(s, dict)
                    for a, v in (s.get("digest") or {}).items()]
        if digest not in subjects:
            raise VerifyFailed(f"{where}: an attestation for another digest ({', '.join(subjects) or 'no subject'}), "
                               f"not {digest}")
        if st.get("predicateType") != ptype:
            raise VerifyFailed(f"{where}: the statement's predicateType {st.get('predicateType')!r} is not the "
                               "layer's annotation")
        out.append((ptype, st))
    return out


def _mismatch(cell: Mapping[str, Any], checkout: Checkout, images: Mapping[str, Any]) -> str | None:
    name = str(cell.get("cell"))
    if name not in checkout.cells:
        return f"cell {name} is not in this checkout's images.yaml"
    if cell.get("imagesYamlCellSha256") != entry_sha256(checkout.cells[name]):
        return f"cell {name}: images.yaml's entry differs from the one the image was built from"
    if cell.get("lockSha256") != checkout.locks.get(name, ""):
        return (f"cell {name}: locks/{name}/pylock.toml has sha256 {checkout.locks.get(name) or '(none)'}, the "
                f"provenance {cell.get('lockSha256') or '(none)'}")
    platform_digest = str((images.get(name) or {}).get("digest", ""))
    labels = checkout.labels(platform_digest) if platform_digest else None
    if labels is None:
        return f"cell {name}: cannot read the image config of {platform_digest or '(no digest)'} to check its snapshot"
    if labels.get(contract.LABEL_OS_SNAPSHOT, "") != cell.get("osSnapshot"):
        return (f"cell {name}: the provenance names Debian snapshot {cell.get('osSnapshot')!r}, the image records "
                f"{labels.get(contract.LABEL_OS_SNAPSHOT)!r}")
    if labels.get(contract.LABEL_CELL) != name:
        return f"cell {name}: the image at {platform_digest} is of cell {labels.get(contract.LABEL_CELL)!r}"
    return None


def verify(store: Store, pub: ec.EllipticCurvePublicKey, digest: str, checkout: Checkout) -> Verified:
    done = Verified(digest)
    done.checks.append(check_signature(store, pub, digest))
    statements = open_attestations(store, pub, digest)
    done.predicate_types = [t for t, _ in statements]
    done.checks.append(f"{tag_for(digest, 'att')}: {len(statements)} statement(s) signed by this key, subject "
                       f"{digest}: {', '.join(done.predicate_types)}")
    for need in (SLSA_PROVENANCE_V1, GATES_V1):
        if need not in done.predicate_types:
            raise VerifyFailed(f"attestation: no {need} statement for {digest}")
    prov = next(st for t, st in statements if t == SLSA_PROVENANCE_V1)
    try:
        cells = prov["predicate"]["buildDefinition"]["externalParameters"]["cells"]
        images = prov["predicate"]["buildDefinition"]["internalParameters"]["images"]
        assert isinstance(cells, list) and cells and isinstance(images, dict)
    except (KeyError, TypeError, AssertionError):
        raise VerifyFailed("provenance: no cells in its external parameters") from None
    for cell in cells:
        why = _mismatch(cell if isinstance(cell, dict) else {}, checkout, images)
        if why:
            raise VerifyFailed(f"provenance: {why}")
        done.cells.append(str(cell["cell"]))
    done.checks.append(f"provenance matches this checkout: cell(s) {', '.join(done.cells)} (images.yaml entry, lock "
                       "sha256) and the Debian snapshot the image records")
    done.reproducible = {c: d for c, d in reproducible_digests(prov["predicate"]).items() if c in done.cells}
    for cell, d in sorted(done.reproducible.items()):
        done.checks.append(f"provenance signs {d} as the reproducible digest of {cell} (what a cold rebuild gives)")
    return done
