"""One pass over `docker save` of an image: every blob decompressed (gzip, zstd or plain) and
searched for secret markers, and every file path of every layer listed.

Two checks read the whole image (~6 GB): no build secret in any layer, config or history
(test_build) and no SSH host key in any layer (test_runtime). Each used to stream the image
itself; the session now saves it once (conftest's ``saved_image`` fixture) and both read the
result.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, cast

import pytest

from builder.publish.zstdpush import ChunkStream  # the same stream the zstd pusher reads

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
CHUNK = 8 << 20


class Scanner:
    """Looks for every marker in a byte stream fed in chunks (a marker may straddle two)."""

    def __init__(self, markers: tuple[bytes, ...]) -> None:
        self.markers = markers
        self.keep = max((len(m) for m in markers), default=0)
        self.tail = b""
        self.found: set[bytes] = set()
        self.bytes = 0

    def feed(self, chunk: bytes) -> None:
        window = self.tail + chunk
        self.found |= {m for m in self.markers if m in window}
        self.tail = window[-self.keep:] if self.keep else b""
        self.bytes += len(chunk)


class _Tee(io.RawIOBase):
    """Reads ``stream`` and feeds every byte read to ``scanner``."""

    def __init__(self, stream: Any, scanner: Scanner) -> None:
        self.stream, self.scanner = stream, scanner

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.stream.read(len(b))
        n = len(data)
        b[:n] = data
        if n:
            self.scanner.feed(bytes(data))
        return n


def decompressed(f: io.BufferedReader) -> tuple[str, Any]:
    """(format, readable) of one blob of `docker save`, by its magic: gzip, zstd or plain."""
    head = f.peek(4)[:4]
    if head.startswith(GZIP_MAGIC):
        return "gzip", gzip.GzipFile(fileobj=f)
    if head == ZSTD_MAGIC:
        try:
            import zstandard
        except ImportError:
            pytest.fail("a zstd layer and no zstandard module. Fix: pip install -e '.[dev]'", pytrace=False)
        return "zstd", zstandard.ZstdDecompressor().stream_reader(f)
    return "plain", f


def chunks(stream: Any) -> Iterator[bytes]:
    while chunk := stream.read(CHUNK):
        yield chunk


@dataclass(frozen=True)
class SavedImage:
    found: frozenset[bytes]  # markers seen anywhere
    formats: dict[str, int]  # layer blobs per format
    scanned: int  # decompressed bytes searched
    paths: tuple[tuple[str, str], ...]  # (blob, path) of every entry of every layer


def scan(image: Any, markers: tuple[bytes, ...]) -> SavedImage:
    """`docker save` is a tar of blobs: every layer and the config and manifests (history, labels,
    env). Each blob is decompressed and searched; a blob that is a tar (a layer) is also listed."""
    scanner = Scanner(markers)
    formats: dict[str, int] = {}
    paths: list[tuple[str, str]] = []
    reader = io.BufferedReader(ChunkStream(image.save(named=True, chunk_size=CHUNK)), CHUNK)
    with tarfile.open(fileobj=cast(IO[bytes], reader), mode="r|", bufsize=1 << 20) as outer:
        for member in outer:
            f = outer.extractfile(member) if member.isfile() else None
            if f is None:
                continue
            kind, stream = decompressed(io.BufferedReader(cast(Any, f), 1 << 20))
            body = io.BufferedReader(_Tee(stream, scanner), 1 << 20)
            head = body.peek(512)[:512]
            is_tar = len(head) == 512 and head[257:262] == b"ustar"
            if is_tar:
                with tarfile.open(fileobj=cast(IO[bytes], body), mode="r|", bufsize=1 << 20) as layer:
                    paths += [(member.name, m.name) for m in layer]
            for _ in chunks(body):  # the rest (a tar's end blocks; all of a blob that is no tar)
                pass
            scanner.tail = b""  # blobs are separate files: no marker spans two
            if is_tar or member.name.endswith("layer.tar") or ("/blobs/" in member.name and member.size > 1 << 16):
                formats[kind] = formats.get(kind, 0) + 1
    return SavedImage(frozenset(scanner.found), formats, scanner.bytes, tuple(paths))
