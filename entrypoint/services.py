"""What each service needs before it starts, and the argv that starts it.

Each prepare_* function does the service's one-time setup (secrets, keys,
directories), prints what the user needs to know (login URL, fingerprints) and
returns a ServiceSpec, or None when the service stays off. sshd is split in two:
plan_sshd() (cheap: is a key supplied?) runs up front, prepare_sshd() (host keys,
about a second the first time) runs after the other services have started. The
supervisor only starts, watches and restarts specs; it knows nothing service-specific.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import ptmg_contract as contract
from common import ENTRYPOINT_DIR, ConfigError, RunAs, Settings, info, read_secret, warn

# Secrets never reach user processes (kernels, the user's command, SSH sessions).
SECRET_VARS = frozenset({
    "JUPYTER_TOKEN", "JUPYTER_TOKEN_FILE", "JUPYTER_PASSWORD_HASH", "JUPYTER_PASSWORD_HASH_FILE",
    "SSH_AUTHORIZED_KEYS", "SSH_AUTHORIZED_KEYS_FILE",
})
# Per-session or per-user variables that an SSH session gets from sshd/login instead.
_SESSION_OWN = frozenset({"HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "SHLVL", "HOSTNAME",
                          "TERM", "MAIL", "_", "SSH"})
SSHD = "/usr/sbin/sshd"
SSHD_CONFIG = ENTRYPOINT_DIR / "sshd_config"
JUPYTER_CONFIG = ENTRYPOINT_DIR / "jupyter_server_config.py"
AUTHORIZED_KEYS_DIR = Path(contract.STATE_DIR) / "ssh/authorized_keys"  # sshd_config names it
SESSION_ENV = Path(contract.STATE_DIR) / "session-env.sh"  # ssh-session sources it
PROFILE_HOOK = Path("/etc/profile.d/pt-multi-gpu.sh")
SECRET_KEYS_FILE = Path(contract.SECRETS_DIR) / "ssh_authorized_keys"
_KEY_LINE = re.compile(r"(^|\s)(ssh-(ed25519|rsa|dss)|ecdsa-sha2-\S+|sk-\S+)\s+[A-Za-z0-9+/=]{20,}")
_HASH = re.compile(r"^(argon2:\$argon2(id|i|d)\$.+|[a-z0-9]+:[0-9a-f]+:[0-9a-f]+)$")


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    check: dict[str, object]  # what probes.probe() and the healthcheck need
    quiet: str | None = None  # regex: drop matching lines of the service's stderr


def child_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in SECRET_VARS}


def _write_private(path: Path, text: str, owner: RunAs) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    if os.geteuid() == 0:
        os.chown(path.parent, owner.uid, owner.gid)
        os.chmod(path.parent, 0o700)
        os.chown(path, owner.uid, owner.gid)


# ---------------------------------------------------------------------- jupyter
def prepare_jupyter(s: Settings, env: dict[str, str], user: RunAs, state: Path,
                    workdir: str) -> ServiceSpec | None:
    if not s.jupyter:
        return None
    exe = shutil.which("jupyter-lab", path=env.get("PATH"))
    if not exe:
        warn("JUPYTER is on but jupyter-lab is not on PATH; Jupyter stays off")
        return None
    token, token_source = read_secret(env, "JUPYTER_TOKEN")
    hashed, hash_source = read_secret(env, "JUPYTER_PASSWORD_HASH")
    if "JUPYTER_TOKEN" in env and not env["JUPYTER_TOKEN"].strip() and not token:
        warn("JUPYTER_TOKEN is empty; an empty token would switch auth off, so a random one is used")
    if hashed and not _HASH.match(hashed):
        raise ConfigError(f"{hash_source} does not look like a hash from "
                          "jupyter_server.auth.passwd() ('argon2:$argon2id$...' or 'sha1:salt:hash')")
    generated = token is None
    if token is None:
        token = secrets.token_hex(24)  # auth is always on: never an empty token
    secret_dir = state / "jupyter"
    _write_private(secret_dir / "token", token, user)
    child = user.env(child_env(env))
    child["PTMG_JUPYTER_TOKEN_FILE"] = str(secret_dir / "token")
    if hashed:
        _write_private(secret_dir / "password-hash", hashed, user)
        child["PTMG_JUPYTER_PASSWORD_HASH_FILE"] = str(secret_dir / "password-hash")
    child["JUPYTER_PORT"] = str(s.jupyter_port)
    child["PTMG_WORKDIR"] = workdir
    if s.tensorboard != "off":
        child["PTMG_TENSORBOARD_PROXY_PORT"] = str(s.tensorboard_port)
    # Printed once per container (a restarted Jupyter keeps the same token).
    url = f"http://127.0.0.1:{s.jupyter_port}/lab"
    if hashed:
        info(f"Jupyter: {url} (log in with the password from {hash_source})")
    elif generated:
        info(f"Jupyter: {url}?token={token}")
        info("  (generated token; set JUPYTER_TOKEN or JUPYTER_TOKEN_FILE to choose one; "
             f"replace {s.jupyter_port} with the host port you published)")
    else:
        info(f"Jupyter: {url}?token=<the token from {token_source}>")
    argv = (*user.drop, exe, f"--config={JUPYTER_CONFIG}")
    return ServiceSpec("jupyter", argv, child, workdir,
                       {"check": "http", "port": s.jupyter_port, "path": "/api/status",
                        "token_file": str(secret_dir / "token")})


# ------------------------------------------------------------------ tensorboard
def prepare_tensorboard(s: Settings, env: dict[str, str], user: RunAs,
                        workdir: str, jupyter_on: bool) -> ServiceSpec | None:
    if s.tensorboard == "off":
        return None
    exe = shutil.which("tensorboard", path=env.get("PATH"))
    if not exe:
        warn("TENSORBOARD is on but tensorboard is not on PATH; TensorBoard stays off")
        return None
    logdir = Path(s.tensorboard_logdir)
    if not logdir.exists():
        # As pt, so a bind-mounted /workspace's permissions decide, not root's.
        made = subprocess.run([*user.drop, "mkdir", "-p", str(logdir)], env=user.env(child_env(env)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
        if made.returncode != 0:
            warn(f"cannot create TENSORBOARD_LOGDIR {logdir} as {user.name} ({made.stderr.strip()}); "
                 "TensorBoard shows nothing until it exists")
    host = "0.0.0.0" if s.tensorboard == "port" else "127.0.0.1"
    where = []
    if jupyter_on:
        where.append(f"http://127.0.0.1:{s.jupyter_port}/tensorboard/ (behind Jupyter's login)")
    if s.tensorboard == "port":
        where.append(f"http://127.0.0.1:{s.tensorboard_port}/ (direct port: NO authentication)")
    if not where:
        where.append(f"127.0.0.1:{s.tensorboard_port} inside the container only "
                     "(turn JUPYTER on, use TENSORBOARD=port, or tunnel over SSH)")
    info(f"TensorBoard: logdir {logdir} at " + " and ".join(where))
    argv = (*user.drop, exe, "--logdir", str(logdir), "--host", host,
            "--port", str(s.tensorboard_port))
    return ServiceSpec("tensorboard", argv, user.env(child_env(env)), workdir,
                       {"check": "http", "port": s.tensorboard_port, "path": "/"})


# ------------------------------------------------------------------------- sshd
def _key_lines(text: str, source: str) -> list[str]:
    keys = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if _KEY_LINE.search(line):
            keys.append(line)
        else:
            warn(f"ignoring a line of {source} that is not an SSH public key: {line[:40]!r}")
    return keys


def collect_authorized_keys(env: dict[str, str], home: str) -> tuple[list[str], list[str]]:
    """(keys, sources) from SSH_AUTHORIZED_KEYS[_FILE], /run/secrets, ~pt/.ssh/authorized_keys."""
    keys: list[str] = []
    sources: list[str] = []
    value, source = read_secret(env, "SSH_AUTHORIZED_KEYS")
    found = [(value, source or "SSH_AUTHORIZED_KEYS")] if value else []
    for path in (SECRET_KEYS_FILE, Path(home) / ".ssh/authorized_keys"):
        with contextlib.suppress(OSError):
            found.append((path.read_text(), str(path)))
    for text, where in found:
        lines = _key_lines(text, where)
        if lines:
            sources.append(f"{where} ({len(lines)})")
            keys += [k for k in lines if k not in keys]
    return keys, sources


def ensure_host_keys(directory: str) -> list[Path]:
    """Host keys are made here at first start, never at build time; a volume
    mounted on `directory` keeps them (and the fingerprints) across containers."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    keys = []
    for kind, extra in (("ed25519", ()), ("rsa", ("-b", "3072"))):
        key = d / f"ssh_host_{kind}_key"
        if not (key.exists() and key.with_suffix(".pub").exists()):
            key.unlink(missing_ok=True)
            subprocess.run(["ssh-keygen", "-q", "-t", kind, *extra, "-N", "", "-C",
                            "pt-multi-gpu host key", "-f", str(key)], check=True)
            made = "generated"
        else:
            made = "kept"
        os.chown(key, 0, 0)
        os.chmod(key, 0o600)  # sshd refuses a private key others can read
        fp = subprocess.run(["ssh-keygen", "-l", "-f", f"{key}.pub"], capture_output=True,
                            text=True, check=False).stdout.strip()
        info(f"sshd host key {made}: {fp}")
        keys.append(key)
    return keys


def write_session_env(env: dict[str, str], workdir: str) -> None:
    """sshd gives a session only its own environment, and Debian's /etc/profile resets
    PATH in every login shell (`ssh`, `docker exec -it C bash -l`). ssh-session and
    /etc/profile.d source this file so PATH (/opt/venv/bin), PTMG_*, NVIDIA_*, ... match
    the container. Root only (written at every start)."""
    lines = ["# Written by pt-multi-gpu at container start: the container's environment for SSH sessions."]
    for key in sorted(child_env(env)):
        if key in _SESSION_OWN or key.startswith("SSH_") or not key.isidentifier():
            continue
        lines.append(f"export {key}={shlex.quote(env[key])}")
    lines.append(f"export PTMG_WORKDIR={shlex.quote(workdir)}")
    SESSION_ENV.parent.mkdir(parents=True, exist_ok=True)
    SESSION_ENV.write_text("\n".join(lines) + "\n")
    os.chmod(SESSION_ENV, 0o644)
    # Debian's /etc/profile resets PATH for login shells; this puts ours back.
    PROFILE_HOOK.write_text(f"# pt-multi-gpu: the container's environment for login shells\n"
                            f"[ -r {SESSION_ENV} ] && . {SESSION_ENV}\n")


def plan_sshd(s: Settings, env: dict[str, str], user: RunAs) -> list[str] | None:
    """Cheap part, done before anything starts: should sshd run, and with which keys?
    sshd starts only when an authorized key is supplied (SSH=auto|on) and we are root."""
    if s.ssh == "off":
        return None
    keys, sources = collect_authorized_keys(env, user.home)
    if os.geteuid() != 0:
        if keys or s.ssh == "on":
            warn(f"started as uid {os.geteuid()}, not root: sshd needs root, so SSH stays off "
                 "(drop --user to get SSH)")
        return None
    if not keys:
        if s.ssh == "on":
            warn("SSH=on but no authorized key was supplied, so sshd stays off: set "
                 "SSH_AUTHORIZED_KEYS or SSH_AUTHORIZED_KEYS_FILE, or mount "
                 f"{user.home}/.ssh/authorized_keys or {SECRET_KEYS_FILE}")
        else:
            info("SSH off: no authorized key supplied (see SSH_AUTHORIZED_KEYS)")
        return None
    if not os.access(SSHD, os.X_OK):
        warn(f"an authorized key was supplied but {SSHD} is missing; SSH stays off")
        return None
    info(f"sshd: {len(keys)} authorized key(s) from " + ", ".join(sources))
    return keys


def prepare_sshd(s: Settings, env: dict[str, str], user: RunAs, keys: list[str]) -> ServiceSpec:
    """Slow part (an RSA host key takes ~1 s the first time): the supervisor runs it
    after Jupyter and TensorBoard have started, so it does not delay them."""
    AUTHORIZED_KEYS_DIR.mkdir(parents=True, exist_ok=True)
    for d in (AUTHORIZED_KEYS_DIR.parent, AUTHORIZED_KEYS_DIR):
        os.chmod(d, 0o755)  # noqa: S103 - root-owned, not writable by pt: passes StrictModes
    target = AUTHORIZED_KEYS_DIR / user.name
    target.write_text("\n".join(keys) + "\n")
    os.chmod(target, 0o644)
    host_keys = ensure_host_keys(s.ssh_host_key_dir)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation dir
    argv = [SSHD, "-D", "-e", "-f", str(SSHD_CONFIG)]
    for key in host_keys:
        argv += ["-h", str(key)]
    info("sshd: port 22 (publish it, e.g. -p 2222:22), user pt, keys only")
    # The healthcheck's probe connects from loopback and leaves before auth.
    quiet = r"^Connection closed by (127\.0\.0\.1|::1) port \d+ \[preauth\]$"
    return ServiceSpec("sshd", tuple(argv), child_env(env), "/",
                       {"check": "ssh", "port": 22}, quiet)
