"""The tag scheme, derived from images.yaml only (pure functions; no Docker, no registry).

Every cell gets two kinds of tags:

- immutable: ``<tag>-<YYYYMMDD>`` and ``<tag>-<git short sha>``. Once pushed they name
  one image forever; publishing never moves them (see builder/publish/).
- floating: ``<tag>`` itself, ``<torch major.minor>-cuda<cuda>`` (plus ``-<flavour>``
  for flavours other than runtime) on the newest torch patch release of that
  minor/CUDA/flavour, and ``latest`` on the cell images.yaml marks latest. They
  move when a newer image of the same cell is published.

The minor tag and ``latest`` are decided over the WHOLE matrix, never over a
``--only`` selection, so publishing one old cell can never pull ``2.7-cuda12.6``
back from 2.7.1 to 2.7.0.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from builder.common.errors import InputError
from builder.common.versions import version_key
from builder.matrix.model import TAG_RE, ImageSpec, Matrix

LATEST = "latest"
SHA_RE = re.compile(r"^([0-9a-f]{7,40})(-dirty)?$")
DATE_RE = re.compile(r"^\d{8}$")
SHORT_SHA = 7


class TagError(InputError):
    """The matrix or the inputs give tags that can't be published (invalid or ambiguous)."""


@dataclass(frozen=True)
class CellTags:
    cell: str
    immutable: tuple[str, ...]
    floating: tuple[str, ...]
    #: cells with the same group share these tags: the platforms of one registry tag (a manifest
    #: list, see builder/publish/manifest_list.py). "" = the cell alone.
    group: str = ""

    @property
    def all(self) -> tuple[str, ...]:
        return self.immutable + self.floating


def date_part(date: dt.date | str) -> str:
    """YYYYMMDD from a date (or a YYYYMMDD string, checked)."""
    if isinstance(date, dt.date):
        return date.strftime("%Y%m%d")
    if not DATE_RE.match(date):
        raise TagError(f"date {date!r} is not YYYYMMDD")
    dt.datetime.strptime(date, "%Y%m%d")  # a real calendar day, or ValueError
    return date


def sha_part(revision: str) -> str:
    """The git short sha (7 hex digits) of a revision; a `-dirty` suffix is kept, so an image
    built from an uncommitted tree never claims to be that commit."""
    m = SHA_RE.match(revision.strip())
    if not m:
        raise TagError(f"revision {revision!r} is not a git commit sha (hex, 7-40 digits, optional -dirty)")
    return m.group(1)[:SHORT_SHA] + (m.group(2) or "")


def _checked(tag: str) -> str:
    if not TAG_RE.match(tag):
        raise TagError(f"{tag!r} is not a valid Docker tag (letters, digits, '_', '.', '-'; at most 128)")
    return tag


def immutable_tags(spec: ImageSpec, date: dt.date | str, revision: str) -> tuple[str, str]:
    """``<tag>-<YYYYMMDD>`` and ``<tag>-<short sha>``."""
    return _checked(f"{spec.tag}-{date_part(date)}"), _checked(f"{spec.tag}-{sha_part(revision)}")


def minor_tag(spec: ImageSpec) -> str:
    """``2.7-cuda12.6`` (runtime) or ``2.7-cuda12.6-dev`` (other flavours)."""
    minor = ".".join(spec.torch.split(".")[:2])
    suffix = "" if spec.flavour == "runtime" else f"-{spec.flavour}"
    return _checked(f"{minor}-cuda{spec.cuda}{suffix}")


def minor_tag_owners(cells: Iterable[ImageSpec]) -> dict[str, str]:
    """minor tag -> the cell that carries it: the newest torch patch of that minor/CUDA/flavour.

    Cells that tie (the same torch patch, differing only in base or Python) are broken by
    images.yaml order: the first one listed wins, so the owner never depends on a dict or a
    sort that is not stable.
    """
    owners: dict[str, ImageSpec] = {}
    for spec in cells:
        tag = minor_tag(spec)
        current = owners.get(tag)
        if current is None or version_key(spec.torch) > version_key(current.torch):
            owners[tag] = spec
    return {tag: spec.name for tag, spec in owners.items()}


def floating_tags(spec: ImageSpec, cells: Sequence[ImageSpec]) -> tuple[str, ...]:
    """The cell's floating tags; ``cells`` is the whole matrix."""
    out = [spec.tag]
    minor = minor_tag(spec)
    if minor_tag_owners(cells).get(minor) == spec.name and minor not in out:
        out.append(minor)
    if spec.latest and LATEST not in out:
        out.append(LATEST)
    return tuple(out)


def cell_tags(spec: ImageSpec, cells: Sequence[ImageSpec], date: dt.date | str, revision: str) -> CellTags:
    return CellTags(spec.name, immutable_tags(spec, date, revision), floating_tags(spec, cells), group=spec.tag)


def platform_tag(spec: ImageSpec, revision: str) -> str:
    """The immutable tag of one platform's image of a multi-platform cell, ``<tag>-<short sha>-<arch>``
    (a manifest list names its images by digest, but a registry keeps only what a tag holds)."""
    return _checked(f"{spec.tag}-{sha_part(revision)}-{spec.arch}")


def check_unambiguous(plans: Iterable[CellTags]) -> None:
    """Raise TagError when two cells claim one tag, or one tag is both immutable and floating
    (a template like ``{torch_minor}-cuda{cuda}`` would make the cell tag a minor tag). The
    platforms of one cell (the same ``group``) share their tags."""
    seen: dict[str, tuple[str, str, str]] = {}
    problems: list[str] = []
    for plan in plans:
        for kind, tags in (("immutable", plan.immutable), ("floating", plan.floating)):
            for tag in tags:
                prev = seen.get(tag)
                owner = plan.group or plan.cell
                if prev is not None and prev[1:] != (owner, kind):
                    problems.append(f"tag {tag!r} is {prev[2]} for cell {prev[0]} and {kind} for cell {plan.cell}")
                seen.setdefault(tag, (plan.cell, owner, kind))
    if problems:
        raise TagError("ambiguous tags; change the tag template in images.yaml:\n  " + "\n  ".join(problems))


def plan(matrix: Matrix, date: dt.date | str, revision: str) -> dict[str, CellTags]:
    """Tags of every cell of the matrix (one date and revision for all), checked for ambiguity."""
    plans = {c.name: cell_tags(c, matrix.cells, date, revision) for c in matrix.cells}
    check_unambiguous(plans.values())
    return plans


def _md(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"
