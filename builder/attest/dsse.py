"""DSSE envelopes (https://github.com/secure-systems-lab/dsse): the pre-authentication encoding, signing, opening.

The signature is ECDSA P-256 over SHA-256 of ``PAE(payloadType, payload)``, DER-encoded, base64 in the
envelope; ``keyid`` is empty, as cosign writes it for a key-based signature. The envelope is serialised
as Go's encoding/json writes cosign's (field order payloadType, payload, signatures; no spaces).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec

from builder.attest.keys import ALGORITHM

IN_TOTO = "application/vnd.in-toto+json"


class EnvelopeError(Exception):
    """An envelope that does not open: the reason, one line."""


def pae(payload_type: str, payload: bytes) -> bytes:
    """``DSSEv1 SP LEN(type) SP type SP LEN(body) SP body`` (lengths in ASCII decimal, bytes)."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def sign(key: ec.EllipticCurvePrivateKey, payload: bytes, payload_type: str = IN_TOTO) -> bytes:
    sig = key.sign(pae(payload_type, payload), ALGORITHM)
    envelope = {"payloadType": payload_type, "payload": base64.b64encode(payload).decode(),
                "signatures": [{"keyid": "", "sig": base64.b64encode(sig).decode()}]}
    return json.dumps(envelope, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Opened:
    payload_type: str
    payload: bytes


def open_envelope(data: bytes, pub: ec.EllipticCurvePublicKey, payload_type: str = IN_TOTO) -> Opened:
    """The payload of an envelope one of whose signatures ``pub`` made; else EnvelopeError."""
    try:
        env = json.loads(data)
    except ValueError:
        raise EnvelopeError("the envelope is not JSON") from None
    if not isinstance(env, dict) or not isinstance(env.get("signatures"), list):
        raise EnvelopeError("not a DSSE envelope (no signatures list)")
    if env.get("payloadType") != payload_type:
        raise EnvelopeError(f"payloadType {env.get('payloadType')!r}, not {payload_type}")
    try:
        payload = base64.b64decode(str(env.get("payload", "")), validate=True)
    except (binascii.Error, ValueError):
        raise EnvelopeError("the payload is not base64") from None
    if not env["signatures"]:
        raise EnvelopeError("the envelope is unsigned (no signatures)")
    message = pae(payload_type, payload)
    for s in env["signatures"]:
        try:
            sig = base64.b64decode(str(s.get("sig", "")) if isinstance(s, dict) else "", validate=True)
            pub.verify(sig, message, ALGORITHM)
            return Opened(payload_type, payload)
        except (binascii.Error, ValueError, InvalidSignature):
            continue
    raise EnvelopeError(f"no signature in the envelope verifies with this key ({len(env['signatures'])} tried)")
