"""The image without its entrypoint, as any uid: the venv's startup module (a private HOME, a user
name, Inductor's cache off a noexec temporary folder) and the login profile (the session file only
when it is the user's own). Real files, real modes and owners, a real noexec mount where root can
make one; every path under the test's own temporary folders, never the host's /tmp."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import types
from collections.abc import Callable, Iterator
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
OTHER_UID = 4242  # no passwd entry on the host or in the image
ROOT_ONLY = "needs root: a noexec mount, a file owned by another uid, a shell run as another uid"


def _load(name: str, path: Path) -> types.ModuleType:
    module = types.ModuleType(name)
    SourceFileLoader(name, str(path)).exec_module(module)
    return module


ptmg_userenv = _load("ptmg_userenv", ROOT / "entrypoint" / "ptmg_userenv.py")


@pytest.fixture(autouse=True)
def temp_candidates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path]:
    """The module's /tmp, /var/tmp and /dev/shm, as folders of this test: a fallback never lands
    in the host's /tmp (it left /tmp/ptmg-0 behind), and where it lands can be asserted."""
    dirs = (tmp_path / "sys-tmp", tmp_path / "sys-var-tmp", tmp_path / "sys-shm")
    for d in dirs:
        d.mkdir()
    monkeypatch.setattr(ptmg_userenv, "_TEMP_CANDIDATES", tuple(map(str, dirs)))
    return dirs


# --- the venv's startup module ------------------------------------------------------------
def test_home_unset_gets_a_private_writable_home(tmp_path: Path) -> None:
    env = {"TMPDIR": str(tmp_path), "USER": "someone"}
    changed = ptmg_userenv.fix(env, os.getuid())
    home = tmp_path / f"ptmg-{os.getuid()}" / "home"
    assert changed == {"HOME": str(home)} and env["HOME"] == str(home)
    assert stat.S_IMODE((tmp_path / f"ptmg-{os.getuid()}").stat().st_mode) == 0o700
    assert home.is_dir() and os.access(home, os.W_OK)


def _unusable_home(kind: str, tmp_path: Path) -> str:
    if kind == "missing":
        return str(tmp_path / "nonexistent" / "home")
    if os.getuid() != 0:  # a read-only folder
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        return str(ro)
    plain = tmp_path / "a-file"  # root writes to any folder: a regular file is never a usable HOME
    plain.write_text("x")
    return str(plain)


@pytest.mark.parametrize("kind", ["missing", "unwritable"])
def test_unusable_home_is_replaced_by_the_private_one(tmp_path: Path, kind: str) -> None:
    temp = tmp_path / "t"
    temp.mkdir()
    env = {"HOME": _unusable_home(kind, tmp_path), "TMPDIR": str(temp), "USER": "u"}
    home = temp / f"ptmg-{os.getuid()}" / "home"
    assert ptmg_userenv.fix(env, os.getuid()) == {"HOME": str(home)}
    assert env == {"HOME": str(home), "TMPDIR": str(temp), "USER": "u"} and home.is_dir()


def test_without_a_writable_temporary_folder_tmpdir_is_the_private_folder(
        tmp_path: Path, temp_candidates: tuple[Path, Path, Path]) -> None:
    """No $TMPDIR, /tmp or /var/tmp to write: the private folder (here under /dev/shm) is TMPDIR too."""
    sys_tmp, var_tmp, shm = temp_candidates
    sys_tmp.rmdir()
    var_tmp.rmdir()
    env = {"USER": "u"}
    base = shm / f"ptmg-{os.getuid()}"
    assert ptmg_userenv.fix(env, os.getuid()) == {"HOME": str(base / "home"), "TMPDIR": str(base)}


def test_a_usable_home_and_a_name_change_nothing(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "USER": "u"}
    assert ptmg_userenv.fix(env, os.getuid()) == {} and env == {"HOME": str(tmp_path), "USER": "u"}


def test_a_uid_without_passwd_entry_gets_a_name(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    assert ptmg_userenv.fix(env, OTHER_UID) == {"USER": f"uid{OTHER_UID}", "LOGNAME": f"uid{OTHER_UID}"}
    assert env["USER"] == env["LOGNAME"] == f"uid{OTHER_UID}"
    named = {"HOME": str(tmp_path), "LNAME": "given"}  # any name getpass reads first is kept
    assert ptmg_userenv.fix(named, OTHER_UID) == {}


def test_a_planted_link_or_foreign_dir_is_never_used(tmp_path: Path,
                                                     temp_candidates: tuple[Path, Path, Path]) -> None:
    """Another user may create /tmp/ptmg-<uid> first: a link, or a folder others can write, is
    skipped, and HOME goes to the next candidate folder."""
    uid = os.getuid()
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / f"ptmg-{uid}").symlink_to(tmp_path)
    assert ptmg_userenv.private_dir(str(first), uid) is None
    (second / f"ptmg-{uid}").mkdir(mode=0o777)
    os.chmod(second / f"ptmg-{uid}", 0o777)
    assert ptmg_userenv.private_dir(str(second), uid) is None
    env = {"TMPDIR": str(first), "USER": "u"}
    fallback = temp_candidates[0] / f"ptmg-{uid}" / "home"
    assert ptmg_userenv.fix(env, uid) == {"HOME": str(fallback)} and fallback.is_dir()
    assert (first / f"ptmg-{uid}").is_symlink() and not (tmp_path / "home").exists()  # nothing made through it


def test_a_private_folder_owned_by_another_uid_is_never_used(tmp_path: Path) -> None:
    """A 0700 folder by the right name, but another uid's: never this uid's HOME."""
    here = tmp_path / "p"
    here.mkdir()
    mine = ptmg_userenv.private_dir(str(here), os.getuid())
    assert mine == str(here / f"ptmg-{os.getuid()}")
    (here / f"ptmg-{OTHER_UID}").mkdir(mode=0o700)  # made by this test's uid, asked for as OTHER_UID
    assert ptmg_userenv.private_dir(str(here), OTHER_UID) is None
    env = {"HOME": "/nonexistent", "TMPDIR": str(here), "USER": "u"}
    assert not ptmg_userenv.fix(env, OTHER_UID).get("HOME", "").startswith(str(here))


def test_the_pth_file_calls_the_module() -> None:
    line = (ROOT / "entrypoint" / "ptmg_userenv.pth").read_text().strip()
    assert line == "import ptmg_userenv; ptmg_userenv.main()"


# --- real noexec and read-only filesystems -------------------------------------------------------
@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """mount(name, options, make=()) -> a tmpfs at tmp_path/name with those options (noexec: Docker's
    --tmpfs and /dev/shm default; ro: a read-only root), holding the folders in `make`; all
    unmounted after the test."""
    mounted: list[Path] = []
    if os.geteuid() != 0:
        pytest.skip(ROOT_ONLY)

    def make_mount(name: str, options: str, make: tuple[str, ...] = ()) -> Path:
        where = tmp_path / name
        where.mkdir()
        opts = [o for o in options.split(",") if o != "ro"]
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([*opts, "size=4m", "mode=1777"]),
                            "ptmg-unit-tmpfs", str(where)], capture_output=True, text=True, timeout=30, check=False)
        if r.returncode:
            pytest.skip(f"{ROOT_ONLY}: mount: {r.stderr.strip()}")
        mounted.append(where)
        for rel in make:  # each folder private (0700), its parents too
            (where / rel).mkdir(parents=True)
            for part in (Path(rel), *Path(rel).parents[:-1]):
                (where / part).chmod(0o700)
        if "ro" in options.split(","):
            subprocess.run(["mount", "-o", "remount,ro", str(where)], capture_output=True, timeout=30, check=True)
        return where

    try:
        yield make_mount
    finally:
        for where in reversed(mounted):
            subprocess.run(["umount", str(where)], capture_output=True, timeout=30, check=True)


@pytest.fixture
def noexec(mount: Callable[..., Path]) -> Path:
    return mount("noexec", "noexec")


@pytest.mark.allowed_skip(reason=ROOT_ONLY)
def test_executable_fs_reads_the_mounts_noexec_flag(tmp_path: Path, noexec: Path) -> None:
    ok = tmp_path / "exec"
    ok.mkdir()
    script = ok / "s"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    assert subprocess.run([str(script)], check=False, timeout=30).returncode == 0  # this folder does allow exec
    assert ptmg_userenv.executable_fs(str(ok)) is True
    assert ptmg_userenv.executable_fs(str(noexec)) is False
    assert ptmg_userenv.executable_fs(str(tmp_path / "absent")) is False  # an error is "no"


@pytest.mark.allowed_skip(reason=ROOT_ONLY)
def test_on_a_real_noexec_temporary_folder_home_and_inductors_cache_go_where_exec_works(
        tmp_path: Path, noexec: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled kernels load from Inductor's and Triton's caches: a noexec folder cannot hold them."""
    ok = tmp_path / "exec"
    ok.mkdir()
    monkeypatch.setattr(ptmg_userenv, "_TEMP_CANDIDATES", (str(noexec), str(ok)))
    env = {"USER": "u"}
    home = f"{ok}/ptmg-{os.getuid()}/home"  # and /tmp (here the noexec mount) is noexec: Inductor's cache too
    assert ptmg_userenv.fix(env, os.getuid()) == {"HOME": home, "TORCHINDUCTOR_CACHE_DIR": f"{home}/.cache/torchinductor"}
    # a noexec TMPDIR and a HOME that allows exec: Inductor's cache under HOME
    env2 = {"USER": "u", "HOME": str(ok), "TMPDIR": str(noexec)}
    assert ptmg_userenv.fix(env2, os.getuid()) == {"TORCHINDUCTOR_CACHE_DIR": f"{ok}/.cache/torchinductor"}
    assert env2["TORCHINDUCTOR_CACHE_DIR"] == f"{ok}/.cache/torchinductor"
    # ... unless the caller chose it, or HOME is noexec too, or the temporary folder allows exec
    chosen = {"USER": "u", "HOME": str(ok), "TMPDIR": str(noexec), "TORCHINDUCTOR_CACHE_DIR": "/mine"}
    assert ptmg_userenv.fix(chosen, os.getuid()) == {}
    (noexec / "h").mkdir()
    assert ptmg_userenv.fix({"USER": "u", "HOME": str(noexec / "h"), "TMPDIR": str(noexec)}, os.getuid()) == {}
    assert ptmg_userenv.fix({"USER": "u", "HOME": str(ok), "TMPDIR": str(ok)}, os.getuid()) == {}


def test_a_home_that_allows_exec_is_preferred(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The order of the candidates, on any host (the noexec flag faked; the real one is above)."""
    noexec, execok = tmp_path / "noexec", tmp_path / "exec"
    noexec.mkdir()
    execok.mkdir()
    monkeypatch.setattr(ptmg_userenv, "_TEMP_CANDIDATES", (str(noexec), str(execok)))
    monkeypatch.setattr(ptmg_userenv, "executable_fs", lambda path: not str(path).startswith(str(noexec)))
    env = {"USER": "u"}
    home = f"{execok}/ptmg-{os.getuid()}/home"
    assert ptmg_userenv.fix(env, os.getuid()) == {"HOME": home, "TORCHINDUCTOR_CACHE_DIR": f"{home}/.cache/torchinductor"}
    env2 = {"USER": "u", "HOME": str(execok), "TMPDIR": str(noexec)}
    assert ptmg_userenv.fix(env2, os.getuid()) == {"TORCHINDUCTOR_CACHE_DIR": f"{execok}/.cache/torchinductor"}


def test_main_never_stops_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(environ: object, uid: int) -> dict[str, str]:
        raise RuntimeError("any error")

    monkeypatch.setattr(ptmg_userenv, "fix", boom)
    ptmg_userenv.main()  # no exception


# --- every rule of the private folder, one at a time --------------------------------------------
@pytest.mark.parametrize("mode", [0o701, 0o702, 0o704, 0o710, 0o720, 0o740, 0o755])
def test_a_private_folder_any_other_uid_can_reach_is_refused(tmp_path: Path, mode: int) -> None:
    (tmp_path / f"ptmg-{os.getuid()}").mkdir()
    os.chmod(tmp_path / f"ptmg-{os.getuid()}", mode)
    assert ptmg_userenv.private_dir(str(tmp_path), os.getuid()) is None


def test_a_parent_that_cannot_hold_the_folder_or_a_folder_that_vanishes_is_no_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ptmg_userenv.private_dir(str(tmp_path / "missing"), os.getuid()) is None
    (tmp_path / "file").write_text("x")
    assert ptmg_userenv.private_dir(str(tmp_path / "file"), os.getuid()) is None

    def vanished(path: str) -> os.stat_result:
        raise FileNotFoundError(path)

    monkeypatch.setattr(ptmg_userenv.os, "lstat", vanished)  # removed between the mkdir and the look
    assert ptmg_userenv.private_dir(str(tmp_path), os.getuid()) is None


def test_the_same_home_on_every_start(tmp_path: Path) -> None:
    """Every Python start runs fix(): the second finds the folder made by the first and keeps it."""
    first = {"TMPDIR": str(tmp_path), "USER": "u"}
    second = dict(first)
    home = tmp_path / f"ptmg-{os.getuid()}" / "home"
    assert ptmg_userenv.fix(first, os.getuid()) == ptmg_userenv.fix(second, os.getuid()) == {"HOME": str(home)}
    assert stat.S_IMODE(home.stat().st_mode) == 0o700


def test_a_home_that_cannot_be_made_goes_to_the_next_folder(tmp_path: Path,
                                                            temp_candidates: tuple[Path, Path, Path]) -> None:
    """ptmg-<uid> is ours, but `home` in it is a file: the next candidate folder is used."""
    base = tmp_path / f"ptmg-{os.getuid()}"
    base.mkdir(mode=0o700)
    base.chmod(0o700)
    (base / "home").write_text("not a folder")
    env = {"TMPDIR": str(tmp_path), "USER": "u"}
    assert ptmg_userenv.fix(env, os.getuid()) == {"HOME": f"{temp_candidates[0]}/ptmg-{os.getuid()}/home"}


def test_tmpdir_is_set_only_when_neither_tmp_nor_var_tmp_is_writable(
        temp_candidates: tuple[Path, Path, Path]) -> None:
    sys_tmp, var_tmp, _shm = temp_candidates
    sys_tmp.rmdir()  # /tmp gone, /var/tmp still there: TMPDIR stays unset
    env = {"USER": "u"}
    assert ptmg_userenv.fix(env, os.getuid()) == {"HOME": f"{var_tmp}/ptmg-{os.getuid()}/home"}
    assert "TMPDIR" not in env


def test_an_unusable_tmpdir_is_neither_home_nor_inductors_temporary_folder(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "USER": "u", "TMPDIR": str(tmp_path / "missing")}
    assert ptmg_userenv.fix(env, os.getuid()) == {}  # /tmp (here: a folder that allows exec) is the one used


@pytest.mark.allowed_skip(reason=ROOT_ONLY)
def test_a_read_only_home_or_temporary_folder_is_never_used(tmp_path: Path, mount: Callable[..., Path],
                                                            temp_candidates: tuple[Path, Path, Path]) -> None:
    """A read-only root (Apptainer's default): HOME there is replaced, and a private folder left
    there earlier is not reused."""
    uid = os.getuid()
    ro = mount("ro", "ro", make=("home", f"ptmg-{uid}/home"))
    assert not ptmg_userenv.writable_dir(str(ro / "home")) and (ro / "home").is_dir()
    env = {"HOME": str(ro / "home"), "USER": "u"}
    assert ptmg_userenv.fix(env, uid) == {"HOME": f"{temp_candidates[0]}/ptmg-{uid}/home"}
    env = {"TMPDIR": str(ro), "USER": "u"}
    assert ptmg_userenv.fix(env, uid) == {"HOME": f"{temp_candidates[0]}/ptmg-{uid}/home"}


@pytest.mark.allowed_skip(reason=ROOT_ONLY)
def test_inductors_temporary_folder_is_tmpdir_or_tmp_or_var_tmp_never_dev_shm(
        tmp_path: Path, mount: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    shm = mount("shm", "noexec")
    var_tmp = mount("var-tmp", "noexec")
    missing = str(tmp_path / "no-tmp")
    # /tmp and /var/tmp absent, /dev/shm noexec: Inductor's folder is not /dev/shm, nothing moves
    monkeypatch.setattr(ptmg_userenv, "_TEMP_CANDIDATES", (missing, str(tmp_path / "no-var-tmp"), str(shm)))
    assert ptmg_userenv.fix({"HOME": str(home), "USER": "u"}, os.getuid()) == {}
    # /tmp absent, /var/tmp noexec: that is the folder, and the cache moves under HOME
    monkeypatch.setattr(ptmg_userenv, "_TEMP_CANDIDATES", (missing, str(var_tmp), str(tmp_path)))
    assert ptmg_userenv.fix({"HOME": str(home), "USER": "u"}, os.getuid()) == {
        "TORCHINDUCTOR_CACHE_DIR": f"{home}/.cache/torchinductor"}


# --- the login profile ----------------------------------------------------------------------
PROFILE = ROOT / "entrypoint" / "profile.sh"
RUN_SESSION = "/run/pt-multi-gpu/session-env.sh"
TMP_SESSION = '"/tmp/pt-multi-gpu-$_ptmg_uid/session-env.sh"'


def _as_other_uid(cmd: list[str]) -> list[str]:
    if os.getuid() == 0:
        return ["setpriv", "--reuid", str(OTHER_UID), "--regid", str(OTHER_UID), "--clear-groups", *cmd]
    return cmd


def _login_path(env: dict[str, str]) -> str:
    # the text, not the path: another uid may not reach this tree (a 0700 scratch copy)
    cmd = ["sh", "-c", PROFILE.read_text() + '\nprintf %s "$PATH"']
    return subprocess.run(_as_other_uid(cmd), env=env, capture_output=True, text=True, check=True, timeout=30).stdout


def test_login_profile_puts_the_image_path_back_without_the_entrypoint() -> None:
    """Debian's /etc/profile resets PATH: `bash -lc python` found no python without a session file."""
    debian = "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
    out = _login_path({"PATH": debian, "PTMG_PATH": "/opt/venv/bin:/usr/bin:/bin"})
    assert out == "/opt/venv/bin:/usr/bin:/bin:" + debian
    again = _login_path({"PATH": out, "PTMG_PATH": "/opt/venv/bin:/usr/bin:/bin"})
    assert again == out  # idempotent: a nested login shell adds nothing


@pytest.fixture
def session_root() -> Iterator[Path]:
    """A folder another uid can reach (pytest's own are 0700 root's), removed after the test."""
    where = Path(tempfile.mkdtemp(prefix="ptmg-unit-profile-"))
    where.chmod(0o755)
    try:
        yield where
    finally:
        shutil.rmtree(where)


def _profile_run(root: Path, as_uid: int) -> tuple[str, str]:
    """(PATH, $FROM_SESSION) after the profile, with its two session files under `root`."""
    text = PROFILE.read_text()
    assert text.count(RUN_SESSION) == 1 and text.count(TMP_SESSION) == 1, "profile.sh's session paths moved"
    text = text.replace(RUN_SESSION, f"{root}{RUN_SESSION}").replace(TMP_SESSION, f'"{root}{TMP_SESSION[1:]}')
    cmd = ["sh", "-c", text + '\nprintf "%s|%s" "$PATH" "${FROM_SESSION:-}"']
    if as_uid != 0:
        cmd = ["setpriv", "--reuid", str(as_uid), "--regid", str(as_uid), "--clear-groups", *cmd]
    out = subprocess.run(cmd, env={"PATH": "/usr/bin:/bin", "PTMG_PATH": "/opt/venv/bin"}, capture_output=True,
                         text=True, check=True, timeout=30).stdout
    path, _, marker = out.partition("|")
    return path, marker


def _session_file(path: Path, owner: int) -> None:
    path.parent.mkdir(parents=True, mode=0o755, exist_ok=True)
    path.write_text("FROM_SESSION=yes; export FROM_SESSION\n")
    path.chmod(0o644)
    os.chown(path, owner, owner)


@pytest.mark.allowed_skip(reason=ROOT_ONLY)
@pytest.mark.parametrize("which", ["run", "tmp"])
def test_login_profile_sources_only_the_users_own_session_file(session_root: Path, which: str) -> None:
    """A readable session file that another uid owns is never sourced (anyone can plant
    /tmp/pt-multi-gpu-<uid>); the user's own is, and root's login shell reads none."""
    if os.geteuid() != 0:
        pytest.skip(ROOT_ONLY)
    session = session_root / (RUN_SESSION[1:] if which == "run" else f"tmp/pt-multi-gpu-{OTHER_UID}/session-env.sh")
    _session_file(session, owner=0)
    assert _profile_run(session_root, OTHER_UID) == ("/opt/venv/bin:/usr/bin:/bin", "")  # root's: not sourced
    os.chown(session, OTHER_UID, OTHER_UID)
    assert _profile_run(session_root, OTHER_UID) == ("/usr/bin:/bin", "yes")  # the user's own: sourced
    assert _profile_run(session_root, 0) == ("/usr/bin:/bin", "")  # root: the profile does nothing
