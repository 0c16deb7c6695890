"""One version type for the whole builder (torch, CUDA, drivers, tags).

Parsing follows the image contract's :func:`ptmg_contract.version_tuple`, which the
entrypoint and the smoke tests use inside the images: ``"2.7.0+cu126"`` -> (2, 7, 0).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ptmg_contract import version_tuple


@functools.total_ordering
@dataclass(frozen=True)
class Version:
    """A dotted version compared numerically, shorter ones padded with zeros (12.6 == 12.6.0)."""

    parts: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> Version:
        """``Version.parse("2.7.0+cu126")``; raises ValueError on text without a leading number."""
        return cls(version_tuple(text))

    def _padded(self, n: int) -> tuple[int, ...]:
        return self.parts + (0,) * (n - len(self.parts))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Version):
            return NotImplemented
        n = max(len(self.parts), len(other.parts))
        return self._padded(n) == other._padded(n)

    def __hash__(self) -> int:
        parts = list(self.parts)
        while parts and parts[-1] == 0:
            parts.pop()
        return hash(tuple(parts))

    def __lt__(self, other: Version) -> bool:
        n = max(len(self.parts), len(other.parts))
        return self._padded(n) < other._padded(n)

    def __str__(self) -> str:
        return ".".join(map(str, self.parts))

    @property
    def major(self) -> int:
        return self.parts[0]

    def prefix(self, n: int) -> str:
        """The first ``n`` components as text: ``Version.parse("2.7.0").prefix(2) == "2.7"``."""
        return ".".join(map(str, self._padded(n)[:n]))


def version_key(text: str) -> Version:
    """A sort key that never raises: text without a number sorts first."""
    try:
        return Version.parse(text)
    except ValueError:
        return Version(())
