"""An emulated cell's bytecode, compiled by the build host's Python: imagebuild/native-bytecode.sh's
`mark` and `compile` on a site-packages laid out as uv leaves it, with this host's own root as the
`ptmg-native-python` stage (Debian's python3, run through its loader as the emulated RUN runs it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "imagebuild" / "native-bytecode.sh"
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
EPOCH = "315532800"

def run(*args: str, epoch: str | None = EPOCH) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
    if epoch is not None:
        env["SOURCE_DATE_EPOCH"] = epoch
    return subprocess.run(["sh", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=False,
                          env=env)


def pyc(source: Path) -> Path:
    return Path(importlib.util.cache_from_source(str(source)))


def uvs_pyc(source: Path, out: Path) -> bytes:
    """What uv's --compile-bytecode writes for `source`: compileall.compile_file with SOURCE_DATE_EPOCH set."""
    code = ("import py_compile, sys; py_compile.compile(sys.argv[1], cfile=sys.argv[2], dfile=sys.argv[1], "
            "doraise=True, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)")
    subprocess.run([f"/usr/bin/python{PYTHON}", "-c", code, str(source), str(out)], check=True, timeout=60)
    return out.read_bytes()


@pytest.fixture
def site(tmp_path: Path) -> Path:
    sp = tmp_path / "venv" / "lib" / f"python{PYTHON}" / "site-packages"
    (sp / "old").mkdir(parents=True)
    (sp / "old" / "__init__.py").write_text("OLD = 1\n")
    shared = tmp_path / "cuda-wheels" / "nvidia"  # the venv links the CUDA tree's folders
    shared.mkdir(parents=True)
    (shared / "__init__.py").write_text("X = 1\n")
    (sp / "nvidia").symlink_to(shared)
    return sp


def test_compile_makes_the_new_sources_bytecode_as_uv_does_and_nothing_else(site: Path, tmp_path: Path) -> None:
    listed = tmp_path / "py-before"
    r = run("mark", str(site), str(listed))
    assert r.returncode == 0, r.stderr
    assert listed.read_text() == f"{site}/old/__init__.py\n"
    # what uv installs: a package, a module, a data folder's source, and Python 2 code it cannot compile
    new = site / "pkg"
    (new / "sub").mkdir(parents=True)
    (new / "__init__.py").write_text("from .sub import thing\n")
    (new / "sub" / "thing.py").write_text("def thing():\n    return 'é'\n")
    (site / "mod.py").write_text("import pkg\n")
    (site / "legacy.py").write_text("print 'python 2'\n")
    (site / "linked.py").symlink_to(tmp_path / "cuda-wheels" / "nvidia" / "__init__.py")  # a shared tree's link
    r = run("compile", str(site), str(listed), "/", PYTHON)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(f"native-bytecode.sh: 4 files compiled by the build host's Python {PYTHON}.")
    for source in (new / "__init__.py", new / "sub" / "thing.py", site / "mod.py"):
        assert pyc(source).read_bytes() == uvs_pyc(source, tmp_path / "uv.pyc"), source
        assert pyc(source).read_bytes()[4:8] == b"\x03\x00\x00\x00"  # hash-checked: no build time in it
    assert not pyc(site / "legacy.py").exists()  # skipped, as uv and pip skip it
    assert not pyc(site / "old" / "__init__.py").exists()  # a lower layer's: not written again
    assert not (tmp_path / "cuda-wheels" / "nvidia" / "__pycache__").exists()  # links are not followed
    assert not pyc(site / "linked.py").exists()


@pytest.mark.parametrize("args, epoch, code, says", [
    (("compile", "{site}", "{tmp}/py-before", "/", "3.99"), EPOCH, 1, "the build host's Python at / is "),
    (("compile", "{site}", "{tmp}/py-before", "{tmp}/no-root", PYTHON), EPOCH, 1, "no dynamic loader"),
    (("compile", "{site}", "{tmp}/py-before", "{tmp}/linked-root", PYTHON), EPOCH, 1, "no dynamic loader"),
    (("compile", "{site}", "{tmp}/py-before", "/", PYTHON), None, 1, "SOURCE_DATE_EPOCH is not set"),
    (("compile", "{site}", "{tmp}/never-marked", "/", PYTHON), EPOCH, 1, "mark did not run"),
    (("compile", "{site}", "{tmp}/py-before", "/"), EPOCH, 2, "usage:"),
    (("mark", "{site}"), EPOCH, 2, "usage:"),
    (("link",), EPOCH, 2, "usage:"),
])
def test_compile_refuses_what_would_give_wrong_or_unreproducible_bytecode(
        site: Path, tmp_path: Path, args: tuple[str, ...], epoch: str | None, code: int, says: str) -> None:
    assert run("mark", str(site), str(tmp_path / "py-before")).returncode == 0
    (site / "new.py").write_text("X = 1\n")
    (tmp_path / "no-root").mkdir()
    # a loader that is a link: in the stage, an absolute one would resolve into the emulated image
    real = next(Path("/usr/lib").glob("*-linux-gnu*/ld-linux*.so.*"))
    (tmp_path / "linked-root" / real.parent.relative_to("/")).mkdir(parents=True)
    (tmp_path / "linked-root" / real.relative_to("/")).symlink_to(real)
    r = run(*(a.format(site=site, tmp=tmp_path) for a in args), epoch=epoch)
    assert r.returncode == code and says in r.stderr, (r.returncode, r.stderr)
    assert not pyc(site / "new.py").exists()
