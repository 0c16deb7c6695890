"""Helpers shared by the host-side tests (no Docker import here).

Polling goes through builder.common.waiting.wait_until() only (re-exported here): no
scattered sleep loops. Unit tests build their own small matrices (small_matrix()) instead
of depending on the cells of the project's images.yaml; the few tests that check the real
images.yaml say so in their names.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from builder.common.waiting import WaitTimeout, wait_until
from builder.matrix import ImageSpec, Matrix, load_matrix

__all__ = ["LATEST", "MID", "NO_ENGINE", "OLD", "SEED_MATRIX", "WaitTimeout", "build_py", "cell",
           "host_port", "load_module", "small_matrix", "wait_until", "write_matrix"]

ROOT = Path(__file__).resolve().parents[1]
#: DOCKER_HOST in the unit tier (tests/unit/conftest.py): a socket that is not there.
NO_ENGINE = "unix:///nonexistent/ptmg-unit-tier-has-no-docker-engine.sock"

#: The three seed cells (torch 2.0.1 with NumPy 1.x, 2.7.0, and 2.14.1: the latest), frozen here
#: so that editing images.yaml never changes what a unit test sees.
SEED_MATRIX = """\
repository: pt-multi-gpu
tag: "{torch}-cuda{cuda}-cudnn{cudnn}-{flavour}"
defaults:
  base: debian:bookworm-slim
  flavour: runtime
  tools:
    - jupyterlab==4.6.6
    - jupyter-server-proxy==4.6.0
    - tensorboard==2.21.0
    - pytest==9.2.0
  apt: []
  pip: []
include:
  - torch: "2.0.1"
    torchvision: "0.15.2"
    cuda: "11.7"
    cudnn: 8
  - torch: "2.7.0"
    torchvision: "0.22.0"
    cuda: "12.6"
    cudnn: 9
  - torch: "2.14.1"
    torchvision: "0.29.1"
    cuda: "13.0"
    cudnn: 9
"""
OLD, MID, LATEST = "2.0.1-cuda11.7-cudnn8-runtime", "2.7.0-cuda12.6-cudnn9-runtime", "2.14.1-cuda13.0-cudnn9-runtime"


def write_matrix(directory: Path, text: str = SEED_MATRIX, name: str = "images.yaml") -> Path:
    """Write a matrix file into `directory` (made if missing) and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def small_matrix(directory: Path, text: str = SEED_MATRIX) -> Matrix:
    """Load `text` (default: the seed cells) as images.yaml in `directory`."""
    return load_matrix(write_matrix(directory, text), "images.yaml")


def cell(matrix: Matrix, name: str) -> ImageSpec:
    """The cell called `name` (a KeyError naming the cells when there is none)."""
    for spec in matrix.cells:
        if spec.name == name:
            return spec
    raise KeyError(f"no cell {name!r}; the matrix has {[c.name for c in matrix.cells]}")


def host_port(container: Any, port: str) -> int:
    """The host port Docker published for `port` (e.g. "8888/tcp") of a docker-py Container."""
    container.reload()
    bindings = (container.attrs["NetworkSettings"]["Ports"] or {}).get(port)
    if not bindings:
        raise AssertionError(f"{port} is not published by container {container.name}")
    return int(bindings[0]["HostPort"])


def load_module(name: str, path: Path) -> ModuleType:
    """Import a file that is not on the path (the in-image modules of smoke_tests/ and entrypoint/)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def smoke_module(name: str) -> ModuleType:
    """An in-image module of smoke_tests/ as the image imports it: by its bare name (smokelib,
    ddp_plan, run_ddp, ...), with smoke_tests/ on sys.path, where its siblings find each other."""
    folder = str(ROOT / "smoke_tests")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return load_module(name, ROOT / "smoke_tests" / f"{name}.py")


def build_py(*args: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`build.py ARGS` as a user runs it (a subprocess in the repository), `env` over this environment."""
    return subprocess.run([sys.executable, str(ROOT / "build.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          check=False, timeout=timeout, env={**os.environ, **(env or {})})


def stop_process(proc: subprocess.Popen[Any], grace: float, sig: int = signal.SIGTERM) -> None:
    """``sig`` (SIGTERM), up to ``grace`` seconds to exit, then SIGKILL; reaped either way."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def vendored_schema(filename: str) -> Any:
    """A validator for a JSON schema check-jsonschema ships (GitHub workflows, the Compose
    Specification, ...): offline, from the dev extra."""
    try:
        import jsonschema
        from check_jsonschema.builtin_schemas import vendor
    except ImportError:
        import pytest

        pytest.fail(f"check-jsonschema (dev extra) vendors {filename}: pip install -e '.[dev]'", pytrace=False)
    schema = json.loads((Path(vendor.__file__).parent / filename).read_text())
    return jsonschema.validators.validator_for(schema)(schema)
