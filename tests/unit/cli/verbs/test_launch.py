"""`build.py launch`'s verb (builder/cli/verbs/launch.py): one file per cell, one cell to stdout,
the cell's torch for the native preflight, and bad input refused with exit 2 (no Docker, no cluster)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

import builder.cli.main as cli
from tests.support import LATEST, MID, OLD, write_matrix
from tests.unit.launch.test_config import CELL
from tests.unit.launch.test_kubernetes import jobset_errors

# --- the verb ------------------------------------------------------------------------------------------------


@pytest.fixture
def matrix_file(tmp_path: Path) -> Path:
    """The seed cells as a matrix file of this test's own (CELL among them)."""
    return write_matrix(tmp_path / "matrix")


def test_verb_writes_one_file_per_cell(tmp_path: Path, matrix_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = cli.main(["launch", "--config", str(matrix_file), "--target", "jobset", "--nodes", "2", "--gpus-per-node",
                   "8", "--no-pin", "--out", str(out), "--json"])
    assert rc == 0
    written = json.loads(capsys.readouterr().out)
    assert sorted(w["cell"] for w in written) == sorted([OLD, MID, LATEST])
    assert {w["target"] for w in written} == {"jobset"}
    for w in written:
        path = Path(w["path"])
        assert path == out / w["cell"] / "jobset.yaml"
        assert jobset_errors(list(yaml.safe_load_all(path.read_text()))[1]) == []


def test_verb_prints_one_cell_to_stdout(matrix_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["launch", "--config", str(matrix_file), "--target", "slurm", "--only", CELL, "--gpus-per-node", "0", "--nproc-per-node", "2",
                   "--launcher", "docker", "--no-pin", "--command", "train.py --lr '1e-3'"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n")
    assert re.search(r"^    train\.py --lr 1e-3$", out, re.M)


def test_verb_gives_the_native_preflight_the_cells_torch(matrix_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from builder.matrix import load_matrix

    (cell,) = [c for c in load_matrix(matrix_file).cells if c.name == CELL]
    assert cli.main(["launch", "--config", str(matrix_file), "--target", "slurm", "--only", CELL, "--launcher",
                     "native", "--nodes", "2", "--no-pin"]) == 0
    out = capsys.readouterr().out
    assert f"export PTMG_JOB_CELL={CELL}\n" in out
    assert f"/site-packages/torch-{cell.torch}+*.dist-info" in out and f"no torch {cell.torch} in" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--target", "slurm"], "cells selected"),
    (["--target", "slurm", "--only", CELL, "--gpus-per-node", "0"], "--nproc-per-node"),
    (["--target", "pytorchjob", "--only", CELL, "--name", "UPPER"], "--name"),
    (["--target", "slurm", "--only", CELL, "--command", "'unclosed"], "--command"),
    (["--target", "slurm", "--only", "no-such-cell"], "matches no cell"),
    (["--target", "slurm", "--only", CELL, "--launcher", "native", "--mount", "/data:/data"],
     "--mount '/data:/data': --launcher native runs no container"),
])
def test_verb_refuses_bad_input_with_exit_2(argv: list[str], message: str, matrix_file: Path,
                                            capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    assert cli.main(["launch", "--config", str(matrix_file), "--no-pin", *argv]) == 2
    err = capfd.readouterr().err + caplog.text
    assert message in err


