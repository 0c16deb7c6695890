"""Shared pieces of the image runtime: logging, settings from the environment,
the state file the healthcheck reads, and the user the runtime runs as.

Standard library only: this runs under the OS python3 (`-I`, isolated) before anything
else, so it must not depend on the venv (and must not import torch). Everything here
runs as pt: root (only with `docker run --user 0`) uses rootstart.py, then become().
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ptmg_contract as contract

ENTRYPOINT_DIR = Path(__file__).resolve().parent
PREFIX = "[ptmg]"
USER = contract.USER
WORKDIR_DEFAULT = contract.WORKDIR
ROOT_STATE_DIR = Path(contract.STATE_DIR)


# --------------------------------------------------------------------- logging
def info(msg: str) -> None:
    print(f"{PREFIX} {msg}", file=sys.stderr, flush=True)


def warn(msg: str) -> None:
    print(f"{PREFIX} WARNING: {msg}", file=sys.stderr, flush=True)


def error(msg: str) -> None:
    print(f"{PREFIX} ERROR: {msg}", file=sys.stderr, flush=True)


class ConfigError(Exception):
    """A setting in the environment is invalid; the message says which and how to fix it."""


# -------------------------------------------------------------------- settings
_ON = {"on", "1", "true", "yes"}
_OFF = {"off", "0", "false", "no"}


class _Reader:
    """Reads settings from env, collecting every error instead of stopping at the first."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.errors: list[str] = []

    def choice(self, name: str, default: str, allowed: dict[str, set[str]]) -> str:
        raw = self.env.get(name, "").strip().lower()
        if not raw:
            return default
        for value, spellings in allowed.items():
            if raw in spellings:
                return value
        self.errors.append(f"{name}={self.env[name]!r} is not one of {'|'.join(allowed)}")
        return default

    def number(self, name: str, default: int | None, lo: int, hi: int) -> int | None:
        raw = self.env.get(name, "").strip()
        if not raw:
            return default
        try:
            value = int(raw)
        except ValueError:
            self.errors.append(f"{name}={raw!r} is not a number")
            return default
        if not lo <= value <= hi:
            self.errors.append(f"{name}={value} is out of range {lo}..{hi}")
            return default
        return value

    def port(self, name: str, default: int) -> int:
        value = self.number(name, default, 1, 65535)
        return default if value is None else value


@dataclass(frozen=True)
class Settings:
    """Everything the runtime reads from the environment, validated up front."""

    mode: str  # "services" | "command" | "selftest"
    argv: tuple[str, ...]
    jupyter: bool
    jupyter_port: int
    ssh: str  # "auto" | "on" | "off"
    tensorboard: str  # "on" | "off" | "port"
    tensorboard_port: int
    tensorboard_logdir: str
    pt_uid: int | None
    pt_gid: int | None
    ssh_host_key_dir: str
    diagnostics: bool
    ssh_port: int = contract.SSH_PORT


def load_settings(argv: list[str], env: dict[str, str]) -> Settings:
    """Turn argv + env into Settings, or raise ConfigError naming every bad variable."""
    if not argv:
        mode = "services"
    elif argv[0] == "selftest":
        mode = "selftest"
    else:
        mode = "command"
    # Services are on by default only in service mode; a command runs alone
    # unless the user asks for a service explicitly.
    serving = mode == "services"
    r = _Reader(env)
    onoff = {"on": _ON, "off": _OFF}
    jupyter = r.choice("JUPYTER", "on" if serving else "off", onoff)
    ssh = r.choice("SSH", "auto" if serving else "off", {"auto": {"auto"}, "on": _ON, "off": _OFF})
    tensorboard = r.choice("TENSORBOARD", "on" if serving else "off",
                           {"on": _ON, "off": _OFF, "port": {"port"}})
    jupyter_port = r.port("JUPYTER_PORT", contract.JUPYTER_PORT)
    tb_port = r.port("TENSORBOARD_PORT", contract.TENSORBOARD_PORT)
    ssh_port = r.port("SSH_PORT", contract.SSH_PORT)
    pt_uid = r.number("PT_UID", None, 1, 2**31 - 2)
    pt_gid = r.number("PT_GID", None, 1, 2**31 - 2)
    diagnostics = r.choice("PTMG_DIAGNOSTICS", "on", onoff)
    if jupyter_port == tb_port:
        r.errors.append(f"JUPYTER_PORT and TENSORBOARD_PORT are both {tb_port}")
    if r.errors:
        raise ConfigError("; ".join(r.errors))
    return Settings(
        mode=mode,
        argv=tuple(argv[1:] if mode == "selftest" else argv),
        jupyter=jupyter == "on",
        jupyter_port=jupyter_port,
        ssh=ssh,
        tensorboard=tensorboard,
        tensorboard_port=tb_port,
        tensorboard_logdir=env.get("TENSORBOARD_LOGDIR") or f"{WORKDIR_DEFAULT}/runs",
        pt_uid=pt_uid,
        pt_gid=pt_gid,
        ssh_host_key_dir=env.get("SSH_HOST_KEY_DIR") or contract.SSH_HOST_KEY_DIR,
        diagnostics=diagnostics == "on",
        ssh_port=ssh_port,
    )


def read_secret(env: dict[str, str], name: str, implicit: Path | None = None) -> tuple[str | None, str | None]:
    """Value of the file named by NAME_FILE, else of `implicit` (a Docker/k8s secret such as
    /run/secrets/jupyter_token) when it exists, else of the variable NAME.

    Returns (value, source). A file wins over the variable: a secret in the environment is
    visible to `docker inspect` and to every `docker exec` (which gets the container's
    environment), so it is only the last resort, and ignored (with a warning) when a file
    is there. Surrounding whitespace (the trailing newline of a secret file) is stripped;
    an empty value counts as unset.
    """
    direct = env.get(name, "").strip()
    path = env.get(f"{name}_FILE", "").strip()
    value: str | None = None
    source: str | None = None
    if path:
        try:
            value = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not text"
            raise ConfigError(f"{name}_FILE={path}: cannot read it ({why})") from None
        source = f"{name}_FILE"
        if not value:
            warn(f"{name}_FILE={path} is empty; ignoring it")
    elif implicit is not None and implicit.is_file():
        try:
            value = implicit.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{implicit}: cannot read it ({exc})") from None
        source = str(implicit)
    if value:
        if direct:
            warn(f"{name} is set but ignored: {source} is used (a value in the environment is visible to "
                 "`docker inspect` and to every `docker exec`; drop it)")
        return value, source
    if direct:
        return direct, name
    return None, None


# ----------------------------------------------------------------- state file
def own_dir(path: Path, uid: int | None = None) -> bool:
    """`path` is a real directory (no link) that `uid` owns and may write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    uid = os.geteuid() if uid is None else uid
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and os.access(path, os.W_OK | os.X_OK)


def state_dir(uid: int | None = None) -> Path:
    """The image's /run/pt-multi-gpu when this user owns it (it belongs to pt), else a per-uid
    dir in /tmp (another --user, or a tmpfs on /run)."""
    uid = os.geteuid() if uid is None else uid
    if own_dir(ROOT_STATE_DIR, uid):
        return ROOT_STATE_DIR
    return Path(tempfile.gettempdir()) / f"pt-multi-gpu-{uid}"


def candidate_state_files(uid: int | None = None) -> list[Path]:
    """Where the healthcheck looks: the image's state dir, then this uid's own one."""
    uid = os.geteuid() if uid is None else uid
    return [ROOT_STATE_DIR / "state.json", Path(tempfile.gettempdir()) / f"pt-multi-gpu-{uid}" / "state.json"]


def private_dir(d: Path, mode: int = 0o700) -> Path:
    """Make `d` a directory of ours with `mode`; something else in its place (a file, a link,
    a directory of another user) is moved aside first."""
    d.parent.mkdir(parents=True, exist_ok=True)
    if not own_dir(d):
        if os.path.lexists(d):
            aside = d.with_name(f".{d.name}.aside-{time.time_ns()}")
            os.rename(d, aside)
            warn(f"{d} was not a directory of ours; moved it to {aside}")
        os.mkdir(d, mode)
    os.chmod(d, mode)
    return d


def write_file(path: Path, text: str, mode: int = 0o600) -> None:
    """Write `path` whole: a new file (O_EXCL|O_NOFOLLOW, so no link is ever followed) renamed
    over the old one. A directory in its place is moved aside."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.time_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)  # whatever the umask
        if os.path.isdir(path) and not os.path.islink(path):
            aside = path.with_name(f".{path.name}.aside-{time.time_ns()}")
            os.rename(path, aside)
            warn(f"{path} was a directory; moved it to {aside}")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, json.dumps(data, indent=2, sort_keys=True) + "\n", 0o644)


# ------------------------------------------------------------------------ user
@dataclass(frozen=True)
class RunAs:
    """Who the runtime, its services and the user's processes run as (never root)."""

    uid: int
    gid: int
    home: str
    name: str

    def env(self, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        env.update(HOME=self.home, USER=self.name, LOGNAME=self.name)
        env.setdefault("SHELL", "/bin/bash")
        return env


def _own_home(path: str, uid: int) -> bool:
    """An absolute folder, not /, that ``uid`` owns and can write: a HOME the runtime bound."""
    try:
        return os.path.isabs(path) and path != "/" and os.stat(path).st_uid == uid and os.access(path, os.W_OK)
    except OSError:
        return False


def current_user() -> RunAs:
    uid, gid = os.geteuid(), os.getegid()
    try:
        pw = pwd.getpwuid(uid)
        name, home = pw.pw_name, pw.pw_dir
    except KeyError:  # an arbitrary --user uid that has no passwd entry
        name, home = str(uid), ""
    # enroot's home hook, Apptainer and Charliecloud bind the caller's HOME and set $HOME to it,
    # for a uid the image's passwd does not know: that HOME is the user's (its ~/.local included).
    if _own_home(os.environ.get("HOME", ""), uid):
        home = os.environ["HOME"]
    if not home or not os.access(home, os.W_OK):
        home = f"{tempfile.gettempdir()}/pt-multi-gpu-home-{uid}"
        os.makedirs(home, mode=0o700, exist_ok=True)
    return RunAs(uid, gid, home, name)


def become(name: str = USER) -> pwd.struct_passwd:
    """Root -> `name`, for good: its groups (from /etc/group, e.g. the venv's group), then
    gid and uid (real, effective and saved). Raises PermissionError if root could come back."""
    pw = pwd.getpwnam(name)
    if pw.pw_uid == 0:
        raise PermissionError(f"user {name} is uid 0")
    os.setgroups(os.getgrouplist(name, pw.pw_gid))
    os.setresgid(pw.pw_gid, pw.pw_gid, pw.pw_gid)
    os.setresuid(pw.pw_uid, pw.pw_uid, pw.pw_uid)
    try:
        os.setuid(0)
    except PermissionError:
        return pw
    raise PermissionError("still able to become root after dropping privileges")
