"""For unit tests of `build.py build` against a fake engine: a BuildKit CLI that is never run,
and a supply stage that neither reads locks/ nor fills the wheel store (no network, no disk)."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.build import orchestrate, supply
from builder.engine import BuildkitCli
from builder.lock.model import CellLock
from builder.lock.target import target
from builder.spec import ImageSpec

FAKE_CLI = BuildkitCli("/nonexistent/docker", ("build",), {})


def fake_lock_state(spec: ImageSpec, lock_root: Path) -> supply.LockState:
    lock = CellLock(spec.name, target(spec), {}, ())
    return supply.LockState(lock, lock_root / "locks" / spec.name / "pylock.toml", "sha256:" + "1" * 64,
                            "sha256:" + "2" * 64)


def stub_supply(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Patch orchestrate's supply stage; returns the cells it was asked to stage (in order)."""
    staged: list[str] = []
    monkeypatch.setattr(orchestrate, "find_buildkit_cli", lambda: FAKE_CLI)
    monkeypatch.setattr(supply, "lock_state", fake_lock_state)
    monkeypatch.setattr(supply, "prepare", lambda spec, *a, **k: staged.append(spec.name))
    return staged
