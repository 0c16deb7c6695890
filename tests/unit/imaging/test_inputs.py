"""The inputs hash (builder/imaging/inputs.py): every input counts (the Dockerfile, the base, each
file's content and mode), the checkout's place does not, and caches are left out."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from builder.common.errors import InputError
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




def test_a_file_gone_between_listing_and_hashing_is_a_located_input_error(tmp_path: Path) -> None:
    (tmp_path / "entrypoint").mkdir()
    for name in ("start.sh", "healthcheck"):
        (tmp_path / "entrypoint" / name).write_text("echo hi\n")
    files = inputs.context_files(tmp_path)
    gone = tmp_path / "entrypoint" / "start.sh"
    gone.unlink()  # as an editor's save-by-rename or a `git checkout` does, mid-build
    for which in ("inputs", "recipe"):
        with pytest.raises(InputError) as caught:
            if which == "inputs":
                inputs.inputs_hash("FROM x", files, "sha256:base", tmp_path)
            else:
                inputs.recipe_hash("FROM x", files, tmp_path)
        assert caught.value.lines[0].startswith(f"{gone}: ") and "changed while the build read it" in caught.value.lines[0]
