"""The build refuses a stale lock: builder.imaging.supply.lock_state on its own, and `build.py build`'s
orchestration against a fake engine, where a lock that no longer says what images.yaml says (or
no lock at all) fails the cell before anything is fetched, staged or built."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.common.errors import InputError
from builder.imaging import orchestrate, os_snapshot, supply
from builder.lock import model
from builder.lock.model import CellLock
from builder.matrix import ImageSpec
from tests.support import MID, ROOT, cell, small_matrix
from tests.unit.imaging.test_orchestrate import FakeEngine
from tests.unit.imaging.test_os_snapshot import Mirror
from tests.unit.supply_fakes import lock_for, package, stub_prepare, write_lock


@pytest.fixture
def spec(tmp_path: Path) -> ImageSpec:
    return cell(small_matrix(tmp_path / "m"), MID)


def stale_lock(spec: ImageSpec) -> CellLock:
    """The lock of images.yaml's previous jupyterlab pin: its requirements and its package."""
    good = lock_for(spec)
    reqs = dict(good.requirements)
    reqs["tools"] = tuple(r.replace("jupyterlab==4.6.6", "jupyterlab==4.6.5") for r in reqs["tools"])
    pkgs = tuple(package(p.name, "4.6.5", p.layer) if p.name == "jupyterlab" else p for p in good.packages)
    return CellLock(spec.name, good.target, reqs, pkgs)


def _build(spec: ImageSpec, tmp_path: Path, engine: FakeEngine) -> orchestrate.CellResult:
    cfg = orchestrate.BuildConfig(root=ROOT, docker_dir=tmp_path / "docker", log_dir=tmp_path / "logs",
                                  os_snapshots=os_snapshot.Snapshots(environ={}, get=Mirror().get),
                                  lock_root=tmp_path / "lock-root")
    (result,) = orchestrate.build_all(engine, [spec], cfg, lambda _c, _l: None)  # type: ignore[arg-type]
    return result



def test_lock_state_of_a_matching_lock(spec: ImageSpec, tmp_path: Path) -> None:
    path = write_lock(tmp_path, lock_for(spec))
    state = supply.lock_state(spec, tmp_path)
    assert state.path == path and state.lock == model.read(path)
    assert state.digest == model.digest(path.read_text(encoding="utf-8"))
    assert state.inputs.startswith(state.digest + " uv:")


def test_lock_state_refuses_a_stale_lock_with_the_difference_and_the_fix(spec: ImageSpec, tmp_path: Path) -> None:
    write_lock(tmp_path, stale_lock(spec))
    with pytest.raises(InputError) as exc:
        supply.lock_state(spec, tmp_path)
    assert exc.value.lines[0] == (f"{spec.name}: tools: images.yaml has jupyterlab==4.6.6, the lock was made for "
                                  "jupyterlab==4.6.5")
    assert f"{spec.name}: images.yaml pins jupyterlab==4.6.6, the lock has jupyterlab==4.6.5" in exc.value.lines
    assert f"fix: run `build.py lock --only {spec.name}`" in exc.value.lines[-1]


def test_lock_state_refuses_a_missing_lock(spec: ImageSpec, tmp_path: Path) -> None:
    with pytest.raises(InputError, match=rf"{spec.name}: no lock \(locks/{spec.name}/pylock.toml is missing"):
        supply.lock_state(spec, tmp_path)


@pytest.mark.parametrize("lock", ["stale", "missing"])
def test_the_build_refuses_a_stale_or_missing_lock_before_anything_else(spec: ImageSpec, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         lock: str) -> None:
    staged = stub_prepare(monkeypatch)
    lock_root = tmp_path / "lock-root"
    if lock == "stale":
        write_lock(lock_root, stale_lock(spec))
    engine = FakeEngine(spec)
    result = _build(spec, tmp_path, engine)
    assert result.status == "failed"
    assert f"run `build.py lock --only {spec.name}`" in result.message
    assert ("images.yaml has jupyterlab==4.6.6" if lock == "stale" else "no lock") in result.message
    assert engine.builds == [] and staged == [], "nothing is fetched, staged or built from a stale lock"
    # The control: the same build with the lock images.yaml asks for goes through.
    write_lock(lock_root, lock_for(spec))
    again = _build(spec, tmp_path, engine)
    assert again.status == "built" and staged == [spec.name] and len(engine.builds) == 1


def test_a_new_lock_rebuilds_an_otherwise_unchanged_cell(spec: ImageSpec, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock file is one of the build's inputs: the same images.yaml with another lock (a
    dependency re-resolved) is built again, not skipped as unchanged."""
    stub_prepare(monkeypatch)
    engine = FakeEngine(spec)
    write_lock(tmp_path / "lock-root", lock_for(spec))
    assert _build(spec, tmp_path, engine).status == "built"
    assert _build(spec, tmp_path, engine).status == "skipped"
    write_lock(tmp_path / "lock-root", lock_for(spec, extra=(package("typing-extensions", "4.16.0"),)))
    rebuilt = _build(spec, tmp_path, engine)
    assert rebuilt.status == "built" and len(engine.builds) == 2, rebuilt.message


def test_without_buildkit_nothing_is_built_or_staged(spec: ImageSpec, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The classic builder cannot bind-mount the locked wheels into the installing RUNs: refused."""
    staged = stub_prepare(monkeypatch)
    monkeypatch.setattr(orchestrate, "find_buildkit_cli", lambda: None)
    monkeypatch.setattr(orchestrate, "missing_builder", lambda: None)  # no docker CLI at all: the classic builder
    write_lock(tmp_path / "lock-root", lock_for(spec))
    engine = FakeEngine(spec)
    r = _build(spec, tmp_path, engine)
    assert r.status == "failed" and r.message == supply.CLASSIC_REFUSAL
    assert engine.builds == [] and staged == []
