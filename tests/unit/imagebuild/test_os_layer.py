"""imagebuild/os-layer.sh: the OS layer's packages are installed in a stage of their own
(dockerfile/06-os.j2) and the image's layer applies what that stage changed (50-os.j2). Here a tree
stands for the stage's root: it is marked, changed the ways apt and the RUN change it, collected, and
the collection applied to a copy of the tree as it was; the copy must then be the changed tree, entry
for entry (type, bytes, mode, owner, links, times), and the tar must hold only what changed."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "imagebuild" / "os-layer.sh"
#: As root (the stage's RUN), another owner for a changed file; elsewhere this user's own ids.
OWNER = (1000, 100) if os.geteuid() == 0 else (os.getuid(), os.getgid())


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120,
                          check=False)


def entries(tree: Path) -> dict[str, tuple[object, ...]]:
    """Every entry below tree: its type and mode, owner, size, link target, bytes, mtime, and which
    other entries share its inode."""
    stats = {str(path.relative_to(tree)): (path, path.lstat()) for path in sorted(tree.rglob("*"))}
    inodes: dict[int, list[str]] = {}
    for rel, (_, st) in stats.items():
        inodes.setdefault(st.st_ino, []).append(rel)
    out: dict[str, tuple[object, ...]] = {}
    for rel, (path, st) in stats.items():
        body = path.read_bytes() if path.is_file() and not path.is_symlink() else None
        target = os.readlink(path) if path.is_symlink() else None
        size = None if path.is_dir() and not path.is_symlink() else st.st_size
        out[rel] = (st.st_mode, st.st_uid, st.st_gid, size, target, body, st.st_mtime_ns, tuple(inodes[st.st_ino]))
    return out


def base_tree(root: Path) -> None:
    """A small root as a base image has it."""
    for d in ("etc/apt/apt.conf.d", "usr/bin", "usr/lib/python3", "var/log/apt", "var/lib/dpkg", "tmp", "opt"):
        (root / d).mkdir(parents=True)
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/bash\n")
    (root / "etc/apt/apt.conf.d/docker-clean").write_text("clean\n")
    (root / "var/log/apt/eipp.log.xz").write_bytes(b"xz")
    (root / "var/lib/dpkg/status").write_text("Package: base-files\n")
    (root / "usr/bin/su").write_bytes(b"\x7fELF su")
    (root / "usr/bin/su").chmod(0o4755)
    (root / "usr/bin/perl").write_bytes(b"\x7fELF perl")
    os.link(root / "usr/bin/perl", root / "usr/bin/perl5.36.0")
    (root / "usr/lib/python3/old").mkdir()
    (root / "usr/lib/python3/old/mod.py").write_text("old = 1\n")
    (root / "usr/bin/unchanged").write_bytes(b"same")
    for path in [root, *root.rglob("*")]:
        os.utime(path, ns=(1_600_000_000_000_000_000,) * 2, follow_symlinks=False)


def apt_changes(root: Path) -> None:
    """What apt and the OS RUN do to it: new packages, an upgrade, a rewrite in place, deletions."""
    (root / "etc/passwd").open("a").write("sshd:x:100:65534::/run/sshd:/usr/sbin/nologin\n")  # in place
    (root / "etc/apt/apt.conf.d/docker-clean").unlink()
    (root / "var/log/apt/eipp.log.xz").unlink()
    new = root / "var/lib/dpkg/status.new"
    new.write_text("Package: base-files\n\nPackage: openssh-server\n")
    new.replace(root / "var/lib/dpkg/status")  # dpkg's way: a new file renamed over the old
    (root / "usr/bin/su").chmod(0o755)  # the setuid strip
    (root / "usr/bin/perl5.36.0").unlink()  # an upgrade: both names anew, one inode
    (root / "usr/bin/perl").unlink()
    (root / "usr/bin/perl").write_bytes(b"\x7fELF perl 5.36.1")
    os.link(root / "usr/bin/perl", root / "usr/bin/perl5.36.0")
    shutil.rmtree(root / "usr/lib/python3/old")
    share = root / "usr/share/doc/openssh server"
    share.mkdir(parents=True)
    (share / "copyright").write_text("BSD\n")
    (share / "odd\nname").write_text("a newline in a file name\n")
    (root / "usr/sbin").mkdir()
    (root / "usr/sbin/sshd").write_bytes(b"\x7fELF sshd")
    (root / "usr/sbin/sshd").chmod(0o755)
    os.chown(root / "usr/sbin/sshd", *OWNER)
    (root / "usr/sbin/ssh-link").symlink_to("sshd")
    (root / "opt/pt-multi-gpu/libcuda").mkdir(parents=True)
    (root / "opt/pt-multi-gpu/libcuda/libcuda.so").write_text("INPUT(-l:libcuda.so.1)\n")
    # Times the RUN leaves: a folder whose file was rewritten in place keeps its own.
    os.utime(root / "usr/sbin/sshd", ns=(1_700_000_000_000_000_000,) * 2)


def collected(tmp_path: Path, change: Callable[[Path], None]) -> tuple[Path, Path, Path]:
    """A base tree marked, changed by `change`, collected: (the stage's root after the change, with its
    collection at /ptmg-os; the image's root as the tree was before; the collection)."""
    root, image = tmp_path / "stage", tmp_path / "image"
    root.mkdir()
    base_tree(root)
    subprocess.run(["cp", "-a", str(root), str(image)], check=True)
    marked = run("mark", root, root / "tmp/ptmg-os-before")
    assert marked.returncode == 0, marked.stderr
    time.sleep(0.02)  # past the clock's tick: a change gets another ctime
    change(root)
    done = run("collect", root, root / "tmp/ptmg-os-before", root / "ptmg-os")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (root / "ptmg-os").iterdir()) == ["deleted", "layer.tar"]
    return root, image, root / "ptmg-os"


@pytest.fixture
def stage(tmp_path: Path) -> tuple[Path, Path, Path]:
    """What apt and the OS RUN change, collected (see `collected`)."""
    return collected(tmp_path, apt_changes)


def test_applying_the_collection_gives_the_tree_apt_left(stage: tuple[Path, Path, Path]) -> None:
    root, image, out = stage
    applied = run("apply", out, image)
    assert applied.returncode == 0, applied.stderr
    # The stage's own files are not part of it; nor is the root's own entry.
    shutil.rmtree(out)
    (root / "tmp/ptmg-os-before").unlink()
    want, got = entries(root), entries(image)
    assert sorted(got) == sorted(want)
    for rel, entry in want.items():
        if rel != "tmp":  # its time is the stage's mark's
            assert got[rel] == entry, rel
    assert got["usr/bin/perl"][-1] == ("usr/bin/perl", "usr/bin/perl5.36.0"), "one inode, two names"


def test_the_layer_holds_what_changed_and_the_folders_above_it_only(stage: tuple[Path, Path, Path]) -> None:
    _, _, out = stage
    with tarfile.open(out / "layer.tar") as tar:
        names = [m.name.removeprefix("./") for m in tar.getmembers()]
    changed = {"etc/passwd", "var/lib/dpkg/status", "usr/bin/su", "usr/bin/perl", "usr/bin/perl5.36.0",
               "usr/share/doc/openssh server/copyright", "usr/share/doc/openssh server/odd\nname",
               "usr/sbin/sshd", "usr/sbin/ssh-link", "opt/pt-multi-gpu/libcuda/libcuda.so"}
    folders = {"etc", "etc/apt", "etc/apt/apt.conf.d", "var", "var/log", "var/log/apt", "var/lib", "var/lib/dpkg",
               "usr", "usr/bin", "usr/lib", "usr/lib/python3", "usr/share", "usr/share/doc",
               "usr/share/doc/openssh server", "usr/sbin", "opt", "opt/pt-multi-gpu", "opt/pt-multi-gpu/libcuda"}
    assert sorted(names) == sorted(changed | folders)
    assert names.index("usr/share/doc") < names.index("usr/share/doc/openssh server/copyright"), "folders first"
    deleted = (out / "deleted").read_bytes().split(b"\0")
    assert deleted == [b"./etc/apt/apt.conf.d/docker-clean", b"./usr/lib/python3/old", b"./usr/lib/python3/old/mod.py",
                       b"./var/log/apt/eipp.log.xz", b""]


def test_the_collection_leaves_out_the_stages_own_files(tmp_path: Path) -> None:
    def neighbour(root: Path) -> None:
        (root / "tmp/ptmg-os-beforehand").write_text("a neighbour of the mark's list is not it\n")

    _, _, out = collected(tmp_path, neighbour)
    with tarfile.open(out / "layer.tar") as tar:
        names = sorted(m.name.removeprefix("./") for m in tar.getmembers())
    assert names == ["tmp", "tmp/ptmg-os-beforehand"]
    assert (out / "deleted").read_bytes() == b""


@pytest.mark.parametrize("args", [(), ("mark", "x"), ("collect", "a", "b"), ("apply", "x"), ("patch", "a", "b", "c")])
def test_a_wrong_call_says_how_to_call_it(args: tuple[str, ...]) -> None:
    r = run(*args)
    assert r.returncode == 2 and r.stderr.startswith("usage: os-layer.sh mark ROOT STATE"), r.stderr


def test_apply_refuses_a_folder_without_a_collection(tmp_path: Path) -> None:
    (tmp_path / "image").mkdir()
    r = run("apply", tmp_path / "nothing", tmp_path / "image")
    assert r.returncode == 2 and "has no layer.tar and deleted (made by collect)" in r.stderr, r.stderr


#: A file capability, as `setcap cap_net_raw=ep` writes it (VFS_CAP_REVISION_2): the layer keeps it.
CAP_NET_RAW = bytes.fromhex("0100000200200000000000000000000000000000")


def test_a_file_capability_goes_with_the_file(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("setting security.capability needs root, as the unit tier runs in CI and the stage's RUN")

    def ping(root: Path) -> None:
        (root / "usr/bin/ping").write_bytes(b"\x7fELF ping")
        os.setxattr(root / "usr/bin/ping", "security.capability", CAP_NET_RAW)

    _, image, out = collected(tmp_path, ping)
    applied = run("apply", out, image)
    assert applied.returncode == 0, applied.stderr
    assert os.getxattr(image / "usr/bin/ping", "security.capability") == CAP_NET_RAW


def test_what_another_filesystem_holds_is_not_part_of_the_layer(tmp_path: Path) -> None:
    """The stage's RUN has mounts in its root: /proc, apt's cache mounts, /etc/hosts and the secrets.
    Neither they nor what is written into them may land in the image's layer."""
    if os.geteuid() != 0:
        pytest.fail("mounting needs root, as the unit tier runs in CI and the stage's RUN")
    root = tmp_path / "stage"
    root.mkdir()
    base_tree(root)
    (root / "var/cache/apt").mkdir(parents=True)
    (root / "etc/hosts").write_text("127.0.0.1 localhost\n")
    elsewhere = tmp_path / "elsewhere"  # BuildKit's own files, on another filesystem than the root's
    elsewhere.mkdir()
    script = f"""set -e
mount -t tmpfs ptmg-test-cache {root}/var/cache/apt
mount -t tmpfs ptmg-test-elsewhere {elsewhere}
echo '127.0.0.1 the-build-host' > {elsewhere}/hosts
mount --bind {elsewhere}/hosts {root}/etc/hosts
sh {SCRIPT} mark {root} {root}/tmp/ptmg-os-before
sleep 0.02
echo deb > {root}/var/cache/apt/openssh-server.deb
echo '127.0.0.1 changed' > {root}/etc/hosts
echo sshd > {root}/usr/bin/sshd
sh {SCRIPT} collect {root} {root}/tmp/ptmg-os-before {root}/ptmg-os
"""
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    with tarfile.open(root / "ptmg-os/layer.tar") as tar:
        names = sorted(m.name.removeprefix("./") for m in tar.getmembers())
    assert names == ["usr", "usr/bin", "usr/bin/sshd"]
    assert (root / "ptmg-os/deleted").read_bytes() == b""
