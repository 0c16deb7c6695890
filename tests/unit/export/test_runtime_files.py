"""The runtime files `build.py export` adds (builder/export/runtime_files.py), run for real with sh:
enroot's rc and environment, Apptainer's env script, their modes, the image's config read whole,
the pip and uv constraint reaching enroot and Charliecloud, and the labels file."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

import ptmg_contract as contract
from builder.export import runtime_files
from builder.render.dockerfile import image_env
from tests import support

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


def test_the_config_is_read_whole_and_absent_fields_are_empty() -> None:
    assert CFG == {"Env": ["PATH=/opt/venv/bin:/usr/bin:/bin", "PTMG_CUDA_ARCH_LIST=sm_80 sm_90", 'ODD=a "b" $c'],
                   "Entrypoint": ["/bin/echo", "EP"], "Cmd": ["CMD ARG"], "WorkingDir": "/workspace",
                   "Labels": {"io.pt-multi-gpu.cell": "c1", "multi": "two\nlines"}, "Volumes": []}
    assert runtime_files.config_of({"Config": {"Volumes": {"/b": {}, "/a": {}}}}) == {
        "Env": [], "Entrypoint": [], "Cmd": [], "WorkingDir": "/", "Labels": {}, "Volumes": ["/a", "/b"]}
    assert runtime_files.config_of({"Config": None})["WorkingDir"] == "/"


def test_each_runtime_file_has_its_mode() -> None:
    """Scripts the runtimes run are executable; the rest is read (enroot and apptainer write the same)."""
    modes = {name: mode for name, (_text, mode) in runtime_files.files(CFG, "dockerd://x").items()}
    script = {".singularity.d/env/10-docker2singularity.sh", ".singularity.d/runscript",
              *(f".singularity.d/actions/{a}" for a in ("exec", "run", "shell"))}
    assert modes == {name: 0o755 if name in script else 0o644 for name in [
        "etc/environment", "etc/rc", "etc/rc.local", "etc/fstab", "ch/environment", ".singularity.d/labels.json",
        *script]}


def test_the_images_pip_and_uv_constraint_reach_enroot_and_charliecloud(tmp_path: Path) -> None:
    """A cell's ENV, as the Dockerfile sets it, in the export's /etc/environment (enroot) and
    /ch/environment (Charliecloud): without UV_CONSTRAINT there, `uv pip install` replaces torch."""
    spec = support.cell(support.small_matrix(tmp_path), support.MID)
    env = [f"{k}={v}" for k, v in image_env(spec)]
    files = runtime_files.files(runtime_files.config_of({"Config": {"Env": env}}), "dockerd://x")
    want = f"UV_CONSTRAINT={contract.PIP_CONSTRAINT_FILE}"
    for name in ("etc/environment", "ch/environment"):
        lines = files[name][0].splitlines()
        assert want in lines and f"PIP_CONSTRAINT={contract.PIP_CONSTRAINT_FILE}" in lines, name
        assert "PYTHONNOUSERSITE=1" in lines and lines == env, name
    assert f'export UV_CONSTRAINT="${{UV_CONSTRAINT:-"{contract.PIP_CONSTRAINT_FILE}"}}"' in \
        files[".singularity.d/env/10-docker2singularity.sh"][0].splitlines()
@pytest.mark.parametrize(("entrypoint", "cmd", "exec_lines"), [
    ([], [], ('    exec "$@"', "    exec /bin/sh")),  # neither: a shell, as enroot does
    (["/ep", "a b"], [], ("    exec /ep 'a b' \"$@\"", "    exec /ep 'a b'")),
    ([], ["/cmd", "x"], ('    exec "$@"', "    exec /cmd x")),
    (["/ep"], ["/cmd"], ('    exec /ep "$@"', "    exec /ep /cmd")),
])
def test_enroot_rc_execs_the_entrypoint_the_command_or_a_shell(entrypoint: list[str], cmd: list[str],
                                                                 exec_lines: tuple[str, str]) -> None:
    rc = runtime_files.enroot_rc({**CFG, "Entrypoint": entrypoint, "Cmd": cmd, "Labels": {}}, "u")
    assert [line for line in rc.splitlines() if line.startswith("    exec ")] == list(exec_lines)


def test_labels_json_is_sorted_with_one_space_indent() -> None:
    text = runtime_files.files({**CFG, "Labels": {"b": "2", "a": "1"}}, "u")[".singularity.d/labels.json"][0]
    assert text == '{\n "a": "1",\n "b": "2"\n}\n'
