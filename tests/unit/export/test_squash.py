"""`build.py export`'s all-or-nothing write (builder/export/squash.py), with a fake engine and fake
squashfs tools (the docker tier exports real images and runs them): the file only when complete,
clear errors for a missing image, tool or disk, a tool's own words when it fails, the space
check, the root's mode, and a SIF for the image's architecture."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from builder.common.errors import InputError, StepFailed
from builder.export import squash


@pytest.mark.parametrize(("name", "fmt", "want"), [
    ("x.tar", "sqsh", "must end in .sqsh"), ("x.sqsh", "sif", "must end in .sif"),
    ("missing/x.sqsh", "sqsh", "does not exist"), ("x.sqsh", "zip", "--format must be"),
])
def test_bad_output_paths_are_input_errors(tmp_path: Path, name: str, fmt: str, want: str) -> None:
    with pytest.raises(InputError, match=want):
        squash.check_output(tmp_path / name, fmt)


class FakeEngine:
    def __init__(self, present: bool = True) -> None:
        self.present = present

    def image_attrs(self, ref: str) -> dict[str, Any] | None:
        return {"Size": 1000, "Architecture": "amd64", "Config": {"Env": ["A=1"], "Entrypoint": ["/bin/true"]}} \
            if self.present else None

    def export_filesystem(self, ref: str, write: Any) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            data = b"hello\n"
            info = tarfile.TarInfo("etc/hello")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            dev = tarfile.TarInfo("dev/null-ish")
            tar.addfile(dev, io.BytesIO(b""))
        write(buf.getvalue())


def _tool(bindir: Path, name: str, body: str) -> None:
    (bindir / name).write_text(f"#!/bin/sh\n{body}\n")
    (bindir / name).chmod(0o755)


def test_export_writes_the_file_only_when_complete(tmp_path: Path, fake_tools: Path) -> None:
    # the fake mksquashfs records what it was given: the rootfs with the runtime files, no dev/*
    _tool(fake_tools, "mksquashfs", 'cat "$1/etc/environment" "$1/etc/hello" > "$2"; ls -A "$1/dev" >> "$2"')
    (tmp_path / "out").mkdir()
    out = squash.check_output(tmp_path / "out" / "x.sqsh", "sqsh")
    done = squash.export(FakeEngine(), "img", "sqsh", out)  # type: ignore[arg-type]
    assert out.read_text() == "A=1\nhello\n" and done.size == 10
    assert done.sha256 == hashlib.sha256(b"A=1\nhello\n").hexdigest() and (done.path, done.format) == (out, "sqsh")
    assert sorted(p.name for p in out.parent.iterdir()) == ["x.sqsh"]  # the work folder is gone


def test_a_failing_tool_leaves_nothing_under_the_final_name(tmp_path: Path, fake_tools: Path) -> None:
    _tool(fake_tools, "mksquashfs", 'echo half > "$2"; echo "Write failed because No space left on device" >&2; exit 1')
    out = tmp_path / "x.sqsh"
    with pytest.raises(StepFailed, match="No space left on device"):
        squash.export(FakeEngine(), "img", "sqsh", out)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == [fake_tools]


def test_missing_image_tool_or_disk_are_clear_errors(tmp_path: Path, fake_tools: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _tool(fake_tools, "mksquashfs", "exit 0")
    with pytest.raises(InputError, match="no image img here"):
        squash.export(FakeEngine(present=False), "img", "sqsh", tmp_path / "x.sqsh")  # type: ignore[arg-type]
    monkeypatch.setenv("PATH", str(fake_tools))
    with pytest.raises(StepFailed, match=r"siftool not found\. Fix: scripts/ensure-tools\.sh export"):
        squash.export(FakeEngine(), "img", "sif", tmp_path / "x.sif")  # type: ignore[arg-type]
    monkeypatch.setattr(shutil, "disk_usage", lambda p: type("U", (), {"free": 10})())
    with pytest.raises(StepFailed, match="not enough disk"):
        squash.export(FakeEngine(), "img", "sqsh", tmp_path / "x.sqsh")  # type: ignore[arg-type]


def test_a_directory_is_named_as_such(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="is a directory; name the file"):
        squash.check_output(tmp_path, "sqsh")



def _free(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda p: type("U", (), {"free": free})())


def test_the_space_check_asks_the_factor_times_the_image_and_says_the_figures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _free(monkeypatch, 1800)
    squash.check_space(tmp_path, 1000, "sqsh")  # exactly enough
    with pytest.raises(StepFailed):
        squash.check_space(tmp_path, 1000, "sif")  # a SIF needs 2.5x
    _free(monkeypatch, 2500)
    squash.check_space(tmp_path, 1000, "sif")
    _free(monkeypatch, 2499)
    with pytest.raises(StepFailed):
        squash.check_space(tmp_path, 1000, "sif")
    _free(monkeypatch, 1799)
    with pytest.raises(StepFailed):
        squash.check_space(tmp_path, 1000, "sqsh")
    # figures that sit on a rounding edge: a GB of 10^9 bytes, exactly
    _free(monkeypatch, 1_150_000_001)
    with pytest.raises(StepFailed) as refused:
        squash.check_space(tmp_path, 1_194_444_445, "sqsh")
    assert str(refused.value) == (f"export: not enough disk in {tmp_path}: 1.2 GB free, about 2.2 GB needed for a "
                                  "1.2 GB image (unpacked root plus the sqsh file); free some space or use -o on "
                                  "another filesystem")
    _free(monkeypatch, 1_149_999_999)
    with pytest.raises(StepFailed, match=r": 1\.1 GB free, about 2\.1 GB needed for a 1\.2 GB image "):
        squash.check_space(tmp_path, 1_194_444_444, "sqsh")
    _free(monkeypatch, 0)
    for size, shown in ((1_150_000_001, "1.2"), (1_149_999_999, "1.1")):
        with pytest.raises(StepFailed, match=f"needed for a {shown} GB image"):
            squash.check_space(tmp_path, size, "sqsh")


def test_a_tool_that_fails_or_hangs_is_named_with_its_last_five_lines(tmp_path: Path) -> None:
    with pytest.raises(StepFailed) as failed:
        squash._run(["sh", "-c", "for i in 1 2 3 4 5 6 7; do echo line$i >&2; done; exit 3"], "mksquashfs")
    assert str(failed.value) == "export: mksquashfs failed (exit 3): line3 / line4 / line5 / line6 / line7"
    with pytest.raises(StepFailed, match=r"^export: siftool add took over 0 s$"):
        squash._run(["sleep", "10"], "siftool add", timeout=0.3)


class NotATar(FakeEngine):
    def export_filesystem(self, ref: str, write: Any) -> None:
        for _ in range(64):  # tar stops at the first block: the rest meets a closed pipe
            write(b"\x07" * 65536)


def test_a_stream_tar_refuses_fails_with_tars_own_words(tmp_path: Path, fake_tools: Path) -> None:
    _tool(fake_tools, "mksquashfs", "exit 0")
    with pytest.raises(StepFailed, match=r"^export: unpacking img failed \(tar exit 2\): .*tar archive"):
        squash.export(NotATar(), "img", "sqsh", tmp_path / "x.sqsh")  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]  # the work folder is gone


def test_the_file_is_world_readable_and_its_time_is_measured(tmp_path: Path, fake_tools: Path) -> None:
    _tool(fake_tools, "mksquashfs", 'echo x > "$2"; chmod 600 "$2"')
    out = tmp_path / "x.sqsh"
    done = squash.export(FakeEngine(), "img", "sqsh", out)  # type: ignore[arg-type]
    assert (out.stat().st_mode & 0o777) == 0o644
    assert 0 <= done.seconds < 60


def test_tars_error_is_quoted_to_its_last_400_characters(tmp_path: Path, fake_tools: Path) -> None:
    _tool(fake_tools, "mksquashfs", "exit 0")  # present: the export looks for it before it unpacks
    _tool(fake_tools, "tar", "cat > /dev/null; printf 'HEAD%0500dTAIL' 0 >&2; exit 2")
    with pytest.raises(StepFailed) as failed:
        squash.export(FakeEngine(), "img", "sqsh", tmp_path / "x.sqsh")  # type: ignore[arg-type]
    assert str(failed.value) == "export: unpacking img failed (tar exit 2): " + "0" * 396 + "TAIL"


def test_an_image_without_a_size_needs_no_space_ahead(tmp_path: Path, fake_tools: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    class NoSize(FakeEngine):
        def image_attrs(self, ref: str) -> dict[str, Any] | None:
            return {"Architecture": "amd64", "Config": {"Env": ["A=1"]}}

    _tool(fake_tools, "mksquashfs", 'echo x > "$2"')
    _free(monkeypatch, 0)
    assert squash.export(NoSize(), "img", "sqsh", tmp_path / "x.sqsh").size == 2  # type: ignore[arg-type]


@pytest.mark.allowed_skip(reason="needs root: a read-only mount")
def test_an_output_folder_that_is_not_writable_is_an_input_error(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "ptmg-unit-ro", str(ro)],
                                           capture_output=True, timeout=30, check=False).returncode:
        pytest.skip("needs root: a read-only mount")
    try:
        with pytest.raises(InputError, match=f"^export: {ro} is not writable$"):
            squash.check_output(ro / "x.sqsh", "sqsh")
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True, timeout=30, check=True)


def test_the_root_is_0755_and_docker_s_own_files_are_dropped(tmp_path: Path, fake_tools: Path) -> None:
    """enroot drops /.dockerenv and what is under /dev; the image's / is world-readable."""
    class WithDockerenv(FakeEngine):
        def export_filesystem(self, ref: str, write: Any) -> None:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                for name in (".dockerenv", "dev/shm/", "etc/keep"):
                    info = tarfile.TarInfo(name.rstrip("/"))
                    info.type = tarfile.DIRTYPE if name.endswith("/") else tarfile.REGTYPE
                    tar.addfile(info, io.BytesIO(b""))
            write(buf.getvalue())

    _tool(fake_tools, "mksquashfs", 'stat -c %a "$1" > "$2"; cd "$1" && find . -path ./.singularity.d -prune -o '
                                    '-print | sort >> "$2"')
    out = tmp_path / "x.sqsh"
    squash.export(WithDockerenv(), "img", "sqsh", out)  # type: ignore[arg-type]
    mode, *paths = out.read_text().splitlines()
    assert mode == "755"
    assert paths == [".", "./ch", "./ch/environment", "./dev", "./etc", "./etc/environment",
                     "./etc/fstab", "./etc/keep", "./etc/rc", "./etc/rc.local"]



def test_a_tar_that_stops_reading_ends_the_stream_and_says_why(tmp_path: Path, fake_tools: Path) -> None:
    """tar exits at once: the engine's next write meets a closed pipe, and tar's own words are the error."""
    _tool(fake_tools, "tar", "echo 'tar: refused' >&2; exit 2")
    _tool(fake_tools, "mksquashfs", "exit 0")
    with pytest.raises(StepFailed, match=r"^export: unpacking img failed \(tar exit 2\): tar: refused$"):
        squash.export(NotATar(), "img", "sqsh", tmp_path / "x.sqsh")  # type: ignore[arg-type]


@pytest.mark.parametrize(("arch", "code"), [("amd64", "2"), ("arm64", "4"), (None, "2")])
def test_a_sif_wraps_the_squashfs_for_the_images_architecture(tmp_path: Path, fake_tools: Path, arch: str | None,
                                                                code: str) -> None:
    class Arch(FakeEngine):
        def image_attrs(self, ref: str) -> dict[str, Any] | None:
            attrs = super().image_attrs(ref) or {}
            return {**attrs, "Architecture": arch} if arch else {k: v for k, v in attrs.items() if k != "Architecture"}

    _tool(fake_tools, "mksquashfs", 'echo "mksquashfs $*" | sed "s#$1#ROOT#; s#$2#SQ#" > "$2"')
    _tool(fake_tools, "siftool", 'case "$1" in new) : > "$2" ;; add) cat "$3" >> "$2"; shift 3; '
                                 'echo "add $*" >> "$0.log" ;; esac')
    out = tmp_path / "x.sif"
    done = squash.export(Arch(), "img", "sif", out, processors=3)  # type: ignore[arg-type]
    assert out.read_text() == ("mksquashfs ROOT SQ -all-root -noappend -no-progress -quiet -comp lz4 "
                               "-processors 3\n")
    assert (fake_tools / "siftool.log").read_text() == (
        f"add --datatype 4 --parttype 2 --partfs 1 --partarch {code} --groupid 1\n")
    assert done.format == "sif" and sorted(p.name for p in tmp_path.iterdir()) == ["bin", "x.sif"]


def test_a_sif_of_an_architecture_without_a_code_is_refused(tmp_path: Path, fake_tools: Path) -> None:
    class Power(FakeEngine):
        def image_attrs(self, ref: str) -> dict[str, Any] | None:
            return {**(super().image_attrs(ref) or {}), "Architecture": "ppc64le"}

    _tool(fake_tools, "mksquashfs", 'echo x > "$2"')
    _tool(fake_tools, "siftool", "exit 0")
    with pytest.raises(StepFailed, match=r"^export: no SIF architecture code for 'ppc64le' \(known: amd64, arm64\)$"):
        squash.export(Power(), "img", "sif", tmp_path / "x.sif")  # type: ignore[arg-type]
    _tool(fake_tools, "mksquashfs", 'echo "$*" > "$2"')
    squash.export(FakeEngine(), "img", "sqsh", tmp_path / "x.sqsh")  # type: ignore[arg-type]
    assert "-processors" not in (tmp_path / "x.sqsh").read_text()  # none asked: mksquashfs's own default


def test_the_working_directory_is_made_with_its_parents(tmp_path: Path) -> None:
    squash.add_runtime_files(tmp_path, {"Config": {"WorkingDir": "/srv/a/b"}}, "u")
    assert (tmp_path / "srv" / "a" / "b").is_dir() and (tmp_path / "etc" / "rc").is_file()
