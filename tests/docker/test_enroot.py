"""enroot on one host: NVIDIA's container runtime, 4.1.2 built from its release source
(`scripts/ensure-tools.sh test`), runs the image the two ways users get it onto a cluster.

- `enroot create` of `build.py export --format sqsh` (the session's export, conftest.exported_sqsh);
- `enroot import dockerd://IMAGE` (enroot's own import from the local engine, as root: it reads
  the engine), then `enroot create` of the squashfs it wrote.

Every container runs as uid 4242 (in no passwd file), unprivileged (enroot's user namespace),
with enroot's default hooks and $HOME bound (ENROOT_MOUNT_HOME: the home hook), on CPU. The
command goes through the image's /etc/rc, as `enroot start` runs it. Read-only (enroot's default)
and with --rw: the selftest passes (its 2-rank gloo DDP job included), torch.compile runs, the
bound HOME is the process's HOME and a planted ~/.local torch in it is not imported (the control
imports it). Each container is removed when its test ends, the import's squashfs as soon as the
container is made (disk: ~5.6 GB a container; the import needs ~17 GB for a while: the saved
image, its unpacked layers and the squashfs).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import sessions
from .test_hpc import OTHER_UID

ENROOT = "/usr/local/bin/enroot"
ENROOT_VERSION = "4.1.2"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")


class Enroot:
    """enroot with every path of its own under ``base``: a uid's, or root's for the import."""

    def __init__(self, base: Path, home: Path) -> None:
        self.base, self.home = base, home

    def env(self, who: str) -> list[str]:
        paths = {name: self.base / who / name.lower() for name in ("RUNTIME", "CACHE", "DATA", "TEMP")}
        for path in paths.values():
            path.mkdir(parents=True, exist_ok=True)
            if who != "root":
                shutil.chown(path, OTHER_UID, OTHER_UID)
        return ["env", "-i", f"HOME={self.home if who != 'root' else '/root'}", f"USER=u{OTHER_UID}",
                "PATH=/usr/local/bin:/usr/bin:/bin", "ENROOT_MOUNT_HOME=y",
                # The import only: lz4 without compressing the data, for speed (the default is lzo).
                "ENROOT_SQUASH_OPTIONS=-comp lz4 -noD",
                *(f"ENROOT_{name}_PATH={path}" for name, path in paths.items())]

    def as_stranger(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        cmd = ["setpriv", "--reuid", str(OTHER_UID), "--regid", str(OTHER_UID), "--clear-groups",
               *self.env("stranger"), ENROOT, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)

    def as_root(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.env("root"), ENROOT, *args], capture_output=True, text=True,
                              timeout=timeout, check=False)

    def create(self, name: str, image: Path) -> str:
        r = self.as_stranger("create", "--name", name, str(image))
        assert r.returncode == 0, f"enroot create {image} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        return name

    def remove(self, name: str) -> None:
        self.as_stranger("remove", "--force", name, timeout=300)


@pytest.fixture(scope="module")
def enroot() -> Iterator[Enroot]:
    """enroot 4.1.2 and a private folder (0755: the stranger uid traverses it) with a HOME of
    OTHER_UID in which ~/.local holds a torch that exits when imported."""
    r = subprocess.run([ENROOT, "version"], capture_output=True, text=True, check=False) \
        if Path(ENROOT).exists() else None
    if r is None or r.stdout.strip() != ENROOT_VERSION:
        pytest.fail(f"enroot {ENROOT_VERSION} is not installed in /usr/local. Fix: PTMG_THIRDPARTY_DIR=DIR "
                    "scripts/ensure-tools.sh test (DIR: enroot and pyxis release tarballs; `make test` uses "
                    "../shared/thirdparty)", pytrace=False)
    base = sessions.scratch("enroot")
    base.chmod(0o755)
    home = base / "home"
    try:
        for py in PYTHONS:
            planted = home / ".local" / "lib" / f"python{py}" / "site-packages" / "torch"
            planted.mkdir(parents=True)
            (planted / "__init__.py").write_text("raise SystemExit('PLANTED ~/.local torch was imported')\n")
        subprocess.run(["chown", "-R", f"{OTHER_UID}:{OTHER_UID}", str(home)], check=True, timeout=60)
        yield Enroot(base, home)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def from_export(enroot: Enroot, exported_sqsh: Path) -> Iterator[str]:
    """Function-scoped, like from_import: each container (5.6 GB) is gone before the next is made."""
    name = enroot.create("ptmg-export", exported_sqsh)
    try:
        yield name
    finally:
        enroot.remove(name)


@pytest.fixture
def from_import(enroot: Enroot, test_image: str) -> Iterator[str]:
    sqsh = enroot.base / "imported.sqsh"
    r = enroot.as_root("import", "--output", str(sqsh), f"dockerd://{test_image}", timeout=1200)
    assert r.returncode == 0, f"enroot import dockerd://{test_image} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    sqsh.chmod(0o644)
    try:
        name = enroot.create("ptmg-import", sqsh)
    finally:
        sqsh.unlink(missing_ok=True)
    try:
        yield name
    finally:
        enroot.remove(name)


#: What tini 0.19 prints when it is neither PID 1 nor a child subreaper: then it cannot reap orphans.
TINI_NOT_REAPING = "Tini is not running as PID 1 and isn't registered as a child subreaper"


def _start(enroot: Enroot, name: str, rw: bool, *command: str, timeout: float = 600) -> str:
    r = enroot.as_stranger("start", *(["--rw"] if rw else []), name, *command, timeout=timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"enroot start {name} {' '.join(command)} exited {r.returncode}:\n{out[-5000:]}"
    # enroot makes no PID namespace, so tini is not PID 1: with -s it is the jobs' subreaper all the same.
    assert TINI_NOT_REAPING not in out, out[-3000:]
    return out


#: An orphan (a shell's background sleep, the shell gone) and who adopts it: the nearest subreaper.
ORPHAN = ("import os, subprocess, time; "
          "pid = int(subprocess.run(['sh', '-c', 'sleep 60 >/dev/null 2>&1 & echo $!'], capture_output=True, "
          "text=True, check=True).stdout); time.sleep(0.5); "
          "ppid = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1]; "
          "print('ADOPTED-BY', open(f'/proc/{ppid}/comm').read().strip()); os.kill(pid, 9)")


def _selftest(enroot: Enroot, name: str, rw: bool, *args: str) -> str:
    out = _start(enroot, name, rw, "selftest", *args, timeout=1500)
    assert re.search(rf"selftest: \S+ in enroot\S* .*as uid {OTHER_UID}", out), out[-3000:]
    assert re.search(r"PASS\s+\S*ddp", out) and re.search(r"PASS\s+\S*compile", out), out[-3000:]
    return out


def _probe(enroot: Enroot, name: str, rw: bool) -> None:
    """torch.compile, the bound HOME with the plant in reach but not imported, and the root
    filesystem read-only or writable as asked."""
    code = ("import os, torch; home = os.environ['HOME']; "
            f"assert home == {str(enroot.home)!r}, 'HOME is ' + home; "
            "assert os.path.isdir(home + '/.local/lib'), 'the bound HOME is not there'; "
            "assert torch.__file__.startswith('/opt/venv/'), torch.__file__; "
            "f = torch.compile(lambda x: x * 2 + 1); assert f(torch.ones(4)).tolist() == [3.0] * 4; "
            "w = os.access('/opt/venv/bin', os.W_OK); print('ENROOT-OK', torch.__file__, 'rootfs-writable' if w else 'rootfs-ro')")
    out = _start(enroot, name, rw, "python", "-c", code)
    assert "ENROOT-OK /opt/venv/" in out, out[-3000:]
    assert ("rootfs-writable" if rw else "rootfs-ro") in out, out[-3000:]
    # A job's orphans go to the image's tini, which reaps them, not to the host's init.
    adopted = _start(enroot, name, rw, "python", "-c", ORPHAN)
    assert "ADOPTED-BY tini" in adopted, adopted[-3000:]
    # The control: the venv's own interpreter outside the venv, without the image's PYTHONNOUSERSITE
    # (an image without those defences), imports the plant from the bound HOME.
    bare = 'env -u PYTHONNOUSERSITE "$(readlink -f /opt/venv/bin/python)" -c "import torch"'
    control = enroot.as_stranger("start", *(["--rw"] if rw else []), name, "sh", "-c", bare)
    assert control.returncode != 0 and "PLANTED ~/.local torch" in control.stdout + control.stderr, \
        control.stdout + control.stderr


def test_export_selftest_compile_and_user_site_read_only_and_writable(enroot: Enroot, from_export: str) -> None:
    _probe(enroot, from_export, rw=False)
    _selftest(enroot, from_export, False)
    _probe(enroot, from_export, rw=True)


def test_import_writable_selftest_compile_and_user_site(enroot: Enroot, from_import: str) -> None:
    """enroot's own import: its /etc/rc and /etc/environment, not the export's."""
    _probe(enroot, from_import, rw=True)
    _selftest(enroot, from_import, True, "-k", "ddp or compile")
