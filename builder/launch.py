"""Ready-to-submit job definitions for a cell: a Slurm batch script, a Kubeflow PyTorchJob,
a JobSet (+ its headless Service).

Everything here is pure except :func:`cmd_launch` (and the one engine call that reads the
image's digest): ``render_slurm(cfg)`` and ``render_pytorchjob(cfg)`` / ``render_jobset(cfg)``
take a frozen :class:`LaunchConfig` and return text, deterministically.

The Slurm script comes from a Jinja2 template (``launch/sbatch.sh.j2``, StrictUndefined: the
template only loops and guards). The Kubernetes manifests are built as plain data and dumped
with PyYAML: a YAML template would have to get indentation and quoting right by hand, data
can't, and the unit tests check the same data against the Kubernetes client's models.

Every node runs the same torchrun command (``builder.smoke.torchrun_argv``) with a c10d
rendezvous on the first node, so ranks are assigned by the rendezvous; the default script is
the image's own DDP smoke job (``builder.smoke.DDP_JOB`` with ``ddp_job_args()``).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from builder.log import log
from builder.render import template_environment
from builder.smoke import DDP_JOB, RDZV_PORT, ddp_job_args, torchrun_argv

if TYPE_CHECKING:
    from builder.cli import Context

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
LAUNCH_DIR = Path(__file__).resolve().parent.parent / "launch"
TARGETS = ("slurm", "pytorchjob", "jobset")
LAUNCHERS = ("pyxis", "apptainer", "docker")
PROJECT_LABELS: Mapping[str, str] = {"project": "pt-multi-gpu"}
CONTAINER = "pytorch"  # the Kubeflow training operator injects its env into the container of this name
FILENAMES: Mapping[str, str] = {"slurm": "slurm.sbatch", "pytorchjob": "pytorchjob.yaml", "jobset": "jobset.yaml"}
#: Shell words that stay expandable ("${VAR}") when the Slurm node script is written.
RDZV_ENDPOINT_VAR = "${PTMG_RDZV_ENDPOINT}"
RDZV_ID_VAR = "${PTMG_RDZV_ID}"
#: Slurm variables each node's container needs (docker does not pass the environment by itself).
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_NODEID", "SLURM_PROCID", "SLURM_NNODES", "SLURM_JOB_NODELIST")
NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")  # DNS-1035; short enough for JobSet pod names
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MOUNT_RE = re.compile(r"^[A-Za-z0-9_./@+=-]+:/[A-Za-z0-9_./@+=-]*(:(ro|rw))?$")


class LaunchError(ValueError):
    """Flags that can't make a job definition (exit 2)."""


# --- the image reference -----------------------------------------------------------


@dataclass(frozen=True)
class ImagePin:
    """What a job pulls: ``repo@sha256:...`` when a registry digest is known, else the tag."""

    ref: str  # what the job definition names
    tag_ref: str  # the tag it was resolved from
    digest: str | None = None  # sha256:... from RepoDigests
    image_id: str | None = None  # the local image id (not pullable, for the record)

    @property
    def pinned(self) -> bool:
        return self.digest is not None

    @property
    def note(self) -> str:
        if self.digest:
            return f"{self.tag_ref} pinned by digest {self.digest}"
        if self.image_id:
            return (f"{self.tag_ref} (local image id {self.image_id}; not in a registry yet, so not pinned by "
                    "digest: push it with `build.py publish` and run launch again)")
        return f"{self.tag_ref} (not found locally: not pinned by digest)"


def _repository(ref: str) -> str:
    """``host:5000/a/b:tag`` -> ``host:5000/a/b`` (a ':' after the last '/' starts the tag)."""
    ref = ref.split("@", 1)[0]
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    return ref[:colon] if colon > slash else ref


def pin_image(ref: str, attrs: Mapping[str, Any] | None) -> ImagePin:
    """Pin ``ref`` by the digest in ``docker image inspect``'s RepoDigests, when there is one.

    A RepoDigest of the same repository wins; otherwise the first in sorted order (an image
    pushed only to a registry under another name is still that image).
    """
    if attrs is None:
        return ImagePin(ref=ref, tag_ref=ref)
    image_id = str(attrs.get("Id") or "") or None
    digests = sorted(str(d) for d in (attrs.get("RepoDigests") or []) if "@sha256:" in str(d))
    if not digests:
        return ImagePin(ref=ref, tag_ref=ref, image_id=image_id)
    repo = _repository(ref)
    same = [d for d in digests if d.split("@", 1)[0] == repo]
    chosen = (same or digests)[0]
    return ImagePin(ref=chosen, tag_ref=ref, digest=chosen.split("@", 1)[1], image_id=image_id)


def pyxis_image(ref: str) -> str:
    """enroot/pyxis spell a registry host with '#': ``nvcr.io/nvidia/pytorch:24.01`` ->
    ``nvcr.io#nvidia/pytorch:24.01``. A ref without a host (Docker Hub) is unchanged."""
    first, sep, rest = ref.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return f"{first}#{rest}"
    return ref


# --- the configuration ---------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    """Everything a job definition depends on; validated by :meth:`check`."""

    cell: str
    image: ImagePin
    nodes: int
    gpus_per_node: int
    nproc_per_node: int
    name: str = "ptmg-ddp"
    command: tuple[str, ...] = ()  # torchrun's script and its args; () = the image's DDP smoke job
    launcher: str = "pyxis"
    rdzv_port: int = RDZV_PORT
    shm_size: str = "8g"
    nccl_debug: str = "WARN"
    socket_ifname: str | None = None  # NCCL_/GLOO_SOCKET_IFNAME; Kubernetes defaults to eth0
    env: tuple[tuple[str, str], ...] = ()
    mounts: tuple[str, ...] = ()  # SRC:DST[:ro] (Slurm)
    time_limit: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    selftest_init: bool = False
    namespace: str | None = None
    source: str = "images.yaml"
    labels: Mapping[str, str] = field(default_factory=lambda: dict(PROJECT_LABELS))

    def check(self) -> LaunchConfig:
        problems = []
        if self.nodes < 1:
            problems.append("--nodes must be >= 1")
        if self.gpus_per_node < 0:
            problems.append("--gpus-per-node must be >= 0")
        if self.nproc_per_node < 1:
            problems.append("--nproc-per-node must be >= 1 (with --gpus-per-node 0 give it: CPU ranks over gloo)")
        if not NAME_RE.match(self.name):
            problems.append(f"--name {self.name!r}: lower-case letters, digits and '-', starting with a letter, "
                            "at most 40 characters (it becomes DNS names)")
        if self.launcher not in LAUNCHERS:
            problems.append(f"--launcher {self.launcher!r}: one of {', '.join(LAUNCHERS)}")
        if not 1 <= self.rdzv_port <= 65535:
            problems.append("--rdzv-port must be a TCP port")
        if not re.match(r"^[0-9]+[kmgKMG]?$", self.shm_size):
            problems.append(f"--shm-size {self.shm_size!r}: a size such as 8g or 512m")
        problems += [f"--env {k}=...: not a variable name" for k, _ in self.env if not ENV_KEY_RE.match(k)]
        problems += [f"--mount {m!r}: SRC:/DST[:ro|rw], no spaces or quotes" for m in self.mounts
                     if not MOUNT_RE.match(m)]
        if problems:
            raise LaunchError("; ".join(problems))
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def script(self) -> tuple[str, ...]:
        """What torchrun runs on every rank: the user's command, or the image's DDP smoke job."""
        return self.command or (DDP_JOB, *ddp_job_args())

    def env_vars(self, default_ifname: str | None) -> tuple[tuple[str, str], ...]:
        """The distributed-training env of every node; --env entries win."""
        out: dict[str, str] = {"NCCL_DEBUG": self.nccl_debug}
        ifname = self.socket_ifname if self.socket_ifname is not None else default_ifname
        if ifname:
            out["NCCL_SOCKET_IFNAME"] = ifname
            out["GLOO_SOCKET_IFNAME"] = ifname
        # A timed-out NCCL collective aborts the process instead of hanging (both spellings:
        # torch 2.0 reads NCCL_*, newer torch TORCH_NCCL_*).
        out["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
        out["NCCL_ASYNC_ERROR_HANDLING"] = "1"
        out.update(dict(self.env))
        return tuple(out.items())


# --- shell helpers -------------------------------------------------------------------


def shell_word(word: str, expand: Sequence[str] = ()) -> str:
    """One POSIX shell word. Words listed in ``expand`` are double-quoted so their ``${VAR}``
    expands where the line runs; everything else is quoted literally."""
    if word in expand:
        return '"' + re.sub(r'(["\\`])', r"\\\1", word) + '"'
    return shlex.quote(word)


def shell_join(argv: Sequence[str], expand: Sequence[str] = ()) -> str:
    return " ".join(shell_word(w, expand) for w in argv)


# --- Slurm ---------------------------------------------------------------------------


def slurm_torchrun(cfg: LaunchConfig) -> str:
    """The torchrun line each node runs (its rendezvous endpoint and id expand on the node)."""
    script = cfg.script()
    argv = torchrun_argv(nnodes=cfg.nodes, nproc_per_node=cfg.nproc_per_node, script=script[0],
                         script_args=script[1:], rdzv_endpoint=RDZV_ENDPOINT_VAR, rdzv_id=RDZV_ID_VAR)
    launcher, job = argv[: len(argv) - len(script)], argv[len(argv) - len(script):]
    expand = (RDZV_ENDPOINT_VAR, RDZV_ID_VAR)
    return f"{shell_join(launcher, expand)} \\\n    {shell_join(job)}"


def render_slurm(cfg: LaunchConfig) -> str:
    """An sbatch script for ``cfg`` (see launch/sbatch.sh.j2)."""
    cfg.check()
    extra = [f"--time={cfg.time_limit}"]
    if cfg.gpus_per_node:
        extra.append(f"--gpus-per-node={cfg.gpus_per_node}")
    if cfg.partition:
        extra.append(f"--partition={cfg.partition}")
    if cfg.account:
        extra.append(f"--account={cfg.account}")
    env = cfg.env_vars(default_ifname=None)
    image = pyxis_image(cfg.image.ref) if cfg.launcher == "pyxis" else cfg.image.ref
    passed = (*SLURM_VARS, "PTMG_RDZV_ENDPOINT", "PTMG_RDZV_ID", "PTMG_NODE_SCRIPT", *(k for k, _ in env))
    return template_environment(LAUNCH_DIR).get_template("sbatch.sh.j2").render(
        source=cfg.source,
        cell=cfg.cell,
        pin=cfg.image,
        filename=FILENAMES["slurm"],
        name=cfg.name,
        nodes=cfg.nodes,
        nproc_per_node=cfg.nproc_per_node,
        gpus_per_node=cfg.gpus_per_node,
        sbatch_extra=extra,
        image_q=shlex.quote(image),
        rdzv_port=cfg.rdzv_port,
        env=[(k, shlex.quote(v)) for k, v in env],
        torchrun=slurm_torchrun(cfg),
        launcher=cfg.launcher,
        mounts=list(cfg.mounts),
        pyxis_mounts=",".join(cfg.mounts),
        shm_size=cfg.shm_size,
        docker_env=" ".join(f"-e {k}" for k in passed),
    )


# --- Kubernetes ----------------------------------------------------------------------


def _meta(cfg: LaunchConfig, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if cfg.namespace:
        meta["namespace"] = cfg.namespace
    meta["labels"] = {**cfg.labels, "io.pt-multi-gpu.cell": cfg.cell}
    annotations = {"io.pt-multi-gpu.image": cfg.image.tag_ref}
    if cfg.image.image_id:
        annotations["io.pt-multi-gpu.image-id"] = cfg.image.image_id
    meta["annotations"] = annotations
    return meta


def _gpu_resources(cfg: LaunchConfig) -> dict[str, Any]:
    if not cfg.gpus_per_node:
        return {}
    return {"resources": {"limits": {"nvidia.com/gpu": cfg.gpus_per_node}}}


def pod_spec(cfg: LaunchConfig, args: Sequence[str], extra_env: Sequence[Mapping[str, Any]] = (),
             ports: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The pod every node runs: the image's entrypoint (tini; the command runs as ``pt``) with
    torchrun as its arguments, GPU limits, a memory-backed /dev/shm, the NCCL env."""
    env = [{"name": k, "value": v} for k, v in cfg.env_vars(default_ifname="eth0")] + [dict(e) for e in extra_env]
    shm_mount = [{"name": "dshm", "mountPath": "/dev/shm"}]
    main: dict[str, Any] = {
        "name": CONTAINER,
        "image": cfg.image.ref,
        "imagePullPolicy": "IfNotPresent",
        # `args`, not `command`: the image's ENTRYPOINT (tini + start.sh) stays, drops to `pt`
        # and passes the exit status through.
        "args": list(args),
        "env": env,
        **_gpu_resources(cfg),
        "volumeMounts": shm_mount,
    }
    if ports:
        main["ports"] = [dict(p) for p in ports]
    spec: dict[str, Any] = {"restartPolicy": "Never"}
    if cfg.selftest_init:
        selftest_args = ["selftest", "--nproc", str(cfg.nproc_per_node)]
        if cfg.gpus_per_node:
            selftest_args.append("--require-gpu")
        spec["initContainers"] = [{
            "name": "selftest",
            "image": cfg.image.ref,
            "imagePullPolicy": "IfNotPresent",
            "args": selftest_args,
            **_gpu_resources(cfg),
            "volumeMounts": shm_mount,
        }]
    spec["containers"] = [main]
    # NCCL and DataLoader workers need more shared memory than the runtime's 64 MB default.
    spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": _k8s_quantity(cfg.shm_size)}}]
    return spec


def _k8s_quantity(size: str) -> str:
    """Docker-style 8g -> Kubernetes 8Gi."""
    m = re.match(r"^([0-9]+)([kmgKMG]?)$", size)
    if not m:
        raise LaunchError(f"not a size: {size!r}")
    unit = {"": "", "k": "Ki", "m": "Mi", "g": "Gi"}[m.group(2).lower()]
    return f"{m.group(1)}{unit}"


def pytorchjob(cfg: LaunchConfig) -> dict[str, Any]:
    """A Kubeflow PyTorchJob (kubeflow.org/v1): one Master, nodes-1 Workers.

    The training operator gives every replica PET_MASTER_ADDR/PET_MASTER_PORT (the Master's
    service) and creates that service. torchrun meets there with the c10d rendezvous; Kubernetes
    expands ``$(PET_MASTER_ADDR)`` in args from the container's env.
    """
    cfg.check()
    argv = torchrun_argv(nnodes=cfg.nodes, nproc_per_node=cfg.nproc_per_node, script=cfg.script()[0],
                         script_args=cfg.script()[1:], rdzv_endpoint="$(PET_MASTER_ADDR):$(PET_MASTER_PORT)",
                         rdzv_id=cfg.name)
    ports = [{"name": "pytorchjob-port", "containerPort": cfg.rdzv_port, "protocol": "TCP"}]
    template = {"metadata": {"labels": {**cfg.labels, "io.pt-multi-gpu.cell": cfg.cell}},
                "spec": pod_spec(cfg, argv, ports=ports)}
    replicas: dict[str, Any] = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
    if cfg.nodes > 1:
        replicas["Worker"] = {"replicas": cfg.nodes - 1, "restartPolicy": "Never", "template": template}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _meta(cfg, cfg.name),
        "spec": {
            "nprocPerNode": str(cfg.nproc_per_node),
            # One failed rank fails the job; no restarts (torchrun --max_restarts 0 as well).
            "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": replicas,
        },
    }


JOBSET_REPLICATED_JOB = "node"


def jobset(cfg: LaunchConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """A headless Service and a JobSet (jobset.x-k8s.io/v1alpha2) of one Indexed Job with
    ``nodes`` pods. Pod ``i`` is ``NAME-node-0-i.NAME``; the rendezvous is pod 0."""
    cfg.check()
    endpoint = f"{cfg.name}-{JOBSET_REPLICATED_JOB}-0-0.{cfg.name}:{cfg.rdzv_port}"
    argv = torchrun_argv(nnodes=cfg.nodes, nproc_per_node=cfg.nproc_per_node, script=cfg.script()[0],
                         script_args=cfg.script()[1:], rdzv_endpoint=endpoint, rdzv_id=cfg.name)
    node_rank = {"name": "NODE_RANK", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}
    ports = [{"name": "rdzv", "containerPort": cfg.rdzv_port, "protocol": "TCP"}]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(cfg, cfg.name),
        "spec": {
            "clusterIP": "None",  # headless: one DNS record per pod
            "publishNotReadyAddresses": True,  # pods resolve before they are Ready (the rendezvous needs it)
            "selector": {"jobset.sigs.k8s.io/jobset-name": cfg.name},
            "ports": [{"name": "rdzv", "port": cfg.rdzv_port, "targetPort": cfg.rdzv_port, "protocol": "TCP"}],
        },
    }
    job_spec = {
        "parallelism": cfg.nodes,
        "completions": cfg.nodes,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "template": {"metadata": {"labels": {**cfg.labels, "io.pt-multi-gpu.cell": cfg.cell}},
                     "spec": pod_spec(cfg, argv, extra_env=[node_rank], ports=ports)},
    }
    js = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": _meta(cfg, cfg.name),
        "spec": {
            # The Service above is this subdomain; JobSet uses it instead of making its own.
            "network": {"enableDNSHostnames": True, "subdomain": cfg.name, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": 0},
            "successPolicy": {"operator": "All"},
            "replicatedJobs": [{"name": JOBSET_REPLICATED_JOB, "replicas": 1, "template": {"spec": job_spec}}],
        },
    }
    return service, js


def _yaml_header(cfg: LaunchConfig, target: str, submit: str) -> str:
    return (f"# GENERATED by `build.py launch --target {target}` from {cfg.source} (cell {cfg.cell}); "
            "edit the flags, not this file.\n"
            f"# Image: {cfg.image.note}\n"
            f"# {cfg.nodes} node(s) x {cfg.nproc_per_node} rank(s); submit: {submit}\n")


class _Dumper(yaml.SafeDumper):
    """No ``&id001`` anchors for values used twice: kubectl reads them, people shouldn't have to."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _dump(docs: Sequence[Mapping[str, Any]]) -> str:
    return "---\n".join(yaml.dump(dict(d), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
                        for d in docs)


def render_pytorchjob(cfg: LaunchConfig) -> str:
    return _yaml_header(cfg, "pytorchjob", f"kubectl apply -f {FILENAMES['pytorchjob']}") + _dump([pytorchjob(cfg)])


def render_jobset(cfg: LaunchConfig) -> str:
    return _yaml_header(cfg, "jobset", f"kubectl apply -f {FILENAMES['jobset']}") + _dump(list(jobset(cfg)))


def render(target: str, cfg: LaunchConfig) -> str:
    if target == "slurm":
        return render_slurm(cfg)
    if target == "pytorchjob":
        return render_pytorchjob(cfg)
    if target == "jobset":
        return render_jobset(cfg)
    raise LaunchError(f"--target {target!r}: one of {', '.join(TARGETS)}")


# --- the verb --------------------------------------------------------------------------


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, choices=TARGETS,
                   help="slurm: an sbatch script; pytorchjob: a Kubeflow PyTorchJob; "
                        "jobset: a JobSet + its headless Service")
    p.add_argument("--nodes", type=int, default=1, help="nodes (Slurm nodes, pods) (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8; 0: CPU ranks over gloo)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks per node (default: --gpus-per-node; required with --gpus-per-node 0)")
    p.add_argument("--command", default=None, metavar="'SCRIPT ARGS'",
                   help="what torchrun runs on every rank, in shell words (default: the image's DDP smoke job, "
                        f"{DDP_JOB})")
    p.add_argument("--launcher", choices=LAUNCHERS, default="pyxis",
                   help="Slurm: how each node runs the image: pyxis (srun --container-image), apptainer "
                        "(apptainer exec docker://...) or docker (docker run --network host) (default pyxis)")
    p.add_argument("--name", default="ptmg-ddp", help="job name (DNS-1035, at most 40 characters; default ptmg-ddp)")
    p.add_argument("--image", default=None, metavar="REF",
                   help="the image to run (default: the cell's tag; pinned by its registry digest when the "
                        "local engine knows one)")
    p.add_argument("--no-pin", action="store_true", help="don't ask the Docker engine for a digest; name the tag")
    p.add_argument("--rdzv-port", type=int, default=RDZV_PORT, help=f"c10d rendezvous port (default {RDZV_PORT})")
    p.add_argument("--shm-size", default="8g", help="/dev/shm per node (docker --shm-size; k8s emptyDir) (default 8g)")
    p.add_argument("--nccl-debug", default="WARN", help="NCCL_DEBUG (default WARN; INFO to debug a hang)")
    p.add_argument("--socket-ifname", default=None,
                   help="NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME (default: eth0 on Kubernetes, unset on Slurm)")
    p.add_argument("--env", action="append", default=[], type=_env_pair, metavar="KEY=VALUE",
                   help="extra environment for every node (repeatable)")
    p.add_argument("--mount", action="append", default=[], metavar="SRC:DST[:ro]",
                   help="Slurm: bind-mount a host path into the container (repeatable)")
    p.add_argument("--time", default="01:00:00", help="Slurm: --time limit (default 01:00:00)")
    p.add_argument("--partition", default=None, help="Slurm: --partition")
    p.add_argument("--account", default=None, help="Slurm: --account")
    p.add_argument("--namespace", default=None, help="Kubernetes: metadata.namespace")
    p.add_argument("--selftest-init", action="store_true",
                   help="Kubernetes: run the image's selftest as an initContainer first")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="write DIR/<cell>/<file> (needed when several cells are selected); default: stdout")


def _pin(ref: str, no_pin: bool) -> ImagePin:
    if no_pin:
        return ImagePin(ref=ref, tag_ref=ref)
    try:
        from builder.engine import Engine

        attrs = Engine().image_attrs(ref)
    except Exception as exc:  # no engine here: still render, by tag
        log.warning("can't ask the Docker engine for %s's digest (%s); naming the tag", ref, exc)
        return ImagePin(ref=ref, tag_ref=ref)
    return pin_image(ref, attrs)


def cmd_launch(ctx: Context) -> int:
    """Write ready-to-submit job definitions for the selected cell(s): a Slurm sbatch script, a
    Kubeflow PyTorchJob or a JobSet, pinned to the image's digest when one is known."""
    a = ctx.args
    if not ctx.cells:
        log.error("no cell selected (check --only/--exclude; `build.py matrix` lists them)")
        return EXIT_INVALID
    if a.out is None and len(ctx.cells) > 1:
        log.error("%d cells selected: choose one with --only CELL, or give --out DIR", len(ctx.cells))
        return EXIT_INVALID
    nproc = a.nproc_per_node if a.nproc_per_node is not None else a.gpus_per_node
    try:
        command = tuple(shlex.split(a.command)) if a.command else ()
    except ValueError as exc:
        log.error("--command: %s", exc)
        return EXIT_INVALID
    written: list[dict[str, Any]] = []
    for cell in ctx.cells:
        ref = a.image or cell.ref
        try:
            cfg = LaunchConfig(
                cell=cell.name, image=_pin(ref, a.no_pin or a.dry_run), nodes=a.nodes, gpus_per_node=a.gpus_per_node,
                nproc_per_node=nproc, name=a.name, command=command, launcher=a.launcher, rdzv_port=a.rdzv_port,
                shm_size=a.shm_size, nccl_debug=a.nccl_debug, socket_ifname=a.socket_ifname, env=tuple(a.env),
                mounts=tuple(a.mount), time_limit=a.time, partition=a.partition, account=a.account,
                selftest_init=a.selftest_init, namespace=a.namespace, source=ctx.config_display,
            ).check()
            text = render(a.target, cfg)
        except LaunchError as exc:
            log.error("%s", exc)
            return EXIT_INVALID
        if not cfg.image.pinned:
            log.warning("%s: %s", cell.name, cfg.image.note)
        entry = {"cell": cell.name, "target": a.target, "image": cfg.image.ref, "digest": cfg.image.digest,
                 "image_id": cfg.image.image_id, "path": None}
        if a.out is None or a.dry_run:
            if a.out is not None:
                log.info("would write %s", a.out / cell.name / FILENAMES[a.target])
            elif not a.json:
                print(text, end="")
        else:
            path = a.out / cell.name / FILENAMES[a.target]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            if a.target == "slurm":
                path.chmod(0o755)
            log.info("wrote %s", path)
            entry["path"] = str(path)
        written.append(entry)
    if a.json:
        print(json.dumps(written, indent=2))
    return EXIT_OK


cmd_launch.add_arguments = add_arguments  # type: ignore[attr-defined]
