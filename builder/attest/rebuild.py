"""``build.py verify --rebuild``: the PUBLISHED image against a fresh reproducible build of its cell, file by file,
and the rebuild's digest against the reproducible digest the provenance signs, where it signs one.

The published image is compared file by file, not by digest. The image ``build.py build`` loads into the
engine (and ``publish`` pushes) can never have the digest of a reproducible export: BuildKit refuses
``rewrite-timestamp=true`` together with loading into the engine (Docker 28.5.2 + buildx 0.29.1: ``exporter
option "rewrite-timestamp" conflicts with "unpack"``), so the published layers carry the build's own file
times, and every layer digest differs from the rebuild's.

So each layer of the published image, streamed from the registry (checked against its digest as it is read,
never held in memory), is read beside the same layer of the rebuild's OCI layout, and every file must agree
in path, type, mode, owner (uid/gid), size, content sha256 and link target; modification times are not
compared. The image config's Entrypoint, Cmd, Env, User and WorkingDir must be equal too (labels, history and
``created`` are not compared: publish and build write dates there).

The digest is compared where ``build.py repro`` proved one: publish signs the reproducible OCI manifest digest
that repro's builds gave for the same inputs as the pushed image (a provenance byproduct), and the rebuild,
made the same way, must give that digest byte for byte.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

import zstandard

from builder.common.digests import HashingReader, digest_of
from builder.common.errors import StepFailed
from builder.imaging.repro import Entry, OciImage, compare_entries, layer_entries, plain_stream

#: What of each file is compared (everything a tar header and the content say, but the time).
COMPARED = "path, type, mode, uid/gid, size, content sha256 and link target"
IGNORED = frozenset({"mtime"})
CONFIG_FIELDS = ("Entrypoint", "Cmd", "Env", "User", "WorkingDir")
NAMES = ("the published image", "the rebuild")
CHUNK = 1 << 20


class RebuildFailed(StepFailed):
    """The published image cannot be read for the comparison (exit 1 with the reason)."""


class BlobSource(Protocol):
    """The registry reads the comparison needs, for one repository."""

    def get_manifest(self, reference: str) -> bytes | None: ...
    def get_blob(self, digest: str) -> bytes: ...  # a small blob read whole (the config)
    def open_blob(self, digest: str) -> AbstractContextManager[IO[bytes]]: ...  # a layer, streamed


def _drain(f: IO[bytes]) -> None:
    while f.read(CHUNK):
        pass


def published_entries(store: BlobSource, digest: str, where: str) -> dict[str, Entry]:
    """path -> entry of a layer blob streamed from the registry; RebuildFailed when its bytes are not ``digest``."""
    try:
        with store.open_blob(digest) as raw:
            hashing = HashingReader(raw, CHUNK)
            plain = plain_stream(hashing)  # type: ignore[arg-type]  # a RawIOBase is a binary stream
            entries = layer_entries(plain)
            _drain(plain)  # to the end, so that the digest covers every byte
            _drain(hashing)  # type: ignore[arg-type]
    except (OSError, EOFError, ValueError, tarfile.TarError, zstandard.ZstdError) as exc:
        raise RebuildFailed(f"{where}: {digest} could not be read as a layer: {exc}") from None
    got = hashing.digest()
    if got != digest:
        raise RebuildFailed(f"{where}: the registry served {hashing.size} bytes with sha256 {got}, not the "
                            f"manifest's {digest}")
    return entries


def local_entries(image: OciImage, digest: str) -> dict[str, Entry]:
    with image.blob(digest).open("rb") as raw:
        return layer_entries(plain_stream(raw))


@dataclass
class Comparison:
    """What ``compare`` found: the counts read, and one line per difference (none: the same)."""

    digest: str
    layers: int = 0
    files: int = 0
    differs: list[str] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return not self.differs


def _json(data: bytes, what: str) -> dict[str, Any]:
    try:
        got = json.loads(data)
        assert isinstance(got, dict)
        return got
    except (ValueError, AssertionError):
        raise RebuildFailed(f"{what} is not a JSON object") from None


def published_image(store: BlobSource, digest: str) -> tuple[list[str], dict[str, Any]]:
    """(layer digests, the config's ``config`` object) of one platform image in the registry."""
    body = store.get_manifest(digest)
    if body is None:
        raise RebuildFailed(f"{digest}: the registry has no such manifest")
    if digest_of(body) != digest:
        raise RebuildFailed(f"{digest}: the registry served a manifest with sha256 {digest_of(body)}")
    manifest = _json(body, f"the manifest {digest}")
    try:
        layers = [str(x["digest"]) for x in manifest["layers"]]
        config_digest = str(manifest["config"]["digest"])
    except (KeyError, TypeError):
        raise RebuildFailed(f"{digest}: not an image manifest with a config and layers (an index? name the "
                            "platform's digest)") from None
    blob = store.get_blob(config_digest)
    if digest_of(blob) != config_digest:
        raise RebuildFailed(f"{digest}: its config's bytes are not {config_digest}")
    return layers, _json(blob, f"the config {config_digest}").get("config") or {}


def compare_config(published: dict[str, Any], rebuilt: dict[str, Any]) -> list[str]:
    return [f"config {k}: published {published.get(k)!r}, rebuilt {rebuilt.get(k)!r}"
            for k in CONFIG_FIELDS if published.get(k) != rebuilt.get(k)]


def compare(store: BlobSource, digest: str, rebuilt: OciImage) -> Comparison:
    """The published image ``digest`` against the rebuild's OCI layout, layer by layer and file by file."""
    layers, config = published_image(store, digest)
    local_config = _json(rebuilt.blob(rebuilt.config_digest).read_bytes(), "the rebuild's config").get("config") or {}
    out = Comparison(digest, layers=max(len(layers), len(rebuilt.layers)))
    out.differs += compare_config(config, local_config)
    if len(layers) != len(rebuilt.layers):
        out.differs.append(f"the published image has {len(layers)} layers, the rebuild {len(rebuilt.layers)}")
    for n in range(out.layers):
        where = f"layer {n + 1}"
        theirs = published_entries(store, layers[n], where) if n < len(layers) else {}
        ours = local_entries(rebuilt, rebuilt.layers[n]) if n < len(rebuilt.layers) else {}
        out.files += len(theirs.keys() | ours.keys())
        diff = list(compare_entries(theirs, ours, NAMES, IGNORED))
        if diff:
            out.differs.append(f"{where}: {len(diff)} path(s) differ")
            out.differs += [f"  {d}" for d in diff]
    return out


def summary(c: Comparison, shown: Sequence[str]) -> str:
    """The verdict's text: what was compared, what was not, and the differences ``shown``."""
    head = (f"{c.digest}: the rebuild {'matches' if c.same else 'differs from'} the published image: {c.layers} "
            f"layer(s), {c.files} path(s) compared by {COMPARED}, and the config's {', '.join(CONFIG_FIELDS)}; "
            "file times are not compared (an image loaded into the engine keeps its build's times: BuildKit "
            "refuses rewrite-timestamp with a load), so neither are the published image's digests")
    return "\n".join([head, *shown])


def digest_verdict(rebuilt: str, signed: str | None, required: bool = False) -> tuple[bool, str]:
    """(the same?, the line) for the rebuild's manifest digest against the reproducible digest the provenance
    signed (``build.py repro``'s, for the same inputs); no digest signed is no verdict, said so, unless one is
    ``required`` (``--require-reproducible``)."""
    if signed is None:
        return not required, (f"the rebuild's manifest digest is {rebuilt}; the provenance signs no reproducible "
                              "digest to compare it with (publish signs one where `build.py repro` proved it for the "
                              "image's inputs: docs/supply-chain.md), so "
                              + ("--require-reproducible refuses it" if required else "only the files are compared"))
    if rebuilt == signed:
        return True, (f"the rebuild's manifest digest {rebuilt} is the reproducible digest the provenance signs: "
                      "bit-identical")
    return False, (f"the rebuild's manifest digest {rebuilt} is not the reproducible digest the provenance signs "
                   f"({signed}): this checkout, base image, Debian snapshot or BuildKit does not build what the "
                   "signer's `build.py repro` built")
