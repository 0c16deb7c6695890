"""ImageSpec -> Dockerfile text, and the docker/ folder that holds the results.

Rendering is pure: `render()` reads only the template and its arguments, sorts
everything it emits, and so produces byte-identical output on every run. The
decisions (which packages, which pins, which index) are made here in Python;
the Jinja2 template only loops and guards.
"""

from __future__ import annotations

import posixpath
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import ptmg_contract as contract
from builder.common.paths import project_root, template_dir
from builder.common.templates import environment
from builder.matrix import ImageSpec
from builder.matrix.model import DEFAULT_PLATFORM, FLAVOUR_PIP, FLAVOURS

TEMPLATE = "Dockerfile.j2"
PROJECT_URL = "https://github.com/pt-multi-gpu/pt-multi-gpu"

# What every image needs from the OS. Python comes from the base OS.
BASE_APT = (
    "ca-certificates",  # TLS for pip and users' downloads
    "openssh-server",  # SSH access (started only when a key is supplied)
    "procps",  # ps/pkill for users and the healthcheck
    "python3",
    "python3-venv",
    "tini",  # PID 1: reaps zombies, forwards signals
)

#: torch.compile in every image: Inductor's C++/OpenMP code (CPU) and Triton's C launcher stubs
#: (GPU) need a C/C++ compiler and the Python headers; JIT C++ extensions too. g++ brings gcc,
#: binutils, libc6-dev and OpenMP (libgomp1 and its link library). Not build-essential: make,
#: dpkg-dev and perl add 47 MiB that compile never uses (the devel flavour adds them). ninja-build
#: (about 0.4 MB): torch.utils.cpp_extension.load/load_inline refuse to build without ninja
#: ("Ninja is required to load C++ extensions"), so a JIT C++ op needs it beside the compiler.
COMPILE_APT = ("g++", "ninja-build", "python3-dev")

#: rdma-core's user space (about 3 MiB): NCCL dlopens libibverbs.so.1 (and, from 2.30, libmlx5.so.1
#: of ibverbs-providers) to talk InfiniBand/RoCE; UCX and MPI use librdmacm. Debian trixie and
#: Ubuntu noble renamed librdmacm1 in the 64-bit time_t transition.
RDMA_APT: Mapping[str, tuple[str, ...]] = {
    "bookworm": ("ibverbs-providers", "libibverbs1", "librdmacm1"),
    "trixie": ("ibverbs-providers", "libibverbs1", "librdmacm1t64"),
    "jammy": ("ibverbs-providers", "libibverbs1", "librdmacm1"),
    "noble": ("ibverbs-providers", "libibverbs1", "librdmacm1t64"),
}


def os_packages(spec: ImageSpec) -> tuple[str, ...]:
    """The OS layer's packages: the same for every cell on one base, whatever its flavour, so that
    the runtime and devel cells of a torch share it (and every later layer up to the tools)."""
    return tuple(sorted(set(BASE_APT) | set(COMPILE_APT) | set(RDMA_APT[spec.os]) | set(spec.apt)))


def devel_packages(spec: ImageSpec) -> tuple[str, ...]:
    """The devel layer's Debian packages (build-essential, git); () for other flavours."""
    return tuple(sorted(FLAVOURS[spec.flavour]))


def devel_requirements(spec: ImageSpec) -> tuple[str, ...]:
    """The devel layer's pip requirements: the CUDA toolkit of the cell's CUDA major.minor from
    NVIDIA's PyPI wheels (nvcc, cudart, CCCL headers), ninja for torch.utils.cpp_extension, and the
    torch pins restated so that the resolver takes the toolkit patch torch itself pins (torch
    2.14.1 requires cuda-toolkit==13.0.3). () for other flavours."""
    if not spec.devel_toolkit:
        return ()
    return tuple(sorted({f"{spec.devel_toolkit}=={spec.cuda}.*", *FLAVOUR_PIP[spec.flavour],
                         *core_requirements(spec)}))


def torch_cuda_arch_list(spec: ImageSpec) -> str:
    """The cell's CUDA targets in TORCH_CUDA_ARCH_LIST's spelling: sm_90 -> 9.0, sm_90a -> 9.0a,
    compute_120 (PTX) -> 12.0+PTX. cpp_extension needs it without a GPU to ask."""
    def dotted(arch: str) -> str:
        num = arch.split("_", 1)[1]
        suffix = num[-1] if num[-1].isalpha() else ""
        digits = num[:-1] if suffix else num
        return f"{digits[:-1]}.{digits[-1]}{suffix}"

    out = [dotted(a) for a in spec.arch_list if a.startswith("sm_")]
    for ptx in (dotted(a) for a in spec.arch_list if a.startswith("compute_")):
        out = [f"{x}+PTX" if x == ptx else x for x in out] if ptx in out else [*out, f"{ptx}+PTX"]
    return ";".join(out)


def slim_args(spec: ImageSpec) -> tuple[str, ...]:
    """Options of imagebuild/slim-venv.sh for this cell: strip Triton's debug sections always;
    drop Triton's Blackwell ptxas where torch has no kernel (nor PTX) for compute capability 10+."""
    args = ["--strip-triton"]
    majors = [int(target.split(".")[0]) for target in torch_cuda_arch_list(spec).split(";") if target]
    if majors and max(majors) < 10:
        args.append("--drop-ptxas-blackwell")
    return tuple(args)


def devel_env(spec: ImageSpec) -> tuple[tuple[str, str], ...]:
    """What the devel layer sets: where the toolkit is, nvcc on PATH, the targets to compile for."""
    if not spec.devel_toolkit:
        return ()
    return (("CUDA_HOME", contract.CUDA_HOME), ("PATH", f"{contract.CUDA_HOME}/bin:${{PATH}}"),
            ("TORCH_CUDA_ARCH_LIST", f'"{torch_cuda_arch_list(spec)}"'))


def core_requirements(spec: ImageSpec) -> tuple[str, ...]:
    """torch, torchvision and the release's limits on its neighbours (compat data: NumPy 1.x for
    torch < 2.3, setuptools with pkg_resources for torch < 2.2)."""
    return tuple(sorted([f"torch=={spec.torch}", f"torchvision=={spec.torchvision}", *spec.neighbours]))


#: What `build.py build` stages in the build context (builder/lock/staging.py), the same paths for
#: every cell: the static uv, one folder of locked wheels and one install lock per installing layer,
#: the SBOM's input. The venv RUNs install from these only.
WHEELHOUSE = "wheelhouse"
#: The RUNs that install into the venv, in build order: the lock's torch layer in two, its CUDA wheels
#: first (builder.lock.target.install_layer), then torch and the rest of it; then tools and devel.
INSTALL_LAYERS = ("cuda", "torch", "tools", "devel")
#: The build secret with the wheel server's URL (builder.lock.wheelserver); absent, the RUNs
#: install from the wheels staged in the build context.
WHEEL_SERVER_ID = "wheel-server"
#: Any fixed value: with it, the .pyc files uv compiles are hash-checked (not timestamped), so two
#: builds from one lock give byte-identical files (1980-01-01, the zip epoch).
SOURCE_DATE_EPOCH = "315532800"
#: What apt, dpkg and ldconfig leave behind in a layer that installs packages: their logs carry the
#: build's wall-clock time and ldconfig's aux-cache the files' ctimes. Each such RUN deletes them, so
#: two builds of one Debian snapshot give the same layer (`build.py repro`).
BUILD_LOGS = "/var/log/apt/* /var/log/dpkg.log /var/log/alternatives.log /var/cache/ldconfig/aux-cache"


#: The build's Python: a stage FROM the cell's base with python3 (and binutils, for slim-venv.sh's
#: strip) from apt, which the venv's RUNs bind-mount read-only at `root`, below the OS layer that
#: gives the image its own python3. Not python3-venv: it holds only ensurepip, and brings pip's and
#: setuptools' wheels and ca-certificates (whose certificate hashing was most of the stage's apt
#: under qemu); the venv is made `--without-pip` by python3's own venv module
#: (dockerfile/05-python.j2, imagebuild/build-python.sh). `libs`: its copies of the libraries its
#: python3 and strip load that the base lacks (LD_LIBRARY_PATH there).
BUILD_PYTHON: Mapping[str, object] = {
    "stage": "ptmg-python",
    "apt": ("binutils", "python3"),
    "root": "/ptmg-build/python",
    "stage_libs": "/ptmg-libs",
    "libs": "/ptmg-build/python/ptmg-libs",
}


#: A cell's bytecode compiler where uv's --compile-bytecode will not do: imagebuild/native-bytecode.sh
#: compiles what the venv's RUNs installed (uv then installs without compiling), one process in path
#: order, hash-checked, with the build host's python3 from a stage of the `ptmg-python` text for the
#: cell's base, bind-mounted at `root`.
#: - An emulated cell (its platform is not the build host's): uv's compile would run the emulated Python
#:   (4 of the arm64 cell's 13.6 build minutes on 2 cores). Its stage is that text on the BUILD host's
#:   platform (`FROM --platform=$BUILDPLATFORM`: on an x86_64 host, the same stage as the native cells'
#:   of that base, so a builder that made one of them has it); a .pyc is the same bytes on every
#:   architecture.
#: - A cell whose Python is ORDERED_BYTECODE or newer: its marshal output depends on what the same
#:   process compiled before (cpython#129724), so uv's pool of workers gave the py3.13 cell other .pyc
#:   bytes from build to build (BENCHMARKS.md); one process in path order gives the same bytes every
#:   time. The build's Python stage itself serves, at its own mount.
NATIVE_PYTHON: Mapping[str, str] = {"stage": "ptmg-native-python", "root": "/ptmg-build/native-python",
                                    "list": "py-before"}
ORDERED_BYTECODE = (3, 12)


def native_python(spec: ImageSpec) -> Mapping[str, str] | None:
    """The cell's bytecode compiler (NATIVE_PYTHON, or the build's Python stage for a native cell of Python
    ORDERED_BYTECODE or newer), or None where uv compiles the bytecode."""
    if spec.platform != DEFAULT_PLATFORM:
        return NATIVE_PYTHON
    if tuple(int(part) for part in spec.python.split(".")[:2]) >= ORDERED_BYTECODE:
        return {**NATIVE_PYTHON, "stage": str(BUILD_PYTHON["stage"]), "root": str(BUILD_PYTHON["root"])}
    return None


#: The shared trees' stages (dockerfile/07-shared.j2) and the folder each fills: its contents (the
#: tree at contract.CUDA_WHEELS or contract.TORCH_FILES under it) become one of the image's first
#: layers (each folder has its own name, so that `docker history` tells the two COPYs apart). The torch
#: stage has uv unpack the whole torch set at `unpacked` first, through a uv cache of its own at
#: `uv_cache`, which the venv's torch RUN bind-mounts at `uv_cache_mount` and installs from (the set is
#: fetched and unpacked once per build; dockerfile/_uv-install.j2).
SHARED_STAGES: Mapping[str, str] = {"cuda_stage": "ptmg-cuda", "cuda_out": "/ptmg-out-cuda",
                                    "torch_stage": "ptmg-torch-files", "torch_out": "/ptmg-out-torch",
                                    "unpacked": "/tmp/ptmg-torch-set", "uv_cache": "/ptmg-uv-cache",
                                    "uv_cache_mount": "/ptmg-build/uv-cache"}


#: The OS stage (dockerfile/06-os.j2): apt runs there, on the base and the user, and
#: imagebuild/os-layer.sh leaves in `out` what it changed (layer.tar, and `deleted`, the paths that went),
#: measured against the list of every entry it made at `before`; the image's OS layer (50-os.j2)
#: applies it above the venv.
OS_STAGE: Mapping[str, str] = {"stage": "ptmg-os", "before": "/tmp/ptmg-os-before", "out": "/ptmg-os"}


def site_packages(spec: ImageSpec) -> str:
    """The venv's site-packages in the cell's image."""
    return f"{contract.VENV}/lib/python{spec.python}/site-packages"


def shared_trees(spec: ImageSpec) -> dict[str, str]:
    """SHARED_STAGES, and the relative path from the venv's site-packages to the CUDA wheels' tree,
    for the venv's links to it."""
    return {**SHARED_STAGES, "cuda_link": posixpath.relpath(contract.CUDA_WHEELS, site_packages(spec))}


def stage_paths() -> dict[str, object]:
    """The staged context paths the templates bind-mount (see WHEELHOUSE)."""
    return {"uv": f"{WHEELHOUSE}/uv", "sbom_input": f"{WHEELHOUSE}/sbom-input.json",
            "pip_constraint": f"{WHEELHOUSE}/pip-constraint.txt",
            "wheels": {layer: f"{WHEELHOUSE}/{layer}" for layer in INSTALL_LAYERS},
            "wheel_server": WHEEL_SERVER_ID,
            "requirements": {layer: f"{WHEELHOUSE}/{layer}.txt" for layer in INSTALL_LAYERS}}


def image_env(spec: ImageSpec) -> tuple[tuple[str, str], ...]:
    """The cell facts the image carries about itself (see docs/image-layout.md)."""
    env = {
        contract.ENV_CELL: spec.name,
        contract.ENV_TORCH: spec.torch,
        contract.ENV_TORCHVISION: spec.torchvision,
        contract.ENV_CUDA: spec.cuda,
        contract.ENV_CUDNN: spec.cudnn,
        contract.ENV_NCCL: spec.nccl or '""',
        contract.ENV_PYTHON: spec.python,
        contract.ENV_MIN_DRIVER: spec.min_driver,
        contract.ENV_CUDA_ARCH_LIST: '"' + " ".join(spec.arch_list) + '"',
        contract.ENV_FLAVOUR: spec.flavour,
        contract.ENV_TORCH_COMPILE: "yes" if spec.compile_supported else f'"no: {spec.compile_note}"',
        **dict(contract.RUNTIME_ENV),
    }
    if spec.compile_supported and not spec.cpu_only:
        env["TRITON_LIBCUDA_PATH"] = contract.LIBCUDA_LINK_DIR
    return tuple(sorted(env.items()))


def static_labels(spec: ImageSpec) -> tuple[tuple[str, str], ...]:
    """Labels known before the build. Versions are added after a probe of the built image."""
    labels = {
        "org.opencontainers.image.title": f"{spec.repository} {spec.name}",
        "org.opencontainers.image.description": (
            f"PyTorch {spec.torch} / CUDA {spec.cuda} / cuDNN {spec.cudnn_major} with JupyterLab, SSH and TensorBoard"
        ),
        "org.opencontainers.image.source": PROJECT_URL,
        "org.opencontainers.image.version": spec.tag,
        "org.opencontainers.image.base.name": spec.base,
        contract.LABEL_CELL: spec.name,
        contract.LABEL_FLAVOUR: spec.flavour,
        contract.LABEL_SBOM: contract.SBOM_FILE,
    }
    return tuple(sorted(labels.items()))


def bounded_apt(seconds: int = 300, tries: int = 3, pause: int = 5) -> str:
    """The shell functions `apt_try` and `apt_bounded` as a Dockerfile RUN inlines them (one logical
    line; dockerfile/_apt.j2 says why apt needs a bound): for a Dockerfile of another template, the
    test clusters' images among them."""
    module = environment(template_dir("render")).get_template("dockerfile/_apt.j2").module
    return str(module.define(seconds=seconds, tries=tries, pause=pause))  # type: ignore[attr-defined]


def render(spec: ImageSpec, source: str = "images.yaml") -> str:
    """The Dockerfile for one cell. Pure and deterministic."""
    template = environment(template_dir("render")).get_template(TEMPLATE)
    wheel_text = "PyPI" if spec.wheel_source == "pypi" else spec.wheel_source
    return template.render(
        c=contract,
        cell=spec,
        source=source,
        apt=os_packages(spec),
        devel_apt=devel_packages(spec),
        devel_reqs=devel_requirements(spec),
        devel_env=devel_env(spec),
        slim_args=slim_args(spec),
        stage=stage_paths(),
        py=BUILD_PYTHON,
        native_python=native_python(spec),
        shared=shared_trees(spec),
        os=OS_STAGE,
        site_packages=site_packages(spec),
        source_date_epoch=SOURCE_DATE_EPOCH,
        build_logs=BUILD_LOGS,
        extra_pip=bool(spec.pip),
        env=image_env(spec),
        labels=static_labels(spec),
        wheel_source_text=wheel_text,
    )


def docker_dir() -> Path:
    """The project's docker/ folder: one docker/<cell>/Dockerfile per cell of images.yaml."""
    return project_root() / "docker"


def docker_dir_for(config: Path) -> Path:
    """Where a matrix's Dockerfiles go: docker/ for the project's images.yaml, else beside the file."""
    config = config.resolve()
    return docker_dir() if config == (project_root() / "images.yaml").resolve() else config.parent / "docker"


def source_name(config: Path) -> str:
    """How the generated header names the matrix file: stable whatever the working directory."""
    config = config.resolve()
    try:
        return config.relative_to(project_root()).as_posix()
    except ValueError:
        return config.name


@dataclass(frozen=True)
class Rendered:
    path: Path
    text: str


def plan(cells: Sequence[ImageSpec], out_dir: Path, source: str = "images.yaml") -> tuple[Rendered, ...]:
    """What docker/ should hold for these cells: one Dockerfile per cell."""
    return tuple(Rendered(out_dir / c.name / "Dockerfile", render(c, source)) for c in cells)


def stale_dirs(cells: Sequence[ImageSpec], out_dir: Path) -> tuple[Path, ...]:
    """Rendered folders in docker/ for cells that no longer exist."""
    if not out_dir.is_dir():
        return ()
    names = {c.name for c in cells}
    return tuple(
        sorted(p for p in out_dir.iterdir() if p.is_dir() and (p / "Dockerfile").exists() and p.name not in names)
    )


def write(files: Sequence[Rendered]) -> list[Path]:
    """Write the files that differ; return the ones written."""
    changed = []
    for f in files:
        if not f.path.exists() or f.path.read_text(encoding="utf-8") != f.text:
            f.path.parent.mkdir(parents=True, exist_ok=True)
            f.path.write_text(f.text, encoding="utf-8")
            changed.append(f.path)
    return changed


def drift(files: Sequence[Rendered]) -> list[Path]:
    """Committed files that differ from what would be rendered (or are missing)."""
    return [
        f.path for f in files if not f.path.exists() or f.path.read_text(encoding="utf-8") != f.text
    ]


def remove(dirs: Sequence[Path]) -> None:
    for d in dirs:
        shutil.rmtree(d)
