"""An exported image run by a real HPC runtime.

`build.py export` writes an enroot squashfs and a SIF (atomically; bad paths exit 2), and
Charliecloud's unprivileged `ch-run` runs the squashfs as a uid not in the image's passwd, with
$HOME bound, read-only: the selftest, a 2-rank gloo DDP job and torch.compile pass, and a planted
~/.local torch is not imported. Its environment comes from /ch/environment (`--set-env`), the same
lines as enroot's /etc/environment: the pyxis/enroot way; and, with no environment from the runtime,
from /.singularity.d/env: the Apptainer way.

Exports live in a private folder under /var/tmp and are deleted as soon as their test ends. The
module runs after test_arm64 (conftest.RUN_LAST): an export unpacks the image's root beside the
squashfs it writes (~10 GB for a while), so it waits until the background builds are done and the
arm64 cell's image and wheels are gone again.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import ptmg_contract as contract

from . import sessions
from .test_hpc import BUILD_PY, OTHER_UID, ROOT, SEEDS, TOOLS


# --- export -------------------------------------------------------------------
@pytest.fixture(scope="module")
def export_dir() -> Iterator[Path]:
    """A private folder other uids can traverse (ch-run runs as OTHER_UID and reads the export)."""
    path = sessions.scratch("export-test")
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _export(cell: str, fmt: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*BUILD_PY, "export", cell, "--format", fmt, "-o", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800, check=False)


def test_export_refuses_bad_paths_and_missing_images(export_dir: Path) -> None:
    cell = SEEDS[1]
    for out, want in ((export_dir / "no" / "x.sqsh", "does not exist"), (export_dir / "x.tar", "must end in .sqsh"),
                      (export_dir, "is a directory")):
        r = _export(cell, "sqsh", out)
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = _export("pt-multi-gpu:no-such-image", "sqsh", export_dir / "x.sqsh")
    assert r.returncode == 2 and "no image" in r.stderr, r.stderr
    assert list(export_dir.iterdir()) == []


def test_export_sif_is_a_sif_with_the_squashfs_inside(export_dir: Path) -> None:
    """The same code path as a cell's export, on the small base image (a cell's SIF is 3.4 GB):
    real mksquashfs, real siftool, and the SIF's primary partition is that squashfs."""
    sif = export_dir / "base.sif"
    try:
        r = _export("debian:bookworm-slim", "sif", sif)
        assert r.returncode == 0, r.stdout + r.stderr
        listing = subprocess.run(["siftool", "list", str(sif)], capture_output=True, text=True, check=True,
                                 timeout=60).stdout
        assert "Squashfs/*System" in listing, listing  # "*System": the primary system partition
        assert [p.name for p in export_dir.iterdir()] == ["base.sif"]  # no temporary left
        part = export_dir / "part.sqsh"
        dumped = subprocess.run(["siftool", "dump", "1", str(sif)], capture_output=True, check=True, timeout=120)
        part.write_bytes(dumped.stdout)
        rc = subprocess.run(["unsquashfs", "-cat", str(part), "etc/rc"], capture_output=True, text=True,
                            check=True, timeout=60).stdout
        assert rc.startswith("# enroot-provenance: dockerd://debian:bookworm-slim"), rc
    finally:
        sif.unlink(missing_ok=True)
        (export_dir / "part.sqsh").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def sqsh(exported_sqsh: Path) -> Path:
    """The session's export (conftest.exported_sqsh, which checks this run's report; test_enroot runs it too)."""
    return exported_sqsh


def test_export_has_the_enroot_files(sqsh: Path) -> None:
    listing = subprocess.run(["unsquashfs", "-cat", str(sqsh), "etc/rc"], capture_output=True, text=True,
                             check=True, timeout=120).stdout
    assert listing.startswith("# enroot-provenance: dockerd://") and f'exec {contract.TINI} ' in listing, listing
    env = subprocess.run(["unsquashfs", "-cat", str(sqsh), "etc/environment"], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert f"PATH={contract.VENV}/bin:" in env and "PIP_CONSTRAINT=" in env and "PYTHONNOUSERSITE=1" in env, env


@pytest.fixture
def stranger_home() -> Iterator[Path]:
    """A home folder of OTHER_UID with a planted ~/.local torch that must never be imported."""
    home = sessions.scratch("home")
    temp = _stranger_tmp(home)  # ch-run shares the host's /tmp: the runs' temporary files go here, then away
    usual = _ch_folder(f"u{OTHER_UID}")  # where ch-run's folder would be with an everyday USER
    had_usual = usual.exists()
    try:
        temp.mkdir(mode=0o700)
        os.chown(temp, OTHER_UID, OTHER_UID)
        for py in ("3.10", "3.11", "3.12", "3.13"):
            planted = home / ".local" / "lib" / f"python{py}" / "site-packages" / "torch"
            planted.mkdir(parents=True)
            (planted / "__init__.py").write_text("raise SystemExit('PLANTED ~/.local torch was imported')\n")
        subprocess.run(["chown", "-R", f"{OTHER_UID}:{OTHER_UID}", str(home)], check=True, timeout=60)
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(_ch_folder(home.name), ignore_errors=True)
    # What a test makes goes when it ends: ch-run's own folder too.
    if usual.exists() and not had_usual:
        shutil.rmtree(usual, ignore_errors=True)
        pytest.fail(f"ch-run left {usual} behind", pytrace=False)


def _stranger_tmp(home: Path) -> Path:
    """OTHER_UID's TMPDIR for one test: a folder of the host's /tmp (ch-run binds it), named after its home."""
    return Path("/tmp") / home.name


def _ch_folder(user: str) -> Path:
    """Where ch-run 0.31 makes its SquashFS mount point for $USER (/var/tmp/$USER.ch/mnt, whatever
    CH_IMAGE_STORAGE says), which outlives the run. The stranger's USER is its home's name, so the
    folder is the test's to remove, and a killed session's goes with its scratch folders
    (sessions.sweep): ch-run's command stays the one users type."""
    return Path("/var/tmp") / f"{user}.ch"


def _ch_run(sqsh: Path, home: Path, command: list[str], *, set_env: bool = True,
            timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """ch-run as OTHER_UID (in no passwd), unprivileged, image read-only, $HOME bound, no entrypoint."""
    if shutil.which("ch-run") is None:
        pytest.fail("ch-run is missing. Fix: scripts/ensure-tools.sh test (Debian: charliecloud-runtime)",
                    pytrace=False)
    env = ["env", "-i", f"HOME={home}", f"USER={home.name}", "PATH=/usr/local/bin:/usr/bin:/bin",
           f"TMPDIR={_stranger_tmp(home)}"]
    ch = ["ch-run", "--no-passwd", "--home", *(["--set-env"] if set_env else []), str(sqsh), "--", *command]
    cmd = ["setpriv", "--reuid", str(OTHER_UID), "--regid", str(OTHER_UID), "--clear-groups", *env, *ch]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def test_charliecloud_runs_the_selftest_as_a_stranger(sqsh: Path, stranger_home: Path) -> None:
    r = _ch_run(sqsh, stranger_home, ["selftest"], timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "in charliecloud" in r.stdout and f"as uid {OTHER_UID}" in r.stdout, r.stdout[-1500:]
    assert re.search(r"PASS\s+\S*ddp", r.stdout), r.stdout[-3000:]  # the 2-rank gloo DDP job ran and passed


def test_charliecloud_tools_compile_and_user_site(sqsh: Path, stranger_home: Path) -> None:
    code = ("import torch, sys; assert torch.__file__.startswith('/opt/venv/'), torch.__file__; "
            "f = torch.compile(lambda x: x * 2 + 1); assert f(torch.ones(4)).tolist() == [3.0] * 4; "
            "print('CH-OK', torch.__file__)")
    r = _ch_run(sqsh, stranger_home, ["python", "-c", code])
    assert r.returncode == 0 and "CH-OK /opt/venv/" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    # The control: the plant is real. The venv's own interpreter, run outside the venv and without
    # the image's PYTHONNOUSERSITE (as an image without those defences would run it), imports it.
    bare = 'env -u PYTHONNOUSERSITE "$(readlink -f /opt/venv/bin/python)" -c "import torch"'
    control = _ch_run(sqsh, stranger_home, ["sh", "-c", bare])
    assert control.returncode != 0 and "PLANTED ~/.local torch" in control.stdout + control.stderr, \
        control.stdout + control.stderr
    login = _ch_run(sqsh, stranger_home, ["bash", "-lc", TOOLS])
    assert "TOOLS-OK" in login.stdout, login.stdout + login.stderr
    # Apptainer's way: no image environment from the runtime, the action script sources
    # /.singularity.d/env/*.sh, then runs the command.
    apptainer = _ch_run(sqsh, stranger_home, ["/.singularity.d/actions/exec", "sh", "-c", TOOLS], set_env=False)
    assert "TOOLS-OK" in apptainer.stdout, apptainer.stdout + apptainer.stderr
