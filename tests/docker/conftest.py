"""Shared fixtures for the docker tier (tests/conftest.py marks every test here `docker`):
a Docker client, the image under test, and factories for containers and networks that
label everything they make and remove it again, even when a test fails.

Modelled on jupyter/docker-stacks tests/utils/tracked_container.py. Only objects
carrying this session's label are ever removed; nothing unlabelled is touched. No test here
passes by skipping (tests/skipguard.py): an unmarked skip fails, the `gpu` tests off a GPU runner
excepted, and the run's summary names every skip with its reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest
from docker.models.containers import Container
from docker.models.networks import Network

from tests import skipguard

from . import cellimage, layerscan, sessions
from .background import Job, Step
from .cellimage import BuiltCell
from .layerscan import SavedImage

LOGGER = logging.getLogger(__name__)
ARTIFACTS = Path(os.environ.get("PTMG_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
PROJECT_LABEL = {"project": "pt-multi-gpu"}
ENGINE_FIX = ("no Docker engine answers. Fix: run `bash scripts/ensure-docker.sh` (starts "
              "dockerd as root on Debian), or point DOCKER_HOST at a running engine.")


@pytest.fixture(scope="session")
def session_labels() -> dict[str, str]:
    """Labels put on every container/network/volume this test session creates."""
    return {**PROJECT_LABEL, "session": sessions.SESSION}


@pytest.fixture(scope="session")
def docker_client(request: pytest.FixtureRequest, session_labels: dict[str, str]) -> Iterator[docker.DockerClient]:
    """A client that answers, or a FAILED test with the fix: never a silent skip. Before anything is made,
    this session is marked alive and what killed sessions left is removed (tests/docker/sessions.py)."""
    try:
        client = docker.from_env(version="auto", timeout=120)
        client.ping()
    except Exception as exc:
        pytest.fail(f"{ENGINE_FIX} ({type(exc).__name__}: {exc})", pytrace=False)
    sessions.hold()
    sessions.sweep(client, lambda line: _say(request, line))
    yield client
    _remove_session_objects(client, session_labels)
    client.close()


def _say(request: pytest.FixtureRequest, line: str) -> None:
    """A line on the terminal now, past pytest's output capture (a fixture's print would be swallowed)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        LOGGER.warning("%s", line)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)


def _remove_session_objects(client: docker.DockerClient, labels: dict[str, str]) -> None:
    """Session finalizer: remove anything still carrying this session's label (images too)."""
    flt = {"label": f"session={labels['session']}"}
    for c in client.containers.list(all=True, filters=flt):
        LOGGER.warning("removing leftover container %s", c.name)
        _quietly(c.remove, force=True, v=True)
    for n in client.networks.list(filters=flt):
        LOGGER.warning("removing leftover network %s", n.name)
        _quietly(n.remove)
    for v in client.volumes.list(filters=flt):
        LOGGER.warning("removing leftover volume %s", v.name)
        _quietly(v.remove, force=True)
    # Images a test built (stand-ins, test-only layers) and the classic builder's intermediate images
    # under them: newest first, so a child goes before the image it was built on. Cell images that
    # build.py made carry the project label only, never this session's, and stay.
    made = client.images.list(all=True, filters=flt)
    for image in sorted(made, key=lambda i: str(i.attrs.get("Created", "")), reverse=True):
        LOGGER.info("removing test image %s %s", image.short_id, image.tags)
        _quietly(client.images.remove, image.id, force=True)


def _quietly(fn: Any, *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as exc:
        LOGGER.warning("cleanup: %s", exc)


#: Modules that test every native cell: when the session runs one, the other native cells are
#: built in the background from the start (background.py).
NATIVE_FOR = ("test_hpc.py", "test_supply.py", "test_training_features.py")
#: The modules that may use those cells: NATIVE_FOR, and test_arm64 (its publish names the amd64 twin of
#: the arm64 cell, AMD; stand-ins today, so it is here to be safe). After the last of them, the native
#: cells that this session built (no image of that name was here before it) are removed again
#: (:func:`drop_session_native_cells`): nothing after uses them, and their ~13 GB would otherwise sit
#: under the second engine's cold builds and the export.
USE_NATIVE = (*NATIVE_FOR, "test_arm64.py")
#: Modules that run after NATIVE_FOR, in this order, the disk's largest users one at a time:
#: - test_arm64: its heavy work (the arm64 cell's emulated build and test, ~20 min of qemu) runs in
#:   the background from the session's start, so by now it has long finished; its module then
#:   removes that image and the aarch64-only wheels (~8 GB), before the second engine needs the disk;
#: - test_modern_engine: the second engine's cold builds (its data-root peaks at about 19 GB in the
#:   containerd store: the shared trees' stages beside the image and its compressed blobs) wait until
#:   the native cells' builds are done and their build cache is dropped, and end before the export
#:   holds its 4 GB;
#: - test_hpc_export needs ~10 GB for a while (an unpacked root and its squashfs); test_pyxis and
#:   test_enroot run the same squashfs (exported_sqsh, held until the session ends), and test_enroot
#:   enroot's own import of the image, after it. Any module that takes exported_sqsh runs here: run
#:   earlier, it would hold the 4 GB export beside every build of the session.
#: - test_sessions starts a second tier session (what a user's next `make test` does after a killed one),
#:   whose module ends prune the build cache: it runs when no background build does.
RUN_LAST = ("test_arm64.py", "test_modern_engine.py", "test_hpc_export.py", "test_pyxis.py", "test_enroot.py",
            "test_sessions.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules in NATIVE_FOR after the others (the background build of the native cells
    overlaps those), then RUN_LAST in its order; stable: each group keeps its order."""
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        if name in RUN_LAST:
            return 2 + RUN_LAST.index(name)
        return int(name in NATIVE_FOR)
    items.sort(key=rank)


#: No docker test passes by skipping: an unmarked skip or xfail fails, but for the `gpu` tests off a
#: GPU runner (PTMG_GPU_TESTS=1 unset). The summary lists every skip with its reason, one line each.
pytest_runtest_makereport = skipguard.docker_tier_report
pytest_make_collect_report = skipguard.docker_tier_collect_report
pytest_terminal_summary = skipguard.docker_tier_summary


#: Free disk the tier needs at its start where the engine keeps its data, in GB. A run from an empty engine
#: went from 80 GB free down to 22 (its peak: ~58 GB); one right after `make images`, whose cells it reuses,
#: from ~51 down to 22. With less, it fills the disk part-way: a build or a selftest fails on ENOSPC
#: far from the cause, and the rest of the run waits out timeouts.
FREE_GB_NEEDED = {"empty": 50, "with the cells": 25}


def disk_shortfall(free_gb: float, cells_present: bool) -> str | None:
    """Why the tier would fill the disk from here, or None."""
    state = "with the cells" if cells_present else "empty"
    need = FREE_GB_NEEDED[state]
    if free_gb >= need:
        return None
    return (f"the docker tier needs {need} GB free on the engine's disk to start ({state} engine: images.yaml's "
            f"cells {'are' if cells_present else 'are not'} built), and it has {free_gb:.1f} GB; it would fill the "
            "disk part-way. Fix: free space (docker image prune -a; docker builder prune -a; old runs' "
            "/var/tmp/ptmg-* folders), then run it again")


@pytest.fixture(scope="session", autouse=True)
def background_work(request: pytest.FixtureRequest, docker_client: docker.DockerClient,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    items = request.session.items
    from builder.matrix import load_matrix

    cells = load_matrix(cellimage.ROOT / "images.yaml").cells
    native_needed = any(item.path.name in NATIVE_FOR for item in items) and not os.environ.get("PTMG_TEST_IMAGE")
    arm64_needed = any(item.path.name in RUN_LAST and "arm_image" in getattr(item, "fixturenames", ())
                       for item in items)
    whole_tier = native_needed or arm64_needed  # its disk is checked (a module or a -k alone needs far less)
    present = _local_tags(docker_client, list(cells)) if whole_tier else set()  # cells' tags already here
    if whole_tier:
        root = docker_client.info().get("DockerRootDir") or "/"
        why = disk_shortfall(shutil.disk_usage(root).free / 1e9, bool(present))
        if why is not None:
            pytest.exit(f"{root}: {why}", returncode=2)
    from tests.docker import test_arm64

    build_py = (sys.executable, str(cellimage.ROOT / "build.py"))
    try:
        if native_needed:
            own = os.environ.get("PTMG_TEST_CELL", cellimage.DEFAULT_CELL)  # built_cell builds it --no-cache
            others = [c for c in cells if not c.emulated and c.name != own]
            native = [a for c in others for a in ("--only", c.name)]
            SESSION_NATIVE[:] = session_native_refs(others, present)
            cellimage.JOBS[cellimage.NATIVE] = Job(
                cellimage.NATIVE, [Step("build", (*build_py, "build", *native), timeout=5400)],
                ARTIFACTS / "background-native.log").start()
        if arm64_needed:
            cellimage.JOBS[cellimage.ARM64] = test_arm64.background_job(
                docker_client, build_py, tmp_path_factory, ARTIFACTS / "background-arm64.log").start()
        yield
    finally:
        for job in cellimage.JOBS.values():
            job.stop()
        arm = cellimage.JOBS.get(cellimage.ARM64)
        if arm is not None:
            test_arm64.clean_up(arm, docker_client)  # a no-op when its module did it
        cellimage.JOBS.clear()


#: The refs the background build of the native cells may make that no image had before this session:
#: removed after the last USE_NATIVE module (drop_session_native_cells).
SESSION_NATIVE: list[str] = []


def session_native_refs(cells: list[Any], present: set[str]) -> list[str]:
    """Of the background build's cells, the refs (each cell's, and `latest` where it is the cell that
    takes it) that were not in the engine when the session started: what the session will have made.
    A ref that was there stays, whatever the session builds under it (a user's `make images`)."""
    refs = [c.ref for c in cells] + [f"{c.repository}:latest" for c in cells if c.latest]
    return [r for r in refs if r not in present]


def last_native_user(module: str, order: list[str]) -> bool:
    """Whether `module` is the last USE_NATIVE module of the session, whose test items run in `order`
    (one entry per item: a module's name repeats)."""
    if module not in USE_NATIVE or module not in order:
        return False
    after = len(order) - order[::-1].index(module)
    return not any(m in USE_NATIVE for m in order[after:])


def _local_tags(client: docker.DockerClient, cells: list[Any]) -> set[str]:
    return {tag for repo in {c.repository for c in cells} for image in client.images.list(name=repo)
            for tag in image.tags}


def drop_session_native_cells(request: pytest.FixtureRequest, client: docker.DockerClient) -> None:
    """After the session's last module in USE_NATIVE: remove the native cells its background build made
    (SESSION_NATIVE), once that build has ended. Nothing after uses them (the second engine's module and
    the export's run the session's own cell), and in a run from an empty engine they hold ~13 GB beside
    the second engine's cold builds and the export."""
    if not SESSION_NATIVE or not last_native_user(request.node.path.name,
                                                  [item.path.name for item in request.session.items]):
        return
    cellimage.wait_for_native_cells()
    removed: list[str] = []
    for ref in SESSION_NATIVE:
        try:
            client.images.remove(ref)
        except docker.errors.ImageNotFound:
            continue
        except docker.errors.APIError as exc:
            LOGGER.warning("removing %s: %s", ref, exc)
            continue
        removed.append(ref)
    SESSION_NATIVE.clear()
    _disk_note(request, f"removed the native cells this session built ({', '.join(removed) or 'none left'}; "
                        "`make images` keeps them)")


def _disk_note(request: pytest.FixtureRequest, text: str) -> None:
    """A line of test-artifacts/disk-usage.txt: the time, the module just ended, what was done."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with (ARTIFACTS / "disk-usage.txt").open("a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} after {request.node.name}: {text}\n")


@pytest.fixture(scope="module", autouse=True)
def reclaim_build_cache(request: pytest.FixtureRequest, docker_client: docker.DockerClient) -> Iterator[None]:
    """After each module: drop the build cache's layers that no image holds any more (a test's
    throwaway image, a cell image a rebuild replaced), and note the disk in
    test-artifacts/disk-usage.txt. Cache mounts (apt) and build contexts stay, and so does every
    layer an image uses. The tier's images take ~40 GB on machines with 50-80 GB free; without
    this, one run's leftovers (~6 GB per rebuilt cell) can fill the disk before the last module.
    After the last module that uses the native cells, the ones this session built go first."""
    yield
    drop_session_native_cells(request, docker_client)
    busy = cellimage.building()
    if busy:  # never prune under a running build: one that meant to reuse a record would lose it
        _disk_note(request, f"no prune ({', '.join(busy)} still building); "
                            f"{shutil.disk_usage('/').free / 1e9:.1f} GB free on /")
        return
    try:
        freed = int(docker_client.api.prune_builds(filters={"type": "regular"}).get("SpaceReclaimed") or 0)
        free = shutil.disk_usage(docker_client.info().get("DockerRootDir") or "/").free
    except (docker.errors.APIError, OSError) as exc:
        LOGGER.warning("reclaiming build cache: %s", exc)
        return
    _disk_note(request, f"freed {freed / 1e9:.1f} GB of unused build cache; {free / 1e9:.1f} GB free")


@pytest.fixture(scope="session")
def built_cell(docker_client: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory) -> BuiltCell:
    """The real cell image under test, built once per session by `build.py build` (see cellimage.py)."""
    try:
        cell = cellimage.build(tmp_path_factory.mktemp("cell"))
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        docker_client.images.get(cell.ref)
    except docker.errors.ImageNotFound:
        pytest.fail(f"image {cell.ref!r} is not present. Fix: unset PTMG_TEST_IMAGE, or build it "
                    "(`python build.py build --only <cell>`).", pytrace=False)
    return cell


#: The longest wait for a byte of `docker save` of the image under test (a cell of ~6 GB).
SAVE_TIMEOUT_S = 1800


@pytest.fixture(scope="session")
def saved_image(built_cell: BuiltCell) -> SavedImage:
    """The image under test saved and read once (layerscan.py): every blob searched for the build's
    planted secrets, every layer's files listed."""
    # Its own client: 20.10 answers a save's request only once it has gathered the layers, which took over
    # the session client's 120 s read timeout beside the background builds (CI's run of 55a8d22's tree).
    client = docker.from_env(version="auto", timeout=SAVE_TIMEOUT_S)
    try:
        return layerscan.scan(client.images.get(built_cell.ref), built_cell.markers)
    finally:
        client.close()


@pytest.fixture(scope="session")
def test_image(built_cell: BuiltCell) -> str:
    """The image under test: a real CUDA cell from images.yaml ($PTMG_TEST_CELL), or $PTMG_TEST_IMAGE."""
    return built_cell.ref


@pytest.fixture(scope="session")
def exported_sqsh(test_image: str) -> Iterator[Path]:
    """`build.py export --format sqsh` of the image under test, made once for the HPC runtimes that
    run it (test_hpc_export: Charliecloud; test_enroot: enroot), in a private folder other uids can
    traverse (they run as a stranger uid), deleted at the session's end (those modules run last)."""
    folder = sessions.scratch("export-sqsh")
    folder.chmod(0o755)
    out = folder / "image.sqsh"
    # The verb's report for this image (builder/cli/verbs/export.py: build-logs/<stem>.export-<format>.json,
    # the stem from Context.one_image), removed first so an earlier run's cannot stand in for this one's.
    report = cellimage.ROOT / "build-logs" / f"{test_image.replace('/', '_').replace(':', '-')}.export-sqsh.json"
    report.unlink(missing_ok=True)
    try:
        r = subprocess.run([sys.executable, str(cellimage.ROOT / "build.py"), "export", test_image, "--format",
                            "sqsh", "-o", str(out)], cwd=cellimage.ROOT, capture_output=True, text=True,
                           timeout=1800, check=False)
        if r.returncode != 0:
            pytest.fail(f"build.py export failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}", pytrace=False)
        digest = hashlib.sha256()
        with out.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        written = json.loads(report.read_text())
        assert {k: written[k] for k in ("image", "format", "path", "size", "sha256")} == {
            "image": test_image, "format": "sqsh", "path": str(out), "size": out.stat().st_size,
            "sha256": digest.hexdigest()}, written
        assert digest.hexdigest() in r.stdout, r.stdout  # the printed table names the same digest
        yield out
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        report.unlink(missing_ok=True)


class TrackedContainers:
    """Factory for labelled, detached containers that are force-removed at teardown."""

    def __init__(self, client: docker.DockerClient, image: str, labels: dict[str, str]):
        self.client = client
        self.image = image
        self.labels = labels
        self.containers: list[Container] = []

    def run(self, image: str | None = None, command: Any = None, **kwargs: Any) -> Container:
        """docker run -d with this session's labels; kwargs go to containers.run()."""
        kwargs["labels"] = {**kwargs.get("labels", {}), **self.labels}
        kwargs["detach"] = True
        container = self.client.containers.run(image or self.image, command, **kwargs)
        self.containers.append(container)
        LOGGER.info("started %s (%s) command=%r", container.name, image or self.image, command)
        return container

    def run_and_wait(self, command: Any = None, timeout: float = 120, image: str | None = None,
                     **kwargs: Any) -> tuple[int, str]:
        """Run to completion within `timeout` seconds; return (exit status, logs).
        A container still running at the timeout is killed and the test fails."""
        container = self.run(image, command, **kwargs)
        try:
            result = container.wait(timeout=timeout)
        except Exception as exc:  # requests' ReadTimeout/ConnectionError
            logs = container.logs().decode(errors="replace")
            _quietly(container.remove, force=True)
            pytest.fail(f"container {command!r} still running after {timeout} s ({exc}); "
                        f"logs:\n{logs[-4000:]}")
        return int(result["StatusCode"]), container.logs().decode(errors="replace")

    def remove_all(self) -> None:
        for container in reversed(self.containers):
            _quietly(container.remove, force=True, v=True)
        self.containers.clear()


@pytest.fixture
def container(docker_client: docker.DockerClient, test_image: str,
              session_labels: dict[str, str]) -> Iterator[TrackedContainers]:
    """`container.run(image=None, command=None, **docker_run_kwargs) -> Container`."""
    tracked = TrackedContainers(docker_client, test_image, session_labels)
    try:
        yield tracked
    finally:
        tracked.remove_all()


@pytest.fixture
def network(docker_client: docker.DockerClient,
            session_labels: dict[str, str]) -> Iterator[Any]:
    """`network(name=None, **kwargs) -> Network`: a labelled network, removed at teardown
    (after disconnecting/removing this session's containers still attached to it)."""
    made: list[Network] = []

    def create(name: str | None = None, **kwargs: Any) -> Network:
        kwargs["labels"] = {**kwargs.get("labels", {}), **session_labels}
        net = docker_client.networks.create(name or f"ptmg-test-{uuid.uuid4().hex[:12]}", **kwargs)
        made.append(net)
        return net

    try:
        yield create
    finally:
        for net in reversed(made):
            try:
                net.reload()
                for c in net.containers:
                    if c.labels.get("session") == session_labels["session"]:
                        _quietly(c.remove, force=True, v=True)
            except docker.errors.NotFound:
                continue
            _quietly(net.remove)

