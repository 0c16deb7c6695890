"""For unit tests of locks and of `build.py build` against a fake engine: locks that agree with
images.yaml (or not), written where a build reads them, and a BuildKit CLI that is never run.

The build's lock check (builder.imaging.supply.lock_state) is never stubbed: a test build reads the
lock this module writes, so a stale lock fails it as it fails a real build. Only the fetch and
staging step (supply.prepare: the wheel store, the network) is replaced, by a recorder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from builder.engine import BuildkitCli
from builder.imaging import orchestrate, supply
from builder.lock import model, uvbin
from builder.lock.model import CellLock, Package, Wheel
from builder.lock.target import requirement_name, target, wanted
from builder.matrix import ImageSpec
from tests.support import ROOT

FAKE_CLI = BuildkitCli("/nonexistent/docker", ("build",), {})
PYPI = "https://files.pythonhosted.org/packages/x"


def package(name: str, version: str, layer: str = "tools", filename: str = "") -> Package:
    filename = filename or f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    return Package(name, version, layer, Wheel(filename, f"{PYPI}/{filename}", 10, f"{abs(hash(name)):064x}"[:64]))


def lock_for(spec: ImageSpec, extra: tuple[Package, ...] = ()) -> CellLock:
    """A lock that agrees with images.yaml for `spec` (what `build.py lock` would record)."""
    reqs = wanted(spec)
    pins = {requirement_name(r): (r.split("==")[1] if "==" in r else "1.0") for layer in reqs.values() for r in layer}
    layer_of = {requirement_name(r): layer for layer, rs in reqs.items() for r in rs}
    pkgs = tuple(package(n, v, layer_of[n]) for n, v in sorted(pins.items()))
    return CellLock(spec.name, target(spec), reqs, pkgs + extra)


def write_lock(lock_root: Path, lock: CellLock) -> Path:
    """`lock` as `build.py lock` writes it under `lock_root`, beside the project's uv lock."""
    path = model.lock_path(lock_root, lock.cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(model.dumps(lock), encoding="utf-8")
    uv = uvbin.uv_lock_path(lock_root)
    if not uv.exists():
        shutil.copy(uvbin.uv_lock_path(ROOT), uv)
    return path


def stub_prepare(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Patch orchestrate's BuildKit lookup and the supply stage's fetch and staging (not its lock
    check); returns the cells it was asked to stage (in order)."""
    staged: list[str] = []
    monkeypatch.setattr(orchestrate, "find_buildkit_cli", lambda: FAKE_CLI)
    monkeypatch.setattr(supply, "prepare", lambda spec, *a, **k: staged.append(spec.name))
    return staged
