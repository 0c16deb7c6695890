"""The image without its entrypoint: the venv's startup module, the login profile, the pip
constraint and its hint, and the selftest's runtime name (pure logic; the docker tier runs them
in real containers and under Charliecloud)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import types
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest

from builder.lock import model
from builder.lock.staging import pip_constraint

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path) -> types.ModuleType:
    """A file of the image as a module (the image imports these by bare name or runs them)."""
    module = types.ModuleType(name)
    SourceFileLoader(name, str(path)).exec_module(module)
    return module


ptmg_userenv = _load("ptmg_userenv", ROOT / "entrypoint" / "ptmg_userenv.py")
where = _load("where", ROOT / "smoke_tests" / "where.py")
pip_hint = _load("pip_hint", ROOT / "entrypoint" / "pip-hint")
OTHER_UID = 4242  # no passwd entry on the host or in the image


# --- the venv's startup module ------------------------------------------------------------
def test_home_unset_gets_a_private_writable_home(tmp_path: Path) -> None:
    env = {"TMPDIR": str(tmp_path), "USER": "someone"}
    changed = ptmg_userenv.fix(env, os.getuid())
    home = tmp_path / f"ptmg-{os.getuid()}" / "home"
    assert changed == {"HOME": str(home)} and env["HOME"] == str(home)
    assert stat.S_IMODE((tmp_path / f"ptmg-{os.getuid()}").stat().st_mode) == 0o700
    assert os.access(home, os.W_OK)


@pytest.mark.parametrize("home", ["/nonexistent/home", "/proc"])
def test_unwritable_home_is_replaced(tmp_path: Path, home: str) -> None:
    if home == "/proc" and os.getuid() == 0:
        home = str(tmp_path / "ro")
        Path(home).mkdir()
        Path(home).chmod(0o500)
        if os.access(home, os.W_OK):  # root writes anyway: a regular file is never a usable HOME
            Path(home).rmdir()
            Path(home).write_text("x")
    env = {"HOME": home, "TMPDIR": str(tmp_path), "USER": "u"}
    assert "HOME" in ptmg_userenv.fix(env, os.getuid())


def test_a_usable_home_and_a_name_change_nothing(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "USER": "u"}
    assert ptmg_userenv.fix(env, os.getuid()) == {} and env == {"HOME": str(tmp_path), "USER": "u"}


def test_a_uid_without_passwd_entry_gets_a_name(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    assert ptmg_userenv.fix(env, OTHER_UID) == {"USER": f"uid{OTHER_UID}", "LOGNAME": f"uid{OTHER_UID}"}


def test_a_planted_link_or_foreign_dir_is_never_used(tmp_path: Path) -> None:
    """Another user may create /tmp/ptmg-<uid> first: a link or a dir not ours is skipped."""
    uid = os.getuid()
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / f"ptmg-{uid}").symlink_to(tmp_path)
    assert ptmg_userenv.private_dir(str(first), uid) is None
    (second / f"ptmg-{uid}").mkdir(mode=0o777)
    os.chmod(second / f"ptmg-{uid}", 0o777)
    assert ptmg_userenv.private_dir(str(second), uid) is None
    env = {"TMPDIR": str(first), "USER": "u"}
    changed = ptmg_userenv.fix(env, uid)
    assert not changed.get("HOME", "").startswith(str(tmp_path))


def test_the_pth_file_calls_the_module() -> None:
    line = (ROOT / "entrypoint" / "ptmg_userenv.pth").read_text().strip()
    assert line == "import ptmg_userenv; ptmg_userenv.main()"


# --- the login profile ----------------------------------------------------------------------
def _login_path(env: dict[str, str]) -> str:
    cmd = ["sh", "-c", f". {ROOT / 'entrypoint' / 'profile.sh'}; printf %s \"$PATH\""]
    if os.getuid() == 0:
        cmd = ["setpriv", "--reuid", str(OTHER_UID), "--regid", str(OTHER_UID), "--clear-groups", *cmd]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=30).stdout


def test_login_profile_puts_the_image_path_back_without_the_entrypoint() -> None:
    """Debian's /etc/profile resets PATH: `bash -lc python` found no python without a session file."""
    debian = "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
    out = _login_path({"PATH": debian, "PTMG_PATH": "/opt/venv/bin:/usr/bin:/bin"})
    assert out.split(":")[0] == "/opt/venv/bin" and out.endswith(debian)
    again = _login_path({"PATH": out, "PTMG_PATH": "/opt/venv/bin:/usr/bin:/bin"})
    assert again == out  # idempotent: a nested login shell adds nothing


# --- the pip constraint -------------------------------------------------------------------------
def test_pip_constraint_pins_torch_and_cuda_wheels_and_keeps_neighbour_limits() -> None:
    lock = model.read(model.lock_path(ROOT, "2.0.1-cuda11.7-cudnn8-runtime"))
    lines = [ln for ln in pip_constraint(lock).splitlines() if ln and not ln.startswith("#")]
    assert "torch==2.0.1" in lines and "torchvision==0.15.2" in lines
    assert any(ln.startswith("triton==") for ln in lines) and any(ln.startswith("nvidia-cudnn-cu11==") for ln in lines)
    assert "numpy<2" in lines and "setuptools<82" in lines
    assert not any(ln.startswith(("jupyterlab", "tensorboard", "numpy==", "pip==")) for ln in lines)


def test_pip_constraint_is_honoured_by_pip_and_uv(tmp_path: Path) -> None:
    """The constraint's format is what pip and uv read: each refuses a pinned version."""
    lock = model.read(model.lock_path(ROOT, "2.7.0-cuda12.6-cudnn9-runtime"))
    path = tmp_path / "constraint.txt"
    path.write_text(pip_constraint(lock))
    wheel = tmp_path / "wheels"
    wheel.mkdir()
    _fake_wheel(wheel, "torch", "9.9.9")
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links",
                          str(wheel), "--target", str(tmp_path / "t"), "torch==9.9.9"],
                         env={**os.environ, "PIP_CONSTRAINT": str(path)}, capture_output=True, text=True, timeout=120, check=False)
    assert pip.returncode != 0 and "ResolutionImpossible" in pip.stderr, pip.stdout + pip.stderr
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    assert uv, "uv is a dev dependency (pyproject.toml)"
    venv = tmp_path / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    r = subprocess.run([uv, "pip", "install", "--python", str(venv / "bin" / "python"), "--offline", "--no-index",
                        "--find-links", str(wheel), "torch==9.9.9"],
                       env={**os.environ, "UV_CONSTRAINT": str(path)}, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0 and "torch==2.7.0" in r.stderr, r.stderr


def _fake_wheel(where: Path, name: str, version: str) -> Path:
    import zipfile

    path = where / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_pip_hint_names_the_pin_and_the_way_out(tmp_path: Path) -> None:
    path = tmp_path / "constraint.txt"
    path.write_text("# head\ntorch==2.7.0\nnvidia-nccl-cu12==2.26.2\nnumpy<2\n")
    quiet = ("ERROR: Cannot install torch==2.5.0 because these package versions have conflicting dependencies.\n"
             "ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/...\n")
    text = pip_hint.hint(quiet, ["install", "torch==2.5.0"], str(path))
    assert text is not None and "torch==2.7.0" in text and "nvidia-nccl" not in text
    assert "PIP_CONSTRAINT= pip install torch==2.5.0" in text
    other = "ERROR: Cannot install foo==1 and bar==2 because these package versions have conflicting dependencies.\n"
    assert pip_hint.hint(other, ["install", "foo"], str(path)) is None
    assert pip_hint.hint("ERROR: No matching distribution found for torchx\n", ["install", "torchx"], str(path)) is None


def test_pip_hint_runs_pip_and_keeps_its_exit_code(tmp_path: Path) -> None:
    """The wrapper, run for real with this Python's pip: output passes through, exit code kept."""
    path = tmp_path / "constraint.txt"
    path.write_text("six==1.15.0\n")
    wheels = tmp_path / "w"
    wheels.mkdir()
    _fake_wheel(wheels, "six", "1.16.0")
    r = subprocess.run([sys.executable, str(ROOT / "entrypoint" / "pip-hint"), "install", "--dry-run", "--no-index",
                        "--find-links", str(wheels), "--target", str(tmp_path / "t"), "six==1.16.0"],
                       env={**os.environ, "PIP_CONSTRAINT": str(path)}, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ResolutionImpossible" in r.stderr and "pins six==1.15.0" in r.stderr
    ok = subprocess.run([sys.executable, str(ROOT / "entrypoint" / "pip-hint"), "--version"],
                        env={**os.environ, "PIP_CONSTRAINT": str(path)}, capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0 and ok.stdout.startswith("pip ")


# --- the selftest's runtime name ------------------------------------------------------------
ENROOT_IMPORT_RC = ("# org.opencontainers.image.title pt-multi-gpu x\n" * 200 + '\nmkdir -p "/workspace" 2> /dev/null\n'
                    'cd "/workspace" && unset OLDPWD || exit 1\n\nif [ -s /etc/rc.local ]; then\n    . /etc/rc.local\nfi\n')


@pytest.mark.parametrize(("env", "files", "rc", "want"), [
    ({"APPTAINER_CONTAINER": "/x.sif"}, {"/.dockerenv"}, "", "apptainer (/x.sif)"),
    ({"SINGULARITY_CONTAINER": "/y.sif"}, set(), "", "apptainer (/y.sif)"),
    ({"CH_RUNNING": "Weird Al Yankovic"}, set(), "# enroot-provenance: x", "charliecloud (ch-run)"),
    ({}, {"/run/.containerenv"}, "", "podman"),
    ({}, {"/.dockerenv"}, "", "docker"),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, set(), "", "kubernetes"),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, {"/.dockerenv"}, "", "docker, in a Kubernetes pod"),
    ({"SLURM_JOB_ID": "12"}, set(), "# enroot-provenance: docker://x", "enroot/pyxis"),
    ({"SLURM_JOB_ID": "12"}, set(), "", "no container runtime recognised"),
    # What `enroot import docker://...` writes itself: the labels, no word "enroot" (seen in enroot 4.1.2).
    ({}, set(), ENROOT_IMPORT_RC, "enroot"),
    ({"SLURM_JOB_ID": "12"}, set(), ENROOT_IMPORT_RC, "enroot/pyxis"),  # pyxis leaves no variable in the task
])
def test_selftest_names_its_runtime(env: dict[str, str], files: set[str], rc: str, want: str) -> None:
    got = where.runtime(env, exists=files.__contains__, read=lambda p: rc if p == "/etc/rc" else "")
    assert got.startswith(want)
    assert ("under Slurm job 12" in got) == ("SLURM_JOB_ID" in env)


def test_a_home_that_allows_exec_is_preferred(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Docker's /dev/shm and --tmpfs mounts are noexec: kernels Inductor compiles there cannot load."""
    noexec, execok = tmp_path / "noexec", tmp_path / "exec"
    noexec.mkdir()
    execok.mkdir()
    monkeypatch.setattr(ptmg_userenv, "_TEMP_CANDIDATES", (str(noexec), str(execok)))
    monkeypatch.setattr(ptmg_userenv, "executable_fs", lambda path: not str(path).startswith(str(noexec)))
    env = {"USER": "u"}
    changed = ptmg_userenv.fix(env, os.getuid())
    assert changed["HOME"].startswith(str(execok))
    # a noexec temporary folder with a usable HOME: Inductor's cache moves under HOME
    env2 = {"USER": "u", "HOME": str(execok), "TMPDIR": str(noexec)}
    assert ptmg_userenv.fix(env2, os.getuid()) == {"TORCHINDUCTOR_CACHE_DIR": f"{execok}/.cache/torchinductor"}
