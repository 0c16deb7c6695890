"""entrypoint/services.py's pure parts: secrets kept from user processes, authorized keys
(parsed, merged from every source, deduplicated), the password-hash check, and what
prepare_jupyter writes and passes on. No root, no sshd, no Jupyter."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import services
from common import ConfigError, RunAs, load_settings

ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHh0ZXN0a2V5MDAwMDAwMDAwMDAwMDAwMDAwMDAw alice@laptop"
RSA = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7dGVzdGtleTAwMDAwMDAwMDAwMDAw bob"
ECDSA = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTY= carol"
SK = "sk-ssh-ed25519@openssh.com AAAAGnNrLXNzaC1lZDI1NTE5QG9wZW5zc2guY29tAAAAI dave"
WITH_OPTIONS = f'from="10.0.0.0/8",no-agent-forwarding {ED25519}'


def test_child_env_drops_every_secret() -> None:
    env = {name: "secret" for name in services.SECRET_VARS}
    env.update(PATH="/opt/venv/bin:/usr/bin", JUPYTER_PORT="8888", PTMG_CELL="c", SSH="on")
    assert services.child_env(env) == {"PATH": "/opt/venv/bin:/usr/bin", "JUPYTER_PORT": "8888",
                                       "PTMG_CELL": "c", "SSH": "on"}
    assert {"JUPYTER_TOKEN", "JUPYTER_TOKEN_FILE", "JUPYTER_PASSWORD_HASH", "JUPYTER_PASSWORD_HASH_FILE",
            "SSH_AUTHORIZED_KEYS", "SSH_AUTHORIZED_KEYS_FILE"} <= services.SECRET_VARS


def test_key_lines_keeps_keys_and_skips_comments(capsys: pytest.CaptureFixture[str]) -> None:
    text = f"# my keys\n\n  {ED25519}  \n{RSA}\n{ECDSA}\n{SK}\n{WITH_OPTIONS}\n"
    assert services._key_lines(text, "src") == [ED25519, RSA, ECDSA, SK, WITH_OPTIONS]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("line", [
    "not a key at all, but a rather long line of text",
    "ssh-ed25519 AAAAshort",  # too short to be key material
    "ssh-ed448 AAAAC3NzaC1lZDI1NTE5AAAAIHh0ZXN0a2V5",  # no such key type
    "-----BEGIN OPENSSH PRIVATE KEY-----",  # a private key pasted by mistake
])
def test_key_lines_warns_about_what_is_not_a_key(line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert services._key_lines(f"{ED25519}\n{line}\n", "SSH_AUTHORIZED_KEYS") == [ED25519]
    assert capsys.readouterr().err == (  # at most 40 characters of it are shown
        f"[ptmg] WARNING: ignoring a line of SSH_AUTHORIZED_KEYS that is not an SSH public key: {line[:40]!r}\n")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home without keys; the image's /run/secrets key file moved into tmp_path (absent)."""
    monkeypatch.setattr(services, "SECRET_KEYS_FILE", tmp_path / "secrets" / "ssh_authorized_keys")
    home = tmp_path / "home"
    home.mkdir()
    return home


def test_authorized_keys_from_every_source_merged_in_order(home: Path, tmp_path: Path) -> None:
    secret = services.SECRET_KEYS_FILE
    secret.parent.mkdir()
    secret.write_text(f"{RSA}\n{ED25519}\n")
    (home / ".ssh").mkdir()
    (home / ".ssh" / "authorized_keys").write_text(f"# pt's own\n{ECDSA}\n{RSA}\n")
    keys, sources = services.collect_authorized_keys({"SSH_AUTHORIZED_KEYS": ED25519}, str(home))
    assert keys == [ED25519, RSA, ECDSA]
    assert sources == ["SSH_AUTHORIZED_KEYS (1)", f"{secret} (2)", f"{home}/.ssh/authorized_keys (2)"]


def test_authorized_keys_from_a_file_variable(home: Path, tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"{SK}\n")
    keys, sources = services.collect_authorized_keys({"SSH_AUTHORIZED_KEYS_FILE": str(f)}, str(home))
    assert (keys, sources) == ([SK], ["SSH_AUTHORIZED_KEYS_FILE (1)"])


def test_no_authorized_keys(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert services.collect_authorized_keys({}, str(home)) == ([], [])
    keys, sources = services.collect_authorized_keys({"SSH_AUTHORIZED_KEYS": "garbage that is no key"}, str(home))
    assert (keys, sources) == ([], [])
    assert "not an SSH public key" in capsys.readouterr().err


@pytest.mark.parametrize(("value", "ok"), [
    ("argon2:$argon2id$v=19$m=10240,t=10,p=8$c2FsdHNhbHQ$aGFzaGhhc2hoYXNo", True),
    ("argon2:$argon2i$v=19$m=10240,t=10,p=8$c2FsdA$aGFzaA", True),
    ("argon2:$argon2d$v=19$m=10240,t=10,p=8$c2FsdA$aGFzaA", True),
    ("sha1:0123456789ab:3f5d4c2a1b0e9f8d7c6b5a4f3e2d1c0b9a8f7e6d", True),
    ("sha256:abcdef:0123456789abcdef", True),
    ("hunter2", False),  # a password, not its hash
    ("argon2:$argon2x$v=19$whatever", False),
    ("argon2:", False),
    ("sha1:salt-not-hex:0123", False),
    ("SHA1:ab:cd", False),
    ("sha1:ab", False),
    ("", False),
])
def test_password_hash_pattern(value: str, ok: bool) -> None:
    assert bool(services._HASH.match(value)) is ok


# --- prepare_jupyter: the token and hash files, and what the server's environment gets ------
@pytest.fixture
def jupyter_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH has a stand-in jupyter-lab (prepare_jupyter only looks it up)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "jupyter-lab"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return {"PATH": str(bin_dir), "PTMG_CELL": "c"}


def _me(tmp_path: Path) -> RunAs:
    return RunAs(os.getuid(), os.getgid(), str(tmp_path / "home"), "pt", ())


def test_jupyter_gets_a_generated_token_in_a_private_file(tmp_path: Path, jupyter_env: dict[str, str],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    env = {**jupyter_env, "JUPYTER_TOKEN": "   "}
    spec = services.prepare_jupyter(load_settings([], env), env, _me(tmp_path), tmp_path / "state", "/workspace")
    assert spec is not None
    token_file = Path(spec.env["PTMG_JUPYTER_TOKEN_FILE"])
    token = token_file.read_text()
    assert len(token) == 48 and int(token, 16) >= 0
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert spec.check == {"check": "http", "port": 8888, "path": "/api/status", "token_file": str(token_file)}
    assert spec.argv[0] == jupyter_env["PATH"] + "/jupyter-lab" and spec.cwd == "/workspace"
    assert not services.SECRET_VARS & set(spec.env)
    err = capsys.readouterr().err
    assert "JUPYTER_TOKEN is empty" in err and f"?token={token}" in err


def test_jupyter_token_from_a_file_is_never_printed(tmp_path: Path, jupyter_env: dict[str, str],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    secret = tmp_path / "token"
    secret.write_text("s3cr3t-token-value\n")
    env = {**jupyter_env, "JUPYTER_TOKEN_FILE": str(secret)}
    spec = services.prepare_jupyter(load_settings([], env), env, _me(tmp_path), tmp_path / "state", "/w")
    assert spec is not None
    assert Path(spec.env["PTMG_JUPYTER_TOKEN_FILE"]).read_text() == "s3cr3t-token-value"
    assert "JUPYTER_TOKEN_FILE" not in spec.env
    err = capsys.readouterr().err
    assert "s3cr3t-token-value" not in err and "<the token from JUPYTER_TOKEN_FILE>" in err


def test_jupyter_refuses_a_password_that_is_not_a_hash(tmp_path: Path, jupyter_env: dict[str, str]) -> None:
    env = {**jupyter_env, "JUPYTER_PASSWORD_HASH": "hunter2"}
    with pytest.raises(ConfigError, match="JUPYTER_PASSWORD_HASH does not look like a hash"):
        services.prepare_jupyter(load_settings([], env), env, _me(tmp_path), tmp_path / "state", "/w")
    assert not (tmp_path / "state").exists(), "nothing is written before the settings are known to be good"


def test_jupyter_off_or_missing_is_no_service(tmp_path: Path, jupyter_env: dict[str, str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    off = {**jupyter_env, "JUPYTER": "off"}
    assert services.prepare_jupyter(load_settings([], off), off, _me(tmp_path), tmp_path, "/w") is None
    bare = {"PATH": str(tmp_path / "empty")}
    assert services.prepare_jupyter(load_settings([], bare), bare, _me(tmp_path), tmp_path, "/w") is None
    assert "jupyter-lab is not on PATH" in capsys.readouterr().err
