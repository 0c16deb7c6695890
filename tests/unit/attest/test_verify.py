"""Signed provenance (builder/attest) against a REAL registry: Debian's docker-registry on 127.0.0.1, started
here (tests/docker/registry.py; no Docker engine). What is signed is read back over HTTP and checked twice: by
builder/attest/verify.py and by a second verifier written below over `cryptography` alone (its own PAE, its
own manifest reading), sharing no code with the signer.

Each refusal is a real change in the registry: a payload byte, a signature, the wrong key, an attestation
replayed onto another digest, an unsigned envelope, a missing .att, a changed blob in the registry's storage.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import requests
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

import ptmg_contract as contract
from builder.attest import cosign_store, keys, statements
from builder.attest.signer import SIGNED, UNCHANGED, sign_digest
from builder.attest.verify import Checkout, VerifyFailed, verify
from builder.common.digests import digest_of
from builder.common.errors import InputError
from builder.publish.address import parse_registry
from builder.publish.client import RegistryClient
from builder.publish.signing import ClientStore
from tests.docker.registry import LocalRegistry

CELL = "2.7.0-cuda12.6-cudnn9-runtime"
ENTRY = {"name": CELL, "torch": "2.7.0", "cuda": "12.6", "platform": "linux/amd64"}
LOCK = "ab" * 32
SNAPSHOT = "sha256:" + "cd" * 32


@pytest.fixture
def repo(registry: LocalRegistry, request: pytest.FixtureRequest) -> tuple[LocalRegistry, ClientStore, str]:
    """A repository of its own per test: (registry, store, docker reference)."""
    name = "pt-" + hashlib.sha256(request.node.name.encode()).hexdigest()[:12]
    client = RegistryClient(parse_registry(f"{registry.host}/ns"), name, None)
    return registry, ClientStore(client), f"{registry.host}/ns/{name}"


@pytest.fixture(scope="module")
def keypair(tmp_path_factory: pytest.TempPathFactory) -> tuple[ec.EllipticCurvePrivateKey, Path]:
    priv, pub = keys.keygen(tmp_path_factory.mktemp("keys") / "signing")
    return keys.load_private(priv), pub


def push_image(store: ClientStore, tag: str, snapshot: str = SNAPSHOT, cell: str = CELL) -> str:
    """A small image (one layer, a config with the labels verify reads) under ``tag``; its manifest digest."""
    layer = os.urandom(64)
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Labels": {
        contract.LABEL_CELL: cell, contract.LABEL_OS_SNAPSHOT: snapshot}},
        "rootfs": {"type": "layers", "diff_ids": [digest_of(layer)]}}).encode()
    for blob in (layer, config):
        store.put_blob(blob, digest_of(blob))
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                           "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                                      "size": len(config), "digest": digest_of(config)},
                           "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                                       "size": len(layer), "digest": digest_of(layer)}]}).encode()
    return store.put_manifest(tag, "application/vnd.docker.distribution.manifest.v2+json", manifest)


def facts(digest: str, lock: str = LOCK, snapshot: str = SNAPSHOT) -> statements.CellFacts:
    return statements.CellFacts(
        cell=CELL, platform="linux/amd64", digest=digest, image_id="sha256:" + "11" * 32, entry=ENTRY,
        lock_sha256=lock, revision="c9a65d3bb0835365687f8af39d66a6e9ad4fd00c", os_snapshot=snapshot,
        os_suites="bookworm@2026-07-11T10:16:37Z bookworm-security@2026-12-02T23:13:43Z",
        source_date_epoch=1796253223, base="pt-multi-gpu-base:bookworm", base_id="sha256:" + "22" * 32,
        engine={"engine": "Docker Engine 20.10.24", "api": "1.41", "builder": "buildkit"},
        source="https://github.com/pt-multi-gpu/pt-multi-gpu",
        smoke={"status": "passed", "at": "2026-12-05T06:00:00Z", "passed": 40, "skipped": 2, "nodes": 1},
        os_gate={"updated": "2026-12-03T02:15:27Z", "maxPendingDays": 14, "result": "passed"},
        vuln_gate={"status": "ok", "findings": []},
        sbom={"bomFormat": "CycloneDX", "specVersion": "1.5", "components": [{"name": "torch", "version": "2.7.0"}]})


def sign(store: ClientStore, ref: str, key: ec.EllipticCurvePrivateKey, digest: str, **kw: Any) -> Any:
    return sign_digest(store, key, ref, digest, statements.for_digest(ref, digest, [facts(digest, **kw)]), [CELL])


def checkout(store: ClientStore, lock: str = LOCK) -> Checkout:
    from builder.cli.verbs.verify import labels_reader

    return Checkout({CELL: ENTRY}, {CELL: lock}, labels_reader(store))


def att_layers(store: ClientStore, digest: str) -> list[cosign_store.Layer]:
    got = cosign_store.read(store, cosign_store.tag_for(digest, "att"))
    assert got is not None
    return got


def put_att(store: ClientStore, digest: str, layers: list[cosign_store.Layer]) -> None:
    cosign_store.write(store, cosign_store.tag_for(digest, "att"), layers)


def edit_envelope(layer: cosign_store.Layer, change: Any) -> cosign_store.Layer:
    env = json.loads(layer.data)
    change(env)
    return cosign_store.Layer(layer.media_type, json.dumps(env).encode(), layer.annotations)


# --- the second verifier: cryptography alone, nothing from builder/ ---------------------------------------------
def independent_verify(base_url: str, path: str, digest: str, pub_pem: bytes) -> list[str]:
    """Read ``sha256-<hex>.att`` and ``.sig`` over plain HTTP and check them as a consumer would; the predicate
    types. Raises AssertionError on anything wrong."""
    pub = serialization.load_pem_public_key(pub_pem)
    assert isinstance(pub, ec.EllipticCurvePublicKey)
    accept = {"Accept": "application/vnd.oci.image.manifest.v1+json"}
    tag = digest.replace(":", "-")

    def blobs(suffix: str) -> list[tuple[dict[str, Any], bytes]]:
        r = requests.get(f"{base_url}/v2/{path}/manifests/{tag}.{suffix}", headers=accept, timeout=10)
        assert r.status_code == 200, f"{tag}.{suffix}: HTTP {r.status_code}"
        out = []
        for layer in r.json()["layers"]:
            data = requests.get(f"{base_url}/v2/{path}/blobs/{layer['digest']}", timeout=10).content
            assert "sha256:" + hashlib.sha256(data).hexdigest() == layer["digest"]
            out.append((layer, data))
        return out

    types = []
    for layer, data in blobs("att"):
        assert layer["mediaType"] == "application/vnd.dsse.envelope.v1+json"
        assert layer["annotations"]["dev.cosignproject.cosign/signature"] == ""
        env = json.loads(data)
        body = base64.b64decode(env["payload"])
        kind = env["payloadType"].encode()
        message = b"DSSEv1 " + str(len(kind)).encode() + b" " + kind + b" " + str(len(body)).encode() + b" " + body
        pub.verify(base64.b64decode(env["signatures"][0]["sig"]), message, ec.ECDSA(hashes.SHA256()))
        st = json.loads(body)
        assert st["_type"] == "https://in-toto.io/Statement/v1"
        assert st["subject"][0]["digest"]["sha256"] == digest.split(":")[1]
        assert layer["annotations"]["predicateType"] == st["predicateType"]
        types.append(st["predicateType"])
    [(layer, payload)] = blobs("sig")
    assert layer["mediaType"] == "application/vnd.dev.cosign.simplesigning.v1+json"
    pub.verify(base64.b64decode(layer["annotations"]["dev.cosignproject.cosign/signature"]), payload,
               ec.ECDSA(hashes.SHA256()))
    simple = json.loads(payload)
    assert simple == {"critical": {"identity": {"docker-reference": f"{base_url.split('//')[1]}/{path}"},
                                   "image": {"docker-manifest-digest": digest},
                                   "type": "cosign container image signature"}, "optional": None}
    return types


# --- keys -------------------------------------------------------------------------------------------------------
def test_keygen_writes_a_0600_pkcs8_p256_key_and_its_public_key(tmp_path: Path) -> None:
    priv, pub = keys.keygen(tmp_path / "cosign")
    assert (priv.name, pub.name) == ("cosign.key", "cosign.pub")
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    assert priv.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8, unencrypted
    key = keys.load_private(priv)
    assert isinstance(key.curve, ec.SECP256R1)
    assert keys.public_pem(key.public_key()) == pub.read_bytes()
    with pytest.raises(InputError, match="exists; keygen never overwrites"):
        keys.keygen(tmp_path / "cosign")


def test_an_encrypted_cosign_key_is_refused_in_one_line_without_its_bytes(tmp_path: Path) -> None:
    secret = base64.b64encode(os.urandom(96)).decode()
    path = tmp_path / "cosign.key"
    path.write_text(f"-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----\n{secret}\n"
                    "-----END ENCRYPTED SIGSTORE PRIVATE KEY-----\n")
    with pytest.raises(InputError) as err:
        keys.load_private(path)
    assert len(err.value.lines) == 1 and str(path) in str(err.value)
    assert "ENCRYPTED SIGSTORE PRIVATE KEY" in str(err.value) and secret[:16] not in str(err.value)


@pytest.mark.parametrize("make", ["p384", "garbage"])
def test_a_key_that_is_not_p256_pem_is_refused_naming_the_path_only(tmp_path: Path, make: str) -> None:
    path = tmp_path / "k.pem"
    if make == "p384":
        path.write_bytes(ec.generate_private_key(ec.SECP384R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    else:
        path.write_text("-----BEGIN PRIVATE KEY-----\nTOPSECRETBYTES\n-----END PRIVATE KEY-----\n")
    with pytest.raises(InputError) as err:
        keys.load_private(path)
    assert str(path) in str(err.value) and "TOPSECRET" not in str(err.value)
    assert ("secp384r1" in str(err.value)) == (make == "p384")


# --- sign, verify, rerun ----------------------------------------------------------------------------------------
def test_signed_digest_verifies_twice_and_a_rerun_signs_nothing(repo: Any, keypair: Any) -> None:
    registry, store, ref = repo
    key, pub = keypair
    digest = push_image(store, "2.7.0-cuda12.6")
    done = sign(store, ref, key, digest)
    assert (done.att_status, done.sig_status) == (SIGNED, SIGNED)
    assert done.predicate_types == [statements.SLSA_PROVENANCE_V1, statements.CYCLONEDX, statements.GATES_V1]
    assert done.attestations == "sha256-" + digest.split(":")[1] + ".att"
    got = verify(store, keys.load_public(pub), digest, checkout(store))
    assert got.cells == [CELL] and got.predicate_types == done.predicate_types
    path = ref.split("/", 1)[1]
    assert independent_verify(registry.url, path, digest, pub.read_bytes()) == done.predicate_types
    # the image itself is untouched: the tag still names the same manifest
    assert store.client.manifest("2.7.0-cuda12.6").digest == digest
    before = registry.snapshot()
    again = sign(store, ref, key, digest)
    assert (again.att_status, again.sig_status) == (UNCHANGED, UNCHANGED)
    assert registry.snapshot() == before  # not one byte written
    changed = sign(store, ref, key, digest, lock="ef" * 32)  # a fact changed: signed again, whole
    assert (changed.att_status, changed.sig_status) == (SIGNED, UNCHANGED)
    with pytest.raises(VerifyFailed, match="pylock.toml has sha256 " + LOCK):
        verify(store, keys.load_public(pub), digest, checkout(store))


def _flip_payload_byte(env: dict[str, Any]) -> None:
    body = bytearray(base64.b64decode(env["payload"]))
    body[body.index(b"2.7.0")] = ord("3")
    env["payload"] = base64.b64encode(bytes(body)).decode()


def _flip_signature_bit(env: dict[str, Any]) -> None:
    sig = bytearray(base64.b64decode(env["signatures"][0]["sig"]))
    sig[-1] ^= 1
    env["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()


@pytest.mark.parametrize(("flip", "layer", "reason"), [
    (_flip_payload_byte, 0, r"layer 0 \(https://slsa.dev/provenance/v1\): no signature in the envelope verifies"),
    (_flip_signature_bit, 2, r"layer 2 .*gates/v1\): no signature"),
], ids=["payload-byte", "signature"])
def test_a_changed_payload_byte_or_signature_fails(repo: Any, keypair: Any, flip: Any, layer: int,
                                                   reason: str) -> None:
    _, store, ref = repo
    key, pub = keypair
    digest = push_image(store, "a")
    sign(store, ref, key, digest)
    layers = list(att_layers(store, digest))
    layers[layer] = edit_envelope(layers[layer], flip)
    put_att(store, digest, layers)
    with pytest.raises(VerifyFailed, match=reason):
        verify(store, keys.load_public(pub), digest, checkout(store))


def test_the_wrong_key_fails(repo: Any, keypair: Any, tmp_path: Path) -> None:
    _, store, ref = repo
    key, _ = keypair
    digest = push_image(store, "a")
    sign(store, ref, key, digest)
    _, other = keys.keygen(tmp_path / "other")
    with pytest.raises(VerifyFailed, match=r"signature: no signature in sha256-.*\.sig verifies with this key"):
        verify(store, keys.load_public(other), digest, checkout(store))
    # and the attestations alone: the .sig signed by the other key too, the .att still not
    other_key = keys.load_private(tmp_path / "other.key")
    sign_digest(store, other_key, ref, digest, [], [CELL])  # an empty .att, a .sig by the other key
    put_att(store, digest, att_layers_of_first_key(store, ref, key, digest))
    with pytest.raises(VerifyFailed, match=r"layer 0 .*: no signature in the envelope verifies with this key"):
        verify(store, keys.load_public(other), digest, checkout(store))


def att_layers_of_first_key(store: ClientStore, ref: str, key: ec.EllipticCurvePrivateKey,
                            digest: str) -> list[cosign_store.Layer]:
    from builder.attest import dsse

    return [cosign_store.attestation_layer(dsse.sign(key, body), t)
            for t, body in statements.for_digest(ref, digest, [facts(digest)])]


def test_an_attestation_replayed_onto_another_digest_fails(repo: Any, keypair: Any) -> None:
    _, store, ref = repo
    key, pub = keypair
    first, second = push_image(store, "first"), push_image(store, "second")
    sign(store, ref, key, first)
    sign(store, ref, key, second)
    put_att(store, second, att_layers(store, first))  # A's signed statements under B's .att tag
    with pytest.raises(VerifyFailed, match=f"an attestation for another digest \\({first}\\), not {second}"):
        verify(store, keys.load_public(pub), second, checkout(store))
    body = store.get_manifest(cosign_store.tag_for(first, "sig"))
    assert body is not None
    store.put_manifest(cosign_store.tag_for(second, "sig"), cosign_store.OCI_MANIFEST, body)
    with pytest.raises(VerifyFailed, match=f"signed by this key for {first}, not {second}"):
        verify(store, keys.load_public(pub), second, checkout(store))


def test_an_unsigned_att_and_a_missing_att_fail(repo: Any, keypair: Any) -> None:
    _, store, ref = repo
    key, pub = keypair
    digest = push_image(store, "a")
    sign(store, ref, key, digest)
    layers = att_layers(store, digest)
    put_att(store, digest, [edit_envelope(x, lambda env: env.update(signatures=[])) for x in layers])
    with pytest.raises(VerifyFailed, match="the envelope is unsigned"):
        verify(store, keys.load_public(pub), digest, checkout(store))
    bare = push_image(store, "b")
    payload = cosign_store.simple_signing_payload(ref, bare)
    cosign_store.write(store, cosign_store.tag_for(bare, "sig"),
                       [cosign_store.signature_layer(payload, cosign_store.sign_blob(key, payload))])
    with pytest.raises(VerifyFailed, match=f"attestation: missing: the registry has no sha256-{bare[7:]}.att"):
        verify(store, keys.load_public(pub), bare, checkout(store))


def test_a_byte_changed_in_the_registry_storage_fails(repo: Any, keypair: Any) -> None:
    registry, store, ref = repo
    key, pub = keypair
    digest = push_image(store, "a")
    sign(store, ref, key, digest)
    blob = att_layers(store, digest)[1].digest.split(":")[1]
    data = registry.storage / "docker/registry/v2/blobs/sha256" / blob[:2] / blob / "data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(VerifyFailed, match="layer 1's bytes do not match its digest"):
        verify(store, keys.load_public(pub), digest, checkout(store))


def test_provenance_that_does_not_match_the_checkout_or_the_image_fails(repo: Any, keypair: Any) -> None:
    _, store, ref = repo
    key, pub = keypair
    digest = push_image(store, "a")
    sign(store, ref, key, digest, snapshot="sha256:" + "ee" * 32)  # the image records SNAPSHOT
    with pytest.raises(VerifyFailed, match=r"names Debian snapshot 'sha256:eeee.*the image records 'sha256:cdcd"):
        verify(store, keys.load_public(pub), digest, checkout(store))
    sign(store, ref, key, digest)
    moved = Checkout({CELL: {**ENTRY, "torch": "2.7.1"}}, {CELL: LOCK}, checkout(store).labels)
    with pytest.raises(VerifyFailed, match=r"images\.yaml's entry differs"):
        verify(store, keys.load_public(pub), digest, moved)
    with pytest.raises(VerifyFailed, match=r"is not in this checkout's images\.yaml"):
        verify(store, keys.load_public(pub), digest, Checkout({}, {}, checkout(store).labels))


def test_the_simple_signing_payload_is_cosigns_byte_for_byte() -> None:
    digest = "sha256:" + "9a" * 32
    assert cosign_store.simple_signing_payload("127.0.0.1:5000/ns/pt", digest) == (
        b'{"critical":{"identity":{"docker-reference":"127.0.0.1:5000/ns/pt"},"image":{"docker-manifest-digest":"'
        + digest.encode() + b'"},"type":"cosign container image signature"},"optional":null}')


def test_the_reproducible_digest_is_a_provenance_byproduct_that_verify_returns_for_its_cells_only() -> None:
    """Pure: a cell with what repro proved gets one SLSA byproduct naming its reproducible manifest; a cell
    without gets none (and no empty list); reading it back keeps only well-formed entries."""
    digest = "sha256:" + "99" * 32
    proven = {"manifest": "sha256:" + "ab" * 32, "config": "sha256:" + "cd" * 32, "source_date_epoch": 1796253223,
              "os_snapshot": SNAPSHOT, "inputs": "sha256:" + "5e" * 32}
    plain = statements.provenance([facts(digest)])
    assert "byproducts" not in plain["runDetails"] and statements.reproducible_digests(plain) == {}
    prov = statements.provenance([dataclasses.replace(facts(digest), reproducible=proven)])
    [b] = prov["runDetails"]["byproducts"]
    assert b["name"] == f"{statements.REPRODUCIBLE}/{CELL}" and b["digest"] == {"sha256": "ab" * 32}
    assert b["annotations"]["cell"] == CELL and b["annotations"]["inputsHash"] == proven["inputs"]
    assert b["annotations"]["sourceDateEpoch"] == 1796253223 and b["mediaType"] == statements.OCI_MANIFEST
    assert (b["annotations"]["buildx"], b["annotations"]["buildkit"]) == ("", "")  # not in this report
    with_tools = statements.provenance([dataclasses.replace(facts(digest), reproducible={**proven, "buildkit": "v0.25.1"})])
    assert with_tools["runDetails"]["byproducts"][0]["annotations"]["buildkit"] == "v0.25.1"
    assert statements.reproducible_digests(prov) == {CELL: proven["manifest"]}
    odd = {"runDetails": {"byproducts": [
        {"name": f"{statements.REPRODUCIBLE}/{CELL}", "digest": {"sha256": "1", "md5": "2"}, "annotations": {"cell": CELL}},
        {"name": f"{statements.REPRODUCIBLE}/other", "digest": {"sha256": "1"}, "annotations": {"cell": CELL}},
        "text", {"name": "other"}, {"annotations": "x"}]}}
    assert statements.reproducible_digests(odd) == {} and statements.reproducible_digests({"runDetails": 3}) == {}


def test_verify_returns_the_signed_reproducible_digest(repo: Any, keypair: Any) -> None:
    _registry, store, ref = repo
    key, pub = keypair
    digest = push_image(store, "2.7.0-cuda12.6")
    proven = {"manifest": "sha256:" + "ab" * 32, "config": "sha256:" + "cd" * 32, "source_date_epoch": 1,
              "os_snapshot": SNAPSHOT, "inputs": "sha256:" + "5e" * 32}
    cell = dataclasses.replace(facts(digest), reproducible=proven)
    sign_digest(store, key, ref, digest, statements.for_digest(ref, digest, [cell]), [CELL])
    got = verify(store, keys.load_public(pub), digest, checkout(store))
    assert got.reproducible == {CELL: proven["manifest"]}
    assert f"provenance signs {proven['manifest']} as the reproducible digest of {CELL} (what a cold rebuild " \
           "gives)" in got.checks
