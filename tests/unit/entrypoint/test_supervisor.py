"""entrypoint/supervisor.py without root: the restart backoff, the stderr filter, and a bad
setting refused before anything starts."""

from __future__ import annotations

import io
import os
import re
import subprocess
import time

import pytest

import ptmg_contract as contract
import services
import supervisor

SPEC = services.ServiceSpec("jupyter", ("jupyter-lab",), {}, "/", {"check": "http", "port": 8888})


def _restart(svc: supervisor.Service, ran: float, capsys: pytest.CaptureFixture[str]) -> float:
    """Let `svc` die after running `ran` seconds; return the delay the supervisor announced."""
    sup = object.__new__(supervisor.Supervisor)  # no __init__: it would take over this process's signals
    svc.started_at = time.monotonic() - ran
    before = time.monotonic()
    sup._schedule_restart(svc, "exited with status 1")
    err = capsys.readouterr().err
    m = re.fullmatch(rf"\[ptmg\] WARNING: jupyter exited with status 1; restart #{svc.restarts} in (\S+) s\n", err)
    assert m, err
    delay = float(m.group(1))
    assert before + delay <= svc.next_start <= time.monotonic() + delay
    return delay


def test_backoff_doubles_up_to_the_cap(capsys: pytest.CaptureFixture[str]) -> None:
    svc = supervisor.Service(SPEC)
    delays = [_restart(svc, 0.1, capsys) for _ in range(8)]
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]
    assert (supervisor.BACKOFF_FIRST, supervisor.BACKOFF_MAX) == (1.0, 30.0)
    assert svc.restarts == 8 and svc.failures == 8


def test_a_service_that_ran_long_enough_starts_over_at_one_second(capsys: pytest.CaptureFixture[str]) -> None:
    svc = supervisor.Service(SPEC)
    for _ in range(5):
        _restart(svc, 0.1, capsys)
    assert _restart(svc, supervisor.STABLE_AFTER + 1, capsys) == 1
    assert _restart(svc, 0.1, capsys) == 2
    assert svc.restarts == 7


def test_filter_lines_drops_only_the_matching_lines(capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    quiet = r"^Connection closed by (127\.0\.0\.1|::1) port \d+ \[preauth\]$"
    stream = io.BytesIO(b"Server listening on 0.0.0.0 port 22.\r\n"
                        b"Connection closed by 127.0.0.1 port 40512 [preauth]\n"
                        b"Connection closed by 10.0.0.7 port 51000 [preauth]\n"
                        b"Connection closed by ::1 port 40514 [preauth]\r\n"
                        b"bad bytes \xff\n")
    supervisor._filter_lines(stream, quiet)
    assert capsysbinary.readouterr().err == (b"Server listening on 0.0.0.0 port 22.\r\n"
                                             b"Connection closed by 10.0.0.7 port 51000 [preauth]\n"
                                             b"bad bytes \xff\n")
    assert stream.closed


def test_a_bad_setting_exits_2_before_anything_starts(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("JUPYTER", "maybe")
    monkeypatch.setenv("PT_UID", "root")
    assert supervisor.main(["true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("[ptmg] ERROR: JUPYTER='maybe' is not one of on|off; PT_UID='root' is not a number")
    assert err.count("\n") == 1 and "README.md" in err


def test_user_path_puts_the_venv_first_only_when_missing() -> None:
    venv = f"{contract.VENV}/bin"
    assert supervisor.user_path("/usr/bin:/bin") == f"{venv}:/usr/bin:/bin"
    assert supervisor.user_path(f"/x:{venv}:/usr/bin") == f"/x:{venv}:/usr/bin"
    assert supervisor.user_path("") == venv


def test_ids_that_need_a_root_start_are_named_and_ignored(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Not root (the image's default): PT_UID/PT_GID other than ours cannot be applied."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getegid", lambda: 1000)
    def stop() -> None:
        raise SystemExit(42)  # the warning is out: go no further (no services started here)
    monkeypatch.setattr(supervisor, "current_user", stop)
    monkeypatch.setenv("PT_UID", "4242")
    with pytest.raises(SystemExit):
        supervisor.main(["true"])
    err = capsys.readouterr().err
    assert "PT_UID/PT_GID ignored: the remap needs a root start" in err and "--user 0" in err


def test_a_root_start_in_an_unsafe_environment_exits_2(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", "/tmp:/usr/bin")
    monkeypatch.chdir("/")
    assert supervisor.main(["true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("[ptmg] ERROR: started as root, but `docker exec` would run root with what pt controls: "
                          "PATH entry /tmp is writable by others")
    assert err.count("\n") == 1


def test_sigterm_gives_a_slow_service_its_grace_and_kills_one_that_ignores_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A service that needs 3 s after SIGTERM (Jupyter shutting a live kernel down on a loaded host)
    ends on its own; one that ignores SIGTERM is killed once the grace is over, inside docker
    stop's 10 s."""
    assert supervisor.STOP_GRACE <= 8  # docker stop sends SIGKILL at 10 s
    sup = object.__new__(supervisor.Supervisor)  # no __init__: it would take over this process's signals
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False)
    sup._rfd = rfd
    slow, stubborn = supervisor.Service(SPEC), supervisor.Service(
        services.ServiceSpec("sshd", ("sshd",), {}, "/", {"check": "tcp", "port": 22}))
    sup.services = [slow, stubborn]
    ready = [os.pipe() for _ in range(2)]
    scripts = ("trap 'sleep 3; exit 0' TERM; echo >&{fd}; while :; do sleep 0.1; done",
               "trap '' TERM; echo >&{fd}; while :; do sleep 0.1; done")
    try:
        for svc, script, (r, w) in zip((slow, stubborn), scripts, ready, strict=True):
            svc.proc = subprocess.Popen(["bash", "-c", script.format(fd=w)], pass_fds=(w,),
                                                   start_new_session=True)
            os.close(w)
            assert os.read(r, 1) == b"\n"  # its trap is set
            os.close(r)
        t0 = time.monotonic()
        sup.stop_services()
        took = time.monotonic() - t0
    finally:
        for svc in (slow, stubborn):
            if svc.proc and svc.proc.poll() is None:
                os.killpg(svc.proc.pid, 9)
                svc.proc.wait()
        os.close(rfd)
        os.close(wfd)
    assert slow.proc and slow.proc.returncode == 0
    assert stubborn.proc and stubborn.proc.returncode == -9
    assert supervisor.STOP_GRACE <= took < supervisor.STOP_GRACE + 2
    err = capsys.readouterr().err
    assert "sshd did not stop" in err and "jupyter did not stop" not in err
