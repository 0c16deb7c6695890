"""Shared pieces of the image runtime: logging, settings from the environment,
the state file the healthcheck reads, and the `pt` user.

Standard library only: this runs under the OS python3 before anything else,
so it must not depend on the venv (and must not import torch).
"""

from __future__ import annotations

import json
import os
import pwd
import sys
import tempfile
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
    )


def read_secret(env: dict[str, str], name: str) -> tuple[str | None, str | None]:
    """Value of NAME, or of the file named by NAME_FILE (Docker/k8s secrets).

    Returns (value, source); surrounding whitespace (the trailing newline of a
    secret file) is stripped; an empty value counts as unset.
    """
    value = env.get(name, "").strip()
    if value:
        return value, name
    path = env.get(f"{name}_FILE", "").strip()
    if path:
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{name}_FILE={path}: cannot read it ({exc.strerror})") from None
        if value:
            return value, f"{name}_FILE"
        warn(f"{name}_FILE={path} is empty; ignoring it")
    return None, None


# ----------------------------------------------------------------- state file
def state_dir(uid: int | None = None) -> Path:
    """/run/pt-multi-gpu when we can write there (root start), else a per-uid dir in /tmp."""
    uid = os.geteuid() if uid is None else uid
    if uid == 0:
        return ROOT_STATE_DIR
    return Path(tempfile.gettempdir()) / f"pt-multi-gpu-{uid}"


def candidate_state_files() -> list[Path]:
    """Where the healthcheck looks: the root location first, then any per-uid one."""
    files = [ROOT_STATE_DIR / "state.json"]
    files += sorted(Path(tempfile.gettempdir()).glob("pt-multi-gpu-*/state.json"))
    return files


def write_json_atomic(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


# ------------------------------------------------------------------------ user
@dataclass(frozen=True)
class RunAs:
    """Who service and user processes run as, and the argv prefix that gets them there."""

    uid: int
    gid: int
    home: str
    name: str
    drop: tuple[str, ...]  # setpriv prefix when starting as root, () otherwise

    def env(self, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        env.update(HOME=self.home, USER=self.name, LOGNAME=self.name)
        env.setdefault("SHELL", "/bin/bash")
        return env


def run_as_pt() -> RunAs:
    pw = pwd.getpwnam(USER)
    drop = ("setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups", "--")
    return RunAs(pw.pw_uid, pw.pw_gid, pw.pw_dir, USER, drop)


def run_as_self() -> RunAs:
    uid, gid = os.geteuid(), os.getegid()
    try:
        pw = pwd.getpwuid(uid)
        name, home = pw.pw_name, pw.pw_dir
    except KeyError:  # an arbitrary --user uid that has no passwd entry
        name, home = str(uid), ""
    if not home or not os.access(home, os.W_OK):
        home = f"{tempfile.gettempdir()}/pt-multi-gpu-home-{uid}"
        os.makedirs(home, mode=0o700, exist_ok=True)
    return RunAs(uid, gid, home, name, ())
