"""What a job definition depends on: the image (pinned by digest) and the validated flags."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ptmg_contract as contract
from builder.common.errors import InputError
from builder.smoke.torchrun import ddp_job_args

TARGETS = ("slurm", "pytorchjob", "jobset")
LAUNCHERS = ("pyxis", "apptainer", "docker", "native", "charliecloud")
#: What --image-file each launcher runs (pyxis/enroot and ch-run: a squashfs; Apptainer: a SIF).
IMAGE_FILE_SUFFIXES: Mapping[str, tuple[str, ...]] = {
    "pyxis": (".sqsh", ".squashfs"), "apptainer": (".sif",), "charliecloud": (".sqsh", ".squashfs")}
IMAGE_FILE_RE = re.compile(r"^/[A-Za-z0-9_./@+=-]+$")
#: How long every node waits at the rendezvous for the others (torchrun's join_timeout): node
#: start-up skews by minutes when every node pulls or unpacks a multi-GB image.
JOIN_TIMEOUT_S = 600
#: What Apptainer's --nv binds the host's driver libraries to (it puts them on LD_LIBRARY_PATH
#: only; Triton links its launcher with -lcuda, which reads LIBRARY_PATH).
APPTAINER_LIBS = "/.singularity.d/libs"
#: What enroot's GPU hook needs to inject the driver and devices (pyxis: in the job, not in the image).
ENROOT_GPU_ENV = (("NVIDIA_VISIBLE_DEVICES", "all"), ("NVIDIA_DRIVER_CAPABILITIES", "compute,utility"))
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
#: A Kubernetes extended resource (a device plugin's), e.g. rdma/rdma_shared_device_a or vpc.amazonaws.com/efa.
RESOURCE_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class LaunchError(InputError):
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


def resolve_image_file(text: str) -> str:
    """``--image-file``: the absolute path of an existing file (the job names it on every node)."""
    path = Path(text).expanduser()
    try:
        path = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        why = "no such file" if isinstance(exc, FileNotFoundError) else str(exc)
        raise LaunchError(f"--image-file {text}: {why}; export one with `build.py export CELL --format "
                          "sqsh|sif -o PATH`") from None
    if not path.is_file():
        raise LaunchError(f"--image-file {text}: not a file ({path})")
    return str(path)


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
    image_file: str = ""  # Slurm: an exported image file (absolute path) instead of the registry image
    torch: str = ""  # the cell's torch version: what a native node must have when it lacks the cell file
    rdzv_port: int = contract.RDZV_PORT
    shm_size: str = contract.SHM_SIZE
    nccl_debug: str = "WARN"
    socket_ifname: str | None = None  # NCCL_/GLOO_SOCKET_IFNAME; Kubernetes defaults to eth0
    env: tuple[tuple[str, str], ...] = ()
    mounts: tuple[str, ...] = ()  # SRC:DST[:ro] (Slurm)
    time_limit: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    selftest_init: bool = False
    #: Kubernetes: RDMA device-plugin resources per pod (name, count); non-empty adds IPC_LOCK too.
    rdma_resources: tuple[tuple[str, int], ...] = ()
    namespace: str | None = None
    #: Kubernetes: the nodes' architecture (kubernetes.io/arch: amd64, arm64): a cell is one platform,
    #: and an image pinned by digest runs only there. "" = any node.
    arch: str = ""
    source: str = "images.yaml"
    labels: Mapping[str, str] = field(default_factory=contract.project_labels)

    def check(self) -> LaunchConfig:
        problems = []
        if self.nodes < 1:
            problems.append("--nodes must be >= 1")
        if self.gpus_per_node < 0:
            problems.append("--gpus-per-node must be >= 0")
        if self.nproc_per_node < 1:
            problems.append("--nproc-per-node must be >= 1 (with --gpus-per-node 0 give it: CPU ranks over gloo)")
        elif self.gpus_per_node and self.nproc_per_node > self.gpus_per_node:
            problems.append(f"--nproc-per-node {self.nproc_per_node} > --gpus-per-node {self.gpus_per_node}: NCCL "
                            "needs one GPU per rank (default: one rank per GPU; ask for fewer, not more)")
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
        problems += [f"--rdma-resource {name}={count}: NAME=COUNT with a device plugin's resource name "
                     "(e.g. rdma/rdma_shared_device_a=1, vpc.amazonaws.com/efa=4) and a count >= 1"
                     for name, count in self.rdma_resources if not RESOURCE_RE.match(name) or count < 1]
        problems += self._image_file_problems()
        if self.launcher == "native" and self.mounts:
            problems.append(f"--mount {self.mounts[0]!r}: --launcher native runs no container, so there is nothing "
                            "to mount into; mount it on the nodes, or use --launcher pyxis, apptainer or docker")
        if problems:
            raise LaunchError(*problems)
        return self

    def _image_file_problems(self) -> list[str]:
        problems = []
        path, launcher = self.image_file, self.launcher
        if launcher == "charliecloud":
            if not path:
                problems.append("--launcher charliecloud runs an exported squashfs: give --image-file PATH.sqsh "
                                "(`build.py export CELL --format sqsh`)")
            if self.gpus_per_node:
                problems.append(
                    f"--launcher charliecloud with --gpus-per-node {self.gpus_per_node}: ch-run injects no GPU "
                    "driver into a squashfs image (it has no GPU hook; the host's libcuda must be copied into an "
                    "unpacked image with `ch-fromhost --nvidia`, which a read-only squashfs can't take). Run GPU "
                    "jobs with --launcher pyxis or apptainer, or CPU ranks here with --gpus-per-node 0")
            problems += [f"--mount {m!r}: ch-run's --bind has no mode; give SRC:DST" for m in self.mounts
                         if m.count(":") > 1]
        if not path:
            return problems
        suffixes = IMAGE_FILE_SUFFIXES.get(launcher)
        if suffixes is None:
            problems.append(f"--image-file {path}: --launcher {launcher} runs no image file; use --launcher "
                            "pyxis or charliecloud (a .sqsh) or apptainer (a .sif)")
        elif not path.endswith(suffixes):
            problems.append(f"--image-file {path}: --launcher {launcher} runs a {' or '.join(suffixes)} file "
                            f"(`build.py export CELL --format {'sif' if launcher == 'apptainer' else 'sqsh'}`)")
        if not IMAGE_FILE_RE.match(path):
            problems.append(f"--image-file {path!r}: an absolute path of letters, digits and ._/@+=- (every "
                            "node opens it by this path)")
        return problems

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def script(self) -> tuple[str, ...]:
        """What torchrun runs on every rank: the user's command, or the image's DDP smoke job."""
        backend = ("--backend", "nccl" if self.gpus_per_node else "gloo")  # a GPU job never falls back to gloo
        return self.command or (contract.DDP_JOB, *ddp_job_args(extra=backend))

    def env_vars(self, default_ifname: str | None) -> tuple[tuple[str, str], ...]:
        """The distributed-training env of every node; --env entries win."""
        out: dict[str, str] = {"NCCL_DEBUG": self.nccl_debug}
        ifname = self.socket_ifname if self.socket_ifname is not None else default_ifname
        if ifname:
            out["NCCL_SOCKET_IFNAME"] = ifname
            out["GLOO_SOCKET_IFNAME"] = ifname
        # A timed-out NCCL collective aborts the process instead of hanging (both spellings:
        # torch 2.0 reads NCCL_*, newer torch TORCH_NCCL_*).
        out.update(contract.NCCL_ASYNC_ENV)
        out.update(dict(self.env))
        return tuple(out.items())


