"""imagebuild/shared-tree.sh: the shared trees (the image's first layers, dockerfile/07-shared.j2), as uv's
--target leaves them in their stages, made into the same bytes whenever and wherever a stage runs and
owned like the venv: the CUDA wheels whole, and of the torch set only the files no Python changes; then
the venv's copies of those become links to them (`link`), and only where the bytes are the same."""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

import ptmg_contract as contract
from builder.render import dockerfile

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "imagebuild" / "shared-tree.sh"
EPOCH = dockerfile.SOURCE_DATE_EPOCH
# As root (the stage's RUN), the venv's owner; elsewhere this user's own ids, which it may give.
IDS = (contract.UID, contract.VENV_GID) if os.geteuid() == 0 else (os.getuid(), os.getgid())


def run(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = ["sh", str(SCRIPT), *(args or ("cuda", str(out), contract.CUDA_WHEELS, str(IDS[0]), str(IDS[1]), EPOCH))]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def owned_like_the_venv(tree: Path) -> None:
    for path in [tree, *tree.rglob("*")]:
        st = path.lstat()
        assert (st.st_uid, st.st_gid) == IDS, path
        assert st.st_mode & stat.S_IWGRP, path
        assert not stat.S_ISDIR(st.st_mode) or st.st_mode & stat.S_ISGID, path
        assert st.st_mtime == int(EPOCH), path


def unpacked(out: Path, umask: int = 0o022) -> Path:
    """What uv's --target leaves: packages, dist-info with uv's install record, a __pycache__."""
    old = os.umask(umask)
    try:
        tree = out / contract.CUDA_WHEELS.lstrip("/")
        lib = tree / "nvidia" / "cublas" / "lib"
        lib.mkdir(parents=True)
        (lib / "libcublas.so.13").write_bytes(b"\x7fELF" + b"\0" * 4096)
        (lib / "libcublas.so.13").chmod(0o755)
        for name in ("libcupti.so.13", "libcupti.so", "libcupti.so.2026"):  # one library, three names (Triton's)
            (lib / name).write_bytes(b"CUPTI" * 2000)
        (lib / "libnvperf host.so").write_bytes(b"NVPRF" * 2000)  # CUPTI's size, other bytes (and a space)
        (tree / "nvidia" / "cublas" / "__init__.py").write_text("")
        (tree / "nvidia" / "cublas" / "__pycache__").mkdir()
        (tree / "nvidia" / "cublas" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"pyc")
        info = tree / "nvidia_cublas-13.1.0.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Name: nvidia-cublas\nVersion: 13.1.0.3\n")
        (info / "uv_cache.json").write_text(f'{{"timestamp": {time.time_ns()}}}')
        (info / "RECORD").write_text("nvidia/cublas/__init__.py,,\nnvidia_cublas-13.1.0.3.dist-info/uv_cache.json,,\n"
                                     "nvidia_cublas-13.1.0.3.dist-info/RECORD,,\n")
        (tree / ".lock").write_text("")
    finally:
        os.umask(old)
    return tree


def layer(out: Path) -> bytes:
    """A layer's tar of OUT, as a tar writer walks it (sorted; owners, modes and times kept)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(out.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(out)), recursive=False)
    return buf.getvalue()


def test_the_tree_is_the_venvs_and_keeps_no_python_or_time_of_its_own(tmp_path: Path) -> None:
    tree = unpacked(tmp_path)
    done = run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"shared-tree.sh: {tree}: ")
    info = tree / "nvidia_cublas-13.1.0.3.dist-info"
    assert not (info / "uv_cache.json").exists() and not (tree / ".lock").exists()
    assert "uv_cache.json" not in (info / "RECORD").read_text()
    assert not list(tree.rglob("__pycache__"))
    owned_like_the_venv(tree)
    assert stat.S_IMODE((tree / "nvidia/cublas/lib/libcublas.so.13").stat().st_mode) == 0o775
    cupti = [(tree / "nvidia/cublas/lib" / n).stat() for n in ("libcupti.so", "libcupti.so.13", "libcupti.so.2026")]
    assert len({st.st_ino for st in cupti}) == 1 and cupti[0].st_nlink == 3  # the same bytes: one inode
    assert (tree / "nvidia/cublas/lib/libcublas.so.13").stat().st_nlink == 1
    assert (tree / "nvidia/cublas/lib/libnvperf host.so").stat().st_nlink == 1  # the same size is not the same bytes
    for above in (tmp_path / "opt",):
        st = above.lstat()
        assert stat.S_IMODE(st.st_mode) == 0o755 and st.st_mtime == int(EPOCH), above
        if os.geteuid() == 0:
            assert (st.st_uid, st.st_gid) == (0, 0)


def test_two_stages_at_other_times_and_umasks_give_the_same_layer(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    unpacked(first)
    time.sleep(1.1)
    unpacked(second, umask=0o077)
    assert layer(first) != layer(second)
    assert run(first).returncode == 0 and run(second).returncode == 0
    assert layer(first) == layer(second)


def test_a_lock_without_cuda_wheels_gives_an_empty_tree(tmp_path: Path) -> None:
    tree = tmp_path / contract.CUDA_WHEELS.lstrip("/")
    tree.mkdir(parents=True)  # what uv's --target leaves for an empty install lock
    done = run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert not list(tree.iterdir())
    owned_like_the_venv(tree)


@pytest.mark.parametrize(("make", "why"), [
    (lambda tree: (tree / "bin").mkdir(), "a CUDA wheel installs programs"),
    (lambda tree: os.rename(tree / "nvidia", tree / "nvidia-x"), "the CUDA wheels were unpacked elsewhere"),
])
def test_a_tree_the_venv_cannot_link_fails_the_build(tmp_path: Path, make: object, why: str) -> None:
    tree = unpacked(tmp_path)
    make(tree)  # type: ignore[operator]
    done = run(tmp_path)
    assert done.returncode == 1 and why in done.stderr, done.stderr


@pytest.mark.parametrize("args", [("cuda", "x"), ("torch", "a", "b", "c", "1", "2", "3", "--strip"), ("link", "x"),
                                  ("link", "a", "b", "c", "d"), ("prune", "x"), ("nothing",), ()])
def test_wrong_arguments_exit_2(args: tuple[str, ...]) -> None:
    done = subprocess.run(["sh", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stderr.startswith("usage: shared-tree.sh cuda OUT TREE"), done.stderr


# --- torch: the files no Python changes, and the venv's links to them -------------------------------------

#: (path in site-packages, bytes in the cp311 wheel, bytes in the cp313 wheel): what torch 2.14.1 and
#: Triton 3.8.0 hold, in small (their RECORDs: these differ, every other file of torch/lib is equal).
TORCH_SET = [
    ("torch/lib/libc10.so", b"c10", b"c10"),
    ("torch/lib/libtorch_cuda.so", b"cuda", b"cuda"),
    ("torch/lib/libtorch_cpu.so", b"cpu 3.11", b"cpu 3.13"),
    ("torch/lib/libtorch_python.so", b"python 3.11", b"python 3.13"),
    ("torch/__init__.py", b"import torch", b"import torch"),
    ("torch/_C.cpython-311-x86_64-linux-gnu.so", b"_C", b"_C"),
    ("triton/backends/nvidia/bin/ptxas", b"ptxas", b"ptxas"),
    ("triton/backends/nvidia/bin/ptxas-blackwell", b"ptxas bw", b"ptxas bw"),
    ("triton/backends/nvidia/lib/cupti/libcupti_static.a", b"static", b"static"),
    ("triton/_C/libtriton.so", b"triton 3.11", b"triton 3.13"),
]
SHARED = {"torch/lib/libc10.so", "torch/lib/libtorch_cuda.so", "triton/backends/nvidia/bin/ptxas",
          "triton/backends/nvidia/bin/ptxas-blackwell"}


def unpack_torch_set(where: Path, python: int) -> Path:
    for path, *data in TORCH_SET:
        (where / path).parent.mkdir(parents=True, exist_ok=True)
        (where / path).write_bytes(data[python - 1])
    (where / "triton/backends/nvidia/bin/ptxas").chmod(0o755)
    return where


def torch_files(tmp_path: Path, python: int, *extra: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path / f"out{python}"
    unpacked = unpack_torch_set(tmp_path / f"set{python}", python)
    done = run(out, "torch", str(unpacked), str(out), contract.TORCH_FILES, str(IDS[0]), str(IDS[1]), EPOCH, *extra)
    assert done.returncode == 0, done.stderr
    assert not unpacked.exists()
    return out, done


def test_torch_keeps_only_the_files_no_python_changes_and_both_pythons_give_the_same_layer(tmp_path: Path) -> None:
    out311, _ = torch_files(tmp_path, 1)
    out313, _ = torch_files(tmp_path, 2)
    tree = out311 / contract.TORCH_FILES.lstrip("/")
    assert {p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()} == SHARED
    owned_like_the_venv(tree)
    assert stat.S_IMODE((tree / "triton/backends/nvidia/bin/ptxas").stat().st_mode) == 0o775
    assert layer(out311) == layer(out313)


def test_torch_drops_blackwells_ptxas_where_slim_venv_does(tmp_path: Path) -> None:
    out, _ = torch_files(tmp_path, 1, "--drop-ptxas-blackwell")
    tree = out / contract.TORCH_FILES.lstrip("/")
    assert {p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()} == \
        SHARED - {"triton/backends/nvidia/bin/ptxas-blackwell"}


def test_link_makes_each_equal_file_a_relative_link_and_keeps_the_rest(tmp_path: Path) -> None:
    out, _ = torch_files(tmp_path, 1)
    tree = out / contract.TORCH_FILES.lstrip("/")
    sp = unpack_torch_set(tmp_path / "venv" / "site-packages", 2)  # the venv's own copy, as uv installed it
    (sp / "torch/lib/libtorch_cuda.so").write_bytes(b"cuda, another build")  # not the same bytes: stays
    done = run(out, "link", str(tree), str(sp))
    assert done.returncode == 0, done.stderr
    linked = {p.relative_to(sp).as_posix() for p in sp.rglob("*") if p.is_symlink()}
    assert linked == SHARED - {"torch/lib/libtorch_cuda.so"}
    for path in linked:
        target = os.readlink(sp / path)
        assert not target.startswith("/"), target  # relative: right in the image and in an unpacked rootfs
        assert (sp / path).resolve() == (tree / path).resolve()
        assert (sp / path).read_bytes() == (tree / path).read_bytes()
    assert (sp / "torch/lib/libtorch_cuda.so").read_bytes() == b"cuda, another build"
    assert (sp / "torch/lib/libtorch_python.so").read_bytes() == b"python 3.13"
    assert "3 files (0 MiB) are links to" in done.stdout and "1 of its files are not the venv's" in done.stdout
    again = run(out, "link", str(tree), str(sp))  # a second pass changes nothing
    assert again.returncode == 0 and "0 files (0 MiB) are links" in again.stdout


def uv_cache(where: Path, python: int) -> Path:
    """uv's cache as the torch files' stage leaves it: each wheel unpacked at archive-v0/<id>/."""
    unpack_torch_set(where / "archive-v0" / "Xq3torchset", python)
    other = where / "archive-v0" / "b7sympy" / "sympy"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("import sympy")
    return where


def installed(cache: Path, sp: Path) -> Path:
    """What uv's copy from that cache writes into site-packages: every unpacked wheel's files."""
    for wheel in sorted((cache / "archive-v0").iterdir()):
        shutil.copytree(wheel, sp, symlinks=True, dirs_exist_ok=True)
    return sp


def files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def test_prune_keeps_uv_from_writing_the_shared_files_and_link_links_exactly_those(tmp_path: Path) -> None:
    out, _ = torch_files(tmp_path, 1)
    tree = out / contract.TORCH_FILES.lstrip("/")
    (tree / "torch/lib/libnot_in_any_wheel.so").write_bytes(b"x")  # the tree's, but no wheel's: never linked
    cache = uv_cache(tmp_path / "cache", 1)
    for where in (tree, cache / "archive-v0" / "Xq3torchset"):  # a source stays, for uv to compile it
        (where / "triton/backends/nvidia/driver.py").write_text("import os")
    done = run(out, "prune", str(tree), str(cache))
    assert done.returncode == 0, done.stderr
    assert f"{cache}: 4 files that {tree} holds taken out" in done.stdout
    assert files(cache / "archive-v0" / "Xq3torchset") == \
        {path for path, *_ in TORCH_SET} - SHARED | {"triton/backends/nvidia/driver.py"}
    assert files(cache / "archive-v0" / "b7sympy") == {"sympy/__init__.py"}
    assert set((cache / "ptmg-pruned").read_text().splitlines()) == SHARED
    sp = installed(cache, tmp_path / "venv" / "site-packages")
    shutil.rmtree(sp / "triton/backends/nvidia/bin")  # every file of it pruned: a folder uv may not make
    done = run(out, "link", str(tree), str(sp), str(cache))
    assert done.returncode == 0, done.stderr
    assert "5 files (0 MiB) are links to" in done.stdout and "1 of its files are not the venv's" in done.stdout
    assert {p.relative_to(sp).as_posix() for p in sp.rglob("*") if p.is_symlink()} == \
        SHARED | {"triton/backends/nvidia/driver.py"}
    for path in SHARED:
        assert not os.readlink(sp / path).startswith("/")
        assert (sp / path).resolve() == (tree / path).resolve()
    assert not (sp / "torch/lib/libnot_in_any_wheel.so").exists()
    assert (sp / "torch/lib/libtorch_python.so").read_bytes() == b"python 3.11"
    assert (sp / "sympy/__init__.py").read_text() == "import sympy"


def test_a_cache_of_another_layout_loses_nothing_and_link_compares_as_before(tmp_path: Path) -> None:
    out, _ = torch_files(tmp_path, 1)
    tree = out / contract.TORCH_FILES.lstrip("/")
    cache = tmp_path / "cache"
    unpack_torch_set(cache / "wheels-v5" / "x", 1)  # not uv's archive-v<N>/<id>/
    done = run(out, "prune", str(tree), str(cache))
    assert done.returncode == 0 and (cache / "ptmg-pruned").read_text() == "", done.stderr
    assert files(cache / "wheels-v5" / "x") == {path for path, *_ in TORCH_SET}
    sp = unpack_torch_set(tmp_path / "venv" / "site-packages", 2)
    (sp / "torch/lib/libc10.so").unlink()  # absent, and not taken out by prune: stays absent
    done = run(out, "link", str(tree), str(sp), str(cache))
    assert done.returncode == 0, done.stderr
    assert {p.relative_to(sp).as_posix() for p in sp.rglob("*") if p.is_symlink()} == SHARED - {"torch/lib/libc10.so"}
    assert not (sp / "torch/lib/libc10.so").exists()


def test_link_from_a_cache_prune_never_saw_fails(tmp_path: Path) -> None:
    out, _ = torch_files(tmp_path, 1)
    tree = out / contract.TORCH_FILES.lstrip("/")
    (tmp_path / "cache").mkdir()
    sp = unpack_torch_set(tmp_path / "venv" / "site-packages", 1)
    done = run(out, "link", str(tree), str(sp), str(tmp_path / "cache"))
    assert done.returncode == 1 and "prune did not run" in done.stderr, done.stderr
