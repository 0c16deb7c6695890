"""Give every Python in the image's venv a usable home, whoever runs it and however.

HPC runtimes (pyxis/enroot, Apptainer, Charliecloud) and `docker run --user N` start the image
without its entrypoint, as a uid that may have no passwd entry, with HOME unset, pointing at a
missing directory, or on a read-only root. torch, Triton, Inductor, matplotlib and Jupyter then
fail where they write their caches (~/.triton, ~/.cache, ~/.config/matplotlib, ~/.local/share/
jupyter), and getpass.getuser() raises KeyError (Inductor names /tmp/torchinductor_<user> by it).

Imported at interpreter start by the venv's ``ptmg_userenv.pth``, this module changes nothing
when HOME is a writable directory and the user has a name. Otherwise, for this process and its
children only:

- USER/LOGNAME become ``uid<N>`` when neither is set and the uid has no passwd entry;
- HOME becomes a private directory ``ptmg-<uid>/home`` (mode 0700, owned by this uid, never
  followed through a symlink) under the first writable of $TMPDIR, /tmp, /var/tmp, /dev/shm,
  one whose filesystem allows exec first (compiled kernels are loaded from the caches);
  the XDG caches, Triton's, Inductor's, matplotlib's and Jupyter's state follow HOME;
- TMPDIR becomes that private directory too when no usual temporary directory is writable;
- TORCHINDUCTOR_CACHE_DIR goes under HOME when the temporary folder is noexec and HOME is not.

It must never stop Python from starting: any error leaves the environment as it was.
"""

from __future__ import annotations

import contextlib
import os
import stat

_TEMP_CANDIDATES = ("/tmp", "/var/tmp", "/dev/shm")
_USER_VARS = ("LOGNAME", "USER", "LNAME", "USERNAME")  # what getpass.getuser() reads first


def writable_dir(path: str | None) -> bool:
    return path is not None and path != "" and os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def executable_fs(path: str) -> bool:
    """Whether the filesystem of ``path`` lets programs and libraries run from it (no noexec)."""
    try:
        return not os.statvfs(path).f_flag & os.ST_NOEXEC
    except OSError:
        return False


def private_dir(parent: str, uid: int) -> str | None:
    """``parent/ptmg-<uid>``, made 0700 if missing; None unless it is this uid's own, real,
    private directory (another user may have planted a file or a link by that name)."""
    path = os.path.join(parent, f"ptmg-{uid}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        return None
    return path


def fix(environ: dict[str, str] | os._Environ[str], uid: int) -> dict[str, str]:
    """What to change in ``environ`` for ``uid`` (and do it); empty when nothing was needed."""
    changed: dict[str, str] = {}
    if not any(environ.get(k) for k in _USER_VARS):
        try:
            import pwd

            pwd.getpwuid(uid)
        except KeyError:
            changed["USER"] = changed["LOGNAME"] = f"uid{uid}"
    if not writable_dir(environ.get("HOME")):
        parents = [d for d in (environ.get("TMPDIR"), *_TEMP_CANDIDATES) if d and writable_dir(d)]
        # Inductor, Triton and torch's JIT extensions load the code they compile from their caches:
        # a folder that allows exec first (Docker's /dev/shm and --tmpfs mounts are noexec).
        for parent in sorted(parents, key=lambda d: not executable_fs(d)):
            base = private_dir(parent, uid)
            if base is None:
                continue
            home = os.path.join(base, "home")
            try:
                os.makedirs(home, 0o700, exist_ok=True)
            except OSError:
                continue
            changed["HOME"] = home
            if not any(writable_dir(environ.get("TMPDIR") if d is None else d)
                       for d in (None, *_TEMP_CANDIDATES[:2])):
                changed["TMPDIR"] = base
            break
    environ.update(changed)
    # Inductor keeps its compiled kernels under the temporary folder: on a noexec one (Docker's
    # --tmpfs default) they cannot load, so they go under HOME when HOME's filesystem allows exec.
    temp = next((d for d in (environ.get("TMPDIR"), *_TEMP_CANDIDATES[:2]) if d and writable_dir(d)), None)
    user_home = environ.get("HOME")
    if (temp and not executable_fs(temp) and not environ.get("TORCHINDUCTOR_CACHE_DIR")
            and writable_dir(user_home) and executable_fs(str(user_home))):
        changed["TORCHINDUCTOR_CACHE_DIR"] = environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
            str(user_home), ".cache", "torchinductor")
    return changed


def main() -> None:
    """The .pth's call. Any error leaves the environment as it was."""
    with contextlib.suppress(Exception):  # never stop the interpreter from starting
        fix(os.environ, os.getuid())
