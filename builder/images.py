"""Build orchestration: inputs hash, skip-unchanged, parallel builds, probe, labels, summary.

The flow for one cell: hash its inputs; if an image with that hash exists, skip.
Else make sure the base exists, build (BuildKit, or the classic builder), run
the built image once to read what is really installed, fail on any mismatch
with images.yaml, and only then label and tag it. A failed cell never moves a
tag, so earlier good images stay where they are.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from builder import base as base_mod
from builder import render
from builder.buildenv import BuildEnv, secret_files
from builder.engine import BuildkitCli, BuildOutcome, BuildRequest, Engine, EngineError, find_buildkit_cli
from builder.log import log
from builder.spec import ImageSpec

ROOT = Path(__file__).resolve().parent.parent
COPIED_DIRS = ("entrypoint", "smoke_tests")  # what the Dockerfile COPYs (see .dockerignore)
IGNORED_PARTS = frozenset({"__pycache__", ".mypy_cache", ".pytest_cache"})  # .dockerignore's exclusions
LABEL_NS = "io.pt-multi-gpu"
HASH_LABEL = f"{LABEL_NS}.inputs-hash"

PROBE = r"""
import importlib.metadata as md, json, sys
import torch, torchvision

def dist(*names):
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            pass
    return None

try:
    v = torch.cuda.nccl.version()
    nccl = ".".join(map(str, v)) if isinstance(v, tuple) else "%d.%d.%d" % (v // 1000, v % 1000 // 100, v % 100)
except Exception:
    nccl = None
try:
    arch = torch._C._cuda_getArchFlags().split()
except Exception:
    arch = []
print(json.dumps({
    "torch": torch.__version__.split("+")[0],
    "torchvision": torchvision.__version__.split("+")[0],
    "cuda": torch.version.cuda,
    "cudnn": dist("nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvidia-cudnn-cu11"),
    "nccl": dist("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11") or nccl,
    "nccl_runtime": nccl,
    "python": "%d.%d" % sys.version_info[:2],
    "arch_list": arch,
}))
"""


@dataclass(frozen=True)
class BuildConfig:
    force: bool = False
    no_cache: bool = False
    jobs: int = 1
    keep_going: bool = False
    log_dir: Path = ROOT / "build-logs"
    build_env: BuildEnv = field(default_factory=lambda: BuildEnv((), ()))
    mirror: str = base_mod.DEFAULT_MIRROR
    dry_run: bool = False
    docker_dir: Path = render.DOCKER_DIR
    source: str = "images.yaml"


@dataclass(frozen=True)
class CellResult:
    cell: str
    status: str  # built | skipped | failed | not-run | would-build
    seconds: float = 0.0
    size: int | None = None
    image_id: str | None = None
    message: str = ""
    log_path: Path | None = None


def context_files(root: Path = ROOT) -> list[Path]:
    """Every file the Dockerfile copies in, sorted (mirrors .dockerignore)."""
    files: list[Path] = []
    for d in COPIED_DIRS:
        for p in sorted((root / d).rglob("*")):
            if p.is_file() and not IGNORED_PARTS.intersection(p.parts) and p.suffix != ".pyc":
                files.append(p)
    return files


def inputs_hash(dockerfile: str, files: Sequence[Path], base_id: str, root: Path = ROOT) -> str:
    """sha256 of everything that decides the image: Dockerfile, copied files (path, mode, bytes), base."""
    h = hashlib.sha256()
    h.update(b"dockerfile\0" + dockerfile.encode() + b"\0base\0" + base_id.encode() + b"\0")
    for p in files:
        rel = p.relative_to(root).as_posix()
        h.update(f"file\0{rel}\0{p.stat().st_mode & 0o777:o}\0".encode())
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return "sha256:" + h.hexdigest()


def check_probe(spec: ImageSpec, probed: dict[str, object]) -> list[str]:
    """Where the built image disagrees with images.yaml (empty when it agrees)."""
    expect = {"torch": spec.torch, "torchvision": spec.torchvision, "cuda": spec.cuda, "cudnn": spec.cudnn,
              "python": spec.python}
    if spec.nccl:
        expect["nccl"] = spec.nccl
    return [f"{k}: images.yaml/compat data says {v}, the image has {probed.get(k)}"
            for k, v in expect.items() if probed.get(k) != v]


def labels_for(spec: ImageSpec, probed: dict[str, object], digest: str, builder: str) -> dict[str, str]:
    """OCI and compatibility labels; versions come from the probe of the built image."""
    arch = probed.get("arch_list")
    return {
        "org.opencontainers.image.created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "org.opencontainers.image.revision": git_revision(),
        "org.opencontainers.image.version": spec.tag,
        "org.opencontainers.image.title": f"{spec.repository} {spec.name}",
        "org.opencontainers.image.source": render.PROJECT_URL,
        "org.opencontainers.image.base.name": spec.base,
        f"{LABEL_NS}.cell": spec.name,
        f"{LABEL_NS}.torch": str(probed["torch"]),
        f"{LABEL_NS}.torchvision": str(probed["torchvision"]),
        f"{LABEL_NS}.cuda": str(probed["cuda"]),
        f"{LABEL_NS}.cudnn": str(probed["cudnn"]),
        f"{LABEL_NS}.nccl": str(probed.get("nccl") or ""),
        f"{LABEL_NS}.python": str(probed["python"]),
        f"{LABEL_NS}.min-driver": spec.min_driver,
        f"{LABEL_NS}.cuda-arch-list": " ".join(arch) if isinstance(arch, list) else "",
        f"{LABEL_NS}.builder": builder,
        HASH_LABEL: digest,
        "project": "pt-multi-gpu",
    }


def git_revision(root: Path = ROOT) -> str:
    try:
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                           check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    rev = r.stdout.strip() if r.returncode == 0 else "unknown"
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True,
                           check=False, timeout=10).stdout.strip()
    return rev + ("-dirty" if dirty and rev != "unknown" else "")


def probe(engine: Engine, image_id: str) -> dict[str, object]:
    r = engine.run(image_id, [], entrypoint=["/opt/venv/bin/python", "-c", PROBE], timeout=300,
                   environment={"CUDA_VISIBLE_DEVICES": ""})
    if r.exit_code != 0:
        raise EngineError(f"probing the built image failed (exit {r.exit_code}):\n{r.output[-2000:]}")
    line = r.output.strip().splitlines()[-1]
    data = json.loads(line)
    assert isinstance(data, dict)
    return data


class _Builder:
    """Builds cells, sharing one engine, one BuildKit CLI lookup and one base lock."""

    def __init__(self, engine: Engine, cfg: BuildConfig, on_line: Callable[[str, str], None]) -> None:
        self.engine = engine
        self.cfg = cfg
        self.on_line = on_line
        self._cli: BuildkitCli | None = None
        self._cli_checked = False
        self._lock = threading.Lock()
        self.stop = threading.Event()

    def cli(self) -> BuildkitCli | None:
        with self._lock:
            if not self._cli_checked:
                self._cli = find_buildkit_cli()
                self._cli_checked = True
                if self._cli is None:
                    log.warning("no docker CLI with BuildKit found; using the classic builder "
                                "(no cache mounts, no build secrets)")
        return self._cli

    def base_id(self, spec: ImageSpec) -> str:
        with self._lock:  # two cells on one base must not bootstrap it twice
            if not self.engine.image_exists(spec.base):
                if self.cfg.dry_run:
                    return "absent"
                base_mod.ensure(self.engine, spec, self.cfg.mirror)
            return self.engine.image_id(spec.base)

    def _run_build(self, spec: ImageSpec, dockerfile: Path, log_path: Path, no_cache: bool) -> BuildOutcome:
        with secret_files(self.cfg.build_env) as secrets:
            req = BuildRequest(ROOT, dockerfile, {"project": "pt-multi-gpu", f"{LABEL_NS}.cell": spec.name},
                               secrets, log_path, no_cache)
            return self.engine.build(req, lambda line: self.on_line(spec.name, line), self.cli())

    def _on_current_base(self, spec: ImageSpec, image_id: str) -> bool:
        base = self.engine.rootfs_layers(spec.base)
        return self.engine.rootfs_layers(image_id)[: len(base)] == base

    def build(self, spec: ImageSpec) -> CellResult:
        if self.stop.is_set():
            return CellResult(spec.name, "not-run", message="skipped after an earlier failure (use --keep-going)")
        start = time.monotonic()
        log_path = self.cfg.log_dir / f"{spec.name}.log"
        try:
            result = self._build(spec, log_path, start)
        except (EngineError, base_mod.BaseError) as exc:
            result = CellResult(spec.name, "failed", time.monotonic() - start, message=str(exc), log_path=log_path)
        if result.status == "failed" and not self.cfg.keep_going:
            self.stop.set()
        return result

    def _build(self, spec: ImageSpec, log_path: Path, start: float) -> CellResult:
        (rendered,) = render.plan([spec], self.cfg.docker_dir, self.cfg.source)
        dockerfile, text = rendered.path, rendered.text
        if not self.cfg.dry_run and render.write([rendered]):
            # The Dockerfile is derived data: keep it current, and say so (`render --check` shows it in git).
            log.info("%s: rendered %s", spec.name, dockerfile)
        digest = inputs_hash(text, context_files(), self.base_id(spec))
        if not self.cfg.force and self.engine.image_exists(spec.ref) \
                and self.engine.image_labels(spec.ref).get(HASH_LABEL) == digest:
            if spec.latest:
                self.engine.tag(spec.ref, f"{spec.repository}:latest")
            return CellResult(spec.name, "skipped", time.monotonic() - start, self.engine.image_size(spec.ref),
                              self.engine.image_id(spec.ref), "unchanged (inputs hash matches)")
        if self.cfg.dry_run:
            return CellResult(spec.name, "would-build", message=f"inputs {digest[:19]} differ from {spec.ref}")
        outcome = self._run_build(spec, dockerfile, log_path, self.cfg.no_cache)
        if outcome.ok and outcome.image_id and not self._on_current_base(spec, outcome.image_id):
            # Seen with dockerd 20.10's BuildKit after a base was re-made under the same name:
            # cached layers from the old base were reused. Never ship that; rebuild uncached.
            log.warning("%s: the build reused layers of an older %s; rebuilding without the layer cache",
                        spec.name, spec.base)
            outcome = self._run_build(spec, dockerfile, log_path, no_cache=True)
        if not outcome.ok or outcome.image_id is None:
            return CellResult(spec.name, "failed", time.monotonic() - start,
                              message=_failure_text(outcome.failed_step, outcome.tail, log_path), log_path=log_path)
        probed = probe(self.engine, outcome.image_id)
        mismatches = check_probe(spec, probed)
        if mismatches:
            return CellResult(spec.name, "failed", time.monotonic() - start,
                              message="the built image does not match images.yaml:\n  " + "\n  ".join(mismatches),
                              log_path=log_path)
        image_id = self.engine.relabel(outcome.image_id, labels_for(spec, probed, digest, outcome.builder), spec.ref)
        if spec.latest:
            self.engine.tag(image_id, f"{spec.repository}:latest")
        return CellResult(spec.name, "built", time.monotonic() - start, self.engine.image_size(spec.ref), image_id,
                          f"{outcome.builder}", log_path)


def _failure_text(step: str, tail: Sequence[str], log_path: Path) -> str:
    lines = [f"failed step: {step}" if step else "the build failed", "last lines:"]
    lines += [f"  | {t}" for t in tail[-30:]]
    lines.append(f"full log: {log_path}")
    return "\n".join(lines)


def build_all(engine: Engine, cells: Sequence[ImageSpec], cfg: BuildConfig,
              on_line: Callable[[str, str], None]) -> list[CellResult]:
    """Build every cell (in parallel with cfg.jobs > 1); results in the order of `cells`."""
    builder = _Builder(engine, cfg, on_line)
    with ThreadPoolExecutor(max_workers=max(1, cfg.jobs)) as pool:
        return list(pool.map(builder.build, cells))
