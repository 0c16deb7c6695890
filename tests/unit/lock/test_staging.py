"""The build context's file work (builder/lock/staging.py), one rule at a time: a link replaces a
different file and leaves the same one alone, a copy where no link can be made, a tree holding
exactly what is wanted and kept, the context staged without wheels (the wheel server), the files
written with their modes, and the pip constraint's exact lines. tests/unit/lock/test_store.py
stages a whole context."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from builder.lock import staging
from builder.lock.model import CellLock, Package, Wheel
from builder.lock.target import Target


def test_a_link_replaces_a_different_file_and_leaves_the_same_one_alone(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "ctx" / "dst"
    src.write_text("new")
    dst.parent.mkdir()
    dst.write_text("old")
    staging.link(src, dst)
    assert dst.stat().st_ino == src.stat().st_ino and dst.read_text() == "new"
    os.utime(dst, ns=(1, 1))
    staging.link(src, dst)  # already the same file: untouched
    assert dst.stat().st_mtime_ns == 1 and not (dst.parent / ".dst.tmp").exists()


@pytest.mark.parametrize("code", [errno.EXDEV, errno.EPERM, errno.EMLINK])
def test_where_no_link_can_be_made_the_file_is_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      code: int) -> None:
    """Another filesystem (EXDEV), a filesystem without hard links (EPERM), too many links (EMLINK)."""
    def no_link(a: object, b: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "link", no_link)
    src, dst = tmp_path / "src", tmp_path / "d" / "dst"
    src.write_text("wheel")
    staging.link(src, dst)
    assert dst.read_text() == "wheel" and dst.stat().st_ino != src.stat().st_ino


def test_any_other_link_error_is_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_link(a: object, b: object) -> None:
        raise OSError(errno.EACCES, "denied")

    monkeypatch.setattr(os, "link", no_link)
    (tmp_path / "src").write_text("x")
    with pytest.raises(PermissionError):
        staging.link(tmp_path / "src", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_a_tree_holds_exactly_what_is_wanted_and_kept(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_text("s")
    dest = tmp_path / "ctx"
    for rel in ("stray/empty", "old/gone.txt", "keepdir/kept.txt", "want/x"):
        path = dest / rel
        if "." in rel or rel == "want/x":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("old")
        else:
            path.mkdir(parents=True)
    staging.sync_tree(dest, {"want/x": src, "want/deep/y": src, "n1/n2/z": src}, frozenset({"keepdir/kept.txt"}))
    got = sorted(p.relative_to(dest).as_posix() + ("/" if p.is_dir() else "") for p in dest.rglob("*"))
    assert got == ["keepdir/", "keepdir/kept.txt", "n1/", "n1/n2/", "n1/n2/z", "want/", "want/deep/", "want/deep/y",
                   "want/x"]


def test_an_empty_tree_is_made_with_its_parents(tmp_path: Path) -> None:
    dest = tmp_path / "a" / "b" / "ctx"
    staging.sync_tree(dest, {})
    assert dest.is_dir() and not any(dest.iterdir())


def _lock() -> CellLock:
    pkgs = (Package("torch", "2.7.0", "torch", Wheel("torch-2.7.0-x.whl", "u", 1, "a" * 64)),
            Package("nvidia-nccl-cu12", "2.26.2", "torch", Wheel("nvidia_nccl_cu12-2.26.2-x.whl", "u", 1, "b" * 64)),
            Package("jupyterlab", "4.6.6", "tools", Wheel("jupyterlab-4.6.6-x.whl", "u", 1, "c" * 64)))
    reqs = {"torch": ("torch==2.7.0", "numpy<2"), "tools": ("jupyterlab==4.6.6", "setuptools<82", "tensorboard")}
    return CellLock("c", Target("3.12", "x86_64-manylinux_2_36", "i"), reqs, pkgs)


def test_a_context_for_the_wheel_server_has_empty_layer_folders_and_every_made_file(tmp_path: Path) -> None:
    root = tmp_path / "project"
    root.mkdir()
    ctx = root / ".build" / "context-0"
    staging.stage(ctx, root, [], _lock(), None, b"UV", {"z": 1, "a": {"y": 2, "b": 3}})
    assert sorted(p.relative_to(ctx).as_posix() for p in ctx.rglob("*")) == [
        "wheelhouse", "wheelhouse/cuda", "wheelhouse/cuda.txt",
        "wheelhouse/devel", "wheelhouse/devel.txt", "wheelhouse/pip-constraint.txt",
        "wheelhouse/sbom-input.json", "wheelhouse/tools", "wheelhouse/tools.txt", "wheelhouse/torch",
        "wheelhouse/torch.txt", "wheelhouse/uv"]
    assert (ctx / "wheelhouse/uv").stat().st_mode & 0o777 == 0o755
    assert (ctx / "wheelhouse/uv").read_bytes() == b"UV"
    assert (ctx / "wheelhouse/pip-constraint.txt").stat().st_mode & 0o777 == 0o644
    assert (ctx / "wheelhouse/sbom-input.json").read_text() == '{\n "a": {\n  "b": 3,\n  "y": 2\n },\n "z": 1\n}\n'


def test_the_lock_s_torch_layer_installs_in_two_runs_its_cuda_wheels_first(tmp_path: Path) -> None:
    """The CUDA wheels (nvidia-*) of the lock's torch layer get their own RUN and wheel folder ("cuda"), so a
    new torch over the same CUDA wheels keeps their layer; torch keeps the rest of its layer."""
    root = tmp_path / "project"
    root.mkdir()
    lock = _lock()
    store = {p.wheel.filename: tmp_path / p.wheel.filename for p in lock.packages}
    for f in store.values():
        f.write_bytes(b"w")
    ctx = root / ".build" / "context-0"
    staging.stage(ctx, root, [], lock, store, b"UV", {})
    layers = {d.name: sorted(f.name for f in d.iterdir()) for d in (ctx / "wheelhouse").iterdir() if d.is_dir()}
    assert layers == {"cuda": ["nvidia_nccl_cu12-2.26.2-x.whl"], "torch": ["torch-2.7.0-x.whl"],
                      "tools": ["jupyterlab-4.6.6-x.whl"], "devel": []}
    assert (ctx / "wheelhouse/cuda.txt").read_text().startswith("nvidia-nccl-cu12==2.26.2 \\")
    assert (ctx / "wheelhouse/torch.txt").read_text().startswith("torch==2.7.0 \\")
    assert [p.name for p in lock.install_layer("cuda")] == ["nvidia-nccl-cu12"]
    assert [p.name for p in lock.layer("torch")] == ["torch", "nvidia-nccl-cu12"]  # the lock's own layers stay


def test_the_constraint_pins_the_cuda_stack_exactly_and_keeps_only_the_limits() -> None:
    text = staging.pip_constraint(_lock())
    assert [ln for ln in text.splitlines() if not ln.startswith("#")] == [
        "nvidia-nccl-cu12==2.26.2", "torch==2.7.0", "numpy<2", "setuptools<82"]
    assert text.splitlines()[0] == "# pt-multi-gpu c: what `pip install` and `uv pip install` may not change"


def test_the_sbom_input_names_each_wheel_and_its_hash() -> None:
    got = staging.sbom_input(_lock(), {"b": "2", "a": "1"}, "locks/c.toml", "sha256:" + "d" * 64)
    assert list(got["facts"]) == ["a", "b"] and got["lock"] == {
        "file": "locks/c.toml", "digest": "sha256:" + "d" * 64, "target": "x86_64-manylinux_2_36", "python": "3.12"}
    assert got["packages"]["torch"] == {"version": "2.7.0", "sha256": "a" * 64, "url": "u",
                                        "filename": "torch-2.7.0-x.whl", "layer": "torch"}


def test_a_written_file_gets_its_folders_and_its_mode_and_is_rewritten_only_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "f"
    staging.write_if_changed(path, b"one", 0o755)
    assert path.read_bytes() == b"one" and path.stat().st_mode & 0o777 == 0o755
    os.utime(path, ns=(1, 1))
    staging.write_if_changed(path, b"one")
    assert path.stat().st_mtime_ns == 1
    staging.write_if_changed(path, b"two")
    assert path.read_bytes() == b"two" and path.stat().st_mode & 0o777 == 0o644
