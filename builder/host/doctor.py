"""Host checks: engine, BuildKit, disk, NVIDIA runtime and driver, and which cells this host can run."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from builder.common.errors import InputError
from builder.engine import (
    Engine,
    EngineError,
    buildx_facts,
    capabilities,
    emulation,
    find_buildkit_cli,
    missing_builder,
)
from builder.imaging import supply
from builder.matrix import ImageSpec, platforms
from builder.smoke import gpufit
from builder.smoke import gpus as gpus_mod

GB = 1000**3
# A cold CUDA cell needs ~7 GB for its layers plus ~3 GB of wheels in the pip cache.
NEED_PER_CELL = 7 * GB
NEED_CACHE = 4 * GB
#: Where a cell of each platform runs on GPUs natively.
NATIVE_GPU_HOSTS = {"linux/amd64": "an x86_64 host", "linux/arm64": "an arm64 host (Grace Hopper GH200, Grace "
                                                                   "Blackwell GB200)"}


@dataclass(frozen=True)
class Finding:
    level: str  # ok | warn | fail
    what: str
    fix: str = ""


@dataclass(frozen=True)
class Gpu:
    name: str
    driver: str
    capability: tuple[int, int] | None = None  # None: nvidia-smi did not say (driver < 510)
    mig: bool = False
    index: str = "0"

    def host_gpu(self) -> gpus_mod.HostGpu:
        return gpus_mod.HostGpu(self.index, "", self.name, self.capability, self.driver, self.mig)


def host_gpus(env: Mapping[str, str] | None = None) -> tuple[list[Gpu], str]:
    """The GPUs this host offers (nvidia-smi, narrowed by CUDA_VISIBLE_DEVICES); ([], reason) when none."""
    found, reason = gpus_mod.visible_gpus(os.environ if env is None else env)
    return [Gpu(g.name or g.uuid, g.driver, g.capability, g.mig, g.index) for g in found], reason


def gpu_findings(gpus: Sequence[Gpu], env: Mapping[str, str]) -> list[Finding]:
    """MIG mode and mixed models (CUDA_DEVICE_ORDER): what changes how the GPUs can be used."""
    out = []
    host = [g.host_gpu() for g in gpus]
    mig = [g for g in host if g.mig]
    if mig:
        out.append(Finding("warn", f"MIG mode is enabled on {', '.join(g.describe() for g in mig)}: NCCL does not "
                                   "communicate between MIG instances, so `build.py test --require-gpu` refuses a "
                                   "multi-rank NCCL run here",
                           "run one rank per job (--nproc 1), or disable MIG (nvidia-smi -i INDEX -mig 0)"))
    order = gpufit.device_order_warning(host, env)
    if order:
        out.append(Finding("warn", order, "export CUDA_DEVICE_ORDER=PCI_BUS_ID"))
    return out


def cell_findings(cells: Sequence[ImageSpec], gpus: Sequence[Gpu], reason: str,
                  matrix_cells: Sequence[ImageSpec] | None = None, host: str | None = None) -> list[Finding]:
    """Per cell: can this host run it on its GPUs (driver, compute capability)? Pure, so it is
    unit-tested. ``matrix_cells``: every cell, to name those that would run (default ``cells``);
    ``host``: this host's platform (default: the machine's; linux/arm64 on a GH200 or GB200)."""
    out = []
    here = host or platforms.host_platform()
    for c in (c for c in cells if c.emulated_on(here)):  # another architecture: qemu runs it, CPU only
        out.append(Finding("warn", f"{c.name}: {c.platform} runs on this {here} host under emulation only (CPU, "
                                   "much slower; GPU checks are skipped)",
                           f"to run it on GPUs: {NATIVE_GPU_HOSTS.get(c.platform, f'a {c.platform} host')} with "
                           f"NVIDIA driver >= {c.min_driver} and the NVIDIA Container Toolkit"))
    cells = [c for c in cells if not c.emulated_on(here)]
    if not gpus:
        for c in cells:
            out.append(Finding("warn", f"{c.name}: no GPU here ({reason}); it builds and runs on CPU only, "
                                       "DDP uses gloo, GPU checks are skipped",
                               f"to run it on GPUs: a host with NVIDIA driver >= {c.min_driver} and the "
                               "NVIDIA Container Toolkit, then `docker run --gpus all ...`"))
        return out
    driver = gpus[0].driver
    on_host = [g.host_gpu() for g in gpus]
    every = matrix_cells if matrix_cells is not None else cells
    for c in cells:
        refused = gpufit.refusal(c, every, on_host, here)
        if not refused:
            caps = sorted({f"sm_{g.capability[0]}{g.capability[1]}" for g in gpus if g.capability})
            on = f" on {', '.join(caps)}" if caps else " (compute capability not reported: driver < 510)"
            out.append(Finding("ok", f"{c.name}: runs here (driver {driver} >= {c.min_driver} for CUDA {c.cuda}{on})"))
            out += [Finding("warn", what, fix) for what, fix in gpufit.ptx_warnings(c, on_host)]
        else:
            out.append(Finding("fail", refused, gpufit.refusal_fix(c, on_host, here, every)))
    return out


def disk_finding(free: int, cells: int) -> Finding:
    need = NEED_PER_CELL * cells + NEED_CACHE
    if free >= need:
        return Finding("ok", f"disk: {free / GB:.0f} GB free for Docker, "
                             f"~{need / GB:.0f} GB needed for {cells} cell(s)")
    return Finding("fail", f"disk: {free / GB:.0f} GB free for Docker, ~{need / GB:.0f} GB needed for {cells} cell(s)",
                   "free space (`docker image prune`, `docker builder prune`) or build fewer cells with --only")


def builder_findings(engine: Engine | None) -> list[Finding]:
    """The builder the build uses, and what its BuildKit can do (asked of the CLI and the engine)."""
    cli = find_buildkit_cli()
    if cli is None:
        missing = missing_builder()
        if missing is not None:
            what, _, fix = missing.partition(". Fix: ")
            return [Finding("fail", f"builder: {what}", fix)]
        return [Finding("warn", "builder: no docker CLI that builds with BuildKit; the classic builder will be used "
                                "(no shared pip cache, no build secrets: CA or pip settings refused)",
                        "install docker buildx, or Debian's docker.io (its 20.10 CLI builds with DOCKER_BUILDKIT=1)")]
    buildx, reported = buildx_facts(cli)
    api = str(engine.version().get("ApiVersion") or "") if engine is not None else None
    version, source = capabilities.buildkit_version(reported, api)
    level = f"BuildKit {'.'.join(map(str, version.parts))} ({source})" if version else f"BuildKit {source}"
    has = ", ".join(f"{name}: {'yes' if ok else 'no'}" for name, ok in capabilities.features(version))
    found = [Finding("ok", f"builder: {cli.describe()}{f' {buildx}' if buildx else ''}; {level}; {has}")]
    if engine is not None:
        try:
            _host, how = supply.server_address(cli.buildx, engine.bridge_gateway, os.environ)
        except InputError as exc:
            found.append(Finding("fail", f"wheels: {exc}"))
        else:
            found.append(Finding("ok", f"wheels: {how}"))
    return found


def diagnose(cells: Sequence[ImageSpec], connect: Callable[[], Engine],
             matrix_cells: Sequence[ImageSpec] | None = None) -> list[Finding]:
    """Every check, in order; ``connect`` makes the run's engine (a failure is a finding, not an error)."""
    findings: list[Finding] = []
    engine: Engine | None
    try:
        engine = connect()
    except EngineError as exc:
        findings.append(Finding("fail", f"engine: {exc}".split("\n")[0], "run `scripts/ensure-docker.sh` "
                                "(as root on Debian it installs and starts dockerd)"))
        engine = None
    if engine is not None:
        info = engine.info()
        ver = engine.version()
        findings.append(Finding("ok", f"engine: Docker {ver.get('Version')} (API {ver.get('ApiVersion')}), "
                                      f"storage driver {info.get('Driver')}"))
        store = capabilities.image_store(info)
        if store.kind == capabilities.UNKNOWN:
            findings.append(Finding("fail", "image store: " + capabilities.unknown_store_line(store).split(". Fix")[0],
                                    capabilities.FIX_STORE))
        else:
            ids = "manifest digests" if store.kind == capabilities.CONTAINERD else "config digests"
            findings.append(Finding("ok", f"image store: {store.kind} ({store.driver}; image IDs are {ids})"))
        root = Path(str(info.get("DockerRootDir", "/var/lib/docker")))
        try:
            free = shutil.disk_usage(root).free
            findings.append(disk_finding(free, len(cells)))
        except OSError:
            findings.append(Finding("warn", f"disk: cannot read free space of {root} (remote engine?)"))
        runtimes = info.get("Runtimes") or {}
        if "nvidia" in runtimes:
            findings.append(Finding("ok", "NVIDIA container runtime: registered with the engine"))
        else:
            findings.append(Finding("warn", "NVIDIA container runtime: not registered with the engine "
                                            "(`docker run --gpus all` will fail)",
                                    "install the NVIDIA Container Toolkit and run "
                                    "`nvidia-ctk runtime configure --runtime=docker`, then restart dockerd"))
    findings += builder_findings(engine)
    gpus, reason = host_gpus()
    if gpus:
        names = ", ".join(sorted({g.name for g in gpus}))
        findings.append(Finding("ok", f"GPUs: {len(gpus)} ({names}), driver {gpus[0].driver}"))
    else:
        findings.append(Finding("warn", f"GPUs: none ({reason})",
                                "images still build and their smoke tests run on CPU (gloo); "
                                "for GPU runs install the NVIDIA driver and Container Toolkit"))
    findings += gpu_findings(gpus, os.environ)
    findings += cell_findings(cells, gpus, reason, matrix_cells)
    # Other architectures (linux/arm64 on x86): qemu through binfmt_misc, and which qemu is in use.
    emulated: dict[str, list[str]] = {}
    for c in cells:
        if c.emulated:
            emulated.setdefault(c.platform, []).append(c.name)
    findings += [Finding(*f) for f in emulation.findings(sorted({*emulated, "linux/arm64"}), emulated)]
    return findings
