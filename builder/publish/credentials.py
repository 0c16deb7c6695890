"""Registry credentials from the environment or the docker config; never in argv, logs or reports."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from builder.publish.address import PublishInputError, Registry


# --- credentials ------------------------------------------------------------------------
class Secret:
    """A string that does not print: repr, str and f-strings show *** (reveal() gives it)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


@dataclass(frozen=True)
class Credentials:
    username: str
    password: Secret
    source: str  # where they came from, for the log (never the values)

    def auth_config(self, registry: Registry) -> dict[str, str]:
        """For the SDK's push(auth_config=...): sent to dockerd in a header, never in argv."""
        return {"username": self.username, "password": self.password.reveal(),
                "serveraddress": registry.server_address}

    def secrets(self) -> tuple[str, ...]:
        pw = self.password.reveal()
        basic = base64.b64encode(f"{self.username}:{pw}".encode()).decode()
        return tuple(s for s in (pw, basic) if s)


class CredentialsError(PublishInputError):
    pass


def redact(text: str, secrets: Iterable[str]) -> str:
    """`text` with every secret (longest first, so no fragment survives) replaced by ***."""
    for s in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(s, "***")
    return text


def docker_config_path(env: Mapping[str, str]) -> Path:
    base = env.get("DOCKER_CONFIG")
    return Path(base) / "config.json" if base else Path(env.get("HOME", str(Path.home()))) / ".docker" / "config.json"


def _read_secret_file(path_text: str, var: str) -> str:
    path = Path(path_text)
    try:
        value = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CredentialsError(f"{var}={path_text}: can't read it ({exc.strerror or exc})") from None
    value = value.rstrip("\r\n")
    if not value:
        raise CredentialsError(f"{var}={path_text}: the file is empty")
    return value


def load_credentials(registry: Registry, env: Mapping[str, str],
                     helper: Callable[[str, str], tuple[str, str] | None] | None = None) -> Credentials | None:
    """Credentials for `registry`: the environment first, then the docker config; None for anonymous.

    Env: PTMG_REGISTRY_USER with PTMG_REGISTRY_PASSWORD or PTMG_REGISTRY_PASSWORD_FILE (a
    password or token file; for CI secrets mounted as files). The docker config is read the
    way the docker CLI reads it: credHelpers[host], else credsStore, else auths[host].
    """
    user = env.get("PTMG_REGISTRY_USER", "")
    pw_env = env.get("PTMG_REGISTRY_PASSWORD")
    pw_file = env.get("PTMG_REGISTRY_PASSWORD_FILE")
    if pw_env and pw_file:
        raise CredentialsError("set PTMG_REGISTRY_PASSWORD or PTMG_REGISTRY_PASSWORD_FILE, not both")
    if user or pw_env or pw_file:
        if not user:
            raise CredentialsError("PTMG_REGISTRY_PASSWORD(_FILE) is set but PTMG_REGISTRY_USER is not; "
                                   "set the user name too (for token registries, any name the registry accepts)")
        if pw_file:
            return Credentials(user, Secret(_read_secret_file(pw_file, "PTMG_REGISTRY_PASSWORD_FILE")),
                               "env PTMG_REGISTRY_USER + PTMG_REGISTRY_PASSWORD_FILE")
        if not pw_env:
            raise CredentialsError("PTMG_REGISTRY_USER is set but neither PTMG_REGISTRY_PASSWORD nor "
                                   "PTMG_REGISTRY_PASSWORD_FILE is")
        return Credentials(user, Secret(pw_env), "env PTMG_REGISTRY_USER + PTMG_REGISTRY_PASSWORD")

    path = docker_config_path(env)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CredentialsError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CredentialsError(f"{path}: not a JSON object")
    run_helper = helper or credential_helper
    helpers = config.get("credHelpers") or {}
    for key in registry.auth_keys:
        if isinstance(helpers, dict) and key in helpers:
            got = run_helper(str(helpers[key]), key)
            return Credentials(got[0], Secret(got[1]), f"docker-credential-{helpers[key]}") if got else None
    if config.get("credsStore"):
        store = str(config["credsStore"])
        for key in registry.auth_keys:
            got = run_helper(store, key)
            if got:
                return Credentials(got[0], Secret(got[1]), f"docker-credential-{store}")
    auths = config.get("auths") or {}
    for key in registry.auth_keys:
        entry = auths.get(key) if isinstance(auths, dict) else None
        if not isinstance(entry, dict):
            continue
        if entry.get("identitytoken"):
            raise CredentialsError(f"{path} holds an identity token for {key}, which publishing can't use; "
                                   "set PTMG_REGISTRY_USER and PTMG_REGISTRY_PASSWORD(_FILE) instead")
        if entry.get("auth"):
            try:
                decoded = base64.b64decode(str(entry["auth"]), validate=True).decode()
            except ValueError:
                raise CredentialsError(f"{path}: auths[{key!r}].auth is not base64 of user:password") from None
            name, sep, pw = decoded.partition(":")
            if not sep:
                raise CredentialsError(f"{path}: auths[{key!r}].auth is not base64 of user:password")
            return Credentials(name, Secret(pw), f"docker config {path}")
        if entry.get("username") and entry.get("password"):
            return Credentials(str(entry["username"]), Secret(str(entry["password"])), f"docker config {path}")
    return None


def credential_helper(name: str, server: str) -> tuple[str, str] | None:
    """`docker-credential-<name> get` with the server on stdin (never argv) -> (user, secret)."""
    exe = shutil.which(f"docker-credential-{name}")
    if exe is None:
        raise CredentialsError(f"the docker config names credential helper {name!r}, but "
                               f"docker-credential-{name} is not on PATH")
    r = subprocess.run([exe, "get"], input=server, capture_output=True, text=True, timeout=30, check=False)
    if r.returncode != 0:
        if "credentials not found" in (r.stdout + r.stderr).lower():
            return None
        raise CredentialsError(f"docker-credential-{name} get failed for {server} (exit {r.returncode})")
    try:
        data = json.loads(r.stdout)
        user, secret = str(data["Username"]), str(data["Secret"])
    except (ValueError, KeyError, TypeError):
        raise CredentialsError(f"docker-credential-{name} gave no Username/Secret for {server}") from None
    if user == "<token>":
        raise CredentialsError(f"docker-credential-{name} holds an identity token for {server}, which publishing "
                               "can't use; set PTMG_REGISTRY_USER and PTMG_REGISTRY_PASSWORD(_FILE) instead")
    return user, secret


