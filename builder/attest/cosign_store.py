"""Attestations and signatures stored as cosign stores them, in the image's own repository.

- ``sha256-<hex>.att``: an OCI image manifest whose layers are DSSE envelopes (media type
  ``application/vnd.dsse.envelope.v1+json``), each annotated ``dev.cosignproject.cosign/signature: ""``
  (the signature is inside the envelope) and ``predicateType: <uri>``; what ``cosign attest --key`` writes.
- ``sha256-<hex>.sig``: an OCI image manifest with one layer, the simple-signing payload
  (``application/vnd.dev.cosign.simplesigning.v1+json``) naming the repository and the manifest digest, its
  ECDSA signature (DER, base64) in the ``dev.cosignproject.cosign/signature`` annotation; what
  ``cosign sign --key`` writes.
- the config of both is go-containerregistry's empty image config with one diff_id per layer (the layer's
  own digest: the layers are not compressed), media type ``application/vnd.oci.image.config.v1+json``.

This is the tag scheme, not the OCI referrers API (Debian 12's docker-registry 2.8 has none). The registry
is reached through :class:`Store`, which builder/publish/signing.py implements over its HTTP client.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric import ec

from builder.attest.keys import ALGORITHM
from builder.common.digests import digest_of
from builder.common.errors import StepFailed

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DSSE_MEDIA_TYPE = "application/vnd.dsse.envelope.v1+json"
SIMPLE_SIGNING = "application/vnd.dev.cosign.simplesigning.v1+json"
SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
PREDICATE_ANNOTATION = "predicateType"
SIMPLE_SIGNING_TYPE = "cosign container image signature"
ZERO_TIME = "0001-01-01T00:00:00Z"  # Go's zero time.Time, as cosign's empty config has it


class StoreError(StepFailed):
    """The registry could not be read or written (exit 1)."""


class Store(Protocol):
    """The registry operations this stage needs, for one repository."""

    def get_manifest(self, reference: str) -> bytes | None: ...  # None: absent; StoreError on a fault
    def get_blob(self, digest: str) -> bytes: ...
    def put_blob(self, data: bytes, digest: str) -> None: ...  # a no-op when the registry holds it
    def put_manifest(self, reference: str, media_type: str, body: bytes) -> str: ...  # the digest


def tag_for(digest: str, suffix: str) -> str:
    """``sha256:ab…`` + ``att`` -> ``sha256-ab….att`` (cosign's tag for what is attached to a digest)."""
    algo, _, hexdigest = digest.partition(":")
    return f"{algo}-{hexdigest}.{suffix}"


def simple_signing_payload(docker_reference: str, digest: str) -> bytes:
    """The payload ``cosign sign`` signs, byte for byte as Go marshals it (field order, no spaces)."""
    return (b'{"critical":{"identity":{"docker-reference":' + json.dumps(docker_reference).encode()
            + b'},"image":{"docker-manifest-digest":' + json.dumps(digest).encode()
            + b'},"type":"' + SIMPLE_SIGNING_TYPE.encode() + b'"},"optional":null}')


def sign_blob(key: ec.EllipticCurvePrivateKey, payload: bytes) -> str:
    return base64.b64encode(key.sign(payload, ALGORITHM)).decode()


@dataclass(frozen=True)
class Layer:
    media_type: str
    data: bytes
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return digest_of(self.data)


def config_for(layers: Sequence[Layer]) -> bytes:
    config = {"architecture": "", "created": ZERO_TIME, "history": [{"created": ZERO_TIME} for _ in layers],
              "os": "", "rootfs": {"type": "layers", "diff_ids": [x.digest for x in layers]}, "config": {}}
    return json.dumps(config, separators=(",", ":")).encode()


def manifest_for(layers: Sequence[Layer]) -> tuple[bytes, bytes]:
    """(config blob, manifest body) of a cosign signature/attestation image holding ``layers``."""
    config = config_for(layers)
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_CONFIG, "size": len(config), "digest": digest_of(config)},
                "layers": [{"mediaType": x.media_type, "size": len(x.data), "digest": x.digest,
                            "annotations": dict(x.annotations)} for x in layers]}
    return config, json.dumps(manifest, separators=(",", ":")).encode()


def attestation_layer(envelope: bytes, predicate_type: str) -> Layer:
    return Layer(DSSE_MEDIA_TYPE, envelope, {SIGNATURE_ANNOTATION: "", PREDICATE_ANNOTATION: predicate_type})


def signature_layer(payload: bytes, b64sig: str) -> Layer:
    return Layer(SIMPLE_SIGNING, payload, {SIGNATURE_ANNOTATION: b64sig})


def write(store: Store, tag: str, layers: Sequence[Layer]) -> str:
    """Upload the layers and the config, then PUT the manifest under ``tag``; its digest."""
    config, body = manifest_for(layers)
    for blob in [x.data for x in layers] + [config]:
        store.put_blob(blob, digest_of(blob))
    return store.put_manifest(tag, OCI_MANIFEST, body)


class Tampered(Exception):
    """What the registry serves under a cosign tag is not what its manifest names: the reason."""


def read(store: Store, tag: str) -> list[Layer] | None:
    """The layers under ``tag`` (None: no such tag), each blob checked against its digest."""
    body = store.get_manifest(tag)
    if body is None:
        return None
    try:
        manifest = json.loads(body)
        entries = manifest["layers"]
        assert isinstance(entries, list)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise Tampered(f"{tag}: not an image manifest with layers") from None
    layers = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("digest"), str):
            raise Tampered(f"{tag}: layer {i} has no digest")
        data = store.get_blob(e["digest"])
        if digest_of(data) != e["digest"]:
            raise Tampered(f"{tag}: layer {i}'s bytes do not match its digest {e['digest']}")
        annotations = e.get("annotations") or {}
        layers.append(Layer(str(e.get("mediaType", "")), data,
                            {str(k): str(v) for k, v in annotations.items()} if isinstance(annotations, dict) else {}))
    return layers
