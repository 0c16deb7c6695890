"""Build orchestration: inputs hash, skip-unchanged, parallel builds, probe, labels, summary.

The flow for one cell: hash its inputs (with the Debian archive's state); if an image
with that hash exists, skip.
Else make sure the base exists, build (BuildKit, or the classic builder), run
the built image once to read what is really installed, fail on any mismatch
with images.yaml, and only then label and tag it. A failed cell never moves a
tag, so earlier good images stay where they are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import ptmg_contract as contract
from builder.common.errors import InputError, StepFailed
from builder.common.log import log
from builder.common.waiting import announced
from builder.engine import (
    BuildkitCli,
    BuildOutcome,
    BuildRequest,
    Engine,
    EngineError,
    emulation,
    find_buildkit_cli,
    missing_builder,
)
from builder.imaging import base_foreign, base_image, supply
from builder.imaging.buildenv import BuildEnv, secret_files
from builder.imaging.inputs import context_files, git_revision, inputs_hash, recipe_hash
from builder.imaging.os_snapshot import Snapshot, Snapshots
from builder.imaging.probe import check_probe, labels_for, probe
from builder.lock import wheelserver
from builder.matrix import ImageSpec
from builder.matrix.model import DEFAULT_PLATFORM
from builder.render import dockerfile as render


@dataclass(frozen=True)
class BuildConfig:
    """How to build: the flags of `build.py build`, resolved. ``root`` is the project folder."""

    root: Path
    docker_dir: Path
    log_dir: Path
    force: bool = False
    no_cache: bool = False
    jobs: int = 1
    keep_going: bool = False
    build_env: BuildEnv = field(default_factory=lambda: BuildEnv((), ()))
    mirror: str = base_image.DEFAULT_MIRROR
    dry_run: bool = False
    source: str = "images.yaml"
    #: The Debian archive's state per release; None: read from the mirrors (and PTMG_OS_SNAPSHOT).
    os_snapshots: Snapshots | None = None
    #: Where locks/ is (None: root); the host's wheel store (None: PTMG_WHEEL_STORE or the default).
    lock_root: Path | None = None
    wheel_store: Path | None = None


@dataclass(frozen=True)
class CellResult:
    cell: str
    status: str  # built | skipped | failed | not-run | would-build
    seconds: float = 0.0
    size: int | None = None
    image_id: str | None = None
    message: str = ""
    log_path: Path | None = None


@dataclass(frozen=True)
class Export:
    """One reproducible export (:func:`export_reproducible`): the build's outcome, the Debian snapshot and
    SOURCE_DATE_EPOCH it built with, and its inputs hash: the one ``build.py build`` would label the cell's
    image with from the same inputs (``LABEL_INPUTS_HASH``), which is how publish tells that a repro report
    is about the image it pushes."""

    outcome: BuildOutcome
    snapshot: Snapshot
    epoch: int
    inputs: str


@dataclass(frozen=True)
class _Staged:
    """A staged build: its context folder, and the wheel server when one serves the wheels."""

    context: Path
    server: wheelserver.WheelServer | None = None

    @property
    def secrets(self) -> dict[str, Path]:
        return {wheelserver.SECRET_ID: self.server.secret} if self.server is not None else {}

    @property
    def wheels_in_context(self) -> bool:
        """Whether the wheels went through the build context (no wheel server served them)."""
        return self.server is None

    @property
    def unreached(self) -> bool:
        """Whether the build's RUNs never asked the wheel server anything (read while it runs)."""
        return self.server is not None and not self.server.requests


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
        self.snapshots = cfg.os_snapshots or Snapshots(cfg.mirror, environ=os.environ)
        self._os: dict[str, Snapshot] = {}  # cell -> the snapshot its OS layer is keyed on
        self._sources_ok: set[str] = set()  # base image ids whose apt sources passed the check
        self.slots = supply.Slots(cfg.root, cfg.jobs)  # one build context folder per parallel build
        self._host: str | None = None  # the wheel server's address; "" when the wheels go in the context
        self.net = supply.net_config(cfg.build_env)

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
        """The id of the cell's base, made first where it is absent. A cell of another platform also
        names the build host's base of the same name (its `ptmg-native-python` stage compiles the
        bytecode: builder/render/dockerfile.py, NATIVE_PYTHON), made the same way: both ids key its inputs."""
        foreign = spec.platform != DEFAULT_PLATFORM
        cli = self.cli() if foreign else None
        refs = (spec.base_ref, spec.base) if foreign else (spec.base_ref,)
        with self._lock:  # two cells on one base must not bootstrap it twice
            for ref in refs:
                if self.engine.image_exists(ref):
                    continue
                if self.cfg.dry_run:
                    return "absent"
                if ref != spec.base:  # another platform's base: its own name (base_foreign)
                    base_foreign.ensure(self.engine, spec, self.cfg.mirror, cli)
                else:
                    base_image.ensure(self.engine, spec, self.cfg.mirror)
            return " ".join(self.engine.image_id(ref) for ref in refs)

    def _run_build(self, spec: ImageSpec, dockerfile: Path, log_path: Path, no_cache: bool,
                   staged: _Staged, oci_dest: Path | None = None, epoch: int | None = None) -> BuildOutcome:
        with secret_files(self.cfg.build_env) as secrets:
            req = BuildRequest(staged.context, dockerfile, contract.project_labels({contract.LABEL_CELL: spec.name}),
                               {**secrets, **staged.secrets}, log_path, no_cache,
                               platform=None if spec.platform == DEFAULT_PLATFORM else spec.platform,
                               oci_dest=oci_dest, source_date_epoch=epoch)
            snap = self._os.get(spec.name)
            if snap is not None and snap.key:  # the OS layer's cache key; never in the Dockerfile
                req = dataclasses.replace(req, build_args={**req.build_args, contract.OS_SNAPSHOT_ARG: snap.key})
            return self.engine.build(req, lambda line: self.on_line(spec.name, line), self.cli())

    def _render(self, spec: ImageSpec) -> render.Rendered:
        """The cell's Dockerfile, written when it changed (except in a dry run)."""
        (rendered,) = render.plan([spec], self.cfg.docker_dir, self.cfg.source)
        if not self.cfg.dry_run and render.write([rendered]):
            # The Dockerfile is derived data: keep it current, and say so (`render --check` shows it in git).
            log.info("%s: rendered %s", spec.name, rendered.path)
        return rendered

    @contextlib.contextmanager
    def _staged(self, spec: ImageSpec, lock: supply.LockState, files: Sequence[Path]) -> Iterator[_Staged]:
        """A build context folder of this build's alone, with the copied files and the verified wheels:
        in the context, or (a buildx builder) from the wheel server while the build runs."""
        host = self._server_host()
        lock_root = self.cfg.lock_root or self.cfg.root
        with self.slots.slot() as context:
            if host is not None:
                with supply.served(spec, lock, context, self.cfg.root, lock_root, files, self.net,
                                   self.cfg.wheel_store, host) as server:
                    yield _Staged(context, server)
            else:
                supply.prepare(spec, lock, context, self.cfg.root, lock_root, files, self.net, self.cfg.wheel_store)
                yield _Staged(context)

    def _server_host(self) -> str | None:
        """Where the wheel server listens (the engine's bridge address), or None: the wheels go in the
        context (Debian 12's 20.10 CLI; or an engine whose bridge is not on this host)."""
        cli = self.cli()  # takes self._lock itself
        with self._lock:
            if self._host is None:
                host, how = supply.server_address(cli is not None and cli.buildx, self.engine.bridge_gateway,
                                                  os.environ)
                self._host = host or ""
                (log.warning if cli is not None and cli.buildx and not host else log.info)("wheels: %s", how)
            return self._host or None

    def export_oci(self, spec: ImageSpec, dest: Path, log_path: Path) -> Export:
        """One uncached build of the cell into an OCI layout folder, its timestamps clamped to the Debian
        snapshot's epoch (`build.py repro`); the engine's images are untouched."""
        rendered = self._render(spec)
        files = context_files(self.cfg.root)
        lock = supply.lock_state(spec, self.cfg.lock_root or self.cfg.root)
        snap = self.snapshots.for_base(spec.base, spec.os, spec.arch, None, spec.ref)
        epoch = snap.epoch()
        if epoch is None:
            raise StepFailed(f"{spec.name}: the Debian archive's state is not known ({snap.describe()}), so there "
                             "is no SOURCE_DATE_EPOCH to build with; a reproducible build needs the mirrors")
        self._os[spec.name] = snap
        digest = inputs_hash(rendered.text, files, self.base_id(spec), self.cfg.root, snap.key, lock.inputs)
        self._check_sources(spec.base_ref, spec.os)
        before = self.engine.build_records()
        with self._staged(spec, lock, files) as staged:
            outcome = self._run_build(spec, rendered.path, log_path, True, staged, dest, epoch)
            wheels_in_context = staged.wheels_in_context
        self._drop_contexts(spec, wheels_in_context)
        # An uncached build's layers (~9 GB for a cell) help no later build: its own records go, no other's.
        freed = self.engine.drop_build_records(self.engine.build_records() - before)
        log.info("%s: dropped this build's %.1f GB of layer records from the build cache", spec.name, freed / 1e9)
        return Export(outcome, snap, epoch, digest)

    def _drop_contexts(self, spec: ImageSpec, wheels_in_context: bool) -> None:
        """Drop the build contexts a build leaves in BuildKit's cache, where the wheels went through the
        context (~3 GB per cell otherwise, kept for nothing). Where the wheel server served them, the
        context is only our files, and it stays (the engine keeps them in any case in Docker 28's
        containerd image store, where a pruned context takes the whole layer cache with it)."""
        if wheels_in_context:
            self._drop(spec, "the build contexts", self.engine.drop_build_contexts)

    def _drop_shared_stages(self, spec: ImageSpec) -> None:
        """Drop the shared trees' stages (3.4 GB of CUDA wheels for CUDA 13): the image holds their files."""
        self._drop(spec, "the shared trees' stages", self.engine.drop_shared_stages)

    @staticmethod
    def _drop(spec: ImageSpec, what: str, drop: Callable[[], int]) -> None:
        try:  # the build stands either way
            freed = drop()
        except EngineError as exc:
            log.warning("%s: %s stay in the build cache: %s", spec.name, what, exc)
        else:
            if freed:
                log.info("%s: dropped %.1f GB of %s from the build cache", spec.name, freed / 1e9,
                         what.removeprefix("the "))

    def _check_sources(self, ref: str, release: str) -> None:
        """The base lists the release's -updates and -security suites (BaseError with the fix); once per base."""
        base = self.engine.image_id(ref)
        with self._lock:
            if base in self._sources_ok:
                return
        base_image.check_sources(self.engine, ref, release)
        with self._lock:
            self._sources_ok.add(base)

    def build(self, spec: ImageSpec) -> CellResult:
        if self.stop.is_set():
            return CellResult(spec.name, "not-run", message="skipped after an earlier failure (use --keep-going)")
        start = time.monotonic()
        log_path = self.cfg.log_dir / f"{spec.name}.log"
        try:
            result = self._build(spec, log_path, start)
        except (EngineError, base_image.BaseError, StepFailed, InputError) as exc:
            result = CellResult(spec.name, "failed", time.monotonic() - start, message=str(exc), log_path=log_path)
        if result.status == "failed" and not self.cfg.keep_going:
            self.stop.set()
        return result

    def _build(self, spec: ImageSpec, log_path: Path, start: float) -> CellResult:
        if spec.emulated and not self.cfg.dry_run:
            emu = emulation.probe(spec.platform)
            if not emu.ok:
                return CellResult(spec.name, "failed", message=f"{spec.platform} is built under emulation, and "
                                  f"{emu.describe()}\nfix: {emulation.FIX}")
        rendered = self._render(spec)
        dockerfile, text = rendered.path, rendered.text
        files = context_files(self.cfg.root)
        lock = supply.lock_state(spec, self.cfg.lock_root or self.cfg.root)  # the lock agrees with images.yaml
        with announced(f"the Docker engine: the labels of {spec.ref} (docker image inspect)"):
            existing = self.engine.image_labels(spec.ref) if self.engine.image_exists(spec.ref) else None
            replaced = self.engine.image_id(spec.ref) if existing is not None else None
        snap = self.snapshots.for_base(spec.base, spec.os, spec.arch,
                                       (existing or {}).get(contract.LABEL_OS_SNAPSHOT), spec.ref)
        self._os[spec.name] = snap
        with announced(f"the base image {spec.base_ref} (another cell's bootstrap, or the engine)"):
            base = self.base_id(spec)
        digest = inputs_hash(text, files, base, self.cfg.root, snap.key, lock.inputs)
        if not self.cfg.force and existing is not None and existing.get(contract.LABEL_INPUTS_HASH) == digest:
            if spec.latest:
                self.engine.tag(spec.ref, f"{spec.repository}:latest")
            return CellResult(spec.name, "skipped", time.monotonic() - start, self.engine.image_size(spec.ref),
                              self.engine.image_id(spec.ref), "unchanged (inputs hash matches)")
        if self.cfg.dry_run:
            return CellResult(spec.name, "would-build", message=f"inputs {digest[:19]} differ from {spec.ref}")
        if self.cli() is None:
            return CellResult(spec.name, "failed", message=supply.CLASSIC_REFUSAL)
        self._check_sources(spec.base_ref, spec.os)
        with self._staged(spec, lock, files) as staged:
            # The image takes the base's files with COPY --from=<base> / / (its shared trees come first),
            # which BuildKit keys on a checksum of the files it copies: a base re-made under the same name
            # with other files is copied anew, never taken from the cache (checked on 20.10). With FROM <base>,
            # 20.10's BuildKit was seen reusing layers of the older base.
            outcome = self._run_build(spec, dockerfile, log_path, self.cfg.no_cache, staged)
            unreached = staged.unreached
            wheels_in_context = staged.wheels_in_context
        self._drop_contexts(spec, wheels_in_context)
        self._drop_shared_stages(spec)
        if not outcome.ok or outcome.image_id is None:
            message = failure_text(outcome.failed_step, outcome.tail, log_path)
            if unreached and any(wheelserver.SECRET_ID in line or "find-links" in line
                                                    for line in outcome.tail):
                message += ("\nthe install RUN never reached the wheel server on the engine's bridge (a firewall "
                            "between the engine's containers and this host?); to put the wheels in the build "
                            f"context instead: {supply.TRANSPORT_ENV}={supply.CONTEXT}")
            return CellResult(spec.name, "failed", time.monotonic() - start, message=message, log_path=log_path)
        probed = probe(self.engine, outcome.image_id, emulated=spec.emulated)
        mismatches = check_probe(spec, probed)
        if mismatches:
            return CellResult(spec.name, "failed", time.monotonic() - start,
                              message="the built image does not match images.yaml:\n  " + "\n  ".join(mismatches),
                              log_path=log_path)
        labels = labels_for(spec, probed, digest, outcome.builder, git_revision(self.cfg.root), render.PROJECT_URL,
                            recipe=recipe_hash(text, files, self.cfg.root, lock.digest))
        image_id = self.engine.relabel(outcome.image_id, labels, spec.ref)
        if spec.latest:
            self.engine.tag(image_id, f"{spec.repository}:latest")
        if replaced and replaced != image_id and self.engine.remove_if_untagged(replaced):
            # A rebuild (a new Debian security release, an edit) would otherwise leave ~6 GB behind
            # per cell as a dangling image. One still in use by a container stays.
            log.info("%s: removed the image this build replaced (%s)", spec.name, replaced[:19])
        return CellResult(spec.name, "built", time.monotonic() - start, self.engine.image_size(spec.ref), image_id,
                          f"{outcome.builder}", log_path)


def failure_text(step: str, tail: Sequence[str], log_path: Path) -> str:
    lines = [f"failed step: {step}" if step else "the build failed", "last lines:"]
    lines += [f"  | {t}" for t in tail[-30:]]
    lines.append(f"full log: {log_path}")
    return "\n".join(lines)


def export_reproducible(engine: Engine, spec: ImageSpec, cfg: BuildConfig, dest: Path, log_path: Path,
                        on_line: Callable[[str, str], None]) -> Export:
    """One uncached build of ``spec`` into the OCI layout folder ``dest`` (see :meth:`_Builder.export_oci`)."""
    return _Builder(engine, cfg, on_line).export_oci(spec, dest, log_path)


def build_all(engine: Engine, cells: Sequence[ImageSpec], cfg: BuildConfig,
              on_line: Callable[[str, str], None]) -> list[CellResult]:
    """Build every cell (in parallel with cfg.jobs > 1); results in the order of `cells`."""
    builder = _Builder(engine, cfg, on_line)
    if not cfg.dry_run and builder.cli() is None:
        missing = missing_builder()
        if missing is not None:  # a current CLI without buildx: one line with the fix, nothing built
            raise InputError(missing)
    with ThreadPoolExecutor(max_workers=max(1, cfg.jobs)) as pool:
        return list(pool.map(builder.build, cells))
