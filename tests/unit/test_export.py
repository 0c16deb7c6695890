"""`build.py export`: the runtime files it adds (run for real with sh) and its all-or-nothing write,
with a fake engine and fake squashfs tools (the docker tier exports real images and runs them)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from builder.common.errors import InputError, StepFailed
from builder.export import runtime_files, squash

CFG: dict[str, Any] = runtime_files.config_of({"Config": {
    "Env": ["PATH=/opt/venv/bin:/usr/bin:/bin", "PTMG_CUDA_ARCH_LIST=sm_80 sm_90", 'ODD=a "b" $c'],
    "Entrypoint": ["/bin/echo", "EP"], "Cmd": ["CMD ARG"], "WorkingDir": "/workspace",
    "Labels": {"io.pt-multi-gpu.cell": "c1", "multi": "two\nlines"}}})


def test_enroot_rc_runs_the_entrypoint_with_the_arguments_or_the_command(tmp_path: Path) -> None:
    cfg = {**CFG, "WorkingDir": str(tmp_path / "wd")}
    rc = tmp_path / "rc"
    rc.write_text(runtime_files.enroot_rc(cfg, "dockerd://img:tag"))
    text = rc.read_text()
    assert text.startswith("# enroot-provenance: dockerd://img:tag\n# io.pt-multi-gpu.cell c1\n# multi two lines\n\n")

    def run(*args: str) -> str:
        return subprocess.run(["sh", str(rc), *args], capture_output=True, text=True, check=True, timeout=30,
                              cwd="/").stdout

    assert run() == "EP CMD ARG\n"
    assert run("x", "y z") == "EP x y z\n"
    assert (tmp_path / "wd").is_dir()  # made at start, as enroot's rc does


def test_apptainer_env_exports_each_variable_unless_set_and_path_always(tmp_path: Path) -> None:
    env = tmp_path / "10-docker2singularity.sh"
    env.write_text(runtime_files.apptainer_env(CFG["Env"]))
    show = 'printf "%s|%s|%s" "$PATH" "$PTMG_CUDA_ARCH_LIST" "$ODD"'
    out = subprocess.run(["/bin/sh", "-c", f". {env}; {show}"], env={"PATH": "/host/bin", "PTMG_CUDA_ARCH_LIST": "mine"},
                         capture_output=True, text=True, check=True, timeout=30).stdout
    assert out == '/opt/venv/bin:/usr/bin:/bin|mine|a "b" $c'


def test_every_runtime_file_is_there() -> None:
    files = runtime_files.files(CFG, "dockerd://x")
    assert files["etc/environment"][0] == files["ch/environment"][0] == "".join(f"{e}\n" for e in CFG["Env"])
    assert {"etc/rc", "etc/rc.local", "etc/fstab", ".singularity.d/runscript", ".singularity.d/labels.json",
            ".singularity.d/actions/exec"} <= set(files)


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


@pytest.fixture
def fake_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return bindir


def test_export_writes_the_file_only_when_complete(tmp_path: Path, fake_tools: Path) -> None:
    # the fake mksquashfs records what it was given: the rootfs with the runtime files, no dev/*
    _tool(fake_tools, "mksquashfs", 'cat "$1/etc/environment" "$1/etc/hello" > "$2"; ls -A "$1/dev" >> "$2"')
    (tmp_path / "out").mkdir()
    out = squash.check_output(tmp_path / "out" / "x.sqsh", "sqsh")
    done = squash.export(FakeEngine(), "img", "sqsh", out)  # type: ignore[arg-type]
    assert out.read_text() == "A=1\nhello\n" and done.size == 10 and len(done.sha256) == 64
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
