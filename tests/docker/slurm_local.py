"""A one-node Slurm cluster on localhost for tests: munged, slurmctld and slurmd from Debian's
`slurm-wlm` and `munge`, all in one temporary folder, on free ports, with their own munge key
and socket. Nothing system-wide is touched (no /etc/slurm, no /run/munge, no systemd).

    with LocalSlurm(tmp_path) as slurm:
        job = slurm.sbatch(script, output=tmp_path / "job-%j.out")
        info = slurm.wait(job, timeout=600)      # {"JobState": "COMPLETED", "ExitCode": "0:0", ...}

No cgroups: proctrack/linuxproc and task/none, so it runs in a container without a systemd or
a writable cgroup tree. Needs root (slurmd runs jobs as their submitter) and `apt-get install
slurm-wlm munge`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import cast

from tests.support import wait_until

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}


class SlurmUnavailable(RuntimeError):
    """The cluster can't start here; the message says why and how to fix it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def slurm_conf(root: Path, ctld_port: int, slurmd_port: int, cpus: int) -> str:
    return "\n".join([
        f"ClusterName=ptmg{uuid.uuid4().hex[:8]}",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge/munge.socket.2",
        # No cgroups anywhere: a container has no writable cgroup tree and no systemd.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "ReturnToService=2",
        "KillWait=10",
        "MinJobAge=600",  # keep finished jobs visible to `scontrol show job` (no accounting here)
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        f"NodeName=localhost CPUs={cpus} State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


class LocalSlurm:
    def __init__(self, root: Path, cpus: int = 2) -> None:
        self.root = root
        self.cpus = cpus
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # --- lifecycle ---
    def __enter__(self) -> LocalSlurm:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        missing = missing_binaries()
        if missing:
            raise SlurmUnavailable(f"not installed: {', '.join(missing)}. Fix: apt-get install -y slurm-wlm munge")
        if os.geteuid() != 0:
            raise SlurmUnavailable("slurmd must run as root to start jobs as their submitter")
        for d in ("munge", "state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.conf.write_text(slurm_conf(self.root, free_port(), free_port(), self.cpus))
        m = self.root / "munge"
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={m}/munge.socket.2", f"--key-file={key}",
                               f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
                               f"--seed-file={m}/munged.seed"])
        wait_until((m / "munge.socket.2").exists, 20, what="munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._spawn("slurmd", ["slurmd", "-D", "-N", "localhost", "-f", str(self.conf)])
        try:
            state = wait_until(self._node_idle, 60, interval=0.5, what="the Slurm node to be idle")
        except AssertionError as exc:
            self.stop()
            raise SlurmUnavailable(f"{exc}\n{self.logs()}") from None
        if state != "idle":  # a daemon died: say so now, not after the timeout
            self.stop()
            raise SlurmUnavailable(f"{state}\n{self.logs()}")

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = (self.root / "log" / f"{name}.out").open("wb")
        proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        self.procs.append(proc)

    def _node_idle(self) -> str | None:
        """'idle'; a message when a daemon exited; None: not yet. (wait_until() takes an exception
        for "not yet", so a dead daemon is returned as a value and ends the wait at once.)"""
        for p in self.procs:
            if p.poll() is not None:
                return f"{cast(list[str], p.args)[0]} exited with {p.returncode}"
        r = subprocess.run(["sinfo", "-h", "-n", "localhost", "-o", "%T"], env=self.env, capture_output=True,
                           text=True, timeout=10, check=False)
        return "idle" if r.stdout.strip() == "idle" else None

    def stop(self) -> None:
        """SIGTERM each daemon this object started (by pid), SIGKILL what's left after 10 s."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.procs.clear()

    def logs(self) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            text = f.read_text(errors="replace")
            parts.append(f"--- {f.name} (last 2000 chars)\n{text[-2000:]}")
        return "\n".join(parts)

    # --- jobs ---
    def sbatch(self, script: Path, output: Path, extra: tuple[str, ...] = ()) -> str:
        r = subprocess.run(["sbatch", "--parsable", f"--output={output}", *extra, str(script)], env=self.env,
                           cwd=output.parent, capture_output=True, text=True, timeout=30, check=False)
        if r.returncode != 0:
            raise AssertionError(f"sbatch failed ({r.returncode}): {r.stderr}")
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o ID` as a dict (JobState, ExitCode, NodeList, ...)."""
        r = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=self.env, capture_output=True,
                           text=True, timeout=10, check=True)
        fields: dict[str, str] = {}
        for word in r.stdout.split():
            key, sep, value = word.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields

    def wait(self, job_id: str, timeout: float) -> dict[str, str]:
        def finished() -> dict[str, str]:
            info = self.job(job_id)
            return info if info.get("JobState") in FINAL_STATES else {}  # {}: not yet

        return wait_until(finished, timeout, interval=2, what=f"Slurm job {job_id} to finish")

    def cancel(self, job_id: str) -> None:
        subprocess.run(["scancel", job_id], env=self.env, capture_output=True, timeout=10, check=False)

    def run(self, script: Path, tmp: Path, timeout: float,
            after: Callable[[str], None] = lambda job_id: None) -> tuple[dict[str, str], str]:
        """Submit `script`, wait for it (cancelled if it does not end in time), run `after(job_id)` either
        way (the test's own clean-up), and return its final fields and its output (printed: -rP, failures)."""
        out = tmp / "job-%j.out"
        job_id = self.sbatch(script, out)
        try:
            info = self.wait(job_id, timeout)
        except AssertionError:
            self.cancel(job_id)
            raise
        finally:
            after(job_id)
        text = Path(str(out).replace("%j", job_id)).read_text(errors="replace")
        print(f"job {job_id}: JobState={info.get('JobState')} ExitCode={info.get('ExitCode')} "
              f"RunTime={info.get('RunTime')}\n{text[-3000:]}")
        return info, text
