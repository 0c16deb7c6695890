"""entrypoint/rootstart.py, the only code that runs as root: which environments it refuses
(a PATH or working directory pt could write, loader/interpreter variables), and the re-own
walk of the uid remap, which must never follow a link pt planted. The remap itself
(usermod/groupmod) and the drop to pt run in the docker tier (tests/docker)."""

from __future__ import annotations

import dataclasses
import os
import pwd
from pathlib import Path

import pytest

import ptmg_contract as contract
import rootstart
from common import ConfigError, Settings

SAFE = {"PATH": contract.ROOT_PATH}


def test_root_only_paths() -> None:
    assert rootstart.root_only("/usr/bin")
    assert rootstart.root_only("/")
    assert rootstart.root_only("/usr/bin/no-such-dir-ptmg")  # its parent decides: nobody else can create it
    assert not rootstart.root_only("/tmp")  # world-writable (sticky or not)
    assert not rootstart.root_only("/tmp/whatever/below")


def test_root_only_follows_the_chain(tmp_path: Path) -> None:
    mine = tmp_path / "d"
    mine.mkdir(mode=0o755)
    assert not rootstart.root_only(str(mine)), "a root-owned dir below a world-writable one is not root's alone"
    link = tmp_path / "to-usr-bin"
    link.symlink_to("/usr/bin")
    assert rootstart.root_only(str(link)), "a link is judged by what it points to"


def test_the_documented_root_environment_is_safe() -> None:
    assert rootstart.unsafe_environment(SAFE, contract.ROOT_WORKDIR) == []


@pytest.mark.parametrize(("env", "cwd", "why"), [
    ({"PATH": f"{contract.VENV}/bin:{contract.ROOT_PATH}"}, "/", f"PATH entry {contract.VENV}/bin"),
    ({"PATH": f"/tmp:{contract.ROOT_PATH}"}, "/", "PATH entry /tmp is writable by others"),
    ({"PATH": "bin:/usr/bin"}, "/", "PATH entry 'bin' is relative"),
    ({"PATH": ":/usr/bin"}, "/tmp", "PATH entry (empty: the working directory)"),
    (SAFE, "/tmp", "the working directory /tmp is writable by others"),
    ({**SAFE, "LD_PRELOAD": "/tmp/x.so"}, "/", "LD_PRELOAD is set"),
    ({**SAFE, "PYTHONPATH": "/tmp"}, "/", "PYTHONPATH is set"),
    ({**SAFE, "BASH_ENV": "/tmp/rc"}, "/", "BASH_ENV is set"),
    # root's `docker exec` inherits the container's HOME when one is given (-e HOME=/workspace, a
    # common convention): bash would read pt's ~/.bashrc and python3 pt's user site as root.
    ({**SAFE, "HOME": "/tmp"}, "/", "HOME /tmp is writable by others"),
    # Loader and interpreter variables beyond the first list: each makes root load what pt wrote.
    ({**SAFE, "LD_AUDIT": "/tmp/a.so"}, "/", "LD_AUDIT is set"),
    ({**SAFE, "GCONV_PATH": "/tmp"}, "/", "GCONV_PATH is set"),
    ({**SAFE, "LOCPATH": "/tmp"}, "/", "LOCPATH is set"),
    ({**SAFE, "PYTHONUSERBASE": "/tmp"}, "/", "PYTHONUSERBASE is set"),
    ({**SAFE, "PYTHONPYCACHEPREFIX": "/tmp"}, "/", "PYTHONPYCACHEPREFIX is set"),
    ({**SAFE, "PERL5LIB": "/tmp"}, "/", "PERL5LIB is set"),  # apt's and debconf's Perl run as root
    ({**SAFE, "PERL5OPT": "-M/tmp/x"}, "/", "PERL5OPT is set"),
    ({**SAFE, "XDG_CONFIG_HOME": "/tmp"}, "/", "XDG_CONFIG_HOME /tmp is writable by others"),
    ({**SAFE, "TMPDIR": "/tmp/pt-owned"}, "/", "TMPDIR /tmp/pt-owned is writable by others"),
])
def test_environments_root_refuses(env: dict[str, str], cwd: str, why: str, tmp_path: Path) -> None:
    if "/opt/venv" in env["PATH"] and not Path(contract.VENV).exists():
        env = {"PATH": f"{tmp_path}:{contract.ROOT_PATH}"}  # this host has no /opt/venv: any non-root dir
        why = f"PATH entry {tmp_path}"
    problems = rootstart.unsafe_environment(env, cwd)
    assert any(why in p for p in problems), problems


#: Every variable root refuses when set at all, written out here (not imported from rootstart):
#: dropping one from the code's list fails its case. Each makes the loader, glibc, Python, a shell
#: or Perl (apt's and debconf's) load code or data from where it points.
REFUSED_WHEN_SET = (
    "GCONV_PATH", "LOCPATH", "NLSPATH", "HOSTALIASES", "RESOLV_HOST_CONF",
    "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONPYCACHEPREFIX", "PYTHONEXECUTABLE",
    "BASH_ENV", "ENV", "PROMPT_COMMAND", "PERL5LIB", "PERLLIB", "PERL5OPT", "PERL5DB",
    "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "LD_DEBUG_OUTPUT", "LD_ANY_NEW_ONE",  # any LD_* counts
)
#: Directories root's programs read their own files from or write to: refused unless root's alone.
REFUSED_UNLESS_ROOTS = ("HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME", "TMPDIR")


@pytest.mark.parametrize("name", REFUSED_WHEN_SET)
def test_each_loader_variable_is_refused(name: str) -> None:
    problems = rootstart.unsafe_environment({**SAFE, name: "/usr/lib"}, "/")  # even a root-owned value
    assert problems == [f"{name} is set (root's `docker exec` would use it)"], problems


@pytest.mark.parametrize("name", REFUSED_UNLESS_ROOTS)
def test_each_directory_variable_is_refused_where_others_can_write(name: str, tmp_path: Path) -> None:
    shared = tmp_path / "pt-owned"  # below a world-writable or user-owned folder: not root's alone
    shared.mkdir()
    problems = rootstart.unsafe_environment({**SAFE, name: str(shared)}, "/")
    assert problems == [f"{name} {shared} is writable by others (root's `docker exec` would use it)"], problems
    assert rootstart.unsafe_environment({**SAFE, name: "relative/dir"}, "/"), "a relative folder is not root's"
    assert rootstart.unsafe_environment({**SAFE, name: "/usr/share"}, "/") == []  # root's alone: fine


def test_harmless_settings_stay_allowed() -> None:
    """What users of ML images set routinely is not refused: only what makes root load code."""
    env = {**SAFE, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/root", "LANG": "C.UTF-8",
           "NCCL_DEBUG": "INFO", "HF_HOME": "/tmp/hf", "TMPDIR": "/tmp"}
    assert rootstart.unsafe_environment(env, "/") == []


def test_start_as_root_refuses_before_touching_anything(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    touched: list[str] = []
    monkeypatch.setattr(rootstart, "remap", lambda s: touched.append("remap"))
    monkeypatch.setattr(rootstart, "become", lambda name: touched.append("become"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        rootstart.start_as_root(Settings(
            mode="services", argv=(), jupyter=True, jupyter_port=8888, ssh="auto", tensorboard="on",
            tensorboard_port=6006, tensorboard_logdir="/workspace/runs", pt_uid=4242, pt_gid=4242,
            ssh_host_key_dir="/k", diagnostics=True), {"PATH": f"{contract.VENV}/bin:/usr/bin"})
    msg = str(info.value)
    assert msg.startswith("started as root, but `docker exec` would run root with what pt controls")
    assert f"-w {contract.ROOT_WORKDIR} -e PATH={contract.ROOT_PATH}" in msg
    assert touched == []


class _Chowns:
    """Stands in for os.chown inside rootstart: records what would be re-owned (the real
    call needs root), resolving the dir_fd the walk passes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, bool]] = []

    def __call__(self, path: str, uid: int, gid: int, *, dir_fd: int | None = None,
                 follow_symlinks: bool = True) -> None:
        where = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path) if dir_fd is not None else path
        self.calls.append((where, uid, gid, follow_symlinks))


@pytest.fixture
def chowns(monkeypatch: pytest.MonkeyPatch) -> _Chowns:
    rec = _Chowns()
    monkeypatch.setattr(os, "chown", rec)  # rootstart calls os.chown
    return rec


def test_rechown_never_follows_a_link(tmp_path: Path, chowns: _Chowns) -> None:
    me = (os.getuid(), os.getgid())
    new = (4242, 4343)
    top = tmp_path / "home"
    (top / "sub").mkdir(parents=True)
    (top / "file").write_text("x")
    (top / "sub" / "deep").write_text("y")
    canary_dir = tmp_path / "canary-dir"  # what a planted link points at
    canary_dir.mkdir()
    (canary_dir / "inner").write_text("root's\n")
    (top / "link-to-file").symlink_to(canary_dir / "inner")
    (top / "link-to-dir").symlink_to(canary_dir)
    (top / "sub" / "link-to-dir").symlink_to(canary_dir)
    assert rootstart.rechown(str(top), me, new, set(), into_mounts=False) == 7
    assert sorted(c[0] for c in chowns.calls) == sorted(str(p) for p in [
        top, top / "sub", top / "file", top / "sub" / "deep", top / "link-to-file", top / "link-to-dir",
        top / "sub" / "link-to-dir"])
    assert all(c[1:] == (*new, False) for c in chowns.calls), "every change is lchown-style, links never followed"
    assert not [c for c in chowns.calls if str(canary_dir) in c[0]]


def test_rechown_changes_only_what_the_old_ids_own(tmp_path: Path, chowns: _Chowns) -> None:
    (tmp_path / "f").write_text("x")
    assert rootstart.rechown(str(tmp_path), (99999, 99999), (1, 1), set(), into_mounts=False) == 0
    assert chowns.calls == []
    uid = os.getuid()
    assert rootstart.rechown(str(tmp_path), (uid, 99999), (1, 1), set(), into_mounts=False) == 2
    assert {c[1:3] for c in chowns.calls} == {(1, -1)}, "only the uid moves when only the uid matches"


def test_rechown_of_a_link_or_nothing_does_nothing(tmp_path: Path, chowns: _Chowns) -> None:
    (tmp_path / "link").symlink_to(tmp_path)
    me = (os.getuid(), os.getgid())
    assert rootstart.rechown(str(tmp_path / "link"), me, (1, 1), set(), into_mounts=True) == 0
    assert rootstart.rechown(str(tmp_path / "absent"), me, (1, 1), set(), into_mounts=True) == 0
    assert chowns.calls == []


def test_rechown_leaves_a_mounted_file_alone(tmp_path: Path, chowns: _Chowns) -> None:
    """A single-file bind mount (-v ~/.gitconfig:/home/pt/.gitconfig, a Kubernetes subPath) is the
    host's file: the remap must not re-own it on the host."""
    me = (os.getuid(), os.getgid())
    (tmp_path / "gitconfig").write_text("x")
    (tmp_path / "other").write_text("y")
    mounts = {str(tmp_path / "gitconfig")}
    assert rootstart.rechown(str(tmp_path), me, (1, 1), mounts, into_mounts=False) == 2  # top + other
    assert str(tmp_path / "gitconfig") not in {c[0] for c in chowns.calls}


def test_rechown_stays_out_of_mounts_unless_asked(tmp_path: Path, chowns: _Chowns) -> None:
    """A bind mount's files belong to the host (the mount point itself too); the image's
    own state dirs are re-owned even when they are volumes."""
    me = (os.getuid(), os.getgid())
    top = tmp_path / "w"
    (top / "mnt").mkdir(parents=True)
    (top / "mnt" / "f").write_text("host's")
    mounts = {str(top / "mnt")}
    assert rootstart.rechown(str(top), me, (1, 1), mounts, into_mounts=False) == 1  # top only
    chowns.calls.clear()
    assert rootstart.rechown(str(top), me, (1, 1), mounts, into_mounts=True) == 3
    assert str(top / "mnt" / "f") in [c[0] for c in chowns.calls]


def test_rechown_reowns_a_dangling_link_itself(tmp_path: Path, chowns: _Chowns) -> None:
    """Each entry is judged by itself (lstat), never by what a link points at: a link whose
    target is gone (or is someone else's) is still pt's link and moves with pt."""
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    me = (os.getuid(), os.getgid())
    assert rootstart.rechown(str(tmp_path), me, (1, 1), set(), into_mounts=False) == 2
    assert str(tmp_path / "dangling") in [c[0] for c in chowns.calls]


def test_rechown_goes_on_past_an_entry_it_cannot_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry that vanishes mid-walk or refuses (a read-only mount) is skipped; the rest moves."""
    done: list[str] = []

    def chown(path: str, uid: int, gid: int, *, dir_fd: int | None = None, follow_symlinks: bool = True) -> None:
        if path == "stuck":
            raise PermissionError(1, "Operation not permitted", path)
        done.append(path)

    monkeypatch.setattr(os, "chown", chown)
    for name in ("stuck", "fine"):
        (tmp_path / name).write_text("x")
    assert rootstart.rechown(str(tmp_path), (os.getuid(), os.getgid()), (1, 1), set(), into_mounts=False) == 2
    assert sorted(done) == sorted([str(tmp_path), "fine"])


def test_root_only_refuses_a_path_it_cannot_look_at(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")  # a loop: realpath leaves it, stat fails (ELOOP)
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert not rootstart.root_only(str(tmp_path / "a"))


def test_a_failing_root_command_says_how_it_failed() -> None:
    rootstart._run(["/bin/sh", "-c", "exit 0"])  # success is silent
    with pytest.raises(rootstart.RootStartFailed, match=r"exited 3: no such user$"):
        rootstart._run(["/bin/sh", "-c", "echo 'no such user' >&2; exit 3"])
    with pytest.raises(rootstart.RootStartFailed, match=r"^cannot run /nonexistent/usermod: No such file"):
        rootstart._run(["/nonexistent/usermod", "-u", "1"])


def test_mount_points_come_from_mountinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    assert {"/", "/proc"} <= rootstart._mount_points()  # the mount point column, not the root or options

    def no_proc(*args: object, **kwargs: object) -> None:
        raise FileNotFoundError(2, "No such file or directory", "/proc/self/mountinfo")

    monkeypatch.setattr(rootstart, "open", no_proc, raising=False)
    assert rootstart._mount_points() == set()


SETTINGS = Settings(mode="services", argv=(), jupyter=True, jupyter_port=8888, ssh="auto", tensorboard="on",
                    tensorboard_port=6006, tensorboard_logdir="/workspace/runs", pt_uid=None, pt_gid=None,
                    ssh_host_key_dir="/k", diagnostics=True)


class _Remap:
    """pt is uid 1000, gid 1001, with its home in tmp_path; records the commands run and the walks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, home: str) -> None:
        self.home = home
        self.mounts: set[str] = set()
        self.runs: list[list[str]] = []
        self.walks: list[tuple[str, tuple[int, int], tuple[int, int], bool]] = []
        pw = pwd.struct_passwd((contract.USER, "x", 1000, 1001, "", home, "/bin/bash"))
        monkeypatch.setattr(pwd, "getpwnam", lambda name: pw if name == contract.USER else None)
        monkeypatch.setattr(rootstart, "_run", self.runs.append)
        monkeypatch.setattr(rootstart, "_mount_points", lambda: self.mounts)
        monkeypatch.setattr(rootstart, "rechown", self.rechown)

    def rechown(self, top: str, old: tuple[int, int], new: tuple[int, int], mounts: set[str], into_mounts: bool) -> int:
        assert mounts is self.mounts
        self.walks.append((top, old, new, into_mounts))
        return 2


@pytest.fixture
def remap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> _Remap:
    return _Remap(monkeypatch, str(tmp_path / "home"))


def test_remap_of_the_uid_keeps_the_group(remap: _Remap, capsys: pytest.CaptureFixture[str]) -> None:
    rootstart.remap(dataclasses.replace(SETTINGS, pt_uid=2000))
    assert remap.runs == [[rootstart.USERMOD, "-o", "-u", "2000", "-g", "1001", contract.USER]]
    old, new = (1000, 1001), (2000, 1001)
    assert remap.walks == [(remap.home, old, new, False), (contract.WORKDIR, old, new, False),
                           *((d, old, new, True) for d in contract.PT_STATE_DIRS)]
    walked = 2 * (2 + len(contract.PT_STATE_DIRS))
    assert f"remapped to uid 2000 gid 1001 (from PT_UID/PT_GID; {walked} entries re-owned" in capsys.readouterr().err


def test_remap_of_the_group_moves_the_group_first(remap: _Remap) -> None:
    rootstart.remap(dataclasses.replace(SETTINGS, pt_gid=3000))
    assert remap.runs == [[rootstart.GROUPMOD, "-o", "-g", "3000", contract.USER],
                          [rootstart.USERMOD, "-o", "-u", "1000", "-g", "3000", contract.USER]]
    assert {w[2] for w in remap.walks} == {(1000, 3000)}


def test_remap_to_the_same_ids_changes_nothing(remap: _Remap) -> None:
    rootstart.remap(SETTINGS)
    rootstart.remap(dataclasses.replace(SETTINGS, pt_uid=1000, pt_gid=1001))
    assert remap.runs == [] and remap.walks == []


def test_remap_leaves_a_mounted_home_or_workdir_to_the_host(remap: _Remap) -> None:
    remap.mounts = {remap.home}
    rootstart.remap(dataclasses.replace(SETTINGS, pt_uid=2000, pt_gid=3000))
    assert [w[0] for w in remap.walks] == [contract.WORKDIR, *contract.PT_STATE_DIRS]
    assert {w[2] for w in remap.walks} == {(2000, 3000)}


@pytest.mark.parametrize("error", [KeyError(contract.USER), OSError(22, "Invalid argument")])
def test_a_failed_drop_to_pt_is_a_start_failure(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    def become(name: str) -> None:
        raise error

    monkeypatch.setattr(rootstart, "unsafe_environment", lambda env, cwd: [])
    monkeypatch.setattr(rootstart, "remap", lambda s: None)
    monkeypatch.setattr(rootstart, "become", become)
    with pytest.raises(rootstart.RootStartFailed, match=f"^cannot drop to {contract.USER}: "):
        rootstart.start_as_root(SETTINGS, SAFE)
