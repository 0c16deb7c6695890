"""entrypoint/services.py's pure parts: secrets kept from user processes, authorized keys
(parsed, merged from every source, deduplicated), the password-hash check, what
prepare_jupyter writes and passes on (never through a link, a directory in the way moved
aside), and how sshd is started (its policy, the forwarding it allows). No root, no Jupyter."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
from pathlib import Path

import pytest

import ptmg_contract as contract
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
])
def test_key_lines_warns_about_what_is_not_a_key(line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert services._key_lines(f"{ED25519}\n{line}\n", "SSH_AUTHORIZED_KEYS") == [ED25519]
    assert capsys.readouterr().err == (  # where, never what: the line may be a secret
        "[ptmg] WARNING: ignoring line 2 of SSH_AUTHORIZED_KEYS: not an SSH public key\n")


#: The body of a private key (made up, the shape of `ssh-keygen -t rsa` output).
PRIVATE = ("-----BEGIN OPENSSH PRIVATE KEY-----\n"
           "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAABlwAAAAdzc2gtcn\n"
           "NhAAAAAwEAAQAAAYEAx1pQ9kT3mZr8Y2fVb0XjL4wNqK7sHd5uE6gC1aRtBvW9oPiSlMnO\n"
           "-----END OPENSSH PRIVATE KEY-----\n")


def test_a_private_key_given_by_mistake_never_reaches_the_log(capsys: pytest.CaptureFixture[str]) -> None:
    """SSH_AUTHORIZED_KEYS_FILE=~/.ssh/id_rsa instead of id_rsa.pub: no part of it may be logged
    (docker logs and CI logs are read by others), and the warning says what to give instead."""
    assert services._key_lines(PRIVATE + ED25519 + "\n", "SSH_AUTHORIZED_KEYS_FILE") == [ED25519]
    err = capsys.readouterr().err
    for body in PRIVATE.splitlines()[1:3]:
        assert body[:12] not in err, err
    assert "a PRIVATE key" in err and ".pub" in err and err.count("\n") == 1, err


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


def stand_in(bin_dir: Path, name: str) -> Path:
    """A folder holding an executable ``name`` that does nothing (the code only looks it up)."""
    bin_dir.mkdir()
    exe = bin_dir / name
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return bin_dir


# --- prepare_jupyter: the token and hash files, and what the server's environment gets ------
@pytest.fixture
def jupyter_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH has a stand-in jupyter-lab (prepare_jupyter only looks it up)."""
    return {"PATH": str(stand_in(tmp_path / "bin", "jupyter-lab")), "PTMG_CELL": "c"}


def _me(tmp_path: Path) -> RunAs:
    return RunAs(os.getuid(), os.getgid(), str(tmp_path / "home"), "pt")


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


@pytest.mark.parametrize("token", ["two\nlines", "with space", "tab\there"])
def test_jupyter_refuses_a_token_that_cannot_go_into_a_header(tmp_path: Path, jupyter_env: dict[str, str],
                                                              token: str) -> None:
    secret = tmp_path / "token"
    secret.write_text(token)
    env = {**jupyter_env, "JUPYTER_TOKEN_FILE": str(secret)}
    with pytest.raises(ConfigError, match="JUPYTER_TOKEN_FILE: a Jupyter token must be printable ASCII"):
        services.prepare_jupyter(load_settings([], env), env, _me(tmp_path), tmp_path / "state", "/w")


@pytest.mark.parametrize("token", ["abc", "letmein", "x" * 15])
def test_jupyter_refuses_a_guessable_token(tmp_path: Path, jupyter_env: dict[str, str], token: str) -> None:
    """Jupyter has no login rate limit: a short token on port 8888 is a shell for whoever guesses it."""
    env = {**jupyter_env, "JUPYTER_TOKEN": token}
    with pytest.raises(ConfigError, match=f"JUPYTER_TOKEN: a Jupyter token needs at least 16 characters "
                                          f"\\(this one has {len(token)}\\)"):
        services.prepare_jupyter(load_settings([], env), env, _me(tmp_path), tmp_path / "state", "/w")


def test_jupyter_token_never_written_through_a_link(tmp_path: Path, jupyter_env: dict[str, str]) -> None:
    """A link (or a directory) where the token goes is replaced, its target never touched."""
    state = tmp_path / "state"
    (state / "jupyter").mkdir(parents=True)
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (state / "jupyter" / "token").symlink_to(target)
    (state / "jupyter" / "password-hash").mkdir()
    env = {**jupyter_env, "JUPYTER_TOKEN": "tok-0123456789abcdef", "JUPYTER_PASSWORD_HASH": "sha1:ab:cd"}
    services.prepare_jupyter(load_settings([], env), env, _me(tmp_path), state, "/w")
    assert target.read_text() == "keep me\n"
    token = state / "jupyter" / "token"
    assert not token.is_symlink() and token.read_text() == "tok-0123456789abcdef"
    assert (state / "jupyter" / "password-hash").read_text() == "sha1:ab:cd"
    assert len(list((state / "jupyter").glob(".password-hash.aside-*"))) == 1


def test_jupyter_secret_dir_replaced_when_it_is_a_link(tmp_path: Path, jupyter_env: dict[str, str]) -> None:
    state = tmp_path / "state"
    state.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (state / "jupyter").symlink_to(elsewhere)
    env = {**jupyter_env, "JUPYTER_TOKEN": "tok-0123456789abcdef"}
    services.prepare_jupyter(load_settings([], env), env, _me(tmp_path), state, "/w")
    assert list(elsewhere.iterdir()) == []
    assert (state / "jupyter").is_dir() and not (state / "jupyter").is_symlink()
    assert stat.S_IMODE((state / "jupyter").stat().st_mode) == 0o700


# --- sshd ------------------------------------------------------------------------------------
def _policy() -> dict[str, str]:
    lines = [line.split(None, 1) for line in services.SSHD_CONFIG.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    return {k.lower(): v for k, v in lines}


def test_sshd_policy_is_keys_only_and_forwards_only_local_tcp() -> None:
    p = _policy()
    for key, value in {"permitrootlogin": "no", "passwordauthentication": "no", "kbdinteractiveauthentication": "no",
                       "authenticationmethods": "publickey", "allowagentforwarding": "no",
                       "allowstreamlocalforwarding": "no", "x11forwarding": "no", "permittunnel": "no",
                       "allowtcpforwarding": "local", "gatewayports": "no", "permitlisten": "none",
                       "permitopen": "none", "permituserrc": "no", "permituserenvironment": "no",
                       "usepam": "no", "allowusers": "pt"}.items():
        assert p.get(key) == value, key
    assert "port" not in p, "the port comes from the supervisor (-o Port), or sshd would listen on two"
    weak = ("ecdh-sha2-nistp", "diffie-hellman-group14", "diffie-hellman-group-exchange", "hmac-sha1", "umac-64",
            "-cbc", "ssh-rsa,", "ecdsa")
    for key in ("kexalgorithms", "macs", "ciphers", "hostkeyalgorithms"):
        assert not [w for w in weak if w in p[key] + ","], (key, p[key])
    assert all(m.endswith("-etm@openssh.com") for m in p["macs"].split(","))


def test_prepare_sshd_argv(tmp_path: Path) -> None:
    env = {"SSH_PORT": "2200", "JUPYTER_PORT": "9000"}
    s = load_settings([], {**env, "SSH_HOST_KEY_DIR": str(tmp_path / "keys")})
    spec = services.prepare_sshd(s, env, _me(tmp_path), [ED25519], tmp_path / "state")
    argv = list(spec.argv)
    assert argv[:5] == [services.SSHD, "-D", "-e", "-f", str(services.SSHD_CONFIG)]
    options = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    keys_dir = tmp_path / "state" / "ssh" / "authorized_keys"
    assert options == ["Port 2200", f"AuthorizedKeysFile {keys_dir}/%u .ssh/authorized_keys",
                       "PermitOpen 127.0.0.1:9000 localhost:9000 127.0.0.1:6006 localhost:6006",
                       f"SetEnv PTMG_SESSION_ENV={tmp_path / 'state' / 'session-env.sh'}"]
    assert (keys_dir / "pt").read_text() == ED25519 + "\n"
    assert stat.S_IMODE((keys_dir / "pt").stat().st_mode) == 0o600
    for d in (keys_dir, keys_dir.parent):  # StrictModes: not group/world writable
        assert stat.S_IMODE(d.stat().st_mode) == 0o755
    hosts = [argv[i + 1] for i, a in enumerate(argv) if a == "-h"]
    assert [Path(h).name for h in hosts] == ["ssh_host_ed25519_key", "ssh_host_rsa_key"]
    assert all(stat.S_IMODE(Path(h).stat().st_mode) == 0o600 for h in hosts)
    assert spec.check == {"check": "ssh", "port": 2200}
    assert services.permit_open(load_settings([], {"TENSORBOARD": "off"})) == "127.0.0.1:8888 localhost:8888"


def test_sshd_stays_off_where_pt_cannot_bind_its_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    start = tmp_path / "ip_unprivileged_port_start"
    start.write_text("1024\n")
    monkeypatch.setattr(services, "UNPRIVILEGED_PORT_START", start)
    monkeypatch.setattr(services, "SECRET_KEYS_FILE", tmp_path / "absent")
    monkeypatch.setattr(services, "SSHD", "/bin/true")  # any executable: this host may have no sshd
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    env = {"SSH_AUTHORIZED_KEYS": ED25519}
    assert services.plan_sshd(load_settings([], env), env, _me(tmp_path)) is None
    assert "cannot listen on port 22 here" in capsys.readouterr().err
    env["SSH_PORT"] = "2222"
    assert services.plan_sshd(load_settings([], env), env, _me(tmp_path)) == [ED25519]


def test_no_token_given_is_no_warning(tmp_path: Path, jupyter_env: dict[str, str],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert services.prepare_jupyter(load_settings([], jupyter_env), jupyter_env, _me(tmp_path), tmp_path / "s", "/w")
    assert "WARNING" not in capsys.readouterr().err


def test_a_public_key_block_is_not_taken_for_a_private_key(capsys: pytest.CaptureFixture[str]) -> None:
    """Only a BEGIN ... PRIVATE KEY line starts a block that is skipped unseen: an RFC 4716
    public key block (or a line merely naming a private key) must not swallow the keys after it."""
    text = ("-----BEGIN SSH2 PUBLIC KEY-----\nAAAAB3NzaC1yc2E\n-----END SSH2 PUBLIC KEY-----\n"
            f"{ED25519}\nmy PRIVATE KEY is elsewhere\n{RSA}\n")
    assert services._key_lines(text, "src") == [ED25519, RSA]


# --- prepare_tensorboard: loopback only unless TENSORBOARD=port --------------------------------
@pytest.fixture
def tb_env(tmp_path: Path) -> dict[str, str]:
    return {"PATH": str(stand_in(tmp_path / "tb-bin", "tensorboard")), "TENSORBOARD_LOGDIR": str(tmp_path / "runs" / "tb"), "JUPYTER_TOKEN": "t" * 20}


@pytest.mark.parametrize(("mode", "jupyter", "host", "says"), [
    ("on", "on", "127.0.0.1", "/tensorboard/ (behind Jupyter's login)"),
    ("on", "off", "127.0.0.1", "inside the container only"),
    ("port", "off", "0.0.0.0", "(direct port: NO authentication)"),
])
def test_tensorboard_listens_beyond_loopback_only_when_asked(tmp_path: Path, tb_env: dict[str, str], mode: str,
                                                            jupyter: str, host: str, says: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    env = {**tb_env, "TENSORBOARD": mode, "JUPYTER": jupyter}
    spec = services.prepare_tensorboard(load_settings([], env), env, _me(tmp_path), "/w", jupyter == "on")
    assert spec is not None
    assert spec.argv == (f"{tb_env['PATH']}/tensorboard", "--logdir", tb_env["TENSORBOARD_LOGDIR"], "--host", host,
                         "--port", "6006")
    assert Path(tb_env["TENSORBOARD_LOGDIR"]).is_dir(), "the logdir is made when missing"
    assert not services.SECRET_VARS & set(spec.env)
    err = capsys.readouterr().err
    assert says in err
    assert ("inside the container only" in err) == (says == "inside the container only")


def test_tensorboard_off_or_missing_is_no_service(tmp_path: Path, tb_env: dict[str, str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    off = {**tb_env, "TENSORBOARD": "off"}
    assert services.prepare_tensorboard(load_settings([], off), off, _me(tmp_path), "/w", True) is None
    missing = {**tb_env, "PATH": str(tmp_path / "empty")}
    assert services.prepare_tensorboard(load_settings([], missing), missing, _me(tmp_path), "/w", True) is None
    assert "tensorboard is not on PATH" in capsys.readouterr().err


def test_a_half_host_key_is_made_again(tmp_path: Path) -> None:
    """A private host key without its .pub (an interrupted first start) is replaced, not kept."""
    d = tmp_path / "keys"
    d.mkdir()
    (d / "ssh_host_ed25519_key").write_text("half\n")
    rsa = d / "ssh_host_rsa_key"  # a whole one, kept (a small key: this test need not wait for 3072 bits)
    subprocess.run([services.SSH_KEYGEN, "-q", "-t", "rsa", "-b", "1024", "-N", "", "-f", str(rsa)], check=True)
    kept = rsa.read_text()
    keys = services.ensure_host_keys(str(d))
    assert [k.name for k in keys] == ["ssh_host_ed25519_key", "ssh_host_rsa_key"]
    assert (d / "ssh_host_ed25519_key").read_text().startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    assert (d / "ssh_host_ed25519_key.pub").is_file()
    assert rsa.read_text() == kept


def test_the_session_env_carries_the_containers_environment_but_no_secret(tmp_path: Path) -> None:
    env = {"PATH": "/opt/venv/bin:/usr/bin", "NCCL_DEBUG": "INFO", "PTMG_CELL": "it's c", "JUPYTER_TOKEN": "s3cr3t",
           "HOME": "/home/pt", "SSH_CLIENT": "1.2.3.4", "BAD-NAME": "x"}
    path = services.write_session_env(env, "/workspace", tmp_path)
    assert path.read_text().splitlines()[1:] == [
        "export NCCL_DEBUG=INFO", "export PATH=/opt/venv/bin:/usr/bin", "export PTMG_CELL='it'\"'\"'s c'",
        f"export {contract.ENV_WORKDIR}=/workspace"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # sourced by pt's login shells


def test_root_may_give_sshd_a_low_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    start = tmp_path / "ip_unprivileged_port_start"
    start.write_text("1024\n")
    monkeypatch.setattr(services, "UNPRIVILEGED_PORT_START", start)
    monkeypatch.setattr(services, "SECRET_KEYS_FILE", tmp_path / "absent")
    monkeypatch.setattr(services, "SSHD", "/bin/true")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    env = {"SSH_AUTHORIZED_KEYS": ED25519}
    assert services.plan_sshd(load_settings([], env), env, _me(tmp_path)) == [ED25519]


@pytest.mark.parametrize(("tensorboard", "proxied"), [("on", True), ("port", True), ("off", False)])
def test_jupyter_proxies_tensorboard_only_when_it_runs(tmp_path: Path, jupyter_env: dict[str, str], tensorboard: str,
                                                       proxied: bool) -> None:
    env = {**jupyter_env, "TENSORBOARD": tensorboard}
    spec = services.prepare_jupyter(load_settings([], env), env, _me(tmp_path), tmp_path / "state", "/w")
    assert spec is not None
    assert spec.env.get("PTMG_TENSORBOARD_PROXY_PORT") == ("6006" if proxied else None)


def test_a_host_key_that_cannot_be_made_stops_sshd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(services, "SSH_KEYGEN", "/bin/false")
    with pytest.raises(subprocess.CalledProcessError):
        services.ensure_host_keys(str(tmp_path / "keys"))


def test_sshd_stays_off_for_a_uid_without_a_passwd_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(services, "SECRET_KEYS_FILE", tmp_path / "absent")
    monkeypatch.setattr(services, "SSHD", "/bin/true")
    monkeypatch.setattr(os, "geteuid", lambda: 3999999)  # docker run --user 3999999: no such user
    env = {"SSH_AUTHORIZED_KEYS": ED25519}
    assert services.plan_sshd(load_settings([], env), env, _me(tmp_path)) is None
    assert "uid 3999999 has no entry in /etc/passwd" in capsys.readouterr().err


def test_a_token_of_exactly_the_minimum_length_is_taken(tmp_path: Path, jupyter_env: dict[str, str]) -> None:
    env = {**jupyter_env, "JUPYTER_TOKEN": "x" * services.MIN_TOKEN}
    spec = services.prepare_jupyter(load_settings([], env), env, _me(tmp_path), tmp_path / "state", "/w")
    assert spec is not None and Path(spec.env["PTMG_JUPYTER_TOKEN_FILE"]).read_text() == "x" * services.MIN_TOKEN


def test_tensorboard_starts_even_when_its_logdir_cannot_be_made(tmp_path: Path, tb_env: dict[str, str],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_text("x")
    env = {**tb_env, "TENSORBOARD_LOGDIR": str(tmp_path / "a-file" / "runs")}
    assert services.prepare_tensorboard(load_settings([], env), env, _me(tmp_path), "/w", True) is not None
    assert "cannot create TENSORBOARD_LOGDIR" in capsys.readouterr().err


def test_sshd_may_listen_on_the_first_unprivileged_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    start = tmp_path / "ip_unprivileged_port_start"
    start.write_text("1024\n")
    monkeypatch.setattr(services, "UNPRIVILEGED_PORT_START", start)
    monkeypatch.setattr(services, "SECRET_KEYS_FILE", tmp_path / "absent")
    monkeypatch.setattr(services, "SSHD", "/bin/true")
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: None)  # any uid has an entry here
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    env = {"SSH_AUTHORIZED_KEYS": ED25519, "SSH_PORT": "1024"}
    assert services.plan_sshd(load_settings([], env), env, _me(tmp_path)) == [ED25519]
