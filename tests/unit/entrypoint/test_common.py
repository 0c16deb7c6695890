"""entrypoint/common.py: settings from the environment (every one, every error at once, the
defaults of each mode) and secrets from NAME or NAME_FILE."""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import common
import ptmg_contract as contract
from common import ConfigError, Settings, load_settings, read_secret

SERVICES: list[str] = []
COMMAND = ["python", "train.py", "--lr", "0.1"]
SELFTEST = ["selftest", "--require-gpu", "-k", "not seed"]


def test_services_mode_defaults() -> None:
    assert load_settings(SERVICES, {}) == Settings(
        mode="services", argv=(), jupyter=True, jupyter_port=contract.JUPYTER_PORT, ssh="auto", tensorboard="on",
        tensorboard_port=contract.TENSORBOARD_PORT, tensorboard_logdir=f"{contract.WORKDIR}/runs", pt_uid=None,
        pt_gid=None, ssh_host_key_dir=contract.SSH_HOST_KEY_DIR, diagnostics=True, ssh_port=contract.SSH_PORT)


def test_command_mode_runs_the_command_alone_by_default() -> None:
    s = load_settings(COMMAND, {})
    assert (s.mode, s.argv) == ("command", tuple(COMMAND))
    assert (s.jupyter, s.ssh, s.tensorboard, s.diagnostics) == (False, "off", "off", True)


def test_selftest_mode_passes_its_arguments_on() -> None:
    s = load_settings(SELFTEST, {})
    assert (s.mode, s.argv) == ("selftest", tuple(SELFTEST[1:]))
    assert (s.jupyter, s.ssh, s.tensorboard) == (False, "off", "off")


def test_selftest_only_as_the_first_word() -> None:
    assert load_settings(["echo", "selftest"], {}).mode == "command"


def test_a_command_gets_a_service_when_asked() -> None:
    s = load_settings(COMMAND, {"JUPYTER": "on", "SSH": "auto", "TENSORBOARD": "port"})
    assert (s.jupyter, s.ssh, s.tensorboard) == (True, "auto", "port")


def test_every_setting_is_read() -> None:
    env = {"JUPYTER": "off", "JUPYTER_PORT": "9999", "SSH": "on", "TENSORBOARD": "port", "TENSORBOARD_PORT": "7007",
           "TENSORBOARD_LOGDIR": "/data/tb", "PT_UID": "4242", "PT_GID": "4343", "SSH_HOST_KEY_DIR": "/keys",
           "PTMG_DIAGNOSTICS": "off", "SSH_PORT": "2222"}
    assert load_settings(SERVICES, env) == Settings(
        mode="services", argv=(), jupyter=False, jupyter_port=9999, ssh="on", tensorboard="port",
        tensorboard_port=7007, tensorboard_logdir="/data/tb", pt_uid=4242, pt_gid=4343, ssh_host_key_dir="/keys",
        diagnostics=False, ssh_port=2222)


@pytest.mark.parametrize(("raw", "on"), [("on", True), ("1", True), ("true", True), ("YES", True), (" On ", True),
                                         ("off", False), ("0", False), ("False", False), ("no", False)])
def test_on_off_spellings(raw: str, on: bool) -> None:
    s = load_settings(SERVICES, {"JUPYTER": raw, "PTMG_DIAGNOSTICS": raw, "SSH": raw, "TENSORBOARD": raw})
    assert (s.jupyter, s.diagnostics) == (on, on)
    assert (s.ssh, s.tensorboard) == (("on", "on") if on else ("off", "off"))


def test_empty_values_mean_the_default() -> None:
    env = dict.fromkeys(("JUPYTER", "SSH", "TENSORBOARD", "JUPYTER_PORT", "TENSORBOARD_PORT", "PT_UID", "PT_GID",
                         "PTMG_DIAGNOSTICS", "TENSORBOARD_LOGDIR", "SSH_HOST_KEY_DIR"), "")
    assert load_settings(SERVICES, env) == load_settings(SERVICES, {})


@pytest.mark.parametrize(("name", "value", "ok"), [
    ("JUPYTER_PORT", "1", True), ("JUPYTER_PORT", "65535", True), ("JUPYTER_PORT", "65536", False),
    ("JUPYTER_PORT", "0", False), ("TENSORBOARD_PORT", "-1", False), ("TENSORBOARD_PORT", "80x", False),
    ("PT_UID", "1", True), ("PT_UID", str(2**31 - 2), True), ("PT_UID", str(2**31 - 1), False), ("PT_UID", "0", False),
    ("PT_GID", "100", True), ("PT_GID", "1.5", False),
    ("PT_GID", "1", True), ("PT_GID", str(2**31 - 2), True), ("PT_GID", str(2**31 - 1), False), ("PT_GID", "0", False),
])
def test_number_ranges(name: str, value: str, ok: bool) -> None:
    if ok:
        assert str(getattr(load_settings(SERVICES, {name: value}), name.lower())) == value
    else:
        with pytest.raises(ConfigError, match=name):
            load_settings(SERVICES, {name: value})


def test_every_bad_setting_is_reported_at_once() -> None:
    env = {"JUPYTER": "maybe", "SSH": "sometimes", "TENSORBOARD": "loud", "JUPYTER_PORT": "http",
           "TENSORBOARD_PORT": "0", "PT_UID": "-5", "PT_GID": "root", "PTMG_DIAGNOSTICS": "2"}
    with pytest.raises(ConfigError) as info:
        load_settings(SERVICES, env)
    parts = str(info.value).split("; ")
    assert [p.split("=", 1)[0] for p in parts] == list(env)  # one message per variable, in a fixed order
    assert "JUPYTER='maybe' is not one of on|off" in parts[0]
    assert "SSH='sometimes' is not one of auto|on|off" in parts[1]
    assert "TENSORBOARD='loud' is not one of on|off|port" in parts[2]
    assert "JUPYTER_PORT='http' is not a number" in parts[3]
    assert "TENSORBOARD_PORT=0 is out of range 1..65535" in parts[4]
    assert "PT_UID=-5 is out of range" in parts[5]


def test_the_same_port_twice_is_an_error() -> None:
    with pytest.raises(ConfigError, match="JUPYTER_PORT and TENSORBOARD_PORT are both 7000"):
        load_settings(SERVICES, {"JUPYTER_PORT": "7000", "TENSORBOARD_PORT": "7000"})
    with pytest.raises(ConfigError, match=f"both {contract.JUPYTER_PORT}"):
        load_settings(COMMAND, {"TENSORBOARD_PORT": str(contract.JUPYTER_PORT)})


# --- read_secret ---------------------------------------------------------------------------
def test_secret_from_the_variable_is_stripped() -> None:
    assert read_secret({"TOKEN": "  direct \n"}, "TOKEN") == ("direct", "TOKEN")


def test_a_secret_file_wins_over_the_variable_with_a_warning(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A value in the environment is in `docker inspect` and every `docker exec`: a file wins."""
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert read_secret({"TOKEN": "  direct \n", "TOKEN_FILE": str(f)}, "TOKEN") == ("from-file", "TOKEN_FILE")
    err = capsys.readouterr().err
    assert "TOKEN is set but ignored: TOKEN_FILE is used" in err and "docker inspect" in err
    assert "direct" not in err and "from-file" not in err


def test_an_implicit_secret_file_is_read_without_a_variable(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "jupyter_token"
    f.write_text("mounted\n")
    assert read_secret({}, "TOKEN", f) == ("mounted", str(f))
    assert read_secret({"TOKEN": "direct"}, "TOKEN", f) == ("mounted", str(f))
    assert "TOKEN is set but ignored" in capsys.readouterr().err
    assert read_secret({"TOKEN": "direct"}, "TOKEN", tmp_path / "absent") == ("direct", "TOKEN")


def test_secret_from_the_file(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("  from-file\n\n")
    assert read_secret({"TOKEN": " ", "TOKEN_FILE": f" {f} "}, "TOKEN") == ("from-file", "TOKEN_FILE")


def test_no_secret() -> None:
    assert read_secret({}, "TOKEN") == (None, None)
    assert read_secret({"TOKEN": "", "TOKEN_FILE": ""}, "TOKEN") == (None, None)


def test_an_empty_secret_file_is_ignored_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "token"
    f.write_text("\n")
    assert read_secret({"TOKEN_FILE": str(f)}, "TOKEN") == (None, None)
    assert f"WARNING: TOKEN_FILE={f} is empty; ignoring it" in capsys.readouterr().err


@pytest.mark.parametrize(("make", "why"), [
    (lambda d: d / "missing", "No such file or directory"),
    (lambda d: d, "Is a directory"),  # unreadable even for root
])
def test_an_unreadable_secret_file_is_a_config_error(tmp_path: Path, make: Callable[[Path], Path], why: str) -> None:
    path = make(tmp_path)
    with pytest.raises(ConfigError) as info:
        read_secret({"TOKEN_FILE": str(path)}, "TOKEN")
    assert str(info.value) == f"TOKEN_FILE={path}: cannot read it ({why})"


def test_an_implicit_secret_file_that_cannot_be_read_is_a_config_error(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    implicit = tmp_path / "jupyter_token"
    implicit.write_bytes(b"\xff\xfe not text")
    with pytest.raises(ConfigError, match=f"^{implicit}: cannot read it"):
        read_secret({}, "JUPYTER_TOKEN", implicit)
    implicit.write_text("fine\n")
    real = Path.read_text

    def unreadable(self: Path, *args: object, **kwargs: object) -> str:
        if self == implicit:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_text", unreadable)
    with pytest.raises(ConfigError, match=f"^{implicit}: cannot read it"):
        read_secret({}, "JUPYTER_TOKEN", implicit)


def test_own_dir_is_a_real_directory_this_uid_owns_and_may_write(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert common.own_dir(tmp_path)
    assert not common.own_dir(tmp_path, os.geteuid() + 1)
    (tmp_path / "f").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path)
    assert not common.own_dir(tmp_path / "f") and not common.own_dir(tmp_path / "link")
    assert not common.own_dir(tmp_path / "absent")
    # A directory of ours that we may not write to (r-x; root would be let in anyway, hence the fake).
    monkeypatch.setattr(os, "access", lambda path, mode: not mode & os.W_OK)
    assert not common.own_dir(tmp_path)


def test_state_dir_is_the_images_own_when_ours_else_a_private_one_per_uid(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "ROOT_STATE_DIR", tmp_path / "absent")
    assert common.state_dir() == Path(tempfile.gettempdir()) / f"pt-multi-gpu-{os.geteuid()}"
    assert common.state_dir(4242) == Path(tempfile.gettempdir()) / "pt-multi-gpu-4242"
    monkeypatch.setattr(common, "ROOT_STATE_DIR", tmp_path)
    assert common.state_dir() == tmp_path
    assert common.state_dir(os.geteuid() + 1) == Path(tempfile.gettempdir()) / f"pt-multi-gpu-{os.geteuid() + 1}"


def test_private_dir_makes_its_parents(tmp_path: Path) -> None:
    d = common.private_dir(tmp_path / "a" / "b" / "c")
    assert d.is_dir() and stat.S_IMODE(d.stat().st_mode) == 0o700


def test_write_file_never_follows_a_link_planted_at_its_temporary_name(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "victim"
    victim.write_text("root's\n")
    monkeypatch.setattr(time, "time_ns", lambda: 7)
    (tmp_path / f".state.json.{os.getpid()}.7.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        common.write_file(tmp_path / "state.json", "{}")
    assert victim.read_text() == "root's\n"


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="No space left"):
        common.write_file(tmp_path / "token", "secret")
    assert list(tmp_path.iterdir()) == []


def test_write_json_atomic_writes_sorted_readable_json_with_its_folders(tmp_path: Path) -> None:
    path = tmp_path / "run" / "ptmg" / "state.json"
    common.write_json_atomic(path, {"b": 1, "a": [2]})
    common.write_json_atomic(path, {"b": 1, "a": [3]})  # again: the folder is there now
    assert path.read_text() == '{\n  "a": [\n    3\n  ],\n  "b": 1\n}\n'
    assert json.loads(path.read_text()) == {"a": [3], "b": 1}
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # the healthcheck reads it as another user


# --- the user the processes run as -------------------------------------------------------------
def _no_passwd_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(uid: int) -> None:
        raise KeyError(uid)
    monkeypatch.setattr("pwd.getpwuid", missing)


def test_a_uid_without_passwd_keeps_the_home_its_runtime_bound(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """enroot's home hook (and Apptainer, Charliecloud) bind the caller's HOME and set $HOME; the
    image has no passwd entry for that uid. Its own writable HOME stays: ~/.local, caches, dotfiles."""
    _no_passwd_entry(monkeypatch)
    monkeypatch.setenv("HOME", str(tmp_path))
    user = common.current_user()
    assert user.home == str(tmp_path) and user.name == str(os.geteuid())


def test_an_unusable_home_falls_back_to_a_private_temporary_one(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    _no_passwd_entry(monkeypatch)
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    not_ours = tmp_path / "elsewhere"
    not_ours.mkdir()
    for home in ("", "relative", str(tmp_path / "missing"), "/"):
        monkeypatch.setenv("HOME", home)
        assert common.current_user().home == f"{tmp_path}/pt-multi-gpu-home-{os.geteuid()}", home
    if os.geteuid() == 0:  # a writable folder of another uid is not taken as this uid's HOME
        os.chown(not_ours, 4242, 4242)
        monkeypatch.setenv("HOME", str(not_ours))
        assert common.current_user().home == f"{tmp_path}/pt-multi-gpu-home-{os.geteuid()}"
