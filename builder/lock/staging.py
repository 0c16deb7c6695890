"""A build's context folder: what the image may see, and the cell's verified wheels (pure file work).

``.build/context-<slot>/`` (one per parallel build slot: two cells never share one) holds

- hard links to the files the Dockerfile copies or bind-mounts (``builder.imaging.inputs.
  context_files``: exactly what the inputs hash covers, so the context IS the hashed input);
- ``wheelhouse/<layer>/``: hard links into the wheel store, one folder per installing RUN
  (cuda, torch, tools, devel: ``INSTALL_LAYERS``; the lock's torch layer is two of them,
  ``builder.lock.target.install_layer``), so each RUN's cache key is exactly its own wheels; empty when the wheels
  reach the RUNs from the wheel server instead (builder.lock.wheelserver);
- ``wheelhouse/<layer>.txt``: that layer's install lock (``name==version --hash=sha256:...``);
- ``wheelhouse/uv``: the static uv for the build host, from its hash-verified wheel;
- ``wheelhouse/sbom-input.json``: the lock's hashes and the cell's facts for the SBOM;
- ``wheelhouse/pip-constraint.txt``: the image's pip constraint (:func:`pip_constraint`).

The paths inside the context are the same for every cell and slot, so the Dockerfile text (and
with it BuildKit's layer cache) does not depend on where a cell was staged. Files that did not
change keep their inode and mtime, so BuildKit's context sync re-sends only what changed since
the slot's previous build (about 30 s for a 3 GB cell switch on a 2-core host).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ptmg_contract as contract
from builder.lock.model import CellLock, requirements_txt
from builder.render.dockerfile import INSTALL_LAYERS

BUILD_DIR = ".build"
WHEELHOUSE = "wheelhouse"
UV = f"{WHEELHOUSE}/uv"
SBOM_INPUT = f"{WHEELHOUSE}/sbom-input.json"
PIP_CONSTRAINT = f"{WHEELHOUSE}/pip-constraint.txt"


def layer_dir(layer: str) -> str:
    return f"{WHEELHOUSE}/{layer}"


def layer_requirements(layer: str) -> str:
    return f"{WHEELHOUSE}/{layer}.txt"


def context_dir(root: Path, slot: int) -> Path:
    return root / BUILD_DIR / f"context-{slot}"


def _same_file(a: Path, b: Path) -> bool:
    try:
        sa, sb = a.stat(), b.stat()
    except FileNotFoundError:
        return False
    return (sa.st_ino, sa.st_dev) == (sb.st_ino, sb.st_dev)


def link(src: Path, dst: Path) -> None:
    """``dst`` becomes a hard link to ``src`` (a copy across filesystems); untouched when it already is."""
    if _same_file(src, dst):
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copy2(src, tmp)
    tmp.replace(dst)


def write_if_changed(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write only when the bytes differ, so an unchanged file keeps its mtime (BuildKit re-sends nothing)."""
    try:
        if path.read_bytes() == data:
            return
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    tmp.replace(path)


def sync_tree(dest: Path, wanted: Mapping[str, Path], keep: frozenset[str] = frozenset()) -> None:
    """``dest`` holds exactly ``wanted`` (relative path -> source file, linked) and the files named in
    ``keep`` (left as they are): everything else is removed."""
    for rel, src in wanted.items():
        link(src, dest / rel)
    if not dest.is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        return
    for path in sorted(dest.rglob("*"), reverse=True):
        rel = path.relative_to(dest).as_posix()
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()) and not any(w.startswith(rel + "/") for w in wanted):
                path.rmdir()
        elif rel not in wanted and rel not in keep:
            path.unlink()


def stage(ctx: Path, root: Path, files: Sequence[Path], lock: CellLock, wheel_file: Mapping[str, Path] | None,
          uv_binary: bytes, sbom_input: Mapping[str, Any]) -> None:
    """Make ``ctx`` the build context of ``lock``'s cell. ``wheel_file``: filename -> its verified store file;
    None when the RUNs take the wheels from the wheel server (the layer folders stay empty; the
    install locks, which key each RUN's cache, are staged either way)."""
    sources = {p.relative_to(root).as_posix(): p for p in files}
    wh_files: dict[str, Path] = {}
    if wheel_file is not None:  # None: the layer folders stay empty
        for layer in INSTALL_LAYERS:
            for p in lock.install_layer(layer):
                wh_files[f"{layer_dir(layer)}/{p.wheel.filename}"] = wheel_file[p.wheel.filename]
    made = frozenset({UV, SBOM_INPUT, PIP_CONSTRAINT, *(layer_requirements(layer) for layer in INSTALL_LAYERS)})
    sync_tree(ctx, {**sources, **wh_files}, made)  # everything else goes
    for layer in INSTALL_LAYERS:
        (ctx / layer_dir(layer)).mkdir(parents=True, exist_ok=True)
        write_if_changed(ctx / layer_requirements(layer), requirements_txt(lock.install_layer(layer)).encode())
    write_if_changed(ctx / UV, uv_binary, 0o755)
    write_if_changed(ctx / SBOM_INPUT, (json.dumps(sbom_input, indent=1, sort_keys=True) + "\n").encode())
    write_if_changed(ctx / PIP_CONSTRAINT, pip_constraint(lock).encode())


def constrained(name: str) -> bool:
    """Whether the image pins this distribution exactly: torch, its companions, Triton, the CUDA wheels."""
    return name in contract.CONSTRAINED_NAMES or name.startswith(contract.CONSTRAINED_PREFIXES)


def pip_constraint(lock: CellLock) -> str:
    """The image's pip constraint file: the lock's exact versions of torch, torchvision, Triton and
    the CUDA wheels, and the release's limits on its neighbours (``numpy<2``, ``setuptools<82``:
    the lock's requirements that are neither a pin nor a bare name). Anything else stays free."""
    pins = [f"{p.name}=={p.version}" for p in lock.packages if constrained(p.name)]
    limits = sorted({r for reqs in lock.requirements.values() for r in reqs
                     if "==" not in r and any(op in r for op in "<>!~")})
    head = (f"# pt-multi-gpu {lock.cell}: what `pip install` and `uv pip install` may not change\n"
            f"# (PIP_CONSTRAINT, UV_CONSTRAINT). To install without it, for one command:\n"
            f"#   PIP_CONSTRAINT= pip install ...     UV_CONSTRAINT= uv pip install ...\n")
    return head + "".join(f"{line}\n" for line in [*sorted(pins), *limits])


def sbom_input(lock: CellLock, facts: Mapping[str, str], lock_file: str, lock_digest: str) -> dict[str, Any]:
    """What imagebuild/sbom.py needs from the host: each distribution's wheel and sha256, the cell's facts."""
    return {
        "cell": lock.cell,
        "lock": {"file": lock_file, "digest": lock_digest, "target": lock.target.platform,
                 "python": lock.target.python},
        "facts": dict(sorted(facts.items())),
        "packages": {p.name: {"version": p.version, "sha256": p.wheel.sha256, "url": p.wheel.url,
                              "filename": p.wheel.filename, "layer": p.layer} for p in lock.packages},
    }
