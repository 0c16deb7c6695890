"""Sign one manifest digest: its statements into ``sha256-<hex>.att``, its simple-signing payload into ``.sig``.

A rerun that changes nothing signs nothing: when the tag already holds exactly these statements (the
same payload bytes, in any order), each signed by this key, it is left alone ("unchanged"); ECDSA
signatures are randomised, so signing again would make a new ``.att`` digest for the same facts.
Anything else (another key, a statement that changed, a layer that no longer verifies) is replaced
whole: the tag then holds only this run's statements, never a stale one beside them.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec

from builder.attest import dsse
from builder.attest.cosign_store import (
    DSSE_MEDIA_TYPE,
    SIGNATURE_ANNOTATION,
    SIMPLE_SIGNING,
    Layer,
    Store,
    Tampered,
    attestation_layer,
    read,
    sign_blob,
    signature_layer,
    simple_signing_payload,
    tag_for,
    write,
)
from builder.attest.keys import ALGORITHM

SIGNED, UNCHANGED = "signed", "unchanged"


@dataclass
class Signed:
    """What was signed for one digest (the report's entry; no key material)."""

    digest: str
    cells: list[str]
    attestations: str  # the .att tag
    signature: str  # the .sig tag
    predicate_types: list[str] = field(default_factory=list)
    att_status: str = ""  # signed | unchanged
    sig_status: str = ""
    att_digest: str = ""  # the .att manifest's digest when this run wrote it
    seconds: float = 0.0


def _held_statements(layers: Sequence[Layer] | None, pub: ec.EllipticCurvePublicKey) -> list[bytes] | None:
    """The payloads of an existing .att, when every layer is a DSSE envelope this key signed; else None."""
    if not layers:
        return None
    out = []
    for x in layers:
        if x.media_type != DSSE_MEDIA_TYPE:
            return None
        try:
            out.append(dsse.open_envelope(x.data, pub).payload)
        except dsse.EnvelopeError:
            return None
    return sorted(out)


def _sig_holds(layers: Sequence[Layer] | None, payload: bytes, pub: ec.EllipticCurvePublicKey) -> bool:
    for x in layers or ():
        if x.media_type != SIMPLE_SIGNING or x.data != payload:
            continue
        try:
            pub.verify(base64.b64decode(x.annotations.get(SIGNATURE_ANNOTATION, ""), validate=True), payload, ALGORITHM)
            return True
        except (binascii.Error, ValueError, InvalidSignature):
            continue
    return False


def _read_or_none(store: Store, tag: str) -> list[Layer] | None:
    try:
        return read(store, tag)
    except Tampered:
        return None  # replaced below


def sign_digest(store: Store, key: ec.EllipticCurvePrivateKey, docker_reference: str, digest: str,
                statements: Sequence[tuple[str, bytes]], cells: Sequence[str]) -> Signed:
    """Attach ``statements`` (predicateType, Statement bytes) and a cosign signature to ``digest``."""
    start = time.monotonic()
    pub = key.public_key()
    done = Signed(digest, list(cells), tag_for(digest, "att"), tag_for(digest, "sig"),
                  [t for t, _ in statements])
    if _held_statements(_read_or_none(store, done.attestations), pub) == sorted(s for _, s in statements):
        done.att_status = UNCHANGED
    else:
        layers = [attestation_layer(dsse.sign(key, body), ptype) for ptype, body in statements]
        done.att_digest = write(store, done.attestations, layers)
        done.att_status = SIGNED
    payload = simple_signing_payload(docker_reference, digest)
    if _sig_holds(_read_or_none(store, done.signature), payload, pub):
        done.sig_status = UNCHANGED
    else:
        write(store, done.signature, [signature_layer(payload, sign_blob(key, payload))])
        done.sig_status = SIGNED
    done.seconds = round(time.monotonic() - start, 3)
    return done
