"""`build.py lock --check` (part of `make lint`): do images.yaml and the committed locks agree? (offline)

Each lock records what it was resolved from: the cell's requirements per layer and its target.
A disagreement names the cell and the difference: a changed pin or tool, a new cell without a
lock, a lock for a cell that is gone, another Python or platform. `build.py build` runs the same
check for the cells it builds, before anything else (a stale lock would build what images.yaml
no longer says).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from builder.common.errors import InputError
from builder.lock import model, uvbin
from builder.lock.model import CellLock
from builder.lock.target import LAYERS, requirement_name, target, wanted
from builder.matrix import ImageSpec


def _relock(cell: str) -> str:
    return f"run `build.py lock --only {cell}`"


def compare(spec: ImageSpec, lock: CellLock) -> list[str]:
    """Every difference between what images.yaml asks of a cell and what its lock was made from."""
    out: list[str] = []
    name = spec.name
    if lock.cell != name:
        out.append(f"{name}: its lock says it is for cell {lock.cell!r}")
    tgt = target(spec)
    for what, want, have in (("Python", tgt.python, lock.target.python), ("platform", tgt.platform,
                             lock.target.platform), ("index", tgt.index, lock.target.index)):
        if want != have:
            out.append(f"{name}: {what}: images.yaml says {want}, the lock was resolved for {have}")
    want_layers = wanted(spec)
    for layer in LAYERS:
        asked, made = set(want_layers[layer]), set(lock.requirements.get(layer, ()))
        if asked == made:
            continue
        by_name_have = {requirement_name(r): r for r in made - asked}
        for req in sorted(asked - made):
            old = by_name_have.pop(requirement_name(req), None)
            out.append(f"{name}: {layer}: images.yaml has {req}, the lock was made for {old}" if old else
                       f"{name}: {layer}: images.yaml adds {req}, the lock does not have it")
        for old in sorted(by_name_have.values()):
            out.append(f"{name}: {layer}: the lock was made with {old}, images.yaml no longer has it")
    pins = lock.pins()
    for layer in LAYERS:
        for req in want_layers[layer]:
            dist = requirement_name(req)
            if dist not in pins:
                out.append(f"{name}: {dist} is not in the lock")
            elif "==" in req and not req.endswith(".*") and req.split("==", 1)[1].strip() != pins[dist]:
                out.append(f"{name}: images.yaml pins {req}, the lock has {dist}=={pins[dist]}")
    return out


def check_cell(spec: ImageSpec, lock_root: Path) -> tuple[CellLock | None, list[str]]:
    """(the lock, its differences from images.yaml); (None, [why]) when there is none."""
    path = model.lock_path(lock_root, spec.name)
    if not path.exists():
        return None, [f"{spec.name}: no lock ({path.relative_to(lock_root)} is missing: a new cell?)"]
    lock = model.read(path)
    return lock, compare(spec, lock)


def stale_locks(lock_root: Path, cells: Sequence[ImageSpec]) -> list[str]:
    """Lock folders for cells images.yaml no longer has."""
    names = {c.name for c in cells}
    base = lock_root / model.LOCK_DIR
    if not base.is_dir():
        return []
    return [f"{p.name}: a lock for a cell images.yaml does not have ({p.relative_to(lock_root)}); "
            "`build.py lock` removes it" for p in sorted(base.iterdir())
            if p.is_dir() and (p / model.LOCK_NAME).exists() and p.name not in names]


def check(lock_root: Path, selected: Sequence[ImageSpec], all_cells: Sequence[ImageSpec]) -> list[str]:
    """Every disagreement, one line each (empty: the locks match images.yaml)."""
    problems: list[str] = []
    for spec in selected:
        try:
            _lock, diffs = check_cell(spec, lock_root)
        except InputError as exc:
            diffs = [f"{spec.name}: {line}" for line in exc.lines]
        problems += diffs
    if len(selected) == len(all_cells):
        problems += stale_locks(lock_root, all_cells)
    try:
        version, wheels = uvbin.read(lock_root)
        if version != uvbin.UV_VERSION or set(wheels) != set(uvbin.HOST_PLATFORMS):
            problems.append(f"{uvbin.UV_LOCK}: pins uv {version} for {', '.join(sorted(wheels))}; builds use uv "
                            f"{uvbin.UV_VERSION} for {', '.join(sorted(uvbin.HOST_PLATFORMS))}")
    except InputError as exc:
        problems += list(exc.lines)
    return problems


def fix_hint(problems: Sequence[str]) -> str:
    cells = sorted({p.split(":", 1)[0] for p in problems if not p.startswith(uvbin.UV_LOCK)})
    only = " ".join(f"--only {c}" for c in cells if not c.endswith(".toml"))
    return f"fix: {_relock(cells[0]) if len(cells) == 1 else 'run `build.py lock' + (' ' + only if only else '') + '`'}"
