"""Registry credentials (builder/publish/credentials.py): the environment and a password file, the
Docker config's auths, helpers and tokens, which wins, and the redaction of a secret (no daemon, no
registry)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from builder.publish import address, credentials
from tests.unit.publish.test_address import PASSWORD

# --- credentials ------------------------------------------------------------------------
REG = address.parse_registry("registry.example.com:5000/ns")


def _config(tmp_path: Path, data: dict[str, Any]) -> dict[str, str]:
    (tmp_path / "config.json").write_text(json.dumps(data))
    return {"DOCKER_CONFIG": str(tmp_path)}


def test_env_credentials_and_password_file(tmp_path: Path) -> None:
    c = credentials.load_credentials(REG, {"PTMG_REGISTRY_USER": "ci", "PTMG_REGISTRY_PASSWORD": PASSWORD})
    assert c is not None and c.username == "ci" and c.password.reveal() == PASSWORD
    f = tmp_path / "token"
    f.write_text(PASSWORD + "\n")
    c = credentials.load_credentials(REG, {"PTMG_REGISTRY_USER": "ci", "PTMG_REGISTRY_PASSWORD_FILE": str(f)})
    assert c is not None and c.password.reveal() == PASSWORD
    assert c.auth_config(REG) == {"username": "ci", "password": PASSWORD, "serveraddress": REG.host}
    assert PASSWORD not in c.source and PASSWORD not in repr(c) and PASSWORD not in str(c.password)
    assert PASSWORD not in f"{c}"


@pytest.mark.parametrize(("env", "why"), [
    ({"PTMG_REGISTRY_PASSWORD": "x"}, "PTMG_REGISTRY_USER is not"),
    ({"PTMG_REGISTRY_USER": "u"}, "neither PTMG_REGISTRY_PASSWORD nor"),
    ({"PTMG_REGISTRY_USER": "u", "PTMG_REGISTRY_PASSWORD": "x", "PTMG_REGISTRY_PASSWORD_FILE": "/x"}, "not both"),
    ({"PTMG_REGISTRY_USER": "u", "PTMG_REGISTRY_PASSWORD_FILE": "/nonexistent/pw"}, "can't read it"),
])
def test_env_credentials_misconfigured(env: dict[str, str], why: str) -> None:
    with pytest.raises(credentials.CredentialsError, match=why):
        credentials.load_credentials(REG, env)


def test_docker_config_auths(tmp_path: Path) -> None:
    auth = base64.b64encode(f"bob:{PASSWORD}".encode()).decode()
    env = _config(tmp_path, {"auths": {"https://registry.example.com:5000": {"auth": auth},
                                       "other.io": {"auth": base64.b64encode(b"x:y").decode()}}})
    c = credentials.load_credentials(REG, env)
    assert c is not None and (c.username, c.password.reveal()) == ("bob", PASSWORD)
    assert credentials.load_credentials(address.parse_registry("third.io"), env) is None
    env = _config(tmp_path, {"auths": {"registry.example.com:5000": {"username": "al", "password": "pw"}}})
    c = credentials.load_credentials(REG, env)
    assert c is not None and (c.username, c.password.reveal()) == ("al", "pw")


def test_env_wins_over_docker_config(tmp_path: Path) -> None:
    env = _config(tmp_path, {"auths": {"registry.example.com:5000": {"username": "al", "password": "pw"}}})
    c = credentials.load_credentials(REG, {**env, "PTMG_REGISTRY_USER": "ci", "PTMG_REGISTRY_PASSWORD": PASSWORD})
    assert c is not None and c.username == "ci"


def test_docker_config_helpers_and_tokens(tmp_path: Path) -> None:
    calls: list[tuple[str, str]] = []

    def helper(name: str, server: str) -> tuple[str, str] | None:
        calls.append((name, server))
        return ("hub-user", PASSWORD) if server == "https://index.docker.io/v1/" else None

    hub = address.parse_registry("docker.io/me")
    env = _config(tmp_path, {"credsStore": "desktop"})
    c = credentials.load_credentials(hub, env, helper=helper)
    assert c is not None and c.username == "hub-user" and c.source == "docker-credential-desktop"
    env = _config(tmp_path, {"credHelpers": {"registry.example.com:5000": "ecr-login"}, "credsStore": "desktop"})
    calls.clear()
    assert credentials.load_credentials(REG, env, helper=helper) is None
    assert calls == [("ecr-login", "registry.example.com:5000")]
    env = _config(tmp_path, {"auths": {"registry.example.com:5000": {"identitytoken": "tok"}}})
    with pytest.raises(credentials.CredentialsError, match="identity token"):
        credentials.load_credentials(REG, env)
    env = _config(tmp_path, {"auths": {"registry.example.com:5000": {"auth": "not-base64!"}}})
    with pytest.raises(credentials.CredentialsError, match="not base64"):
        credentials.load_credentials(REG, env)


def test_no_docker_config_is_anonymous(tmp_path: Path) -> None:
    assert credentials.load_credentials(REG, {"DOCKER_CONFIG": str(tmp_path / "none")}) is None


def test_redact() -> None:
    c = credentials.Credentials("bob", credentials.Secret(PASSWORD), "test")
    basic = base64.b64encode(f"bob:{PASSWORD}".encode()).decode()
    text = f"error: auth {PASSWORD} failed; header Basic {basic}; again {PASSWORD}"
    out = credentials.redact(text, c.secrets())
    assert PASSWORD not in out and basic not in out
    assert out == "error: auth *** failed; header Basic ***; again ***"
    assert credentials.redact("nothing here", ()) == "nothing here"


