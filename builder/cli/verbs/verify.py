"""`build.py verify REF --key PUB`: check a published image's cosign signature and signed attestations."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from builder.attest import keys, statements
from builder.attest.cosign_store import StoreError, digest_of
from builder.attest.verify import Checkout, verify
from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.errors import InputError, StepFailed
from builder.publish.address import Registry, parse_registry
from builder.publish.client import RegistryClient
from builder.publish.credentials import load_credentials
from builder.publish.signing import ClientStore, lock_sha256

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def parse_ref(text: str) -> tuple[Registry, str, str]:
    """``HOST[:PORT]/PATH/NAME(:TAG|@sha256:HEX)`` -> (registry with PATH as namespace, NAME, tag or digest)."""
    ref = text.strip()
    name_part, at, digest = ref.partition("@")
    if at and not DIGEST.fullmatch(digest):
        raise InputError(f"verify: {text!r}: {digest!r} is not sha256: and 64 lowercase hex digits")
    head, slash, last = name_part.rpartition("/")
    if not slash:
        raise InputError(f"verify: {text!r}: give HOST[:PORT]/[NAMESPACE/]NAME:TAG or ...@sha256:DIGEST")
    name, colon, tag = last.partition(":")
    if not at and not colon:
        raise InputError(f"verify: {text!r}: name a tag (NAME:TAG) or a digest (NAME@sha256:...)")
    registry = parse_registry(head)
    return registry, name, digest if at else tag


def labels_reader(store: ClientStore) -> Callable[[str], Mapping[str, str] | None]:
    def labels(digest: str) -> Mapping[str, str] | None:
        try:
            body = store.get_manifest(digest)
            if body is None:
                return None
            config_digest = str(json.loads(body)["config"]["digest"])
            blob = store.get_blob(config_digest)
            if digest_of(blob) != config_digest:
                return None
            found = json.loads(blob).get("config", {}).get("Labels") or {}
            return {str(k): str(v) for k, v in found.items()}
        except (StoreError, ValueError, KeyError, TypeError, AttributeError):
            return None

    return labels


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ref", metavar="REF", type=types.text,
                   help="the published image: HOST[:PORT]/[NAMESPACE/]NAME:TAG or NAME@sha256:DIGEST")
    p.add_argument("--key", required=True, metavar="PUB", type=types.text,
                   help="the signer's public key (PEM, as `build.py keygen` writes PATH.pub; cosign.pub works too)")


def run(ctx: Context) -> int:
    pub = keys.load_public(Path(ctx.args.key))
    registry, name, reference = parse_ref(ctx.args.ref)
    client = RegistryClient(registry, name, load_credentials(registry, os.environ))
    remote = client.manifest(reference)
    if remote.fault is not None:
        raise StepFailed(f"verify: {ctx.args.ref}: {remote.fault}")
    if remote.digest is None:
        raise StepFailed(f"verify: {ctx.args.ref}: the registry has no such image")
    store = ClientStore(client)
    root = ctx.docker_dir.parent
    checkout = Checkout({c.name: statements.cell_entry(c) for c in ctx.matrix.cells},
                        {c.name: lock_sha256(root, c.name) for c in ctx.matrix.cells}, labels_reader(store))
    digests = [remote.digest] + [d for _, d in remote.children]  # an index: it and each platform's image
    for digest in digests:
        done = verify(store, pub, digest, checkout)
        print(f"{digest} ({', '.join(done.cells)}): verified")
        for line in done.checks:
            print(f"  - {line}")
    print(f"{ctx.args.ref}: OK, {len(digests)} digest(s) signed by {keys.key_id(pub)}")
    return 0


VERB = Verb("verify", "check a published image's signature and its signed provenance, SBOM and gate attestations",
            "verify REF --key PUB", run, add_arguments,
            "Check the cosign signature (sha256-<hex>.sig) and the DSSE-signed in-toto attestations "
            "(sha256-<hex>.att) of the digest REF resolves to (and each platform of an index): signed by --key, "
            "about this digest, and made from this checkout's images.yaml cell and lock and the image's own "
            "Debian snapshot. Exit 1 with the reason otherwise.")
