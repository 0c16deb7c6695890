"""Host checks: engine, BuildKit, disk, NVIDIA runtime and driver, and which cells this host can run."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from builder.common.versions import Version
from builder.engine import Engine, EngineError, buildx_facts, capabilities, find_buildkit_cli, missing_builder
from builder.host import emulation
from builder.spec import ImageSpec

GB = 1000**3
# A cold CUDA cell needs ~7 GB for its layers plus ~3 GB of wheels in the pip cache.
NEED_PER_CELL = 7 * GB
NEED_CACHE = 4 * GB


@dataclass(frozen=True)
class Finding:
    level: str  # ok | warn | fail
    what: str
    fix: str = ""


@dataclass(frozen=True)
class Gpu:
    name: str
    driver: str


def host_gpus() -> tuple[list[Gpu], str]:
    """GPUs and driver via nvidia-smi; ([], reason) when there are none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "nvidia-smi not found (no NVIDIA driver on this host)"
    try:
        r = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20, check=False)
    except subprocess.TimeoutExpired:
        return [], "nvidia-smi timed out"
    if r.returncode != 0:
        return [], f"nvidia-smi failed: {r.stderr.strip()[:200]}"
    gpus = [Gpu(*(x.strip() for x in line.split(",", 1))) for line in r.stdout.strip().splitlines() if "," in line]
    return gpus, "" if gpus else "nvidia-smi lists no GPU"


def cell_findings(cells: Sequence[ImageSpec], gpus: Sequence[Gpu], reason: str) -> list[Finding]:
    """Per cell: can this host run it on its GPUs? Pure, so it is unit-tested."""
    out = []
    for c in (c for c in cells if c.emulated):  # another architecture: qemu runs it, CPU only
        out.append(Finding("warn", f"{c.name}: {c.platform} runs here under emulation only (CPU, much slower; "
                                   "GPU checks are skipped)",
                           f"to run it on GPUs: an {c.arch} host (e.g. Grace Hopper) with NVIDIA driver >= "
                           f"{c.min_driver} and the NVIDIA Container Toolkit"))
    cells = [c for c in cells if not c.emulated]
    if not gpus:
        for c in cells:
            out.append(Finding("warn", f"{c.name}: no GPU here ({reason}); it builds and runs on CPU only, "
                                       "DDP uses gloo, GPU checks are skipped",
                               f"to run it on GPUs: a host with NVIDIA driver >= {c.min_driver} and the "
                               "NVIDIA Container Toolkit, then `docker run --gpus all ...`"))
        return out
    driver = gpus[0].driver
    for c in cells:
        if Version.parse(driver) >= Version.parse(c.min_driver):
            out.append(Finding("ok", f"{c.name}: runs here (driver {driver} >= {c.min_driver} for CUDA {c.cuda})"))
        else:
            out.append(Finding("fail", f"{c.name}: driver {driver} is older than {c.min_driver}, the minimum for "
                                       f"CUDA {c.cuda}; CUDA will not initialise in this image",
                               f"upgrade the NVIDIA driver to >= {c.min_driver}, or use a cell with an older CUDA"))
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
    return [Finding("ok", f"builder: {cli.describe()}{f' {buildx}' if buildx else ''}; {level}; {has}")]


def diagnose(cells: Sequence[ImageSpec], connect: Callable[[], Engine]) -> list[Finding]:
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
    findings += cell_findings(cells, gpus, reason)
    # Other architectures (linux/arm64 on x86): qemu through binfmt_misc, and which qemu is in use.
    emulated: dict[str, list[str]] = {}
    for c in cells:
        if c.emulated:
            emulated.setdefault(c.platform, []).append(c.name)
    findings += [Finding(*f) for f in emulation.findings(sorted({*emulated, "linux/arm64"}), emulated)]
    return findings
