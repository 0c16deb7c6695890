"""Export a local image as an enroot squashfs (.sqsh) or an Apptainer SIF (.sif), with no registry.

``docker export`` of a created container streams the root filesystem into ``tar -x`` in a private
temporary folder beside the output; the runtime files (:mod:`builder.export.runtime_files`) are
added; ``mksquashfs`` (Debian's squashfs-tools, with enroot's own ``-all-root``, lz4) writes the
squashfs under a temporary name, ``siftool`` wraps it for ``.sif``, and only a complete file is
renamed to its final name. The temporary folder goes whatever happens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from builder.common.errors import InputError, StepFailed
from builder.common.paths import sha256_file
from builder.engine import Engine
from builder.export import runtime_files

FORMATS = {"sqsh": ".sqsh", "sif": ".sif"}
TOOLS = {"sqsh": ("mksquashfs",), "sif": ("mksquashfs", "siftool")}
#: lz4: the fastest to write and to read (squashfuse and the kernel both read it); 4% larger than
#: mksquashfs's default gzip for a cell, and written in a fraction of the time (BENCHMARKS.md).
COMPRESSION = "lz4"
#: SIF partition architecture codes (siftool add --partarch).
SIF_ARCH = {"amd64": "2", "arm64": "4"}
#: Free space needed beside the output, as a multiple of the image's size: the unpacked rootfs
#: plus the compressed file (about 0.7x) and, for SIF, its copy.
SPACE_FACTOR = {"sqsh": 1.8, "sif": 2.5}


@dataclass(frozen=True)
class Exported:
    path: Path
    format: str
    size: int
    sha256: str
    seconds: float


def check_output(path: Path, fmt: str) -> Path:
    """The absolute output path, or InputError (exit 2) naming what is wrong with it."""
    if fmt not in FORMATS:
        raise InputError(f"export: --format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    out = path.expanduser().absolute()
    if out.is_dir():
        raise InputError(f"export: {out} is a directory; name the file (e.g. {out / ('image' + FORMATS[fmt])})")
    if out.suffix != FORMATS[fmt]:
        raise InputError(f"export: {out}: a {fmt} file must end in {FORMATS[fmt]}")
    if not out.parent.is_dir():
        raise InputError(f"export: {out.parent} does not exist; create it first")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise InputError(f"export: {out.parent} is not writable")
    return out


def check_tools(fmt: str) -> None:
    missing = [t for t in TOOLS[fmt] if shutil.which(t) is None]
    if missing:
        pkgs = {"mksquashfs": "squashfs-tools", "siftool": "siftool"}
        names = " ".join(pkgs[t] for t in missing)
        raise StepFailed(f"export: {', '.join(missing)} not found. Fix: scripts/ensure-tools.sh export "
                         f"(Debian: apt-get install {names})")


def check_space(where: Path, image_size: int, fmt: str) -> None:
    need = int(image_size * SPACE_FACTOR[fmt])
    free = shutil.disk_usage(where).free
    if free < need:
        raise StepFailed(f"export: not enough disk in {where}: {free / 1e9:.1f} GB free, about {need / 1e9:.1f} GB "
                         f"needed for a {image_size / 1e9:.1f} GB image (unpacked root plus the {fmt} file); "
                         "free some space or use -o on another filesystem")


def _run(cmd: list[str], what: str, timeout: float = 3600) -> None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise StepFailed(f"export: {what} took over {timeout:.0f} s") from None
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
        raise StepFailed(f"export: {what} failed (exit {r.returncode}): " + " / ".join(tail))


def unpack(engine: Engine, ref: str, rootfs: Path) -> None:
    """The image's filesystem into ``rootfs`` (owners and modes kept; enroot drops dev/ and .dockerenv)."""
    proc = subprocess.Popen(["tar", "-x", "--numeric-owner", "-C", str(rootfs)], stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    stdin = proc.stdin
    if stdin is None:  # pragma: no cover - Popen with PIPE always has one
        raise StepFailed("export: tar has no input")

    def write(chunk: bytes) -> None:
        stdin.write(chunk)

    try:
        engine.export_filesystem(ref, write)
    except BrokenPipeError:
        pass
    finally:
        stdin.close()
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        code = proc.wait()
    if code != 0:
        raise StepFailed(f"export: unpacking {ref} failed (tar exit {code}): {err.strip()[-400:]}")
    for name in (".dockerenv",):
        (rootfs / name).unlink(missing_ok=True)
    dev = rootfs / "dev"
    if dev.is_dir():
        for entry in dev.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def add_runtime_files(rootfs: Path, attrs: dict[str, object], uri: str) -> None:
    cfg = runtime_files.config_of(attrs)
    for rel, (text, mode) in runtime_files.files(cfg, uri).items():
        path = rootfs / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            path.unlink()
        path.write_text(text, encoding="utf-8")
        path.chmod(mode)
    (rootfs / cfg["WorkingDir"].lstrip("/")).mkdir(parents=True, exist_ok=True)


def export(engine: Engine, ref: str, fmt: str, out: Path, *, processors: int | None = None) -> Exported:
    """Write ``ref`` to ``out`` (checked by :func:`check_output`) as ``fmt``; atomically."""
    start = time.monotonic()
    check_tools(fmt)
    attrs = engine.image_attrs(ref)
    if attrs is None:
        raise InputError(f"export: no image {ref} here; build it first (`build.py build --only ...`)")
    check_space(out.parent, int(attrs.get("Size") or 0), fmt)
    arch = str(attrs.get("Architecture") or "amd64")
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        rootfs = work / "rootfs"
        rootfs.mkdir(mode=0o755)
        unpack(engine, ref, rootfs)
        add_runtime_files(rootfs, attrs, f"dockerd://{ref}")
        squash = work / "image.sqsh"
        procs = ["-processors", str(processors)] if processors else []
        _run(["mksquashfs", str(rootfs), str(squash), "-all-root", "-noappend", "-no-progress", "-quiet",
              "-comp", COMPRESSION, *procs], "mksquashfs")
        shutil.rmtree(rootfs)
        result = squash
        if fmt == "sif":
            if arch not in SIF_ARCH:
                raise StepFailed(f"export: no SIF architecture code for {arch!r} (known: {', '.join(SIF_ARCH)})")
            sif = work / "image.sif"
            _run(["siftool", "new", str(sif)], "siftool new")
            _run(["siftool", "add", str(sif), str(squash), "--datatype", "4", "--parttype", "2", "--partfs", "1",
                  "--partarch", SIF_ARCH[arch], "--groupid", "1"], "siftool add")
            squash.unlink()
            result = sif
        result.chmod(0o644)
        digest = sha256_file(result)
        size = result.stat().st_size
        os.replace(result, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Exported(out, fmt, size, digest, time.monotonic() - start)
