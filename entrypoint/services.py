"""What each service needs before it starts, and the argv that starts it.

Each prepare_* function does the service's one-time setup (secrets, keys,
directories), prints what the user needs to know (login URL, fingerprints) and
returns a ServiceSpec, or None when the service stays off. sshd is split in two:
plan_sshd() (cheap: is a key supplied?) runs up front, prepare_sshd() (host keys,
about a second the first time) runs after the other services have started. The
supervisor only starts, watches and restarts specs; it knows nothing service-specific.

All of this runs as the user (pt), never as root: every file written here is pt's own,
in pt's own state dir, so no boundary is crossed (root mode ends in rootstart.py).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import ptmg_contract as contract
from common import (
    ENTRYPOINT_DIR,
    ConfigError,
    RunAs,
    Settings,
    info,
    private_dir,
    read_secret,
    warn,
    write_file,
)

# Kept out of the environment of every user process (kernels, the user's command, SSH
# sessions), so that no `env`, crash report or notebook output shows them. Given as
# variables they are still in the container's configuration (`docker inspect`, and the
# environment of every `docker exec`): prefer the *_FILE forms or /run/secrets.
SECRET_VARS = frozenset({
    "JUPYTER_TOKEN", "JUPYTER_TOKEN_FILE", "JUPYTER_PASSWORD_HASH", "JUPYTER_PASSWORD_HASH_FILE",
    "SSH_AUTHORIZED_KEYS", "SSH_AUTHORIZED_KEYS_FILE",
})
# Per-session or per-user variables that an SSH session gets from sshd/login instead.
_SESSION_OWN = frozenset({"HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "SHLVL", "HOSTNAME",
                          "TERM", "MAIL", "_", "SSH"})
SSHD = "/usr/sbin/sshd"
SSH_KEYGEN = "/usr/bin/ssh-keygen"
SSHD_CONFIG = ENTRYPOINT_DIR / "sshd_config"
JUPYTER_CONFIG = ENTRYPOINT_DIR / "jupyter_server_config.py"
SESSION_ENV = "session-env.sh"  # in the state dir; ssh-session and the profile hook source it
SECRET_KEYS_FILE = Path(contract.SECRETS_DIR) / "ssh_authorized_keys"
SECRET_TOKEN_FILE = Path(contract.SECRETS_DIR) / "jupyter_token"
SECRET_HASH_FILE = Path(contract.SECRETS_DIR) / "jupyter_password_hash"
UNPRIVILEGED_PORT_START = Path("/proc/sys/net/ipv4/ip_unprivileged_port_start")
_KEY_LINE = re.compile(r"(^|\s)(ssh-(ed25519|rsa|dss)|ecdsa-sha2-\S+|sk-\S+)\s+[A-Za-z0-9+/=]{20,}")
_HASH = re.compile(r"^(argon2:\$argon2(id|i|d)\$.+|[a-z0-9]+:[0-9a-f]+:[0-9a-f]+)$")
# A token travels in an HTTP header and a URL: printable ASCII, no spaces.
_TOKEN = re.compile(r"^[\x21-\x7e]+$")
MIN_TOKEN = 16


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


# ---------------------------------------------------------------------- jupyter
def prepare_jupyter(s: Settings, env: dict[str, str], user: RunAs, state: Path,
                    workdir: str) -> ServiceSpec | None:
    if not s.jupyter:
        return None
    exe = shutil.which("jupyter-lab", path=env.get("PATH"))
    if not exe:
        warn("JUPYTER is on but jupyter-lab is not on PATH; Jupyter stays off")
        return None
    token, token_source = read_secret(env, "JUPYTER_TOKEN", SECRET_TOKEN_FILE)
    hashed, hash_source = read_secret(env, "JUPYTER_PASSWORD_HASH", SECRET_HASH_FILE)
    if token is not None and not _TOKEN.match(token):
        raise ConfigError(f"{token_source}: a Jupyter token must be printable ASCII without spaces")
    if token is not None and len(token) < MIN_TOKEN:
        # Jupyter has no login rate limit: a short token is a shell for whoever guesses it.
        raise ConfigError(f"{token_source}: a Jupyter token needs at least {MIN_TOKEN} characters (this one "
                          f"has {len(token)}); make one with `openssl rand -hex 24`, or set none for a random one")
    if "JUPYTER_TOKEN" in env and not env["JUPYTER_TOKEN"].strip() and not token:
        warn("JUPYTER_TOKEN is empty; an empty token would switch auth off, so a random one is used")
    if hashed and not _HASH.match(hashed):
        raise ConfigError(f"{hash_source} does not look like a hash from "
                          "jupyter_server.auth.passwd() ('argon2:$argon2id$...' or 'sha1:salt:hash')")
    generated = token is None
    if token is None:
        token = secrets.token_hex(24)  # auth is always on: never an empty token
    secret_dir = private_dir(state / "jupyter")
    write_file(secret_dir / "token", token)
    child = user.env(child_env(env))
    child["PTMG_JUPYTER_TOKEN_FILE"] = str(secret_dir / "token")
    if hashed:
        write_file(secret_dir / "password-hash", hashed)
        child["PTMG_JUPYTER_PASSWORD_HASH_FILE"] = str(secret_dir / "password-hash")
    child["JUPYTER_PORT"] = str(s.jupyter_port)
    child[contract.ENV_WORKDIR] = workdir
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
    argv = (exe, f"--config={JUPYTER_CONFIG}")
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
        try:
            logdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            warn(f"cannot create TENSORBOARD_LOGDIR {logdir} as {user.name} ({exc.strerror}); "
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
    argv = (exe, "--logdir", str(logdir), "--host", host,
            "--port", str(s.tensorboard_port))
    return ServiceSpec("tensorboard", argv, user.env(child_env(env)), workdir,
                       {"check": "http", "port": s.tensorboard_port, "path": "/"})


# ------------------------------------------------------------------------- sshd
def _key_lines(text: str, source: str) -> list[str]:
    """The public keys in ``text``. What is not one is named by its line number, never shown: it may
    be a private key given by mistake (``id_rsa`` for ``id_rsa.pub``), and logs are read by others."""
    if "PRIVATE KEY-----" in text:
        warn(f"{source} holds a PRIVATE key; ignored, and none of it is shown. Give the public half "
             "(the .pub file), and treat that private key as exposed to whoever set this")
    keys = []
    in_private = False
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("-----BEGIN") and "PRIVATE KEY" in line:
            in_private = True
        if in_private:
            in_private = not (line.startswith("-----END") and "PRIVATE KEY" in line)
            continue
        if not line or line.startswith("#"):
            continue
        if _KEY_LINE.search(line):
            keys.append(line)
        else:
            warn(f"ignoring line {number} of {source}: not an SSH public key")
    return keys


def collect_authorized_keys(env: dict[str, str], home: str) -> tuple[list[str], list[str]]:
    """(keys, sources) from SSH_AUTHORIZED_KEYS[_FILE], /run/secrets, ~pt/.ssh/authorized_keys."""
    keys: list[str] = []
    sources: list[str] = []
    value, source = read_secret(env, "SSH_AUTHORIZED_KEYS")
    found = [(value, source or "SSH_AUTHORIZED_KEYS")] if value else []
    for path in (SECRET_KEYS_FILE, Path(home) / ".ssh/authorized_keys"):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            found.append((path.read_text(), str(path)))
    for text, where in found:
        lines = _key_lines(text, where)
        if lines:
            sources.append(f"{where} ({len(lines)})")
            keys += [k for k in lines if k not in keys]
    return keys, sources


def ensure_host_keys(directory: str) -> list[Path]:
    """Host keys are made here at first start, never at build time; a volume mounted on
    `directory` keeps them (and the fingerprints) across containers. sshd runs as pt, so
    they are pt's (0600 in a 0700 dir)."""
    d = private_dir(Path(directory))
    keys = []
    for kind, extra in (("ed25519", ()), ("rsa", ("-b", "3072"))):
        key = d / f"ssh_host_{kind}_key"
        if not (key.is_file() and key.with_suffix(".pub").is_file()):
            for stale in (key, key.with_suffix(".pub")):
                stale.unlink(missing_ok=True)
            subprocess.run([SSH_KEYGEN, "-q", "-t", kind, *extra, "-N", "", "-C",
                            "pt-multi-gpu host key", "-f", str(key)], check=True, stdin=subprocess.DEVNULL)
            made = "generated"
        else:
            made = "kept"
        os.chmod(key, 0o600)  # sshd refuses a private key others can read
        fp = subprocess.run([SSH_KEYGEN, "-l", "-f", f"{key}.pub"], capture_output=True,
                            text=True, check=False).stdout.strip()
        info(f"sshd host key {made}: {fp}")
        keys.append(key)
    return keys


def write_session_env(env: dict[str, str], workdir: str, state: Path) -> Path:
    """sshd gives a session only its own environment, and Debian's /etc/profile resets
    PATH in every login shell (`ssh`, `docker exec -it C bash -l`). ssh-session and
    /etc/profile.d/pt-multi-gpu.sh (for pt's login shells only, never root's) source this
    file so PATH (/opt/venv/bin), PTMG_*, NVIDIA_*, ... match the container."""
    lines = ["# Written by pt-multi-gpu at container start: the container's environment for SSH sessions."]
    for key in sorted(child_env(env)):
        if key in _SESSION_OWN or key.startswith("SSH_") or not key.isidentifier():
            continue
        lines.append(f"export {key}={shlex.quote(env[key])}")
    lines.append(f"export {contract.ENV_WORKDIR}={shlex.quote(workdir)}")
    path = state / SESSION_ENV
    write_file(path, "\n".join(lines) + "\n", 0o644)
    return path


def _unprivileged_port_start() -> int:
    try:
        return int(UNPRIVILEGED_PORT_START.read_text().strip())
    except (OSError, ValueError):
        return 1024


def plan_sshd(s: Settings, env: dict[str, str], user: RunAs) -> list[str] | None:
    """Cheap part, done before anything starts: should sshd run, and with which keys?
    sshd starts only when an authorized key is supplied (SSH=auto|on)."""
    if s.ssh == "off":
        return None
    keys, sources = collect_authorized_keys(env, user.home)
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
    try:
        pwd.getpwuid(os.geteuid())
    except KeyError:
        warn(f"sshd runs as the container's user and logs only that user in, but uid {os.geteuid()} has no entry "
             "in /etc/passwd (docker run --user UID without a user); SSH stays off")
        return None
    start = _unprivileged_port_start()
    if s.ssh_port < start and os.geteuid() != 0:
        warn(f"sshd runs as {user.name} and cannot listen on port {s.ssh_port} here (this host lets "
             f"non-root processes bind ports >= {start} only; Docker allows all): set SSH_PORT={max(start, 2222)} "
             "and publish that port; SSH stays off")
        return None
    info(f"sshd: {len(keys)} authorized key(s) from " + ", ".join(sources))
    return keys


def permit_open(s: Settings) -> str:
    """The only places `ssh -L` may reach: Jupyter and TensorBoard on the container's loopback."""
    ports = [s.jupyter_port] + ([s.tensorboard_port] if s.tensorboard != "off" else [])
    return " ".join(f"{host}:{port}" for port in ports for host in ("127.0.0.1", "localhost"))


def prepare_sshd(s: Settings, env: dict[str, str], user: RunAs, keys: list[str], state: Path) -> ServiceSpec:
    """Slow part (an RSA host key takes ~1 s the first time): the supervisor runs it
    after Jupyter and TensorBoard have started, so it does not delay them. sshd runs as
    the user (pt): it can only ever log in pt, and never needs PAM or privilege separation."""
    # sshd's StrictModes: owned by us, not writable by group or others.
    keys_dir = private_dir(private_dir(state / "ssh", 0o755) / "authorized_keys", 0o755)
    write_file(keys_dir / user.name, "\n".join(keys) + "\n", 0o600)
    host_keys = ensure_host_keys(s.ssh_host_key_dir)
    session_env = state / SESSION_ENV
    argv = [SSHD, "-D", "-e", "-f", str(SSHD_CONFIG)]
    for key in host_keys:
        argv += ["-h", str(key)]
    argv += ["-o", f"Port {s.ssh_port}",
             "-o", f"AuthorizedKeysFile {keys_dir}/%u .ssh/authorized_keys",
             "-o", f"PermitOpen {permit_open(s)}",
             "-o", f"SetEnv PTMG_SESSION_ENV={session_env}"]
    info(f"sshd: port {s.ssh_port} (publish it, e.g. -p {contract.SSH_HOST_PORT}:{s.ssh_port}), user {user.name}, "
         "keys only; ssh -L only to Jupyter/TensorBoard")
    # The healthcheck's probe connects from loopback and leaves before auth.
    quiet = r"^Connection closed by (127\.0\.0\.1|::1) port \d+ \[preauth\]$"
    return ServiceSpec("sshd", tuple(argv), child_env(env), "/",
                       {"check": "ssh", "port": s.ssh_port}, quiet)
