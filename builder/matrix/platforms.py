"""Which platforms a run covers: ``--platforms native|all|linux/arm64[,...]`` (pure).

Cells for the host's own platform build in minutes; the others build and run under qemu
emulation (an x86 host: linux/arm64), which takes much longer. So `build`, `test` and `base`
cover the native platform unless asked (``--platforms all``, env PTMG_PLATFORMS), while
`publish` covers all of them: one registry tag carries every platform of a cell.
"""

from __future__ import annotations

from collections.abc import Sequence

from builder.matrix.model import PLATFORMS, ImageSpec, native_platform

NATIVE = "native"
ALL = "all"


def host_platform(machine: str | None = None) -> str:
    """The Docker platform of this host (linux/amd64 on x86_64)."""
    return native_platform(machine)


def parse(text: str) -> tuple[str, ...]:
    """``native`` | ``all`` | a comma-separated list of platforms; ValueError says what is valid."""
    words = tuple(w.strip() for w in text.split(",") if w.strip())
    if not words:
        raise ValueError("empty; give native, all, or platforms such as linux/arm64")
    if len(words) == 1 and words[0] in (NATIVE, ALL):
        return words
    bad = [w for w in words if w not in PLATFORMS]
    if bad:
        raise ValueError(f"unknown platform {bad[0]!r}; valid: {NATIVE}, {ALL}, or a comma-separated list of "
                         f"{', '.join(PLATFORMS)}")
    return words


def covered(wanted: Sequence[str], host_os_arch: str) -> frozenset[str]:
    """The platforms ``wanted`` (parsed) stands for on a host of platform ``host_os_arch``."""
    if tuple(wanted) == (ALL,):
        return frozenset(PLATFORMS)
    if tuple(wanted) == (NATIVE,):
        return frozenset({host_os_arch})
    return frozenset(wanted)


def choose(cells: Sequence[ImageSpec], wanted: Sequence[str],
           host_os_arch: str) -> tuple[tuple[ImageSpec, ...], tuple[ImageSpec, ...]]:
    """(the cells on the wanted platforms, the ones left out), both in matrix order."""
    keep = covered(wanted, host_os_arch)
    return tuple(c for c in cells if c.platform in keep), tuple(c for c in cells if c.platform not in keep)
