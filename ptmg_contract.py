"""The image contract: every literal that describes a pt-multi-gpu image, written once.

Imported by the builder on the host (``builder/``), and inside every image by the
entrypoint (``/opt/pt-multi-gpu/entrypoint``) and the smoke tests
(``/opt/pt-multi-gpu/smoke_tests``), which find it at ``/opt/pt-multi-gpu/ptmg_contract.py``.
``compose.yaml`` and ``.devcontainer/devcontainer.json`` are generated from it
(``build.py render``). Change a value here, run ``make render``, rebuild.

Standard library only, no side effects, and no syntax newer than Python 3.8: it runs
under the host's Python and under every image's Python.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

PROJECT = "pt-multi-gpu"

# --- labels -----------------------------------------------------------------------
#: Every container, network, volume and image the project makes carries this label.
PROJECT_LABEL: tuple[str, str] = ("project", PROJECT)
LABEL_NS = "io.pt-multi-gpu"


def label(name: str) -> str:
    """``label("torch")`` -> ``"io.pt-multi-gpu.torch"``."""
    return f"{LABEL_NS}.{name}"


LABEL_CELL = label("cell")
LABEL_FLAVOUR = label("flavour")
LABEL_PLATFORM = label("platform")
LABEL_INPUTS_HASH = label("inputs-hash")
LABEL_BUILDER = label("builder")
LABEL_BASE_MADE_BY = label("base.made-by")
LABEL_BASE_CREATED = label("base.created")
LABEL_SMOKE = label("smoke")
LABEL_NODE = label("node")
LABEL_SLURM_JOB = label("slurm-job")
OCI_CREATED = "org.opencontainers.image.created"
OCI_REVISION = "org.opencontainers.image.revision"

# --- the OS patch level -----------------------------------------------------------
#: The base's apt suites, space-separated (`build.py base` writes it on a bootstrapped base).
LABEL_BASE_APT_SUITES = label("base.apt-suites")
#: The archive state the OS layer's `apt-get upgrade` applied: the newest Release date of the suites apt
#: read (UTC, ISO 8601), read from OS_PATCH_FILE. Not the build's clock: one snapshot, one value.
LABEL_OS_UPDATED = label("os.updated")
#: The suites apt saw then, with their Release dates: "bookworm@2026-07-11T10:16:37Z ...".
LABEL_OS_SUITES = label("os.suites")
#: The host's key for that state of the archive (the OS layer's cache key, OS_SNAPSHOT_ARG).
LABEL_OS_SNAPSHOT = label("os.snapshot")
#: sha256 of the installed Debian packages (name, version, arch) and of the venv's distributions.
LABEL_OS_PACKAGES = label("os.packages")
LABEL_VENV_PACKAGES = label("venv.packages")
#: sha256 of the recipe alone (Dockerfile and copied files, not the base's image id): with the two
#: package hashes, what publish compares with the image a floating tag already holds.
LABEL_RECIPE_HASH = label("recipe-hash")
#: The build arg that carries the snapshot key into the OS layer's RUN (BuildKit keys its cache on it).
OS_SNAPSHOT_ARG = "PTMG_OS_SNAPSHOT"
#: Where the image's SBOM is (CycloneDX JSON: every Debian package and Python distribution).
LABEL_SBOM = label("sbom")

# --- paths in the image -----------------------------------------------------------
PREFIX = "/opt/pt-multi-gpu"
CONTRACT_FILE = f"{PREFIX}/ptmg_contract.py"
#: The cell's name, one line. A Slurm node that runs the image's software directly (`build.py
#: launch --launcher native`) must have it, with the job's cell, before the job runs there.
CELL_FILE = f"{PREFIX}/cell"
#: The OS patch level, written by the OS layer's RUN (imagebuild/os-patch-level.sh): `key: value`
#: lines (updated, snapshot, suite), root's; the build reads it into the io.pt-multi-gpu.os.* labels.
OS_PATCH_FILE = f"{PREFIX}/os-patch-level"
#: The SBOM, written at build time from inside the image (imagebuild/sbom.py): CycloneDX 1.5 JSON
#: listing every Debian package and every Python distribution (name, version, purl, the lock's sha256,
#: license where the metadata says) and the image's torch/CUDA/cuDNN/NCCL. Root's, 0644.
SBOM_FILE = f"{PREFIX}/sbom.cdx.json"
ENTRYPOINT_DIR = f"{PREFIX}/entrypoint"
SMOKE_DIR = f"{PREFIX}/smoke_tests"
START_SCRIPT = f"{ENTRYPOINT_DIR}/start.sh"
HEALTHCHECK = f"{ENTRYPOINT_DIR}/healthcheck"
SELFTEST = f"{SMOKE_DIR}/selftest"
DDP_JOB = f"{SMOKE_DIR}/ddp_job.py"
VENV = "/opt/venv"
VENV_PYTHON = f"{VENV}/bin/python"
#: NVIDIA's CUDA wheels (the lock's nvidia-* distributions), unpacked here as the image's FIRST layer,
#: below the base's files (docs/image-layout.md, "Layers"): the bottom layer's chain ID is its diff ID,
#: so every cell with the same CUDA wheels shares it on a node, whatever its base or Python. The venv's
#: site-packages holds a relative link to each of its entries (nvidia/, nvidia_*.dist-info/, ...), so
#: torch's RPATHs ($ORIGIN/../../nvidia/*/lib) and importlib.metadata find them where they always were.
#: pt's, group users, g+w, setgid folders: like the venv (the root boundary).
CUDA_WHEELS = "/opt/cuda-wheels"
#: Of the lock's torch set, the files that are the same bytes in the wheels of every Python (torch/lib but
#: libtorch_python.so and libtorch_cpu.so, Triton's backends), as the image's second layer: the venv's
#: copies of them are relative links here (imagebuild/shared-tree.sh), so cells of one torch set and
#: several Pythons share them on a node. pt's, group users, like the venv.
TORCH_FILES = "/opt/torch-files"
WORKDIR = "/workspace"
STATE_DIR = "/run/pt-multi-gpu"
SSH_HOST_KEY_DIR = "/var/lib/pt-multi-gpu/ssh-host-keys"
SECRETS_DIR = "/run/secrets"
TINI = "/usr/bin/tini"
#: A linker script `libcuda.so` (INPUT(-l:libcuda.so.1)): Triton releases that link their launcher
#: with -lcuda (3.3, torch 2.7) find through it the libcuda.so.1 that the NVIDIA Container Toolkit
#: injects (it does not always inject the unversioned libcuda.so). TRITON_LIBCUDA_PATH points here.
LIBCUDA_LINK_DIR = f"{PREFIX}/libcuda"
#: devel flavour: the CUDA toolkit from NVIDIA's PyPI wheels, laid out as torch.utils.cpp_extension
#: expects it (bin/nvcc, include/, lib64/libcudart.so); CUDA_HOME points here.
CUDA_HOME = "/usr/local/cuda"
#: RDMA (InfiniBand, RoCE, EFA): the verbs device nodes a container needs, the HCAs in sysfs, and
#: the rdma-core library NCCL dlopens (libibverbs.so, then libibverbs.so.1).
IB_DEVICE_DIR = "/dev/infiniband"
IB_SYSFS_DIR = "/sys/class/infiniband"
IBVERBS_LIBRARY = "libibverbs.so.1"

# --- the user ---------------------------------------------------------------------
USER = "pt"
UID = 1000
GID = 1000
HOME = f"/home/{USER}"
#: The group that may write the venv (pip install as pt, also after a PT_UID/PT_GID remap):
#: pt is a member; the venv is group-writable and setgid, so new files stay in the group.
VENV_GROUP = "users"
VENV_GID = 100
#: Root mode (`docker run --user 0`, needed only for PT_UID/PT_GID): root's `docker exec`
#: inherits the container's PATH and working directory, so the entrypoint refuses to start
#: as root unless both are root's own (see docs/security.md). These are the values to pass.
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ROOT_WORKDIR = "/"
#: Directories pt owns besides its home and WORKDIR (the uid remap re-owns them).
PT_STATE_DIRS: tuple[str, ...] = (STATE_DIR, "/var/lib/pt-multi-gpu")
#: The image's PATH, kept in the image as this variable: pt's PATH after a root start (whose
#: own PATH must be ROOT_PATH). And where pt's processes run after a root start.
ENV_USER_PATH = "PTMG_PATH"
ENV_WORKDIR = "PTMG_WORKDIR"

# --- without the entrypoint (HPC runtimes, --entrypoint, any uid) ------------------
#: The pip constraint made from the cell's lock: torch, torchvision, Triton and the CUDA wheels
#: pinned, and the release's limits on its neighbours. pip (PIP_CONSTRAINT) and uv
#: (UV_CONSTRAINT) honour it, so no install replaces the image's CUDA torch unasked.
PIP_CONSTRAINT_FILE = "/etc/pip/constraint.txt"
#: Distributions the constraint pins exactly (by canonical name or prefix).
CONSTRAINED_NAMES: tuple[str, ...] = ("torch", "torchvision", "torchaudio", "triton", "pytorch-triton")
CONSTRAINED_PREFIXES: tuple[str, ...] = ("nvidia-", "cuda-")
#: The startup module every venv Python imports (a .pth in site-packages): a private, writable
#: HOME and a user name when the runtime gives neither (entrypoint/ptmg_userenv.py).
USERENV_MODULE = "ptmg_userenv"
#: What the image's ENV adds for every runtime: no user site-packages (a ~/.local torch must
#: not shadow the image's), and the pip constraint for pip and uv.
RUNTIME_ENV: tuple[tuple[str, str], ...] = (
    ("PYTHONNOUSERSITE", "1"),
    ("PIP_CONSTRAINT", PIP_CONSTRAINT_FILE),
    ("UV_CONSTRAINT", PIP_CONSTRAINT_FILE),
)

# --- services and ports ------------------------------------------------------------
JUPYTER = "jupyter"
TENSORBOARD = "tensorboard"
SSHD = "sshd"
SERVICES: tuple[str, ...] = (JUPYTER, TENSORBOARD, SSHD)
JUPYTER_PORT = 8888
SSH_PORT = 22
SSH_HOST_PORT = 2222  # what the docs and compose.yaml publish 22 as
TENSORBOARD_PORT = 6006
TENSORBOARD_PROXY_PATH = "/tensorboard/"
#: The ports an image EXPOSEs, in order.
PORTS: tuple[int, ...] = (JUPYTER_PORT, SSH_PORT, TENSORBOARD_PORT)

# --- environment --------------------------------------------------------------------
#: Cell facts baked into every image (ENV), read by the diagnostics and the smoke tests.
ENV_CELL = "PTMG_CELL"
ENV_TORCH = "PTMG_TORCH"
ENV_TORCHVISION = "PTMG_TORCHVISION"
ENV_CUDA = "PTMG_CUDA"
ENV_CUDNN = "PTMG_CUDNN"
ENV_NCCL = "PTMG_NCCL"
ENV_PYTHON = "PTMG_PYTHON"
ENV_MIN_DRIVER = "PTMG_MIN_DRIVER"
ENV_CUDA_ARCH_LIST = "PTMG_CUDA_ARCH_LIST"
ENV_FLAVOUR = "PTMG_FLAVOUR"
#: "yes", or "no: <why>" (torch.compile refuses this image's Python): read by the smoke tests and
#: the start diagnostics.
ENV_TORCH_COMPILE = "PTMG_TORCH_COMPILE"
#: Runtime settings the entrypoint reads (see entrypoint/README.md).
ENV_JUPYTER_TOKEN = "JUPYTER_TOKEN"  # noqa: S105 - the name of a variable
ENV_JUPYTER_PASSWORD_HASH = "JUPYTER_PASSWORD_HASH"  # noqa: S105 - a variable name
ENV_SSH_AUTHORIZED_KEYS = "SSH_AUTHORIZED_KEYS"
ENV_PT_UID = "PT_UID"
ENV_PT_GID = "PT_GID"
#: Set by `build.py test` for a cell of another architecture (the container runs under qemu):
#: what it runs on, e.g. "linux/arm64 on linux/amd64 (qemu 10.0.2)". The selftest then skips, with
#: that reason, the checks that take many minutes each under emulation (torchrun, torch.compile).
ENV_SMOKE_EMULATED = "PTMG_SMOKE_EMULATED"

#: check name -> (ENV variable, image label): what the selftest compares the image against.
EXPECT_KEYS: Mapping[str, tuple[str, str]] = {
    "torch": (ENV_TORCH, label("torch")),
    "torchvision": (ENV_TORCHVISION, label("torchvision")),
    "cuda": (ENV_CUDA, label("cuda")),
    "cudnn": (ENV_CUDNN, label("cudnn")),
    "nccl": (ENV_NCCL, label("nccl")),
    "python": (ENV_PYTHON, label("python")),
    "cuda-arch-list": (ENV_CUDA_ARCH_LIST, label("cuda-arch-list")),
    "min-driver": (ENV_MIN_DRIVER, label("min-driver")),
}

# --- wheels that carry CUDA libraries -----------------------------------------------
#: Distribution names, newest CUDA major first: PyPI's torch wheels take cuDNN and NCCL from these.
CUDNN_DISTS: tuple[str, ...] = ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvidia-cudnn-cu11")
NCCL_DISTS: tuple[str, ...] = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
CUDNN_DIST_PATTERN = r"nvidia-cudnn-cu\d+"
NCCL_DIST_PATTERN = r"nvidia-nccl-cu\d+"

# --- the DDP smoke job ----------------------------------------------------------------
#: Rank 0 prints one line ``PTMG_DDP_RESULT {json}``; host runners parse it.
DDP_RESULT_MARKER = "PTMG_DDP_RESULT "
#: Printed by rank 0 at step 10 of epoch 0; the node-kill fault test waits for it.
DDP_KILL_TRIGGER = "phase=train epoch=0 step=10 "
#: How a stuck collective is named by the job's watchdog.
DDP_STUCK_MARKER = "PTMG_DDP stuck rank(s): "
RDZV_PORT = 29400
#: Environment for ranks on several hosts (containers on one Docker network). NCCL_IB_DISABLE:
#: no InfiniBand between containers; both spellings of async error handling (torch 2.0 reads
#: NCCL_*, newer torch TORCH_NCCL_*).
MULTINODE_ENV: Mapping[str, str] = {
    "NCCL_SOCKET_IFNAME": "eth0",
    "GLOO_SOCKET_IFNAME": "eth0",
    "NCCL_IB_DISABLE": "1",
    "NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}
#: NCCL's (and libfabric's, for AWS EFA) network settings: the Slurm docker launcher passes them from
#: the job's environment into each node's container by name; the start diagnostics show the ones set.
NCCL_NET_ENV: tuple[str, ...] = (
    "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_IB_GID_INDEX", "NCCL_IB_TC", "NCCL_IB_SL", "NCCL_NET",
    "NCCL_NET_GDR_LEVEL", "NCCL_CROSS_NIC", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "FI_PROVIDER",
    "FI_EFA_USE_DEVICE_RDMA",
)
#: A timed-out NCCL collective aborts the process instead of hanging (both spellings).
NCCL_ASYNC_ENV: Mapping[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "NCCL_ASYNC_ERROR_HANDLING": "1",
}
#: /dev/shm for smoke runs: gloo and NCCL need more than Docker's 64 MB default.
SMOKE_SHM_SIZE = "1g"
#: /dev/shm the docs, compose.yaml and the launch jobs ask for.
SHM_SIZE = "8g"


def project_labels(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The project label plus ``extra``: what every object the project creates carries."""
    out = {PROJECT_LABEL[0]: PROJECT_LABEL[1]}
    out.update(extra or {})
    return out


# --- versions ---------------------------------------------------------------------------
_VERSION_RE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")


def version_tuple(text: str) -> tuple[int, ...]:
    """How versions in labels, env and tool output compare: the leading dotted numbers.

    ``"2.7.0+cu126"`` -> (2, 7, 0); ``"9.5.1.17"`` -> (9, 5, 1, 17); ``"580"`` -> (580,).
    Raises ValueError when the text does not start with a number.
    """
    m = _VERSION_RE.match(text)
    if not m:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(p) for p in m.group(1).split("."))


# --- GPU architectures (smoke_tests/smokelib and the host's GPU checks) ----------------

_ARCH_RE = re.compile(r"^(sm|compute)_(\d+)([a-z]?)$")


def parse_arch(arch: str) -> tuple[str, int, int, str] | None:
    """``"sm_86"`` -> ("sm", 8, 6, ""); ``"compute_90"`` -> ("compute", 9, 0, "");
    ``"sm_90a"`` -> ("sm", 9, 0, "a"). Unknown text -> None."""
    m = _ARCH_RE.match(arch.strip())
    if not m:
        return None
    kind, digits, suffix = m.group(1), m.group(2), m.group(3)
    return kind, int(digits[:-1]), int(digits[-1]), suffix


def arch_covers(arch_list: Iterable[str], capability: tuple[int, int]) -> bool:
    """Whether a build for ``arch_list`` runs natively or by PTX JIT on ``capability``.

    - a cubin ``sm_XY`` runs on every GPU of the same major X with minor >= Y;
    - an arch-specific cubin (``sm_90a``, ``sm_100f``) runs only on exactly X.Y;
    - PTX ``compute_XY`` is JIT-compiled for any GPU with capability >= X.Y.
    """
    major, minor = capability
    for arch in arch_list:
        parsed = parse_arch(arch)
        if parsed is None:
            continue
        kind, a_major, a_minor, suffix = parsed
        if kind == "compute":
            if (a_major, a_minor) <= (major, minor):
                return True
        elif suffix:
            if (a_major, a_minor) == (major, minor):
                return True
        elif a_major == major and a_minor <= minor:
            return True
    return False
