"""The inputs hash (builder/imaging/inputs.py): every input counts (the Dockerfile, the base, each
file's content and mode), the checkout's place does not, and caches are left out."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from builder.imaging import inputs
from builder.matrix import ImageSpec
from tests.support import MID, small_matrix
from tests.support import cell as cell_named


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory) -> ImageSpec:
    return cell_named(small_matrix(tmp_path_factory.mktemp("matrix")), MID)


def test_inputs_hash_tracks_every_input(cell: ImageSpec, tmp_path: Path) -> None:
    (tmp_path / "entrypoint").mkdir()
    (tmp_path / "smoke_tests").mkdir()
    f = tmp_path / "entrypoint" / "start.sh"
    f.write_text("echo hi\n")
    files = inputs.context_files(tmp_path)
    h = inputs.inputs_hash("FROM x", files, "sha256:base", tmp_path)
    # The same tree elsewhere (another checkout) hashes the same: only relative paths count.
    elsewhere = tmp_path / "elsewhere" / "checkout"
    shutil.copytree(tmp_path / "entrypoint", elsewhere / "entrypoint")
    shutil.copytree(tmp_path / "smoke_tests", elsewhere / "smoke_tests")
    assert inputs.inputs_hash("FROM x", inputs.context_files(elsewhere), "sha256:base", elsewhere) == h
    assert h != inputs.inputs_hash("FROM y", files, "sha256:base", tmp_path)
    assert h != inputs.inputs_hash("FROM x", files, "sha256:other", tmp_path)
    f.write_text("echo bye\n")
    assert h != inputs.inputs_hash("FROM x", files, "sha256:base", tmp_path)
    f.write_text("echo hi\n")
    os.chmod(f, 0o755)
    assert h != inputs.inputs_hash("FROM x", files, "sha256:base", tmp_path)
    (tmp_path / "smoke_tests" / "__pycache__").mkdir()
    (tmp_path / "smoke_tests" / "__pycache__" / "x.pyc").write_bytes(b"junk")
    assert inputs.context_files(tmp_path) == files


