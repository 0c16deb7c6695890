"""The container's main process (under tini): set up, then run the services or the command.

    start.sh            -> services mode: Jupyter, TensorBoard, sshd (per env), supervised
    start.sh CMD ARGS   -> command mode: CMD runs as pt; its exit status is the container's
    start.sh selftest … -> /opt/pt-multi-gpu/smoke_tests/selftest … as pt

It runs as pt (the image's USER). Started as root (`docker run --user 0`, only needed for
PT_UID/PT_GID), it checks root's environment, remaps pt's uid/gid and drops to pt for good
first (rootstart.py); nothing else ever runs as root.

Order: read settings (fail fast on a bad value) -> [root: rootstart] -> diagnostics
(warnings only) -> prepare services -> supervise. A crashed service is restarted with
bounded exponential backoff; SIGTERM stops every service within STOP_GRACE seconds and
the container exits 0.
"""

from __future__ import annotations

import os.path
import sys

# Import only from the image's own root-owned folders (this one and the contract's), never
# from the working directory or the user's environment (start.sh runs python3 -I).
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import contextlib
import os
import re
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import diagnostics
import ptmg_contract as contract
import rootstart
import services
from common import (
    WORKDIR_DEFAULT,
    ConfigError,
    current_user,
    error,
    info,
    load_settings,
    state_dir,
    warn,
    write_json_atomic,
)
from probes import probe

SELFTEST = Path(contract.SELFTEST)
# Seconds every service together gets between SIGTERM and SIGKILL: inside docker stop's default 10 s,
# with room for a Jupyter that shuts a live kernel down on a loaded 2-core host (2 s was seen to
# be too short there). An idle container stops in under a second (BENCHMARKS.md).
STOP_GRACE = 5.0
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0  # restart delays: 1, 2, 4, ... 30 s
STABLE_AFTER = 30.0  # a service that ran this long is healthy again: backoff restarts at 1 s
PROBE_EVERY = 0.25
VENV_BIN = f"{contract.VENV}/bin"


# ------------------------------------------------------------------- supervisor
def _filter_lines(stream: IO[bytes], pattern: str) -> None:
    """Copy a service's stderr to ours, without the lines matching `pattern`."""
    rx = re.compile(pattern)
    with stream:
        for raw in stream:
            if not rx.search(raw.decode("utf-8", "replace").rstrip("\r\n")):
                sys.stderr.buffer.write(raw)
                sys.stderr.buffer.flush()


class Service:
    def __init__(self, spec: services.ServiceSpec):
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.next_start = 0.0
        self.failures = 0
        self.restarts = 0
        self.ready = False

    @property
    def name(self) -> str:
        return self.spec.name

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class Supervisor:
    def __init__(self, specs: list[services.ServiceSpec], state_file: Path, mode: str):
        self.services = [Service(spec) for spec in specs]
        self.state_file = state_file
        self.mode = mode
        self.t0 = time.monotonic()
        self.stop_signal: int | None = None
        self.all_ready_logged = False
        self.command: subprocess.Popen[bytes] | None = None
        self.pending: list[str] = []  # enabled, still being prepared (see run)
        self.failed: list[str] = []  # enabled, but could not be prepared
        self._rfd, wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(wfd, False)
        signal.set_wakeup_fd(wfd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select()

    def _on_stop(self, signum: int, _frame: object) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum

    def write_state(self) -> None:
        write_json_atomic(self.state_file, {
            "mode": self.mode,
            "supervisor_pid": os.getpid(),
            "services": {
                **{name: {"check": "pending"} for name in self.pending},
                **{name: {"check": "failed"} for name in self.failed},
                **{svc.name: {**svc.spec.check,
                              "pid": svc.proc.pid if svc.proc is not None and svc.alive() else None,
                              "restarts": svc.restarts, "argv": list(svc.spec.argv)}
                   for svc in self.services},
            },
        })

    def _start(self, svc: Service) -> None:
        svc.started_at = time.monotonic()
        svc.ready = False
        try:
            # Own session: SIGTERM/SIGKILL reach the service's whole process tree.
            svc.proc = subprocess.Popen(list(svc.spec.argv), env=svc.spec.env, cwd=svc.spec.cwd,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        stderr=subprocess.PIPE if svc.spec.quiet else None)
        except OSError as exc:
            error(f"{svc.name}: cannot start ({exc})")
            svc.proc = None
            self._schedule_restart(svc, "failed to start")
            return
        if svc.spec.quiet and svc.proc.stderr is not None:
            threading.Thread(target=_filter_lines, args=(svc.proc.stderr, svc.spec.quiet),
                             daemon=True).start()
        self.write_state()

    def _schedule_restart(self, svc: Service, why: str) -> None:
        ran = time.monotonic() - svc.started_at
        svc.failures = 1 if ran >= STABLE_AFTER else svc.failures + 1
        delay = min(BACKOFF_FIRST * 2 ** (svc.failures - 1), BACKOFF_MAX)
        svc.next_start = time.monotonic() + delay
        svc.restarts += 1
        warn(f"{svc.name} {why}; restart #{svc.restarts} in {delay:g} s")

    def _elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _reap(self) -> None:
        for svc in self.services:
            if svc.proc is None or svc.proc.returncode is not None:
                continue
            code = svc.proc.poll()
            if code is not None:
                what = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
                ran = time.monotonic() - svc.started_at
                svc.ready = False
                if self.stop_signal is None:
                    self._schedule_restart(svc, f"{what} after {ran:.1f} s")
                    self.write_state()

    def _probe(self) -> bool:
        """Log each service's first readiness; True while some service is not ready."""
        pending = False
        for svc in self.services:
            if svc.alive() and not svc.ready:
                ok, _ = probe(svc.spec.check, timeout=0.2)
                if ok:
                    svc.ready = True
                    info(f"{svc.name} ready ({time.monotonic() - svc.started_at:.1f} s)")
                else:
                    pending = True
        if (not pending and not self.all_ready_logged and self.services
                and all(svc.ready for svc in self.services)):
            self.all_ready_logged = True
            info(f"ready: {', '.join(s.name for s in self.services)} "
                 f"({self._elapsed():.1f} s after start)")
        return pending

    def _wait(self, timeout: float) -> None:
        with contextlib.suppress(InterruptedError):
            select.select([self._rfd], [], [], max(0.0, timeout))
        try:
            while os.read(self._rfd, 512):
                pass
        except BlockingIOError:
            pass

    def run(self, command: tuple[list[str], dict[str, str]] | None = None,
            late: Sequence[tuple[str, Callable[[], services.ServiceSpec]]] = ()) -> int:
        """Start the services, then the `late` ones (slow to prepare), then `command`;
        supervise until the command ends or a stop signal comes."""
        # Late services count as enabled from the start, so the healthcheck stays
        # unhealthy until they answer too (not healthy on the early ones alone).
        self.pending = [name for name, _ in late]
        for svc in self.services:
            self._start(svc)
        for name, prepare in late:
            try:
                svc = Service(prepare())
            except (OSError, subprocess.CalledProcessError) as exc:
                error(f"cannot prepare {name}: {exc}")
                self.failed.append(name)  # stays in the state: the container reports unhealthy
                continue
            finally:
                self.pending.remove(name)
            self.services.append(svc)
            self._start(svc)
        if command is not None:
            argv, env = command
            try:
                self.command = subprocess.Popen(argv, env=env)
            except OSError as exc:
                error(f"cannot run {argv[-1]!r}: {exc}")
                self.stop_services()
                return 127
        self.write_state()
        if not self.services and command is None:
            warn("no service is enabled; the container idles until stopped "
                 "(set JUPYTER=on, TENSORBOARD=on or an SSH key, or pass a command)")
        last_probe = 0.0
        while True:
            self._reap()
            if self.command is not None and self.command.poll() is not None:
                code = self.command.returncode
                self.stop_services()
                return 128 - code if code < 0 else code
            if self.stop_signal is not None:
                info(f"got {signal.Signals(self.stop_signal).name}: stopping services")
                self.stop_services()
                if self.command is not None:
                    # tini -g already signalled the command (same process group); let
                    # it finish its own shutdown, as long as docker's stop timeout allows.
                    code = self.command.wait()
                    return 128 - code if code < 0 else code
                return 0
            now = time.monotonic()
            for svc in self.services:
                if svc.proc is not None and svc.proc.returncode is None:
                    continue
                if now >= svc.next_start:
                    info(f"restarting {svc.name}")
                    self._start(svc)
            pending = False
            if now - last_probe >= PROBE_EVERY:
                last_probe = now
                pending = self._probe()
            waits = [svc.next_start - now for svc in self.services if not svc.alive()]
            waits.append(PROBE_EVERY if pending or not self.all_ready_logged else 5.0)
            self._wait(min(waits))

    def stop_services(self) -> None:
        alive = [svc for svc in self.services if svc.alive()]
        for svc in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(svc.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + STOP_GRACE
        while alive and time.monotonic() < deadline:
            self._wait(min(0.05, deadline - time.monotonic()))
            alive = [svc for svc in alive if svc.proc.poll() is None]  # type: ignore[union-attr]
        for svc in alive:
            warn(f"{svc.name} did not stop within {STOP_GRACE:g} s; killing it")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(svc.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
            svc.proc.wait()  # type: ignore[union-attr]


# ------------------------------------------------------------------------- main
def _exec(argv: list[str], env: dict[str, str]) -> int:
    try:
        os.execvpe(argv[0], argv, env)  # noqa: S606 - becoming the user's command is the point
    except OSError as exc:
        error(f"cannot run {argv[0]!r}: {exc.strerror}")
        return 127 if isinstance(exc, FileNotFoundError) else 126


def user_path(path: str) -> str:
    """pt's PATH: the container's, with the venv first if it is missing (root mode runs with
    a PATH of root-owned dirs only; pt's processes still want the venv)."""
    entries = [e for e in path.split(":") if e]
    return ":".join(entries if VENV_BIN in entries else [VENV_BIN, *entries])


def main(argv: list[str]) -> int:
    env = dict(os.environ)
    try:
        s = load_settings(argv, env)
    except ConfigError as exc:
        error(f"{exc} (see {contract.ENTRYPOINT_DIR}/README.md)")
        return 2
    if os.geteuid() == 0:
        try:
            rootstart.start_as_root(s, env)
        except ConfigError as exc:
            error(f"{exc} (see {contract.ENTRYPOINT_DIR}/README.md)")
            return 2
        except rootstart.RootStartFailed as exc:
            error(f"cannot set up user {contract.USER}: {exc}")
            return 1
        # From here on this process is pt. Root mode runs in a root-owned working directory
        # (see rootstart.py); pt's processes run in /workspace (or PTMG_WORKDIR).
        workdir = env.get(contract.ENV_WORKDIR) or WORKDIR_DEFAULT
        env["PATH"] = env.get(contract.ENV_USER_PATH) or user_path(env.get("PATH", ""))
        try:
            os.chdir(workdir)
        except OSError as exc:
            warn(f"cannot enter {workdir}: {exc.strerror}; staying in {os.getcwd()}")
            workdir = os.getcwd()
    else:
        workdir = os.getcwd()
        if s.pt_uid not in (None, os.geteuid()) or s.pt_gid not in (None, os.getegid()):
            warn(f"PT_UID/PT_GID ignored: the remap needs a root start ({rootstart.ROOT_MODE_FIX})")
    user = current_user()
    base_env = user.env(services.child_env(env))
    sdir = state_dir()
    try:
        sdir.mkdir(parents=True, exist_ok=True)
        os.chmod(sdir, 0o755)  # noqa: S103 - the healthcheck reads the state; secrets live in 0700 subdirs
    except OSError as exc:
        error(f"cannot use the state directory {sdir}: {exc}")
        return 1
    try:
        services.write_session_env(env, workdir, sdir)
    except OSError as exc:
        warn(f"cannot write the environment for SSH/login shells: {exc}")
    state_file = sdir / "state.json"
    python = contract.VENV_PYTHON if os.path.exists(contract.VENV_PYTHON) else sys.executable

    # Command: what runs in the foreground instead of (or beside) the services.
    command: list[str] | None = None
    if s.mode == "selftest":
        if not os.access(SELFTEST, os.X_OK):
            error(f"{SELFTEST} is missing or not executable in this image")
            return 127
        command = [str(SELFTEST), *s.argv]
    elif s.mode == "command":
        command = list(s.argv)

    def background(fn: Callable[[], None]) -> None:
        threading.Thread(target=fn, daemon=True).start()

    try:
        specs = [spec for spec in (
            services.prepare_jupyter(s, env, user, sdir, workdir),
            services.prepare_tensorboard(s, env, user, workdir, s.jupyter),
        ) if spec is not None]
        ssh_keys = services.plan_sshd(s, env, user)
    except ConfigError as exc:
        error(f"{exc} (see {contract.ENTRYPOINT_DIR}/README.md)")
        return 2
    except OSError as exc:
        error(f"cannot prepare the services: {exc}")
        return 1
    late = [] if ssh_keys is None else [
        ("sshd", lambda: services.prepare_sshd(s, env, user, ssh_keys, sdir))]

    if command is not None and not specs and not late:
        # Nothing to supervise: become the command (tini reaps and forwards signals).
        if s.diagnostics:
            diagnostics.run(env, background=None, python=python, child_env=base_env)
        write_json_atomic(state_file, {"mode": s.mode, "services": {}})
        return _exec(command, base_env)

    if s.diagnostics:
        # nvidia-smi can take a second on a GPU host: keep it off the services' path.
        background(lambda: diagnostics.run(env, background=background, python=python,
                                           child_env=base_env))
    sup = Supervisor(specs, state_file, s.mode)
    return sup.run(None if command is None else (command, base_env), late)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
