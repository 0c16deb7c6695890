"""The tag scheme (builder/matrix/tags.py): pure, derived from images.yaml only."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import pytest

from builder.matrix import ImageSpec, Matrix, load_matrix, tags
from tests.support import cell

ROOT = Path(__file__).resolve().parents[3]

MATRIX = """\
repository: pt-multi-gpu
tag: "{torch}-cuda{cuda}-cudnn{cudnn}-{flavour}"
include:
  - torch: "2.7.0"
    cuda: "12.6"
  - torch: "2.7.1"
    cuda: "12.6"
  - torch: "2.9.0"
    cuda: "13.0"
    flavour: devel
  - torch: "2.9.0"
    cuda: "13.0"
  - torch: "2.7.1"
    cuda: "12.8"
  - torch: "2.6.0"
    cuda: "12.6"
"""


def _matrix(tmp_path: Path, text: str) -> Matrix:
    path = tmp_path / "images.yaml"
    path.write_text(text)
    return load_matrix(path)


@pytest.fixture
def matrix(tmp_path: Path) -> Matrix:
    return _matrix(tmp_path, MATRIX)


def _cell(m: Matrix, name: str) -> ImageSpec:
    return cell(m, name)


def test_immutable_tags_date_and_short_sha(matrix: Matrix) -> None:
    spec = _cell(matrix, "2.7.0-cuda12.6-cudnn9-runtime")
    sha = "4a297245bf902b033fcab83501586d02aaecdd09"
    assert tags.immutable_tags(spec, dt.date(2026, 11, 30), sha) == (
        "2.7.0-cuda12.6-cudnn9-runtime-20261130", "2.7.0-cuda12.6-cudnn9-runtime-4a29724")
    # A YYYYMMDD string is the same; a dirty tree says so instead of claiming the commit.
    assert tags.immutable_tags(spec, "20261130", sha + "-dirty")[1] == "2.7.0-cuda12.6-cudnn9-runtime-4a29724-dirty"


@pytest.mark.parametrize("date", ["2026-11-30", "20261331", "2026113"])
def test_bad_dates_rejected(matrix: Matrix, date: str) -> None:
    with pytest.raises((tags.TagError, ValueError)):
        tags.immutable_tags(matrix.cells[0], date, "abcdef0")


@pytest.mark.parametrize("rev", ["unknown", "", "abc", "4A29724", "g4a29724", "4a29724-modified"])
def test_bad_revisions_rejected(matrix: Matrix, rev: str) -> None:
    with pytest.raises(tags.TagError, match="not a git commit sha"):
        tags.immutable_tags(matrix.cells[0], "20261130", rev)


def test_minor_tag_only_on_newest_patch_per_minor_cuda_flavour(matrix: Matrix) -> None:
    got = {c.name: tags.floating_tags(c, matrix.cells) for c in matrix.cells}
    assert got == {
        # 2.7.1 is newer: the 2.7.0 runtime cell keeps only its own tag.
        "2.7.0-cuda12.6-cudnn9-runtime": ("2.7.0-cuda12.6-cudnn9-runtime",),
        "2.7.1-cuda12.6-cudnn9-runtime": ("2.7.1-cuda12.6-cudnn9-runtime", "2.7-cuda12.6"),
        # Flavour is its own line (suffix), so the devel cell gets its minor tag; `latest` goes to
        # the runtime cell of the newest torch, never to its devel twin.
        "2.9.0-cuda13.0-cudnn9-devel": ("2.9.0-cuda13.0-cudnn9-devel", "2.9-cuda13.0-devel"),
        "2.9.0-cuda13.0-cudnn9-runtime": ("2.9.0-cuda13.0-cudnn9-runtime", "2.9-cuda13.0", "latest"),
        # Another CUDA is another line.
        "2.7.1-cuda12.8-cudnn9-runtime": ("2.7.1-cuda12.8-cudnn9-runtime", "2.7-cuda12.8"),
        "2.6.0-cuda12.6-cudnn9-runtime": ("2.6.0-cuda12.6-cudnn9-runtime", "2.6-cuda12.6"),
    }


def test_minor_tag_decided_over_the_whole_matrix_not_a_selection(matrix: Matrix) -> None:
    """Publishing `--only 2.7.0*` must not pull 2.7-cuda12.6 back to 2.7.0."""
    old = _cell(matrix, "2.7.0-cuda12.6-cudnn9-runtime")
    assert "2.7-cuda12.6" not in tags.floating_tags(old, matrix.cells)
    assert "2.7-cuda12.6" in tags.floating_tags(old, [old])  # what a selection-based rule would wrongly do


def test_minor_tag_goes_to_newest_patch_whatever_the_order(tmp_path: Path) -> None:
    m = _matrix(tmp_path, 'repository: r\ninclude:\n  - {torch: "2.2.2", cuda: "12.1"}\n'
                          '  - {torch: "2.2.0", cuda: "12.1"}\n')
    assert tags.minor_tag_owners(m.cells) == {"2.2-cuda12.1": "2.2.2-cuda12.1-cudnn8-runtime"}
    assert tags.minor_tag_owners(reversed(m.cells)) == {"2.2-cuda12.1": "2.2.2-cuda12.1-cudnn8-runtime"}


def test_minor_tag_tie_goes_to_first_cell_in_images_yaml(tmp_path: Path) -> None:
    m = _matrix(tmp_path, 'repository: r\ntag: "{torch}-cuda{cuda}-{flavour}-{os}"\ninclude:\n'
                          '  - {torch: "2.7.1", cuda: "12.6", base: "debian:trixie-slim"}\n'
                          '  - {torch: "2.7.1", cuda: "12.6"}\n')
    assert tags.minor_tag_owners(m.cells) == {"2.7-cuda12.6": "2.7.1-cuda12.6-runtime-trixie"}


def test_real_images_yaml(tmp_path: Path) -> None:
    m = load_matrix(ROOT / "images.yaml")
    plans = tags.plan(m, dt.date(2026, 11, 30), "4a297245bf902b033fcab83501586d02aaecdd09")
    latest = [name for name, p in plans.items() if "latest" in p.floating]
    assert latest == [c.name for c in m.cells if c.latest] and len(latest) == 1
    p = plans["2.7.0-cuda12.6-cudnn9-runtime"]
    assert p.floating == ("2.7.0-cuda12.6-cudnn9-runtime", "2.7-cuda12.6")
    assert p.immutable == ("2.7.0-cuda12.6-cudnn9-runtime-20261130", "2.7.0-cuda12.6-cudnn9-runtime-4a29724")
    owners: dict[str, set[str]] = {}  # a tag is one cell's; the platforms of a cell (its group) share it
    for q in plans.values():
        for t in q.all:
            owners.setdefault(t, set()).add(q.group or q.cell)
    assert all(len(o) == 1 for o in owners.values()), owners
    arm = plans["2.14.1-cuda13.0-cudnn9-runtime-arm64"]
    assert arm.immutable == plans["2.14.1-cuda13.0-cudnn9-runtime"].immutable and arm.group == arm.floating[0]


def test_ambiguous_template_rejected(tmp_path: Path) -> None:
    # A template that makes the cell tag its own minor tag: one tag, not two.
    m = _matrix(tmp_path, 'repository: r\ntag: "{torch_minor}-cuda{cuda}"\ninclude:\n'
                          '  - {torch: "2.7.0", cuda: "12.6"}\n')
    assert tags.plan(m, "20261130", "abcdef0")["2.7-cuda12.6"].floating == ("2.7-cuda12.6", "latest")
    bad = [tags.CellTags("a", ("x-1",), ("x", "2.7-cuda12.6")), tags.CellTags("b", ("y-1",), ("2.7-cuda12.6",))]
    with pytest.raises(tags.TagError, match=re.escape("'2.7-cuda12.6' is floating for cell a and floating for cell b")):
        tags.check_unambiguous(bad)
    with pytest.raises(tags.TagError, match="immutable for cell a and floating for cell b"):
        tags.check_unambiguous([tags.CellTags("a", ("x-1",), ("x",)), tags.CellTags("b", ("y",), ("x-1",))])


def test_too_long_tag_rejected(tmp_path: Path) -> None:
    m = _matrix(tmp_path, 'repository: r\ntag: "' + "x" * 120 + '-{torch}"\ninclude:\n  - {torch: "2.7.0"}\n')
    with pytest.raises(tags.TagError, match="not a valid Docker tag"):
        tags.immutable_tags(m.cells[0], "20261130", "abcdef0")
