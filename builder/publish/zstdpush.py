"""``publish --compression zstd``: push one local image with zstd layers through the registry's HTTP API.

``docker push`` (the gzip default) sends what the engine compresses; this pusher reads `docker save`
of the image once, front to back, and for each layer blob on the way:

1. decompresses it when the engine stored it compressed (gzip or zstd, told by their magic bytes:
   Docker 28's containerd store saves its compressed blobs; the classic store, 20.10's ``<id>/layer.tar``
   and 25+'s OCI layout alike, saves plain tars),
2. hashes the plain tar (its diff_id),
3. compresses it with zstd and streams it to the registry (POST, one streamed PATCH, PUT ``?digest=``):
   no temporary file, memory bounded by a few chunks and zstd's window.

The save's ``manifest.json`` (it comes last) then gives the layers' order. Their diff_ids must be the
config's ``rootfs.diff_ids``, in order, and the config's digest the image being published; otherwise
nothing is tagged. The config goes up byte-exact, so its digest stays the classic store's image ID
(what publish's "unchanged" and verification compare), then an OCI manifest goes under the tag.

A blob the registry already holds is not sent again where its digest can be known before its bytes
are read: a layer this run already uploaded (a retry after a fault, the image's other tags), the config.
A zstd digest is only known after compressing, so a layer new to this run is always compressed and sent.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import posixpath
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol, cast

from builder.common.digests import HashingReader, digest_of
from builder.common.log import human_size, log
from builder.engine import EngineError
from builder.publish.client import OCI_MANIFEST
from builder.publish.faults import Fault, push_fault
from builder.publish.push import PushTracker

ZSTD_LAYER = "application/vnd.oci.image.layer.v1.tar+zstd"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
GZIP_MAGIC, ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"
LEVEL = 3  # zstd's own default, and BuildKit's for zstd layers
CHUNK = 1 << 20
SMALL = 4 << 20  # a save entry up to this size is read whole: the metadata (manifest.json, the config) is


class SaveError(Exception):
    """The saved image is not what is being published (or not readable): never retried."""


@dataclass(frozen=True)
class Blob:
    """One layer as pushed."""

    diff_id: str  # sha256 of the plain tar
    digest: str  # of the zstd blob
    size: int


class SavePort(Protocol):
    def save(self, ref: str) -> Iterator[bytes]: ...


class BlobRegistry(Protocol):
    def blob_exists(self, digest: str) -> bool | Fault: ...
    def upload_blob(self, body: bytes | Iterator[bytes], digest: str | Callable[[], str]) -> str | Fault: ...
    def put_manifest(self, reference: str, media_type: str, body: bytes) -> str | Fault: ...


# --- the save stream (pure) -------------------------------------------------------------
class ChunkStream(io.RawIOBase):
    """A readable file over an iterator of byte chunks (the engine's save stream)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self.chunks = iter(chunks)
        self.buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self.buf:
            try:
                self.buf = memoryview(next(self.chunks))
            except StopIteration:
                return 0
        n = min(len(b), len(self.buf))
        b[:n] = self.buf[:n]
        self.buf = self.buf[n:]
        return n


def sniff(head: bytes) -> str:
    """gzip, zstd or plain, by the magic bytes a blob starts with."""
    return "gzip" if head.startswith(GZIP_MAGIC) else "zstd" if head.startswith(ZSTD_MAGIC) else "plain"


def plain(raw: IO[bytes]) -> IO[bytes]:
    """The plain tar of a layer blob, decompressing a gzip or zstd one on the fly."""
    f = io.BufferedReader(cast(Any, raw), CHUNK)
    kind = sniff(f.peek(4)[:4])
    if kind == "gzip":
        return cast(IO[bytes], gzip.GzipFile(fileobj=f))
    if kind == "zstd":
        import zstandard

        return cast(IO[bytes], zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True))
    return f


def is_layer(data: bytes) -> bool:
    """Whether a small entry read whole is a layer (compressed, or a tar) rather than metadata (JSON, text)."""
    return sniff(data[:4]) != "plain" or data[257:262] == b"ustar"


@dataclass
class Saved:
    """What one pass over a save stream found."""

    layers: dict[str, Blob] = field(default_factory=dict)  # entry -> the layer it was pushed as
    small: dict[str, bytes] = field(default_factory=dict)  # entries read whole that are no layer (yet)
    links: dict[str, str] = field(default_factory=dict)  # entry -> the entry it links to (20.10 links repeats)


def walk(chunks: Iterable[bytes], layer: Callable[[str, IO[bytes]], Blob]) -> Saved:
    """One sequential pass over a `docker save` tar: each layer-looking entry goes to ``layer`` as it
    streams by; small entries are kept whole; links are noted (their targets may come later)."""
    saved = Saved()
    reader = io.BufferedReader(ChunkStream(chunks), CHUNK)
    with tarfile.open(fileobj=cast(IO[bytes], reader), mode="r|", bufsize=CHUNK) as tar:
        for m in tar:
            if m.issym():
                saved.links[m.name] = posixpath.normpath(posixpath.join(posixpath.dirname(m.name), m.linkname))
            elif m.islnk():
                saved.links[m.name] = posixpath.normpath(m.linkname)
            elif m.isfile():
                f = tar.extractfile(m)
                assert f is not None
                if m.size > SMALL or m.name.endswith("/layer.tar"):
                    saved.layers[m.name] = layer(m.name, f)
                    continue
                data = f.read()
                if is_layer(data):
                    saved.layers[m.name] = layer(m.name, io.BytesIO(data))
                else:
                    saved.small[m.name] = data
    return saved


def resolve(name: str, links: dict[str, str]) -> str:
    seen = set()
    while name in links and name not in seen:
        seen.add(name)
        name = links[name]
    return name


def layer_order(saved: Saved) -> tuple[str, list[str]]:
    """(config entry, layer entries in order) from the save's manifest.json (one image)."""
    if "manifest.json" not in saved.small:
        raise SaveError("the saved image has no manifest.json (Docker's save always writes one)")
    try:
        (entry,) = json.loads(saved.small["manifest.json"])
        return resolve(str(entry["Config"]), saved.links), [resolve(str(p), saved.links) for p in entry["Layers"]]
    except KeyError as exc:
        raise SaveError(f"the saved image has no {exc} in its manifest.json") from None
    except (ValueError, TypeError) as exc:
        raise SaveError(f"the saved image's manifest.json is not one image's: {exc}") from None


def check_diff_ids(config: bytes, layers: Sequence[Blob]) -> None:
    """The layers' diff_ids must be the config's rootfs.diff_ids, in order; SaveError names the first that is not."""
    try:
        want = [str(d) for d in json.loads(config)["rootfs"]["diff_ids"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise SaveError(f"the saved image's config has no rootfs.diff_ids ({exc})") from None
    have = [b.diff_id for b in layers]
    if have != want:
        at = next((i for i, (h, w) in enumerate(zip(have, want, strict=False)) if h != w), min(len(have), len(want)))
        raise SaveError(f"the saved layers are not the image's: layer {at + 1} of {len(have)} hashes to "
                        f"{have[at] if at < len(have) else 'nothing'}, and the config says "
                        f"{want[at] if at < len(want) else 'nothing'} ({len(want)} layers); nothing was tagged")


def manifest_body(config: bytes, layers: Sequence[Blob]) -> bytes:
    """The OCI image manifest of the config and the zstd layers, in canonical bytes (fixed key order)."""
    doc = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
           "config": {"mediaType": OCI_CONFIG, "digest": digest_of(config), "size": len(config)},
           "layers": [{"mediaType": ZSTD_LAYER, "digest": b.digest, "size": b.size} for b in layers]}
    return (json.dumps(doc, indent=3) + "\n").encode()


# --- the push ---------------------------------------------------------------------------
class _Stop(Exception):
    def __init__(self, fault: Fault) -> None:
        super().__init__(str(fault))
        self.fault = fault


def _short(digest: str) -> str:
    return digest.removeprefix("sha256:")[:12]


class ZstdPusher:
    """Pushes images of one engine to one repository. What it uploaded is remembered for the run:
    per save entry (a retry skips the layers that got there), per image (its other tags only HEAD)."""

    def __init__(self, engine: SavePort, registry: BlobRegistry, *, level: int = LEVEL, threads: int = -1) -> None:
        self.engine, self.registry = engine, registry
        self.level, self.threads = level, threads
        self.known: dict[str, Blob] = {}  # save entry -> the layer blob it became
        self.pushed: dict[str, tuple[bytes, tuple[str, ...]]] = {}  # image id -> (manifest, layer digests)

    def push(self, image_id: str, tag: str, tracker: PushTracker) -> Fault | None:
        """Push ``image_id`` (its config digest: the classic store's image ID) under ``tag``; the manifest's
        digest goes to ``tracker.digest``, the layers sent and found to its lists."""
        try:
            body = self._again(image_id, tracker) or self._full(image_id, tracker)
        except _Stop as stop:
            return stop.fault
        except SaveError as exc:
            return Fault("local", str(exc), False)
        except EngineError as exc:
            return push_fault(str(exc))
        got = self.registry.put_manifest(tag, OCI_MANIFEST, body)
        if isinstance(got, Fault):
            return got
        tracker.digest, tracker.size = got, len(body)
        return None

    def _exists(self, digest: str) -> bool:
        there = self.registry.blob_exists(digest)
        if isinstance(there, Fault):
            raise _Stop(there)
        return there

    def _again(self, image_id: str, tracker: PushTracker) -> bytes | None:
        """The manifest of an image pushed earlier in this run, when the registry still holds its blobs."""
        if image_id not in self.pushed:
            return None
        body, layers = self.pushed[image_id]
        if not all(self._exists(d) for d in (image_id, *layers)):
            return None
        tracker.existing += [_short(d) for d in layers]
        return body

    def _full(self, image_id: str, tracker: PushTracker) -> bytes:
        def layer(name: str, raw: IO[bytes]) -> Blob:
            hit = self.known.get(name)
            if hit is not None and self._exists(hit.digest):
                reader = HashingReader(plain(raw), CHUNK)
                while reader.read(CHUNK):
                    pass
                if reader.digest() != hit.diff_id:
                    raise SaveError(f"{name} hashes to {reader.digest()} now, and to {hit.diff_id} when it was sent")
                tracker.existing.append(_short(hit.digest))
                log.info("  layer %s: already there", _short(hit.digest))
                return hit
            blob = self._upload(name, raw)
            self.known[name] = blob
            tracker.uploaded.append(_short(blob.digest))
            return blob

        saved = walk(self.engine.save(image_id), layer)
        config_entry, entries = layer_order(saved)
        for entry in entries:  # a layer small enough to pass for metadata (an empty layer's 1024 zero bytes)
            if entry not in saved.layers and entry in saved.small:
                saved.layers[entry] = layer(entry, io.BytesIO(saved.small.pop(entry)))
        missing = [e for e in entries if e not in saved.layers]
        if config_entry not in saved.small or missing:
            raise SaveError(f"the saved image lacks {', '.join(missing) or config_entry}")
        config = saved.small[config_entry]
        if digest_of(config) != image_id:
            raise SaveError(f"the saved config is {digest_of(config)}, not the image being published ({image_id})")
        layers = [saved.layers[e] for e in entries]
        check_diff_ids(config, layers)
        if not self._exists(image_id):
            got = self.registry.upload_blob(config, image_id)
            if isinstance(got, Fault):
                raise _Stop(got)
        body = manifest_body(config, layers)
        self.pushed[image_id] = (body, tuple(b.digest for b in layers))
        return body

    def _upload(self, name: str, raw: IO[bytes]) -> Blob:
        """Compress one layer on its way to the registry; its diff_id is hashed on the way in."""
        import zstandard

        tar = HashingReader(plain(raw), CHUNK)
        sha, size = hashlib.sha256(), 0
        cctx = zstandard.ZstdCompressor(level=self.level, threads=self.threads)

        def chunks() -> Iterator[bytes]:
            nonlocal size
            try:
                for out in cctx.read_to_iter(cast(IO[bytes], tar), read_size=CHUNK, write_size=CHUNK):
                    sha.update(out)
                    size += len(out)
                    yield out
            except (OSError, EOFError, tarfile.TarError, zstandard.ZstdError) as exc:
                # not an OSError on the way out: the HTTP client would take it for a network fault and retry
                raise SaveError(f"{name}: this layer of the saved image can't be read: {exc}") from None

        got = self.registry.upload_blob(chunks(), lambda: "sha256:" + sha.hexdigest())
        if isinstance(got, Fault):
            raise _Stop(got)
        log.info("  layer %s: sent (%s, zstd %s)", _short(got), human_size(tar.size), human_size(size))
        return Blob(tar.digest(), got, size)
