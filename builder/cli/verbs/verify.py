"""`build.py verify REF --key PUB`: check a published image's cosign signature and signed attestations."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import ptmg_contract as contract
from builder.attest import keys, rebuild, statements
from builder.attest.cosign_store import StoreError
from builder.attest.verify import Checkout, verify
from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.digests import digest_of
from builder.common.errors import InputError, StepFailed
from builder.common.log import BuildProgress, log
from builder.engine import find_buildkit_cli
from builder.imaging import buildenv, repro
from builder.imaging.orchestrate import BuildConfig, export_reproducible, failure_text
from builder.matrix import ImageSpec
from builder.publish.address import Registry, parse_registry
from builder.publish.client import RegistryClient
from builder.publish.credentials import load_credentials
from builder.publish.signing import ClientStore, lock_sha256

DIGEST = repro.DIGEST


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
    p.add_argument("--rebuild", action="store_true",
                   help="then build the provenance's cell once from scratch: its digest must be the reproducible "
                        "digest the provenance signs (where `build.py repro` proved one), and the published image "
                        "must match it file by file (docs/supply-chain.md); needs the containerd image store")
    p.add_argument("--require-reproducible", action="store_true",
                   help="with --rebuild: exit 1 for an image whose provenance signs no reproducible digest (an "
                        "older attestation, or a publish without `build.py repro`'s report), instead of comparing "
                        "its files only")
    p.add_argument("--log-dir", default=os.environ.get("PTMG_LOG_DIR", "build-logs"), type=types.text,
                   help="where --rebuild's build log goes (default build-logs/)")


#: Builds a cell from scratch into an OCI layout folder; the Debian snapshot key it built with. The engine's
#: (engine_rebuilder) in use; the one seam the unit tests replace.
Rebuilder = Callable[[ImageSpec, Path], str]


def engine_rebuilder(ctx: Context) -> Rebuilder:
    """`build.py repro --against`'s one uncached build (export_reproducible); exit 2 in one line where the
    engine cannot make one (the classic image store, no buildx, an old BuildKit)."""
    engine = ctx.engine()
    missing = repro.cannot(find_buildkit_cli(), engine.store(), str(engine.version().get("ApiVersion") or ""))
    if missing is not None:
        raise InputError(f"verify --rebuild: {missing}")
    cfg = BuildConfig(root=ctx.root, docker_dir=ctx.docker_dir, log_dir=Path(ctx.args.log_dir),
                      build_env=buildenv.detect(os.environ, []), source=ctx.source, lock_root=ctx.docker_dir.parent)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)

    def build(spec: ImageSpec, dest: Path) -> str:
        log_path = cfg.log_dir / f"{spec.name}.verify-rebuild.log"
        log.info("%s: one build from scratch into %s (full log: %s)", spec.name, dest, log_path)
        with BuildProgress([spec.name]) as progress:
            done = export_reproducible(engine, spec, cfg, dest, log_path, progress.line)
        if not done.outcome.ok:
            raise StepFailed(f"{spec.name}: the rebuild failed\n" +
                             failure_text(done.outcome.failed_step, done.outcome.tail, log_path))
        return done.snapshot.key

    return build


@dataclass(frozen=True)
class Target:
    """One platform image to rebuild: its digest, its cell, the Debian snapshot it records, and the reproducible
    digest its provenance signs (None: none signed)."""

    digest: str
    spec: ImageSpec
    snapshot: str
    reproducible: str | None = None


def check_rebuilds(store: ClientStore, targets: Sequence[Target], build: Rebuilder, workdir: Path,
                   require_reproducible: bool = False) -> int:
    """Rebuild each target's cell into ``workdir``: its manifest digest must be the signed reproducible digest
    (where one is signed), and the published image must match it file by file (builder/attest/rebuild.py).
    0: every one matches."""
    status = 0
    for t in targets:
        dest = workdir / t.spec.name
        rebuilt_snapshot = build(t.spec, dest)
        try:
            image = repro.read_layout(dest)
        except repro.LayoutError as exc:
            raise StepFailed(f"verify --rebuild: {t.spec.name}: {exc}") from None
        same_digest, digest_line = rebuild.digest_verdict(image.manifest_digest, t.reproducible, require_reproducible)
        got = rebuild.compare(store, t.digest, image)
        shutil.rmtree(dest)  # gigabytes; the next platform's rebuild needs the room
        moved = rebuilt_snapshot != t.snapshot
        if not got.same and moved:
            got.differs.insert(0, f"the Debian archive moved since {t.digest} was built (snapshot {t.snapshot}, the "
                                  f"rebuild's {rebuilt_snapshot}): its packages can differ; a rebuild matches only "
                                  "while the archive holds the published snapshot")
        text = rebuild.summary(got, repro.shown(got.differs))
        if got.same:
            print(f"{t.spec.name}: {text}")
        else:
            log.error("%s: %s", t.spec.name, text)
            status = 1
        if same_digest:
            print(f"{t.spec.name}: {digest_line}")
        else:
            log.error("%s: %s%s", t.spec.name, digest_line, f" (the Debian snapshot moved: {t.snapshot} then "
                      f"{rebuilt_snapshot})" if moved else "")
            status = 1
    return status


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
    verified = {}
    for digest in digests:
        done = verified[digest] = verify(store, pub, digest, checkout)
        print(f"{digest} ({', '.join(done.cells)}): verified")
        for line in done.checks:
            print(f"  - {line}")
    print(f"{ctx.args.ref}: OK, {len(digests)} digest(s) signed by {keys.key_id(pub)}")
    if not ctx.args.rebuild:
        return 0
    specs = {c.name: c for c in ctx.matrix.cells}
    reader = labels_reader(store)
    targets = [Target(d, specs[cell], str((reader(d) or {}).get(contract.LABEL_OS_SNAPSHOT, "")),
                      verified[d].reproducible.get(cell) or verified[remote.digest].reproducible.get(cell))
               for d in [d for _, d in remote.children] or [remote.digest] for cell in verified[d].cells]
    build = engine_rebuilder(ctx)
    work = ctx.root / ".build"
    work.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="verify-rebuild-", dir=work) as tmp:
        return check_rebuilds(store, targets, build, Path(tmp), ctx.args.require_reproducible)


VERB = Verb("verify", "check a published image's signature and its signed provenance, SBOM and gate attestations",
            "verify REF --key PUB [--rebuild]", run, add_arguments,
            "Check the cosign signature (sha256-<hex>.sig) and the DSSE-signed in-toto attestations "
            "(sha256-<hex>.att) of the digest REF resolves to (and each platform of an index): signed by --key, "
            "about this digest, and made from this checkout's images.yaml cell and lock and the image's own "
            "Debian snapshot. Exit 1 with the reason otherwise. --rebuild then builds each platform's cell once "
            "from scratch (as `repro --against`): its manifest digest must be the reproducible digest the provenance "
            "signs, where publish signed one (`build.py repro` proved it for the same inputs), and it is compared "
            "with the published image layer by layer: every file's path, type, mode, uid/gid, size, content and "
            "link target, and the config's Entrypoint, Cmd, Env, User and WorkingDir; the published image's file "
            "times and digests are not compared (an image loaded into the engine keeps its build's file times). "
            "Exit 1 naming the digests or the files that differ.")
