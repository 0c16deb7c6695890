"""The only part of the runtime that runs as root, and only with `docker run --user 0`
(the image's USER is pt): check that root's environment is root's own, remap pt's
uid/gid (PT_UID/PT_GID), then drop to pt for good. Everything after that, including
every service, the diagnostics and the user's command, runs as pt.

Rules for this file (tests/docker/test_root_boundary.py attacks them):
  * run programs by absolute path only (root-owned, in root-owned dirs), with a fixed
    environment; never look anything up in PATH;
  * import nothing pt can write (start.sh runs /usr/bin/python3 -I; supervisor.py puts
    only the image's own root-owned folders on sys.path);
  * never open, write, chown or read a path pt controls: the re-own walk works on
    directory file descriptors and never follows a link (os.fwalk, lchown by dir_fd).

Why the environment check: `docker exec` without -u runs as the container's user, so in
a container started with --user 0 it runs as root, with the container's PATH and working
directory. The image's PATH starts with /opt/venv/bin and its WORKDIR is /workspace, both
writable by pt (pip install must work). Root mode therefore needs a PATH of root-owned
directories and a root-owned working directory, and refuses to start without them:

    docker run --user 0 -w / -e PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
        -e PT_UID=$(id -u) -e PT_GID=$(id -g) IMAGE
"""

from __future__ import annotations

import os
import pwd
import stat
import subprocess

import ptmg_contract as contract
from common import ConfigError, Settings, become, info

GROUPMOD = "/usr/sbin/groupmod"
USERMOD = "/usr/sbin/usermod"
#: The environment of every program root runs.
ROOT_ENV = {"PATH": contract.ROOT_PATH, "LC_ALL": "C", "HOME": "/root"}
ROOT_MODE_FIX = (f"start root mode as documented: docker run --user 0 -w {contract.ROOT_WORKDIR} "
                 f"-e PATH={contract.ROOT_PATH} ... (services and your command still run as "
                 f"{contract.USER}, in {contract.WORKDIR}, with the venv on PATH); or drop --user 0 "
                 "if you do not need PT_UID/PT_GID")


class RootStartFailed(Exception):
    """The remap failed (exit 1); the message says what."""


#: Variables that make the dynamic loader, glibc, Python, bash or Perl (apt and debconf run Perl as
#: root) load code or data from where they point; any LD_* counts too. Refused when set at all.
LOADER_VARS = frozenset({
    "GCONV_PATH", "LOCPATH", "NLSPATH", "HOSTALIASES", "RESOLV_HOST_CONF",
    "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONPYCACHEPREFIX", "PYTHONEXECUTABLE",
    "BASH_ENV", "ENV", "PROMPT_COMMAND", "PERL5LIB", "PERLLIB", "PERL5OPT", "PERL5DB",
})
#: Directories root's programs take their own files from (~/.bashrc, ~/.local's user site, XDG
#: config) or write to: allowed only where they are root's alone (runc sets HOME=/root when unset).
DIR_VARS = ("HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME", "TMPDIR")
SHARED_TMP = ("/tmp", "/var/tmp")  # sticky: a TMPDIR there is every root tool's default anyway


def root_only(path: str) -> bool:
    """Only root can change what `path` is: it and every directory above it (links resolved)
    belong to root and are not writable by group or others (a sticky dir such as /tmp counts
    as writable). A path that does not exist counts as its nearest existing parent."""
    p = os.path.realpath(path)
    while not os.path.lexists(p) and p != "/":
        p = os.path.dirname(p)
    while True:
        try:
            st = os.stat(p)
        except OSError:
            return False
        if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return False
        if p == "/":
            return True
        p = os.path.dirname(p)


def unsafe_environment(env: dict[str, str], cwd: str) -> list[str]:
    """What in root's environment pt could control (empty when it is safe for root)."""
    problems = []
    for entry in env.get("PATH", "").split(":"):
        where = cwd if entry in ("", ".") else entry
        if not where.startswith("/"):
            problems.append(f"PATH entry {entry!r} is relative")
        elif not root_only(where):
            problems.append(f"PATH entry {entry or '(empty: the working directory)'} is writable by others")
    if not root_only(cwd):
        problems.append(f"the working directory {cwd} is writable by others")
    for name in DIR_VARS:  # where root's shells and tools read their own config and write temp files
        value = env.get(name)
        if name == "TMPDIR" and value in SHARED_TMP:
            continue
        if value and not (value.startswith("/") and root_only(value)):
            problems.append(f"{name} {value} is writable by others (root's `docker exec` would use it)")
    for name in sorted(env):
        if env[name] and (name.startswith("LD_") or name in LOADER_VARS):
            problems.append(f"{name} is set (root's `docker exec` would use it)")
    return problems


def _run(argv: list[str]) -> None:
    try:
        subprocess.run(argv, env=ROOT_ENV, cwd="/", check=True, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except subprocess.CalledProcessError as exc:
        raise RootStartFailed(f"{' '.join(argv)} exited {exc.returncode}: {exc.stderr.strip()}") from None
    except OSError as exc:
        raise RootStartFailed(f"cannot run {argv[0]}: {exc.strerror}") from None


def _mount_points() -> set[str]:
    try:
        with open("/proc/self/mountinfo") as f:
            return {line.split()[4] for line in f}
    except OSError:
        return set()


def rechown(top: str, old: tuple[int, int], new: tuple[int, int], mounts: set[str], into_mounts: bool) -> int:
    """Give what `old` owns under `top` to `new`; return how many entries changed. Works on
    directory file descriptors opened without following links (os.fwalk), and changes each
    entry itself (lchown by dir_fd), so no link pt planted is ever followed, even if pt
    swaps a directory for a link while this runs. Without `into_mounts` it stays out of
    mounted directories (a bind mount's files belong to the host)."""
    changed = 0

    def fix(name: str, dir_fd: int | None) -> None:
        nonlocal changed
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            uid = new[0] if st.st_uid == old[0] else -1
            gid = new[1] if st.st_gid == old[1] else -1
            if uid != -1 or gid != -1:
                os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
                changed += 1
        except OSError:
            pass

    try:
        st = os.lstat(top)
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return 0
    fix(top, None)
    for root, dirs, files, dir_fd in os.fwalk(top, follow_symlinks=False):
        if not into_mounts:
            dirs[:] = [d for d in dirs if os.path.join(root, d) not in mounts]
        for name in [*dirs, *files]:
            if into_mounts or os.path.join(root, name) not in mounts:  # a mounted file is the host's too
                fix(name, dir_fd)
    return changed


def remap(s: Settings) -> None:
    """pt gets PT_UID/PT_GID. Its group `pt` follows PT_GID; it stays a member of the venv's
    group (contract.VENV_GROUP), which is how it keeps write access to the venv (group-
    writable, never re-owned: that would copy gigabytes into the container layer)."""
    pw = pwd.getpwnam(contract.USER)
    old = (pw.pw_uid, pw.pw_gid)
    new = (s.pt_uid or pw.pw_uid, s.pt_gid or pw.pw_gid)
    if new == old:
        return
    # -o: the host's uid/gid may already exist in the image (e.g. gid 100 "users").
    if new[1] != old[1]:
        _run([GROUPMOD, "-o", "-g", str(new[1]), contract.USER])
    _run([USERMOD, "-o", "-u", str(new[0]), "-g", str(new[1]), contract.USER])
    mounts = _mount_points()
    changed = 0
    for top in (pw.pw_dir, contract.WORKDIR):  # never an arbitrary -w dir such as /
        if top not in mounts:
            changed += rechown(top, old, new, mounts, into_mounts=False)
    for top in contract.PT_STATE_DIRS:  # the image's own state, also on a volume
        changed += rechown(top, old, new, mounts, into_mounts=True)
    info(f"user {contract.USER} remapped to uid {new[0]} gid {new[1]} (from PT_UID/PT_GID; "
         f"{changed} entries re-owned; the venv stays writable through group {contract.VENV_GROUP})")


def start_as_root(s: Settings, env: dict[str, str]) -> None:
    """Check root's environment, remap, become pt. Raises ConfigError (exit 2) when the
    environment is not root's own, RootStartFailed (exit 1) when the remap fails."""
    cwd = os.getcwd()
    problems = unsafe_environment(env, cwd)
    if problems:
        raise ConfigError("started as root, but `docker exec` would run root with what pt controls: "
                          + "; ".join(problems) + f". Fix: {ROOT_MODE_FIX}")
    remap(s)
    try:
        become(contract.USER)
    except (KeyError, PermissionError, OSError) as exc:
        raise RootStartFailed(f"cannot drop to {contract.USER}: {exc}") from None
