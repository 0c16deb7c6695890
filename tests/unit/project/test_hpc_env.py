"""The image without its entrypoint: the pip constraint and its hint, and the selftest's runtime
name (pure logic; the docker tier runs them in real containers and under Charliecloud). The venv's
startup module and the login profile: tests/unit/entrypoint/test_userenv.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest

from builder.lock import model
from builder.lock.staging import pip_constraint

ROOT = Path(__file__).resolve().parents[3]


def _load(name: str, path: Path) -> types.ModuleType:
    """A file of the image as a module (the image imports these by bare name or runs them)."""
    module = types.ModuleType(name)
    SourceFileLoader(name, str(path)).exec_module(module)
    return module


where = _load("where", ROOT / "smoke_tests" / "where.py")
pip_hint = _load("pip_hint", ROOT / "entrypoint" / "pip-hint")


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

