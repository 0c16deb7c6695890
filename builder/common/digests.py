"""Content digests as registries and OCI layouts write them (``sha256:<hex>``), of bytes in memory
or of a stream read once (a layer checked against its digest as it passes, never held whole)."""

from __future__ import annotations

import hashlib
import io
from typing import IO, Any


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class HashingReader(io.RawIOBase):
    """Reads through to ``raw``, at most ``chunk`` bytes a call, hashing and counting every byte that
    passes: wrap a blob's stream in it, read it to the end, then compare ``digest()`` and ``size``."""

    def __init__(self, raw: IO[bytes], chunk: int) -> None:
        self.raw, self.chunk, self.sha, self.size = raw, chunk, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.raw.read(min(len(b), self.chunk))
        n = len(data)
        b[:n] = data
        self.sha.update(data)
        self.size += n
        return n

    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()
