"""What a job definition depends on: the image (pinned by digest) and the validated flags."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import ptmg_contract as contract
from builder.common.errors import InputError
from builder.smoke.torchrun import IN_CONTAINER_OUT, ddp_job_args

TARGETS = ("slurm", "pytorchjob", "jobset")
LAUNCHERS = ("pyxis", "apptainer", "docker", "native", "charliecloud")
#: What --image-file each launcher runs (pyxis/enroot and ch-run: a squashfs; Apptainer: a SIF).
IMAGE_FILE_SUFFIXES: Mapping[str, tuple[str, ...]] = {
    "pyxis": (".sqsh", ".squashfs"), "apptainer": (".sif",), "charliecloud": (".sqsh", ".squashfs")}
IMAGE_FILE_RE = re.compile(r"^/[A-Za-z0-9_./@+=-]+$")
#: How long every node waits at the rendezvous for the others (torchrun's join_timeout, and the
#: c10d store's read_timeout: a node up before the first one retries its connection that long):
#: node start-up skews by minutes when every node pulls or unpacks a multi-GB image.
JOIN_TIMEOUT_S = 600
#: Slurm's rendezvous port when --rdzv-port is not given: RDZV_PORT_BASE + job id % RDZV_PORT_SPAN,
#: so two jobs sharing a node rarely meet on one port; below Linux's ephemeral ports (32768-60999),
#: which the kernel hands to outgoing connections.
RDZV_PORT_BASE = 20000
RDZV_PORT_SPAN = 10000
#: Slurm's defaults for what each node's task may use: cores per rank (a GPU rank with its
#: DataLoader workers; a CPU rank is one core) and memory per rank, besides /dev/shm.
CPUS_PER_GPU_RANK = 4
MEM_PER_GPU_RANK_G = 16
MEM_PER_CPU_RANK_G = 2
#: What enroot's Mellanox hook needs to bring the node's InfiniBand devices in (pyxis, --rdma).
ENROOT_RDMA_ENV = (("MELLANOX_VISIBLE_DEVICES", "all"),)
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
#: Where the image's DDP job writes its record on a Slurm node (one folder per job: jobs may share a
#: node's /tmp), and the job's directory next to its output file, where the record is copied to.
RESULT_TMP_VAR = "${PTMG_RESULT_TMP}"
#: Slurm variables each node's container needs (docker does not pass the environment by itself).
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_NODEID", "SLURM_PROCID", "SLURM_NNODES", "SLURM_JOB_NODELIST")
NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")  # DNS-1035; short enough for JobSet pod names
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MEM_RE = re.compile(r"^([0-9]+)([KMGT]?)$")  # sbatch --mem: 0 = all of the node's memory
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
    """Everything a job definition depends on, checked when it is made (a bad flag: LaunchError, exit 2);
    the renderers take it as it is, and what is derived from it (the script, the sizes) is computed once."""

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
    rdzv_port: int | None = None  # None: Slurm derives it from the job id, Kubernetes uses contract.RDZV_PORT
    shm_size: str = contract.SHM_SIZE
    nccl_debug: str = "WARN"
    socket_ifname: str | None = None  # NCCL_/GLOO_SOCKET_IFNAME; Kubernetes defaults to eth0
    env: tuple[tuple[str, str], ...] = ()
    mounts: tuple[str, ...] = ()  # SRC:DST[:ro] (Slurm)
    time_limit: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    #: Slurm: cores for each node's task (None: CPUS_PER_GPU_RANK per GPU rank, 1 per CPU rank)
    cpus_per_task: int | None = None
    #: Slurm: memory per node, sbatch's spelling (None: MEM_PER_*_RANK_G per rank + /dev/shm; "0" = all)
    mem: str | None = None
    exclusive: bool = False  # Slurm: whole nodes (every core, --mem=0 unless --mem is given)
    rdma: bool = False  # Slurm: NCCL over the nodes' InfiniBand/RoCE (pyxis: enroot's Mellanox hook)
    selftest_init: bool = False
    #: Kubernetes: RDMA device-plugin resources per pod (name, count); non-empty adds IPC_LOCK too.
    rdma_resources: tuple[tuple[str, int], ...] = ()
    namespace: str | None = None
    #: Kubernetes: the nodes' architecture (kubernetes.io/arch: amd64, arm64): a cell is one platform,
    #: and an image pinned by digest runs only there. "" = any node.
    arch: str = ""
    source: str = "images.yaml"
    labels: Mapping[str, str] = field(default_factory=contract.project_labels)

    def __post_init__(self) -> None:
        """Checked once, here: every LaunchConfig that exists is one a renderer can take."""
        problems = self._problems()
        if problems:
            raise LaunchError(*problems)

    def _problems(self) -> list[str]:
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
        if self.rdzv_port is not None and not 1 <= self.rdzv_port <= 65535:
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
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            problems.append("--cpus-per-task must be >= 1")
        if self.mem is not None and not MEM_RE.match(self.mem):
            problems.append(f"--mem {self.mem!r}: sbatch's size, e.g. 64G or 512000M (0: all of the node's memory)")
        return problems

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

    def ddp_job(self, out: str = IN_CONTAINER_OUT) -> tuple[str, ...]:
        """The image's DDP smoke job, writing its record (result.json, tb/) to ``out``."""
        backend = ("--backend", "nccl" if self.gpus_per_node else "gloo")  # a GPU job never falls back to gloo
        return (contract.DDP_JOB, *ddp_job_args(out=out, extra=backend))

    @cached_property
    def script(self) -> tuple[str, ...]:
        """What torchrun runs on every rank: the user's command, or the image's DDP smoke job."""
        return self.command or self.ddp_job()

    @cached_property
    def shm_bytes(self) -> int:
        """--shm-size in bytes (docker's units: k, m, g are powers of 1024)."""
        m = re.match(r"^([0-9]+)([kmgKMG]?)$", self.shm_size)
        assert m is not None  # checked in __post_init__
        power: int = " kmg".index(m.group(2).lower() or " ")
        return int(m.group(1)) * int(1024**power)

    @cached_property
    def node_cpus(self) -> int:
        """Cores for each node's ranks (sbatch --cpus-per-task; the pod's cpu request)."""
        if self.cpus_per_task is not None:
            return self.cpus_per_task
        return self.nproc_per_node * (CPUS_PER_GPU_RANK if self.gpus_per_node else 1)

    @cached_property
    def node_mem_mib(self) -> int:
        """Memory for each node's ranks in MiB (0: all of the node's): --mem, all with --exclusive, else
        a size per rank plus /dev/shm (a memory-backed tmpfs: what the ranks put there counts)."""
        if self.mem is not None:
            m = MEM_RE.match(self.mem)
            assert m is not None  # checked in __post_init__
            kib = int(m.group(1)) * {"K": 1, "": 1024, "M": 1024, "G": 1024**2, "T": 1024**3}[m.group(2)]
            return -(-kib // 1024)
        if self.exclusive:
            return 0
        per_rank = MEM_PER_GPU_RANK_G if self.gpus_per_node else MEM_PER_CPU_RANK_G
        return self.nproc_per_node * per_rank * 1024 + -(-self.shm_bytes // 1024**2)

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


