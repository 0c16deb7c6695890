"""A multi-node Slurm cluster made of containers of the cell image, for tests.

    image = build_slurm_image(client, cell, cell_ref, labels, log_dir)  # FROM the cell + slurm-wlm, munge
    with SlurmCluster(client, image, labels, nodes=2) as cluster:
        job = cluster.sbatch(script_text, "ddp.sbatch")    # as `pt`, from the controller
        info = cluster.wait(job, timeout=300)              # {"JobState": "COMPLETED", "ExitCode": "0:0", ...}
        rows = cluster.sacct(job)                          # [{"JobID": "1", "State": "COMPLETED", ...}, ...]

Containers: the controller `slurmctl` (slurmctld + slurmdbd + MariaDB, so `sacct` works) and
`node1`..`nodeN` (slurmd), all of one image: the cell plus a test-only Slurm layer
(slurm_cluster/Dockerfile, built through the project's engine with the cell build's secrets). The
nodes run the image's own software (torch in /opt/venv): `build.py launch --launcher native` runs
the node script on them directly. slurmd runs as root and starts job steps as the submitter.

One user-defined network with a subnet of its own (10.213.X.0/24, the first free X): the host
is .1 (`gateway`: where a service the test runs on the host, e.g. a registry, is reached), the
controller is .10, `nodeN` is .10+N, and every container's /etc/hosts names them all, so a killed
container's name still resolves (Docker's DNS forgets it at once, and slurmctld then stalls in
getaddrinfo retries). Two volumes: the config (munge key, slurm.conf, slurmdbd.conf; read-only on
every container) and /shared (job scripts, outputs, results; the same path on every node), both
filled through a created, never started, container (no bind mounts: works with a remote engine).
Everything carries the session's labels plus `io.pt-multi-gpu.slurm-cluster=<id>`; stop() removes
it all, also after a failed start.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import tarfile
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import docker
import docker.errors
import docker.types
from docker.models.containers import Container
from docker.models.networks import Network

import ptmg_contract as contract
from builder.engine import BuildRequest, Engine, find_buildkit_cli
from builder.imaging.buildenv import detect, secret_files
from builder.matrix import load_matrix
from builder.render.dockerfile import bounded_apt
from tests.support import wait_until

HERE = Path(__file__).resolve().parent / "slurm_cluster"
ROOT = Path(__file__).resolve().parents[2]
IMAGE_REPO = "ptmg-slurm-test"
CLUSTER_LABEL = contract.label("slurm-cluster")
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                          "BOOT_FAIL", "DEADLINE", "PREEMPTED"})
SHARED = "/shared"
JOBS = f"{SHARED}/jobs"


class SlurmClusterError(RuntimeError):
    """The cluster could not be built or started; the message carries the daemons' logs."""


# --- the image ----------------------------------------------------------------------------------


def cell_os(cell: str) -> str:
    """The cell's OS (its apt cache mounts are named after it); bookworm if images.yaml lacks the cell."""
    for spec in load_matrix(ROOT / "images.yaml").cells:
        if spec.name == cell:
            return spec.os
    return "bookworm"


def dockerfile_text(os_name: str, tail: str = "") -> str:
    """slurm_cluster/Dockerfile plus ``tail``, for a cell on ``os_name``: its apt cache mounts, and
    apt bounded as in the images (builder.render.dockerfile.bounded_apt)."""
    text = (HERE / "Dockerfile").read_text() + tail
    return text.replace("@OS@", os_name).replace("@APT_BOUNDED@", bounded_apt())


def build_slurm_image(client: docker.DockerClient, cell: str, base_ref: str, labels: Mapping[str, str],
                      log_dir: Path, context: Path = HERE, tail: str = "") -> str:
    """Build slurm_cluster/Dockerfile (plus ``tail``, more instructions, from ``context``) FROM
    ``base_ref`` through the project's engine (BuildKit, the host's CA and proxy settings as the same
    build secrets a cell build gets); returns the tag."""
    tag = f"{IMAGE_REPO}:{cell}-{uuid.uuid4().hex[:8]}"
    cli = find_buildkit_cli()
    if cli is None:
        raise SlurmClusterError("no docker CLI with BuildKit here (the Slurm layer uses cache and secret mounts)")
    engine = Engine(client, labels=labels)
    with tempfile.TemporaryDirectory(prefix="ptmg-slurm-df-") as tmp:
        dockerfile = Path(tmp) / "Dockerfile"
        dockerfile.write_text(dockerfile_text(cell_os(cell), tail))
        with secret_files(detect(os.environ)) as secrets:
            req = BuildRequest(context=context, dockerfile=dockerfile, labels=dict(labels), secrets=secrets,
                               log_path=log_dir / "slurm-image-build.log", build_args={"BASE": base_ref})
            outcome = engine.build(req, lambda _line: None, cli)
    if not outcome.ok or outcome.image_id is None:
        tail = "\n".join(outcome.tail)
        raise SlurmClusterError(f"building the Slurm layer FROM {base_ref} failed: {outcome.failed_step}\n{tail}")
    engine.tag(outcome.image_id, tag)
    return tag


# --- configuration ------------------------------------------------------------------------------


def slurm_conf(nodes: int, cpus: int, slurmd_timeout: int, message_timeout: int) -> str:
    return "\n".join([
        "ClusterName=ptmg",
        "SlurmctldHost=slurmctl",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # No cgroup delegation in the containers: processes tracked by parentage, no binding.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "PropagateResourceLimits=NONE",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=slurmctl",
        "JobCompType=jobcomp/none",
        "StateSaveLocation=/var/spool/slurmctld",
        "SlurmdSpoolDir=/var/spool/slurmd",
        "SlurmctldPidFile=/run/slurmctld.pid",
        "SlurmdPidFile=/run/slurmd.pid",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "MailProg=/bin/true",
        # A node that stops answering is DOWN about SlurmdTimeout + MessageTimeout later and its job
        # ends NODE_FAIL. JobRequeue is left at Slurm's default (1, requeue after a node failure):
        # the generated script's `#SBATCH --no-requeue` must be what keeps the job from going back
        # to the queue (where a 2-node job waits for ever on a cluster with one node left).
        f"SlurmdTimeout={slurmd_timeout}",
        f"MessageTimeout={message_timeout}",
        "KillWait=5",
        "InactiveLimit=0",
        "UnkillableStepTimeout=30",
        "ReturnToService=2",
        "MinJobAge=600",  # finished jobs stay visible to `scontrol show job`
        f"NodeName=node[1-{nodes}] CPUs={cpus} RealMemory=1024 State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


SLURMDBD_CONF = "\n".join([
    "AuthType=auth/munge",
    "DbdHost=localhost",
    "SlurmUser=root",
    "PidFile=/run/slurmdbd.pid",
    "StorageType=accounting_storage/mysql",
    "StorageHost=localhost",
    "StorageUser=root",
    "StorageLoc=slurm_acct_db",
    "DebugLevel=info",
    "",
])


def _tar(files: Mapping[str, tuple[bytes | None, int, int]]) -> bytes:
    """{path: (content, or None for a directory; mode; uid = gid)} -> a tar archive."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, (data, mode, uid) in files.items():
            info = tarfile.TarInfo(name)
            info.mode, info.uid, info.gid, info.mtime = mode, uid, uid, int(time.time())
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _quietly(fn: Any, *args: Any, **kwargs: Any) -> None:
    with contextlib.suppress(docker.errors.APIError):  # NotFound included: already gone
        fn(*args, **kwargs)


# --- the cluster --------------------------------------------------------------------------------


class SlurmCluster:
    def __init__(self, client: docker.DockerClient, image: str, labels: Mapping[str, str], nodes: int = 2,
                 cpus: int = 2, slurmd_timeout: int = 10, message_timeout: int = 5,
                 run_options: Mapping[str, Any] | None = None) -> None:
        """run_options: more keywords of every container's run (pyxis: seccomp, /dev/fuse, volumes)."""
        self.client, self.image, self.nodes = client, image, nodes
        self.run_options = dict(run_options or {})
        self.id = uuid.uuid4().hex[:8]
        self.prefix = f"ptmg-slurm-{self.id}"
        self.labels = {**labels, CLUSTER_LABEL: self.id}
        self.conf = slurm_conf(nodes, cpus, slurmd_timeout, message_timeout)
        self.names = ["slurmctl", *(f"node{i}" for i in range(1, nodes + 1))]
        self.containers: dict[str, Container] = {}
        self.up_seconds: float | None = None
        self.gateway = ""  # the host's address on the cluster's network, once started

    # --- lifecycle ---
    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self, timeout: float = 120) -> None:
        t0 = time.monotonic()
        try:
            self._start(timeout)
        except BaseException as exc:
            logs = self.logs()
            self.stop()
            raise SlurmClusterError(f"the Slurm cluster did not come up ({exc}):\n{logs}") from None
        self.up_seconds = time.monotonic() - t0

    def _start(self, timeout: float) -> None:
        net, prefix = self._network()
        ips = {name: f"{prefix}.{10 + i}" for i, name in enumerate(self.names)}
        etc = self.client.volumes.create(f"{self.prefix}-etc", labels=self.labels)
        shared = self.client.volumes.create(f"{self.prefix}-shared", labels=self.labels)
        options = dict(self.run_options)
        volumes = {etc.name: {"bind": "/etc/ptmg-slurm", "mode": "ro"}, shared.name: {"bind": SHARED, "mode": "rw"},
                   **options.pop("volumes", {})}
        filler = self.client.containers.create(self.image, entrypoint=["true"], labels=self.labels,
                                               volumes={etc.name: {"bind": "/cfg"}, shared.name: {"bind": SHARED}})
        try:
            filler.put_archive("/cfg", _tar({
                "munge.key": (os.urandom(1024), 0o600, 0),
                "slurm.conf": (self.conf.encode(), 0o644, 0),
                "slurmdbd.conf": (SLURMDBD_CONF.encode(), 0o600, 0),
            }))
            filler.put_archive(SHARED, _tar({"jobs": (None, 0o755, contract.UID),
                                             "runs": (None, 0o755, contract.UID)}))
        finally:
            filler.remove(force=True)
        for name in self.names:
            endpoint = self.client.api.create_endpoint_config(ipv4_address=ips[name], aliases=[name])
            self.containers[name] = self.client.containers.run(
                self.image, ["controller" if name == "slurmctl" else "node"], name=f"{self.prefix}-{name}",
                hostname=name, network=net.name, networking_config={net.name: endpoint},
                extra_hosts=dict(ips), labels=self.labels, shm_size="1g", volumes=volumes, detach=True, **options)
        # wait_until() takes an exception for "not yet": an exited container is returned as a message.
        state = wait_until(self._all_idle, timeout, interval=0.5, what=f"{self.nodes} idle Slurm nodes")
        if state != "idle":
            raise SlurmClusterError(state)

    def _network(self) -> tuple[Network, str]:
        """A network on 10.213.X.0/24 (the first free X of a random sample) and its '10.213.X'."""
        last: Exception | None = None
        for x in random.sample(range(256), 40):
            pool = docker.types.IPAMPool(subnet=f"10.213.{x}.0/24", gateway=f"10.213.{x}.1")
            try:
                net = self.client.networks.create(self.prefix, driver="bridge", labels=self.labels,
                                                  ipam=docker.types.IPAMConfig(pool_configs=[pool]))
            except docker.errors.APIError as exc:  # "Pool overlaps with other one on this address space"
                last = exc
                continue
            self.gateway = f"10.213.{x}.1"
            return net, f"10.213.{x}"
        raise SlurmClusterError(f"no free 10.213.X.0/24 subnet for the cluster's network ({last})")

    def _all_idle(self) -> str | None:
        """'idle' when every node is; a message when a container exited; None: not yet."""
        for c in self.containers.values():
            c.reload()
            if c.status != "running":
                return f"{c.name} exited ({c.attrs['State'].get('ExitCode')})"
        rc, out = self.exec(["sinfo", "-h", "-N", "-o", "%N %T"])
        return "idle" if rc == 0 and out.split().count("idle") == self.nodes else None

    def node_idle(self, node: str) -> bool:
        rc, out = self.exec(["sinfo", "-h", "-n", node, "-o", "%T"])
        return rc == 0 and out.strip() == "idle"

    def leftovers(self) -> list[str]:
        """Containers, networks and volumes of this cluster that still exist."""
        flt = {"label": f"{CLUSTER_LABEL}={self.id}"}
        return ([f"container {c.name}" for c in self.client.containers.list(all=True, filters=flt)]
                + [f"network {n.name}" for n in self.client.networks.list(filters=flt)]
                + [f"volume {v.name}" for v in self.client.volumes.list(filters=flt)])

    def stop(self) -> None:
        """Remove every container, network and volume of this cluster (by its label)."""
        flt = {"label": f"{CLUSTER_LABEL}={self.id}"}
        for c in self.client.containers.list(all=True, filters=flt):
            _quietly(c.remove, force=True, v=True)
        for n in self.client.networks.list(filters=flt):
            _quietly(n.remove)
        for v in self.client.volumes.list(filters=flt):
            _quietly(v.remove, force=True)
        self.containers.clear()

    def logs(self, tail: int = 60) -> str:
        parts = []
        for name, c in self.containers.items():
            try:
                text = c.logs(tail=tail).decode(errors="replace")
            except docker.errors.APIError as exc:
                text = str(exc)
            parts.append(f"--- {name}\n{text}")
        return "\n".join(parts)

    # --- commands ---
    def exec(self, argv: list[str], user: str = "root", node: str = "slurmctl", timeout: int = 30) -> tuple[int, str]:
        r = self.containers[node].exec_run(["timeout", str(timeout), *argv], user=user, workdir=JOBS)
        return int(r.exit_code), r.output.decode(errors="replace")

    def write(self, path: str, text: str, uid: int = contract.UID) -> None:
        """Write a file on the shared volume (e.g. /shared/jobs/x.sbatch), owned by ``uid``."""
        d, name = os.path.split(path)
        self.containers["slurmctl"].put_archive(d, _tar({name: (text.encode(), 0o755, uid)}))

    def read(self, path: str) -> str:
        rc, out = self.exec(["cat", path])
        return out if rc == 0 else ""

    def sbatch(self, script: str, name: str, *options: str, user: str = contract.USER) -> str:
        """Submit ``script`` as ``user`` from /shared/jobs (its --output lands there too)."""
        self.write(f"{JOBS}/{name}", script)
        rc, out = self.exec(["sbatch", "--parsable", *options, name], user=user)
        if rc != 0:
            raise AssertionError(f"sbatch {name} failed ({rc}): {out}")
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o``; {} while slurmctld does not answer (a dying node can stall it)."""
        rc, out = self.exec(["scontrol", "show", "job", "-o", job_id])
        fields: dict[str, str] = {}
        if rc == 0:
            for word in out.split():
                key, sep, value = word.partition("=")
                if sep and key not in fields:
                    fields[key] = value
        return fields

    def wait(self, job_id: str, timeout: float, states: frozenset[str] = FINAL_STATES) -> dict[str, str]:
        def reached() -> dict[str, str]:
            info = self.job(job_id)
            return info if info.get("JobState") in states else {}  # {}: not yet

        return wait_until(reached, timeout, interval=0.5, what=f"Slurm job {job_id} to reach {sorted(states)}")

    def sacct(self, job_id: str) -> dict[str, dict[str, str]]:
        """sacct's rows of the job and its steps, by JobID (``1``, ``1.batch``, ``1.0``)."""
        fields = "JobID,JobName,User,State,ExitCode,Elapsed,Start,End,NodeList"
        _rc, out = self.exec(["sacct", "-j", job_id, "-P", "-n", "-o", fields])
        rows = [dict(zip(fields.split(","), line.split("|"), strict=True)) for line in out.splitlines() if "|" in line]
        return {r["JobID"]: r for r in rows}

    def output(self, job_id: str, job_name: str = "ptmg-ddp") -> str:
        return self.read(f"{JOBS}/{job_name}-{job_id}.out")

    def cancel(self, job_id: str) -> None:
        self.exec(["scancel", job_id])

    def processes(self, node: str, pattern: str) -> str:
        """`pgrep -a -f pattern` on ``node``: what of a job still runs there ('' when nothing)."""
        regex = f"[{pattern[0]}]{pattern[1:]}"  # not matching itself in the command line of `timeout`
        rc, out = self.exec(["pgrep", "-a", "-f", regex], node=node)
        return out.strip() if rc == 0 else ""

    # --- faults ---
    def kill(self, node: str) -> None:
        self.containers[node].kill()

    def restart(self, node: str, timeout: float = 60) -> None:
        self.containers[node].start()
        wait_until(lambda: self.node_idle(node), timeout, interval=0.5, what=f"{node} idle again")


def finish(cluster: SlurmCluster, job: str, timeout: float) -> tuple[dict[str, str], str]:
    """Wait for the job's final state; cancel it when there is none in time."""
    try:
        info = cluster.wait(job, timeout)
    except AssertionError:
        cluster.cancel(job)
        raise AssertionError(f"job {job} did not end in {timeout} s:\n{cluster.output(job)[-4000:]}\n"
                             f"{cluster.logs()}") from None
    text = cluster.output(job)
    print(f"job {job}: JobState={info.get('JobState')} ExitCode={info.get('ExitCode')} Reason={info.get('Reason')} "
          f"RunTime={info.get('RunTime')}\n{text[-3000:]}")  # shown by pytest -rP or on failure
    return info, text
