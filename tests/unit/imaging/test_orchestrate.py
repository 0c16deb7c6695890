"""Security updates in `build.py build`, against a fake engine: the archive's state is the OS layer's build arg
and part of the inputs hash; the image gets the patch-level labels from its OS layer's own
record; an unchanged matrix on an unchanged Debian is a no-op, a new security upload is not;
offline, the recorded snapshot keeps it a no-op; a base without the security suite is refused.
"""

from __future__ import annotations

import contextlib
import json
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import ptmg_contract as contract
from builder.engine import BuildOutcome, BuildRequest, EngineError
from builder.engine.model import RunResult
from builder.imaging import orchestrate, os_snapshot, supply
from builder.matrix import ImageSpec
from tests.support import MID, ROOT, cell, small_matrix
from tests.unit.imaging.test_os_snapshot import Mirror, release
from tests.unit.supply_fakes import lock_for, stub_prepare, write_lock

BASE_ID = "sha256:" + "b" * 64


class FakeEngine:
    """Just what orchestrate uses: images with labels, one build per call, the probe run."""

    def __init__(self, spec: ImageSpec, base_labels: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.images: dict[str, dict[str, Any]] = {spec.base: {"Id": BASE_ID, "labels": base_labels or {
            contract.LABEL_BASE_APT_SUITES: "bookworm bookworm-updates bookworm-security"}, "layers": ["base"]}}
        self.builds: list[BuildRequest] = []
        self.base_runs = 0
        self.removed: list[str] = []
        self.contexts_dropped = 0  # after how many builds the kept build contexts were dropped
        self.shared_dropped = 0  # ... and the shared trees' stages
        self.prune_error: Exception | None = None

    def image_exists(self, ref: str) -> bool:
        return ref in self.images

    def bridge_gateway(self) -> str | None:  # only a buildx build asks; these use the 20.10 CLI
        return None

    def image_labels(self, ref: str) -> dict[str, str]:
        return dict(self.images[ref]["labels"])

    def image_id(self, ref: str) -> str:
        return str(self.images[ref]["Id"])

    def image_size(self, ref: str) -> int:
        return 6_000_000_000

    def tag(self, image_id: str, ref: str) -> None:
        self.images[ref] = next(i for i in self.images.values() if i["Id"] == image_id)

    def build(self, req: BuildRequest, on_line: Callable[[str], None], cli: Any) -> BuildOutcome:
        self.builds.append(req)
        image_id = f"sha256:{len(self.builds):064d}"
        self.images[image_id] = {"Id": image_id, "labels": {}, "layers": ["base", "os"]}
        self.last_snapshot = req.build_args.get(contract.OS_SNAPSHOT_ARG, "")
        return BuildOutcome(True, image_id, "buildkit")

    def run(self, image: str, command: list[str], **kw: Any) -> RunResult:
        if image == self.spec.base:  # the base's sources, read in a container
            self.base_runs += 1
            return RunResult(0, "deb http://deb.debian.org/debian bookworm main\n")
        s = self.spec
        record = {"updated": ["2026-12-01T06:00:00Z"], "snapshot": [self.last_snapshot],
                  "suite": ["bookworm-security 2026-11-29T00:53:13Z", "bookworm 2026-07-11T10:16:37Z"]}
        probed = {"torch": s.torch, "torchvision": s.torchvision, "cuda": s.cuda, "cudnn": s.cudnn, "nccl": s.nccl,
                  "python": s.python, "arch_list": list(s.arch_list), "os_patch": record, "os_packages": "sha256:" + "1" * 64,
                  "venv_packages": "sha256:" + "2" * 64}
        return RunResult(0, json.dumps(probed))

    def remove_if_untagged(self, image_id: str) -> bool:
        if any(ref != i["Id"] and i["Id"] == image_id for ref, i in self.images.items()):
            return False  # a tag still names it
        self.removed.append(image_id)
        self.images.pop(image_id, None)
        return True

    def drop_shared_stages(self) -> int:
        self.shared_dropped = len(self.builds)
        return 4_100_000_000

    def drop_build_contexts(self) -> int:
        if self.prune_error is not None:
            raise self.prune_error
        self.contexts_dropped = len(self.builds)
        return 3_200_000_000

    def relabel(self, image_id: str, labels: dict[str, str], ref: str) -> str:
        new = f"{image_id}-labelled"
        self.images[new] = self.images[ref] = {**self.images[image_id], "Id": new, "labels": dict(labels)}
        return new


@pytest.fixture
def spec(tmp_path: Path) -> ImageSpec:
    return cell(small_matrix(tmp_path / "m"), MID)


def build(engine: FakeEngine, spec: ImageSpec, tmp_path: Path, mirror: Mirror, environ: dict[str, str] | None = None,
          monkeypatch: pytest.MonkeyPatch | None = None) -> orchestrate.CellResult:
    lock_root = tmp_path / "lock-root"  # the cell's lock, read and checked as in a real build
    if not (lock_root / "locks" / spec.name).exists():
        write_lock(lock_root, lock_for(spec))
    cfg = orchestrate.BuildConfig(root=ROOT, docker_dir=tmp_path / "docker", log_dir=tmp_path / "logs",
                                  os_snapshots=os_snapshot.Snapshots(environ=environ or {}, get=mirror.get),
                                  lock_root=lock_root)
    (result,) = orchestrate.build_all(engine, [spec], cfg, lambda _c, _l: None)  # type: ignore[arg-type]
    return result


@pytest.fixture(autouse=True)
def no_buildkit_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    stub_prepare(monkeypatch)  # a fake BuildKit CLI; no wheel store filled (the lock is read and checked)


def test_snapshot_keys_the_os_layer_and_labels_the_image(spec: ImageSpec, tmp_path: Path) -> None:
    engine, mirror = FakeEngine(spec), Mirror()
    r = build(engine, spec, tmp_path, mirror)
    assert r.status == "built", r.message
    (req,) = engine.builds
    key = os_snapshot.fetch("bookworm", "amd64", get=Mirror().get).key
    assert req.build_args == {contract.OS_SNAPSHOT_ARG: key}
    dockerfile = req.dockerfile.read_text()
    assert f"ARG {contract.OS_SNAPSHOT_ARG}\n" in dockerfile and key not in dockerfile  # never rendered in
    labels = engine.image_labels(spec.ref)
    assert labels[contract.LABEL_OS_UPDATED] == "2026-12-01T06:00:00Z"
    assert labels[contract.LABEL_OS_SNAPSHOT] == key
    assert labels[contract.LABEL_OS_SUITES] == "bookworm@2026-07-11T10:16:37Z bookworm-security@2026-11-29T00:53:13Z"
    assert labels[contract.LABEL_OS_PACKAGES] == "sha256:" + "1" * 64
    assert labels[contract.LABEL_RECIPE_HASH].startswith("sha256:")
    assert labels[contract.LABEL_RECIPE_HASH] != labels[contract.LABEL_INPUTS_HASH]


def test_unchanged_debian_is_a_no_op_and_a_new_security_upload_is_not(spec: ImageSpec, tmp_path: Path) -> None:
    engine, mirror = FakeEngine(spec), Mirror()
    assert build(engine, spec, tmp_path, mirror).status == "built"
    # The same archive, its security Release re-signed with a new Date: still a no-op.
    mirror.suites["bookworm-security"] = release("bookworm-security", date="Sun, 06 Dec 2026 00:53:13 UTC")
    again = build(engine, spec, tmp_path, mirror)
    assert again.status == "skipped" and len(engine.builds) == 1
    # A new security upload: the next build rebuilds, with a new key for the OS layer.
    first_key = engine.builds[0].build_args[contract.OS_SNAPSHOT_ARG]
    mirror.suites["bookworm-security"] = release("bookworm-security", amd64="f" * 64)
    replaced = engine.image_id(spec.ref)
    rebuilt = build(engine, spec, tmp_path, mirror)
    assert rebuilt.status == "built" and len(engine.builds) == 2
    assert engine.removed == [replaced], "the image the rebuild replaced is not left dangling"
    assert engine.builds[1].build_args[contract.OS_SNAPSHOT_ARG] not in ("", first_key)
    # ... and that is again a no-op.
    assert build(engine, spec, tmp_path, mirror).status == "skipped" and len(engine.builds) == 2


def test_a_build_drops_the_build_contexts_it_leaves_and_a_skip_touches_nothing(spec: ImageSpec,
                                                                               tmp_path: Path) -> None:
    engine, mirror = FakeEngine(spec), Mirror()
    assert build(engine, spec, tmp_path, mirror).status == "built" and engine.contexts_dropped == 1
    assert engine.shared_dropped == 1  # the shared trees' stages too: the image holds their files
    engine.contexts_dropped = engine.shared_dropped = 0
    assert build(engine, spec, tmp_path, mirror).status == "skipped" and engine.contexts_dropped == 0
    assert engine.shared_dropped == 0


def test_a_build_whose_wheels_were_served_keeps_its_context(spec: ImageSpec, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With the wheel server (buildx), the context is only our files; Docker 28's containerd store drops the
    whole layer cache with a pruned context, so it stays (the next build must reuse the venv's layers)."""
    served: list[str] = []

    @contextlib.contextmanager
    def serve(spec: ImageSpec, *a: object, **k: object) -> Iterator[object]:
        served.append(spec.name)
        yield types.SimpleNamespace(secret=tmp_path / "wheel-server", requests=1)

    monkeypatch.setattr(orchestrate._Builder, "_server_host", lambda self: "10.213.28.1")
    monkeypatch.setattr(supply, "served", serve)
    engine = FakeEngine(spec)
    assert build(engine, spec, tmp_path, Mirror()).status == "built"
    assert served == [spec.name] and len(engine.builds) == 1 and engine.contexts_dropped == 0


def test_a_build_stands_when_its_contexts_cannot_be_dropped(spec: ImageSpec, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine(spec)
    engine.prune_error = EngineError("the Docker engine stopped answering (drop_build_contexts): reset")
    assert build(engine, spec, tmp_path, Mirror()).status == "built"
    assert "the build contexts stay in the build cache" in caplog.text


def test_the_override_forces_a_rebuild(spec: ImageSpec, tmp_path: Path) -> None:
    engine, mirror = FakeEngine(spec), Mirror()
    build(engine, spec, tmp_path, mirror)
    r = build(engine, spec, tmp_path, mirror, {"PTMG_OS_SNAPSHOT": "test-newer-suite"})
    assert r.status == "built" and engine.builds[-1].build_args[contract.OS_SNAPSHOT_ARG] == "test-newer-suite"
    assert engine.image_labels(spec.ref)[contract.LABEL_OS_SNAPSHOT] == "test-newer-suite"


def test_offline_an_unchanged_matrix_stays_a_no_op(spec: ImageSpec, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    engine, mirror = FakeEngine(spec), Mirror()
    build(engine, spec, tmp_path, mirror)
    mirror.down = True
    r = build(engine, spec, tmp_path, mirror)
    assert r.status == "skipped" and len(engine.builds) == 1
    assert "did not answer" in caplog.text


def test_a_base_without_the_security_suite_fails_the_build_with_the_fix(spec: ImageSpec, tmp_path: Path) -> None:
    engine = FakeEngine(spec, base_labels={contract.LABEL_BASE_MADE_BY: "debootstrap --variant=minbase bookworm"})
    r = build(engine, spec, tmp_path, Mirror())
    assert r.status == "failed" and engine.builds == []
    assert "lacks bookworm-updates, bookworm-security" in r.message and "build.py base --rebootstrap" in r.message
