"""The build's side of locked installs: check a cell's lock, fill the wheel store, stage the build context.

For one cell, in order (orchestrate.py calls these):

1. :func:`lock_state` (offline, milliseconds; before the skip-unchanged check): the lock must exist
   and agree with images.yaml (else the cell fails with the difference and `build.py lock`);
   its digest and the build-host uv wheel's sha256 go into the inputs hash.
2. Only when the cell is built, one of two ways for the wheels to reach the installing RUNs
   (:func:`transport`):

   - :func:`prepare` (``context``): verify or download the lock's wheels and uv into the host's
     wheel store (the host's index, proxy and CA settings: the build's own), then stage them with
     the copied files into the slot's context folder. BuildKit copies the whole context in before
     any RUN starts.
   - :func:`served` (``server``, buildx builders): stage the context without the wheels, start a
     wheel server on the engine's bridge address (builder.lock.wheelserver) and fetch the wheels
     into the store while the build runs: the fetch overlaps the build's Python stage and the user's
     RUN (the venv's RUNs come next), and the 3 GB never enter the context.

The classic builder cannot bind-mount the staged wheels into a RUN; such builds are refused
(:data:`CLASSIC_REFUSAL`) rather than installing from anywhere else.
"""

from __future__ import annotations

import fcntl
import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from builder.common.errors import InputError, StepFailed
from builder.common.log import log
from builder.imaging.buildenv import BuildEnv, bundle, public_roots
from builder.lock import check, model, staging, uvbin, wheelserver
from builder.lock.model import CellLock
from builder.lock.net import NetConfig
from builder.lock.store import FetchStats, Store, default_store
from builder.matrix import ImageSpec
from builder.render.dockerfile import INSTALL_LAYERS

CLASSIC_REFUSAL = ("the classic builder cannot bind-mount the locked, hash-checked wheels into the installing "
                   "RUNs, and this project installs from nothing else; build with BuildKit: Docker's `docker` "
                   "CLI < 23 with DOCKER_BUILDKIT=1 (Debian's docker.io) or any CLI with the buildx plugin")


def net_config(build_env: BuildEnv) -> NetConfig:
    """The host network settings a build carries (index, proxies, CAs), for the host-side fetch too."""
    return NetConfig(dict(build_env.env), bundle(build_env, public_roots()) if build_env.has_ca else b"")


@dataclass(frozen=True)
class LockState:
    lock: CellLock
    path: Path
    digest: str  # sha256 of the lock file's text
    uv_sha256: str  # the build host's uv wheel

    @property
    def inputs(self) -> str:
        """What the inputs hash adds for the lock: the lock file and the uv that installs from it."""
        return f"{self.digest} uv:{self.uv_sha256}"


def lock_state(spec: ImageSpec, lock_root: Path) -> LockState:
    """The cell's lock, checked against images.yaml; InputError names the difference and the fix."""
    lock, problems = check.check_cell(spec, lock_root)
    if problems or lock is None:
        raise InputError(*problems, f"the lock of {spec.name} does not match images.yaml; fix: run "
                         f"`build.py lock --only {spec.name}` and commit locks/")
    path = model.lock_path(lock_root, spec.name)
    text = path.read_text(encoding="utf-8")
    return LockState(lock, path, model.digest(text), uvbin.host_wheel(lock_root).sha256)


class Slots:
    """One context folder per parallel build: ``.build/context-<n>``. Two builds never share one:
    within a process, n < jobs is handed out once at a time; across processes (two `build.py
    build` at once, e.g. `make images` in one terminal and `--only X` in another) each folder is
    held by an exclusive flock on ``.build/context-<n>.lock``, and a taken one is passed over for
    the next free n (n, n + jobs, n + 2 jobs, ...). The kernel drops a dead process's lock."""

    def __init__(self, root: Path, jobs: int) -> None:
        self.root = root
        self.jobs = max(1, jobs)
        self._free: queue.Queue[int] = queue.Queue()
        for n in range(self.jobs):
            self._free.put(n)

    @contextmanager
    def slot(self) -> Iterator[Path]:
        n = self._free.get()
        try:
            with self._locked_folder(n) as folder:
                yield folder
        finally:
            self._free.put(n)

    @contextmanager
    def _locked_folder(self, n: int) -> Iterator[Path]:
        k = n
        while True:
            folder = staging.context_dir(self.root, k)
            folder.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder.with_name(folder.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                k += self.jobs  # another process builds in this one
                continue
            try:
                yield folder
            finally:
                os.close(fd)  # releases the lock
            return


def facts(spec: ImageSpec) -> dict[str, str]:
    """The cell's own components for the SBOM (what its labels say: the probe checks them after the build)."""
    return {"cell": spec.name, "repository": spec.repository, "tag": spec.tag, "torch": spec.torch,
            "torchvision": spec.torchvision, "cuda": spec.cuda, "cudnn": spec.cudnn, "nccl": spec.nccl or "",
            "python": spec.python, "platform": spec.platform, "flavour": spec.flavour, "base": spec.base}


CONTEXT, SERVER = "context", "server"
TRANSPORT_ENV = "PTMG_WHEEL_TRANSPORT"


def transport(buildx: bool, environ: Mapping[str, str]) -> str:
    """How the wheels reach the RUNs: ``server`` where the builder is buildx, ``context`` for Debian
    12's 20.10 CLI (exactly as it always has). ``PTMG_WHEEL_TRANSPORT=context|server`` chooses
    (benchmarks compare the two on one engine)."""
    given = environ.get(TRANSPORT_ENV, "").strip()
    if given in (CONTEXT, SERVER):
        return given
    if given:
        raise InputError(f"{TRANSPORT_ENV}={given!r}: not a wheel transport; use {CONTEXT} or {SERVER}")
    return SERVER if buildx else CONTEXT


def server_address(buildx: bool, bridge_gateway: Callable[[], str | None],
                   environ: Mapping[str, str]) -> tuple[str | None, str]:
    """Where the build's wheel server listens (the engine's bridge address), or None when the wheels go
    in the build context; and, in words, how the wheels reach the RUNs and why (`build`, `doctor`)."""
    if transport(buildx, environ) == CONTEXT:
        why = f"{TRANSPORT_ENV}={CONTEXT}" if environ.get(TRANSPORT_ENV, "").strip() else "Debian 12's 20.10 CLI"
        return None, f"in the build context ({why})"
    gateway = bridge_gateway()
    if gateway and wheelserver.bindable(gateway):
        return gateway, f"from build.py's wheel server on the engine's bridge address ({gateway}), not in the context"
    return None, (f"in the build context: the engine's bridge address ({gateway or 'none'}) is not one of this "
                  "host's (a remote engine?)")


def _context_files(spec: ImageSpec, state: LockState, lock_root: Path, store: Store) -> tuple[bytes, dict[str, object]]:
    """The host's uv (fetched and verified first: the context needs it) and the SBOM's input."""
    uv_wheel = uvbin.host_wheel(lock_root)
    store.ensure([uv_wheel])
    return (uvbin.binary(store.file(uv_wheel)),
            staging.sbom_input(state.lock, facts(spec), state.path.relative_to(lock_root).as_posix(), state.digest))


def _log_fetch(spec: ImageSpec, store: Store, stats: FetchStats, when: str) -> None:
    if stats.downloaded:
        log.info("%s: %d wheel(s) downloaded (%.2f GB) in %.1f s%s, %d already in %s", spec.name, stats.downloaded,
                 stats.bytes_downloaded / 1e9, stats.seconds, when, stats.present, store.path)


def prepare(spec: ImageSpec, state: LockState, ctx: Path, root: Path, lock_root: Path, files: Sequence[Path],
            net: NetConfig, store_path: Path | None = None) -> None:
    """Fill the store with the cell's wheels and the host's uv (verified), then stage the context ``ctx``."""
    store = Store(store_path or default_store(), net)
    wheels = [p.wheel for p in state.lock.packages]
    _log_fetch(spec, store, store.ensure(wheels), "")
    uv, sbom = _context_files(spec, state, lock_root, store)
    staging.stage(ctx, root, files, state.lock, {w.filename: store.file(w) for w in wheels}, uv, sbom)


@contextmanager
def served(spec: ImageSpec, state: LockState, ctx: Path, root: Path, lock_root: Path, files: Sequence[Path],
           net: NetConfig, store_path: Path | None = None,
           host: str = "127.0.0.1") -> Iterator[wheelserver.WheelServer]:
    """Stage ``ctx`` without the wheels, and serve them on ``host`` while they are fetched into the
    store; the body runs the build. A failed fetch raises its own error after the build (whose
    install RUN got a 503 for that wheel), so the cell fails with the cause, not uv's symptom."""
    store = Store(store_path or default_store(), net)
    uv, sbom = _context_files(spec, state, lock_root, store)
    staging.stage(ctx, root, files, state.lock, None, uv, sbom)
    layers = {layer: [p.wheel.filename for p in state.lock.install_layer(layer)] for layer in INSTALL_LAYERS}
    failed: list[StepFailed] = []
    with wheelserver.serve(store.path, layers, host) as server:

        def fetch() -> None:
            try:
                stats = store.ensure([p.wheel for p in state.lock.packages], on_ready=server.ready)
            except StepFailed as exc:
                failed.append(exc)
                server.fail_all(str(exc).splitlines()[0])
            except Exception as exc:  # a bug in the fetch: fail the cell with it, never leave a RUN waiting
                failed.append(StepFailed(f"the host's wheel fetch stopped: {exc!r}"))
                server.fail_all(f"the host's wheel fetch stopped: {exc!r}")
            else:
                _log_fetch(spec, store, stats, " while the build ran")

        fetcher = threading.Thread(target=fetch, name=f"ptmg-fetch-{spec.name}", daemon=True)
        fetcher.start()
        yield server
        fetcher.join()
        files_sent, sent = server.served
        log.info("%s: the build's RUNs took %d wheel file(s) (%.2f GB) from the wheel server at %s",
                 spec.name, files_sent, sent / 1e9, server.url)
    if failed:
        raise failed[0]
