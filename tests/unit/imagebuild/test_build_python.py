"""The build's Python for the venv's RUNs below the OS layer: imagebuild/build-python.sh's `use` and
`restore` on a venv laid out as `python3 -m venv --without-pip /opt/venv` lays it out, and the
ptmg-python stage's library copies (dockerfile/05-python.j2, as rendered) on this host's own python3
(Debian's, as in the stage)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from builder.render import dockerfile
from tests.support import small_matrix

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "imagebuild" / "build-python.sh"
PY = dockerfile.BUILD_PYTHON
STAGE = "/ptmg-build/python"
PYVENV = ("home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.11.2\n"
          "executable = /usr/bin/python3.11\ncommand = /usr/bin/python3 -m venv --without-pip /opt/venv\n")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=False)


def venv(tmp_path: Path, home: str = "/usr/bin") -> Path:
    v = tmp_path / "venv"
    (v / "bin").mkdir(parents=True)
    (v / "pyvenv.cfg").write_text(PYVENV.replace("= /usr/bin", f"= {home}"))
    (v / "bin" / "python3").symlink_to(f"{home}/python3")
    (v / "bin" / "python").symlink_to("python3")
    (v / "bin" / "python3.11").symlink_to("python3")
    return v


def links(v: Path) -> dict[str, str]:
    return {p.name: os.readlink(p) for p in sorted((v / "bin").iterdir())}


def test_use_points_the_venv_at_the_stage_and_restore_back_at_usr_bin(tmp_path: Path) -> None:
    v = venv(tmp_path)
    r = run("use", str(v))
    assert r.returncode == 0, r.stderr
    assert links(v) == {"python": "python3", "python3": f"{STAGE}/usr/bin/python3", "python3.11": "python3"}
    assert (v / "pyvenv.cfg").read_text() == PYVENV.replace("= /usr/bin", f"= {STAGE}/usr/bin")
    r = run("restore", str(v))
    assert r.returncode == 0, r.stderr
    assert links(v) == {"python": "python3", "python3": "/usr/bin/python3", "python3.11": "python3"}
    assert (v / "pyvenv.cfg").read_text() == PYVENV, "restored: what `python3 -m venv` writes in the image"


def test_restore_of_a_venv_the_stage_made(tmp_path: Path) -> None:
    """The torch RUN makes the venv with the stage's python3: its links and pyvenv.cfg name the stage."""
    v = venv(tmp_path, home=f"{STAGE}/usr/bin")
    r = run("restore", str(v))
    assert r.returncode == 0, r.stderr
    assert os.readlink(v / "bin" / "python3") == "/usr/bin/python3"
    assert (v / "pyvenv.cfg").read_text() == PYVENV


def test_restore_fails_when_the_venv_still_names_the_stage(tmp_path: Path) -> None:
    v = venv(tmp_path)
    (v / "bin" / "python3-odd").symlink_to(f"{STAGE}/opt/python3")
    r = run("restore", str(v))
    assert r.returncode == 1 and f"still naming {STAGE}" in r.stderr and "python3-odd" in r.stderr


def _needed(lib: str) -> Path:
    out = subprocess.run(["ldd", os.path.realpath("/usr/bin/python3")], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    (path,) = (line.split()[2] for line in out.splitlines() if line.strip().startswith(lib))
    return Path(os.path.realpath(path))


def copy_libs(tmp_path: Path, base_libs: str) -> set[str]:
    """The stage RUN's library steps as rendered (from `mkdir -p` on), with the base's checksums
    `base_libs` (md5sum's lines) and the copies' folder in tmp_path; the names it copied."""
    spec = small_matrix(tmp_path / "m", 'include:\n  - {torch: "2.7.0"}\n').cells[0]
    stage = dockerfile.render(spec).split(f" AS {PY['stage']}\n", 1)[1].split("\nFROM ", 1)[0]
    steps = stage.replace("\\\n", " ").split(" && ")
    first = next(i for i, step in enumerate(steps) if step.strip().startswith(f"mkdir -p {PY['stage_libs']}"))
    out, base = tmp_path / "libs", tmp_path / "base-libs"
    base.write_text(base_libs)
    script = (" && ".join(steps[first:]).replace("/tmp/ptmg-base-libs", str(base))
              .replace("/tmp/ptmg-ldd", str(tmp_path / "ldd")).replace(str(PY["stage_libs"]), str(out)))
    r = subprocess.run(["bash", "-o", "pipefail", "-c", script], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stderr
    return {p.name for p in out.iterdir()}


def test_the_stage_copies_what_the_base_lacks_and_never_glibc(tmp_path: Path) -> None:
    got = copy_libs(tmp_path / "all", "")
    assert "libexpat.so.1" in got, got  # Debian's python3.11 links it; a slim base lacks it
    assert not {n for n in got if n.startswith(("libc.so", "ld-linux", "libm.so"))}, got
    assert "libcrypto.so.3" in got or "libssl.so.3" not in got, got  # libc's prefix is not libcrypto's
    expat = _needed("libexpat.so.1")
    line = f"{hashlib.md5(expat.read_bytes()).hexdigest()}  {expat}\n"  # what md5sum writes
    assert "libexpat.so.1" not in copy_libs(tmp_path / "some", line), "the base's own copy is used"


def test_a_wrong_verb_is_refused() -> None:
    r = run("libs")
    assert r.returncode == 2 and "usage: build-python.sh use|restore VENV" in r.stderr
