"""`build.py repro`: what it needs of the engine, the epoch, the OCI layout and the named differences (pure)."""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import stat
import tarfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from builder.cli.verbs.repro import digest
from builder.common.errors import StepFailed
from builder.engine import buildkit
from builder.engine.capabilities import CLASSIC, CONTAINERD, Store
from builder.imaging import repro
from builder.imaging.os_snapshot import Snapshot, SuiteState


def _cli(tmp_path: Path, buildkit_version: str) -> buildkit.BuildkitCli:
    path = tmp_path / "docker"
    path.write_text("#!/bin/sh\n"
                    'if [ "$2" = version ]; then echo github.com/docker/buildx 0.29.1 x; exit 0; fi\n'
                    f'if [ "$2" = inspect ]; then printf "Name: default\\nBuildKit version: {buildkit_version}\\n"; '
                    "exit 0; fi\nexit 1\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return buildkit.BuildkitCli(str(path), buildkit.BUILDX_ARGS, {})


def test_a_current_engine_in_the_containerd_store_can(tmp_path: Path) -> None:
    assert repro.cannot(_cli(tmp_path, "v0.25.2"), Store(CONTAINERD, "overlayfs"), "1.51") is None


@pytest.mark.parametrize("case", ["no cli", "20.10 cli", "old buildkit", "classic store", "unknown store"])
def test_an_engine_that_cannot_gets_one_line_with_the_fix(tmp_path: Path, case: str) -> None:
    cli = None if case == "no cli" else (buildkit.BuildkitCli("/usr/bin/docker", ("build",), {}) if case == "20.10 cli"
                                         else _cli(tmp_path, "v0.12.5" if case == "old buildkit" else "v0.25.2"))
    store = Store(CLASSIC, "overlay2") if case == "classic store" else (
        Store("unknown", "weird") if case == "unknown store" else Store(CONTAINERD, "overlayfs"))
    line = repro.cannot(cli, store, "1.44")
    assert line is not None and "\n" not in line and "Fix:" in line, line
    want = {"no cli": "buildx", "20.10 cli": "buildx", "old buildkit": ">= 0.13", "classic store": "containerd",
            "unknown store": "containerd"}[case]
    assert want in line


def test_the_epoch_is_the_snapshots_newest_release_date() -> None:
    snap = Snapshot("sha256:k", (SuiteState("bookworm", "2026-07-11T10:16:37Z", "p"),
                                 SuiteState("bookworm-updates", "2026-12-02T02:09:57Z", "p"),
                                 SuiteState("bookworm-security", "2026-12-01T19:40:00Z", "p")))
    assert snap.epoch() == 1796177397  # 2026-12-02T02:09:57Z
    assert Snapshot("sha256:k", (), "PTMG_OS_SNAPSHOT").epoch() is None
    assert Snapshot("", (SuiteState("x", "not a date", "p"),)).epoch() is None
    # a suite whose date does not parse is passed over, and the suites after it still count
    assert Snapshot("sha256:k", (SuiteState("x", "not a date", "p"), *snap.suites)).epoch() == 1796177397


def test_against_takes_only_a_full_sha256_digest() -> None:
    good = "sha256:" + "a" * 64
    assert digest(good) == good
    for bad in ("sha256:" + "A" * 64, "sha256:abc", "a" * 64, "sha512:" + "a" * 128, good + " "):
        with pytest.raises(argparse.ArgumentTypeError, match="not a digest"):
            digest(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="control character"):
        digest(good + "\n")


# --- OCI layouts made here ---------------------------------------------------------------------------
def _tar(files: dict[str, tuple[bytes, int, int]]) -> bytes:
    """name -> (content, mode, mtime)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, (content, mode, mtime) in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(content), mode, mtime
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def _blob(folder: Path, data: bytes) -> str:
    d = hashlib.sha256(data).hexdigest()
    (folder / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (folder / "blobs" / "sha256" / d).write_bytes(data)
    return f"sha256:{d}"


def _layout(folder: Path, layers: list[dict[str, tuple[bytes, int, int]]], label: str = "x") -> repro.OciImage:
    tars = [_tar(files) for files in layers]
    blobs = [_blob(folder, gzip.compress(t, mtime=0)) for t in tars]
    config = _blob(folder, json.dumps({"config": {"Labels": {"l": label}}, "rootfs": {
        "type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(t).hexdigest()}" for t in tars]}}).encode())
    manifest = _blob(folder, json.dumps({"config": {"digest": config}, "layers": [{"digest": b} for b in blobs]}).encode())
    (folder / "index.json").write_text(json.dumps({"manifests": [{"digest": manifest}]}))
    return repro.read_layout(folder)


BASE = {"etc/os-release": (b"debian\n", 0o644, 100)}
OURS = {"opt/venv/a.py": (b"print(1)\n", 0o644, 100), "opt/pt-multi-gpu/os-patch-level": (b"updated: x\n", 0o644, 100)}


def test_two_equal_layouts_have_equal_digests_and_nothing_differs(tmp_path: Path) -> None:
    a, b = _layout(tmp_path / "a", [BASE, OURS]), _layout(tmp_path / "b", [BASE, OURS])
    assert a.manifest_digest == b.manifest_digest and len(a.layers) == 2
    assert repro.differing_files(a, b) == []


def test_the_files_that_differ_are_named_with_what_differs(tmp_path: Path) -> None:
    changed = {**OURS, "opt/pt-multi-gpu/os-patch-level": (b"updated: y\n", 0o644, 100),
               "opt/venv/a.py": (b"print(1)\n", 0o755, 200), "var/log/dpkg.log": (b"log\n", 0o644, 100)}
    a, b = _layout(tmp_path / "a", [BASE, OURS]), _layout(tmp_path / "b", [BASE, changed])
    lines = repro.differing_files(a, b)
    assert lines[0] == "layer 2: 3 path(s) differ"  # layer 1 is the same, so it is not read
    assert "  /opt/pt-multi-gpu/os-patch-level: content differ" in lines
    assert "  /opt/venv/a.py: mode, mtime differ" in lines
    assert "  /var/log/dpkg.log: only in the second build" in lines


def test_a_path_in_one_build_only_is_named_with_the_build_that_has_it() -> None:
    entry = ("0", 0o644, 0, 0, 4, "", 100, "c" * 64)
    a = {"/both": entry, "/gone": entry}
    b = {"/both": (*entry[:6], 200, entry[7]), "/new": entry}
    names = ("the published image", "the rebuild")
    assert list(repro.compare_entries(a, b, names)) == [
        "/both: mtime differ", "/gone: only in the published image", "/new: only in the rebuild"]
    assert list(repro.compare_entries(a, b, names, frozenset({"mtime"}))) == [
        "/gone: only in the published image", "/new: only in the rebuild"]


def test_a_config_only_difference_and_a_layer_count_are_said(tmp_path: Path) -> None:
    a, b = _layout(tmp_path / "a", [BASE, OURS], "one"), _layout(tmp_path / "b", [BASE, OURS], "two")
    assert repro.differing_files(a, b) == ["every layer is the same; the image configs differ (labels, history or "
                                           "created)"]
    c = _layout(tmp_path / "c", [BASE])
    assert repro.differing_files(a, c)[0] == "the first build has 2 layers, the second 1"


def test_a_folder_that_is_not_a_layout_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(repro.LayoutError, match="not a one-image OCI layout"):
        repro.read_layout(tmp_path)
    (tmp_path / "index.json").write_text('{"manifests": [{"digest": "sha256:1"}, {"digest": "sha256:2"}]}')
    with pytest.raises(repro.LayoutError):
        repro.read_layout(tmp_path)


def test_the_verdict_is_same_only_when_every_build_has_the_expected_digest() -> None:
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64

    def verdict(expected: str | None, *digests: str) -> repro.Verdict:
        return repro.Verdict(tuple(repro.Build(d, "sha256:c", 1.0) for d in digests), expected, 0, "k", ())

    assert verdict(None, a, a).same and not verdict(None, a, b).same and not verdict(None, b, a).same
    assert verdict(a, a).same  # --against: the one build is the printed digest
    assert not verdict(b, a).same  # ... or it is not, however it compares with itself


def test_a_long_list_is_cut_and_counted() -> None:
    assert repro.shown([str(i) for i in range(45)])[-1] == "... and 5 more"
    assert repro.shown(["a"]) == ["a"]


# --- dropping one build's layer records, never another's ------------------------------------------------
class _Cache:
    """A BuildKit cache as the engine's API shows it: prune takes one ID and removes a record only when
    nothing built on it is left; `busy` records are never removed."""

    def __init__(self, parents: dict[str, str | None], busy: frozenset[str] = frozenset()) -> None:
        self.parents, self.busy, self.calls = dict(parents), busy, 0
        self.api = self

    def df(self) -> dict[str, object]:
        return {"BuildCache": [{"ID": i, "Type": "regular", "Size": 10} for i in self.parents] +
                              [{"ID": "mount", "Type": "exec.cachemount", "Size": 10}]}

    def prune_builds(self, filters: dict[str, list[str]], all: bool) -> dict[str, object]:
        self.calls += 1
        assert all and len(filters["id"]) == 1, filters  # the engine refuses several IDs in one filter
        rid = filters["id"][0]
        if rid not in self.parents or rid in self.busy or rid in self.parents.values():
            return {"CachesDeleted": None, "SpaceReclaimed": 0}
        del self.parents[rid]
        return {"CachesDeleted": [rid], "SpaceReclaimed": 10}


class _Contexts:
    """An engine's API for the context prune: its store (`docker info`), and the prunes asked of it."""

    def __init__(self, driver_status: list[list[str]]) -> None:
        self.status = driver_status
        self.prunes: list[dict[str, str]] = []
        self.api = self

    def info(self) -> dict[str, object]:
        return {"Driver": "overlayfs" if self.status else "overlay2", "DriverStatus": self.status}

    def prune_builds(self, filters: dict[str, str]) -> dict[str, object]:
        self.prunes.append(filters)
        return {"SpaceReclaimed": 3_200_000_000}


def test_the_containerd_store_keeps_a_context_that_carried_the_wheels(caplog: pytest.LogCaptureFixture) -> None:
    """The wheels through the context (PTMG_WHEEL_TRANSPORT=context, or no wheel server): the classic store
    drops the 3 GB context after the build; the containerd store keeps it, since a pruned context takes the
    whole layer cache with it there."""
    from builder.engine.docker import Engine
    classic = _Contexts([["Backing Filesystem", "extfs"]])
    assert Engine(client=classic, labels={}).drop_build_contexts() == 3_200_000_000
    assert classic.prunes == [{"type": "source.local"}]
    containerd = _Contexts([["driver-type", "io.containerd.snapshotter.v1"]])
    assert Engine(client=containerd, labels={}).drop_build_contexts() == 0
    assert containerd.prunes == []
    assert "stay in the build cache" in caplog.text


class _Stages(_Cache):
    """The cache after a cell's build: its shared trees' stages, the image's own layers, a running build's stage."""

    RUN = "mount / from exec /bin/bash -o pipefail -c umask 0002 && mkdir /tmp/ptmg-uv && ... && sh "

    def __init__(self, driver_status: list[list[str]]) -> None:
        super().__init__({"cuda": None, "torch": None, "venv": None, "torch-layer": None, "other-cuda": None},
                         busy=frozenset({"other-cuda"}))
        self.status = driver_status
        self.descriptions = {
            "cuda": self.RUN + "/ptmg-build/shared-tree.sh cuda /ptmg-out /opt/cuda-wheels 1000 100 315532800",
            "torch": self.RUN + "/ptmg-build/shared-tree.sh torch /tmp/t /ptmg-out /opt/torch-files 1000 100 1",
            "venv": self.RUN + "/ptmg-build/build-python.sh restore /opt/venv",
            "torch-layer": self.RUN + "/ptmg-build/shared-tree.sh link /opt/torch-files /opt/venv/lib/python3.11/site",
            "other-cuda": self.RUN + "/ptmg-build/shared-tree.sh cuda /ptmg-out /opt/cuda-wheels 1000 100 315532800"}

    def info(self) -> dict[str, object]:
        return {"Driver": "overlayfs" if self.status else "overlay2", "DriverStatus": self.status}

    def df(self) -> dict[str, object]:
        return {"BuildCache": [{"ID": i, "Type": "regular", "Size": 10, "InUse": i in self.busy,
                                "Description": self.descriptions[i]} for i in self.parents]}


def test_after_a_build_the_shared_trees_stages_go_and_the_images_layers_stay() -> None:
    """The stage's copy of the CUDA wheels (3.4 GB) is a second one beside the image's: it goes, in the classic
    store; the image's layers (the torch RUN names imagebuild/shared-tree.sh too) and a running build's stage stay."""
    from builder.engine.docker import Engine
    classic = _Stages([["Backing Filesystem", "extfs"]])
    assert Engine(client=classic, labels={}).drop_shared_stages() == 20
    assert set(classic.parents) == {"venv", "torch-layer", "other-cuda"}
    containerd = _Stages([["driver-type", "io.containerd.snapshotter.v1"]])
    assert Engine(client=containerd, labels={}).drop_shared_stages() == 0
    assert len(containerd.parents) == 5 and containerd.calls == 0


def test_a_builds_own_records_go_and_every_other_stays() -> None:
    from builder.engine.docker import Engine
    cache = _Cache({"other": None, "a": None, "b": "a", "c": "b"})
    engine = Engine(client=cache, labels={})
    assert engine.build_records() == {"other", "a", "b", "c"}  # cache mounts are not layer records
    assert engine.drop_build_records({"a", "b", "c"}) == 30
    assert set(cache.parents) == {"other"}


class _Flaky(_Cache):
    """Docker 28's containerd store right after a build: the listing names a read-only mount's view that
    BuildKit is removing, `failures` times, then answers."""

    def __init__(self, failures: int, why: str = "snapshot xe7a1dp47ii6enggb9f3gu1hx-view does not exist: not found"):
        super().__init__({"a": None})
        self.failures, self.why, self.listings = failures, why, 0

    def df(self) -> dict[str, object]:
        import docker.errors

        self.listings += 1
        if self.listings <= self.failures:
            raise docker.errors.NotFound("500 Server Error", explanation=self.why)
        return super().df()


def test_a_listing_that_names_a_gone_snapshot_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from builder.engine import buildcache
    from builder.engine.docker import Engine

    waited: list[float] = []
    monkeypatch.setattr("builder.engine.buildcache.time.sleep", waited.append)
    flaky = _Flaky(failures=2)
    assert Engine(client=flaky, labels={}).build_records() == {"a"}
    assert flaky.listings == 3 and waited == list(buildcache.LISTING_RETRIES[:2])


def test_a_listing_is_asked_again_a_bounded_number_of_times_and_only_for_a_gone_snapshot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from builder.engine import EngineError, buildcache
    from builder.engine.docker import Engine

    waited: list[float] = []
    monkeypatch.setattr("builder.engine.buildcache.time.sleep", waited.append)
    stuck = _Flaky(failures=99)
    with pytest.raises(EngineError, match=r"refused build_records: snapshot .*-view does not exist"):
        Engine(client=stuck, labels={}).build_records()
    assert stuck.listings == len(buildcache.LISTING_RETRIES) + 1 and sum(waited) <= 15
    waited.clear()
    other = _Flaky(failures=1, why="permission denied")
    with pytest.raises(EngineError, match=r"refused build_records: permission denied"):
        Engine(client=other, labels={}).build_records()
    assert other.listings == 1 and waited == []


def test_a_record_that_cannot_go_ends_the_rounds() -> None:
    from builder.engine.docker import Engine
    cache = _Cache({"a": None, "b": "a"}, busy=frozenset({"b"}))
    assert Engine(client=cache, labels={}).drop_build_records({"a", "b"}) == 0
    assert set(cache.parents) == {"a", "b"} and cache.calls == 2


def test_an_engine_that_stops_answering_while_records_are_dropped_is_an_engine_error() -> None:
    import requests

    from builder.engine import EngineError
    from builder.engine.docker import Engine

    class Gone(_Cache):
        def prune_builds(self, filters: dict[str, list[str]], all: bool) -> dict[str, object]:
            raise requests.exceptions.ConnectionError("connection reset")

    with pytest.raises(EngineError, match=r"stopped answering \(drop_build_records\): connection reset"):
        Engine(client=Gone({"a": None}), labels={}).drop_build_records({"a"})


# --- the verb: its exit status, the differing files named, the report --------------------------------
A, B = "sha256:" + "a" * 64, "sha256:" + "b" * 64


@pytest.fixture
def repro_verb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`build.py repro CELL` with the engine and the two builds faked: run(verdict, against) ->
    (exit status, stdout, the error lines logged, the report)."""
    import logging

    from builder.cli.verbs import repro as verb
    from builder.common.log import log
    from builder.imaging import buildenv
    from tests import support

    matrix = support.small_matrix(tmp_path / "m")
    engine = SimpleNamespace(store=lambda: Store(CONTAINERD, "overlayfs"), version=lambda: {"ApiVersion": "1.51"})
    monkeypatch.setattr(verb, "find_buildkit_cli", lambda: None)
    seen: dict[str, Any] = {}
    monkeypatch.setattr(repro, "cannot", lambda cli, store, api: seen.update(cannot=(store.kind, api)))
    monkeypatch.setattr(buildenv, "detect", lambda environ, extra: None)
    logs = tmp_path / "logs" / "nested"  # made with its parents

    def run(verdict: repro.Verdict, against: str | None, capsys: pytest.CaptureFixture[str], cell: str | None = support.MID,
            selected: tuple[str, ...] = ()) -> tuple[int, str, list[str], Any]:
        monkeypatch.setattr(repro, "reproduce", lambda engine, spec, *a, **k: seen.update(spec=spec.name) or verdict)
        args = argparse.Namespace(cell=cell, against=against, log_dir=str(logs))
        chosen = tuple(c for c in matrix.cells if c.name in selected) if selected else matrix.cells
        ctx = SimpleNamespace(args=args, matrix=matrix, cells=chosen, source="images.yaml",
                              docker_dir=tmp_path / "docker", root=tmp_path, engine=lambda: engine)
        errors: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.levelno >= logging.ERROR:
                    errors.append(record.getMessage())

        keep = Keep()
        log.addHandler(keep)
        try:
            code = verb.run(ctx)  # type: ignore[arg-type]
        finally:
            log.removeHandler(keep)
        text = (logs / f"{seen['spec']}.repro.json").read_text()
        report = json.loads(text)
        assert text == json.dumps(report, indent=1) + "\n"
        assert seen["cannot"] == ("containerd", "1.51")  # the engine's store and API version are asked
        return code, capsys.readouterr().out, errors, report

    run.seen = seen  # type: ignore[attr-defined]
    return run


def _verdict(*digests: str, expected: str | None = None, differs: tuple[str, ...] = ()) -> repro.Verdict:
    return repro.Verdict(tuple(repro.Build(d, "sha256:c", 60.0) for d in digests), expected, 1700000000, "20250101T000000Z",
                         differs)


def test_the_verb_exits_0_only_when_the_builds_are_bit_identical(repro_verb: Any,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, out, errors, report = repro_verb(_verdict(A, A), None, capsys)
    assert code == 0 and errors == [] and out.splitlines()[-1] == f"2.7.0-cuda12.6-cudnn9-runtime: bit-identical ({A})"
    assert report["same"] is True and report["differs"] == [] and [b["manifest"] for b in report["builds"]] == [A, A]
    assert report["source_date_epoch"] == 1700000000 and report["against"] is None


def test_the_verb_exits_1_and_names_every_differing_file(repro_verb: Any, capsys: pytest.CaptureFixture[str]) -> None:
    differs = ("layer 3: opt/venv/lib/x.pyc: mtime", "layer 5: etc/ld.so.cache: content")
    code, out, errors, report = repro_verb(_verdict(A, B, differs=differs), None, capsys)
    assert code == 1 and "bit-identical" not in out
    assert errors == [f"2.7.0-cuda12.6-cudnn9-runtime: the builds differ:\n{differs[0]}\n{differs[1]}"]
    assert report["same"] is False and report["differs"] == list(differs)
    assert [b["manifest"] for b in report["builds"]] == [A, B]


def test_the_verb_against_another_digest_exits_1(repro_verb: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, errors, report = repro_verb(_verdict(A, expected=B, differs=("the manifest differs",)), B, capsys)
    assert code == 1 and report["against"] == B and report["same"] is False
    assert errors == ["2.7.0-cuda12.6-cudnn9-runtime: the builds differ:\nthe manifest differs"]
    rows = [line.split() for line in out.splitlines()]
    assert ["build", "1", A, "sha256:c", "60", "s"] in rows and ["--against", B] in rows


def test_the_verb_takes_the_named_cell_or_the_one_selected_and_runs_again(
        repro_verb: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from builder.common.errors import InputError
    from tests import support

    verdict = repro.Verdict((repro.Build(A, "sha256:c", 61.26), repro.Build(A, "sha256:c", 0.04)), None, 1, "s", ())
    for _ in range(2):  # the second run finds build-logs/ and .build/ there
        code, _out, _errors, report = repro_verb(verdict, None, capsys, cell=None, selected=(support.LATEST,))
        assert code == 0 and report["cell"] == support.LATEST == repro_verb.seen["spec"]
        assert [b["seconds"] for b in report["builds"]] == [61.3, 0.0]
    with pytest.raises(InputError, match=r"^repro: name one cell, or select exactly one with --only; 2 selected$"):
        repro_verb(verdict, None, capsys, cell=None, selected=(support.OLD, support.MID))
    with pytest.raises(InputError, match=r"^repro: 'nope' is not a cell of images\.yaml"):
        repro_verb(verdict, None, capsys, cell="nope")
    code, out, _errors, _report = repro_verb(_verdict(A, expected=A), A, capsys)  # --against: one build
    assert code == 0 and out.splitlines()[-1] == f"{support.MID}: bit-identical ({A})"


# --- the report publish signs: what repro proved, for which inputs -------------------------------------------
INPUTS = "sha256:" + "1" * 64
CELL = "2.7.0-cuda12.6-cudnn9-runtime"


def test_the_verbs_report_records_the_inputs_and_leaves_no_temporary_file(repro_verb: Any,
                                                                          capsys: pytest.CaptureFixture[str],
                                                                          tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The report names the inputs hash and the buildx and BuildKit that built (a digest depends on their tar and
    gzip writers), and what publish reads of it is exactly that."""
    from builder.cli.verbs import repro as verb

    cli = SimpleNamespace(buildx=True)
    monkeypatch.setattr(verb, "find_buildkit_cli", lambda: cli)
    monkeypatch.setattr(verb, "buildx_facts", lambda c: ("0.29.1", "v0.25.1") if c is cli else (None, None))
    verdict = repro.Verdict((repro.Build(A, B, 60.0),) * 2, None, 1700000000, "20250101T000000Z", (), INPUTS)
    code, _out, _errors, report = repro_verb(verdict, None, capsys)
    assert code == 0 and report["inputs"] == INPUTS and (report["buildx"], report["buildkit"]) == ("0.29.1", "v0.25.1")
    folder = tmp_path / "logs" / "nested"
    assert sorted(p.name for p in folder.iterdir()) == [f"{CELL}.repro.json"]
    got = repro.proven_digest(folder, CELL, INPUTS)
    assert got == repro.Proven(A, B, 1700000000, "20250101T000000Z", INPUTS, "0.29.1", "v0.25.1")


def _report(folder: Path, **change: Any) -> None:
    data = {"cell": CELL, "same": True, "against": None, "source_date_epoch": 1700000000, "os_snapshot": "s",
            "inputs": INPUTS, "differs": [], "builds": [{"manifest": A, "config": B, "seconds": 1.0}] * 2, **change}
    repro.write_report(folder, CELL, {k: v for k, v in data.items() if v is not ...})


@pytest.mark.parametrize(("change", "why"), [
    ({"same": False, "builds": [{"manifest": A, "config": B}, {"manifest": B, "config": B}]},
     "its builds differed (not bit-identical), so no digest was proven"),
    ({"inputs": "sha256:" + "2" * 64}, f"was made from other inputs (sha256:{'2' * 64}) than the image ({INPUTS})"),
    ({"inputs": ...}, "records no inputs hash (an older build.py wrote it)"),
    ({"cell": "other"}, f"is the report of cell 'other', not {CELL}"),
    ({"builds": []}, "is not a repro report: no builds"),
    ({"same": "yes"}, "its builds differed"),
    # nothing in the report is taken on trust: every build the same digest, every digest of its form
    ({"builds": [{"manifest": A, "config": B}, {"manifest": B, "config": B}]}, "its builds differed"),
    ({"against": B}, "its builds differed"),
    ({"builds": [{"manifest": "nonsense", "config": B}]}, "a build's manifest 'nonsense' is not sha256: and 64"),
    ({"builds": [{"manifest": A, "config": None}]}, "the config None is not sha256: and 64 lowercase hex digits"),
    ({"source_date_epoch": True}, "source_date_epoch True is not a whole number of seconds"),
    ({"source_date_epoch": -1}, "source_date_epoch -1 is not a whole number of seconds"),
    ({"inputs": "sha256:" + "1" * 63}, "inputs 'sha256:111"),
    ({"os_snapshot": 7}, "its cell and os_snapshot are not strings"),
])
def test_a_report_proves_a_digest_only_for_bit_identical_builds_of_the_same_inputs(tmp_path: Path, change: Any,
                                                                                   why: str) -> None:
    _report(tmp_path)
    assert isinstance(repro.proven_digest(tmp_path, CELL, INPUTS), repro.Proven)
    _report(tmp_path, **change)
    got = repro.proven_digest(tmp_path, CELL, INPUTS)
    assert isinstance(got, str) and why in got and str(tmp_path / f"{CELL}.repro.json") in got, got


def test_a_missing_unreadable_or_huge_report_is_one_line(tmp_path: Path) -> None:
    got = repro.proven_digest(tmp_path, CELL, INPUTS)
    assert got == f"no repro report ({tmp_path}/{CELL}.repro.json; `build.py repro {CELL}` writes it)"
    path = repro.report_path(tmp_path, CELL)
    path.write_text("{not json")
    assert "is not a repro report: Expecting property name" in str(repro.proven_digest(tmp_path, CELL, INPUTS))
    with path.open("wb") as fh:  # never read whole
        fh.write(b" " * (repro.REPORT_LIMIT + 10))
    assert str(repro.proven_digest(tmp_path, CELL, INPUTS)).endswith(f"over {repro.REPORT_LIMIT} bytes")
    for text in (f'{{"cell": "{CELL}", "inputs": "{INPUTS}", "builds": [{{"manifest": "{A}", "config": "{B}"}}], '
                 '"source_date_epoch": Infinity, "os_snapshot": "s", "same": true}',  # Python's json takes Infinity
                 '{"inputs": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}",  # deeper than Python's recursion limit
                 "[]", "\udcff"):
        path.write_text(text, errors="surrogateescape")
        got = repro.proven_digest(tmp_path, CELL, INPUTS)
        assert isinstance(got, str) and "is not a repro report: " in got and len(got) < 400 + len(str(path)), got
    path.unlink()
    path.mkdir()
    assert "cannot be read: Is a directory" in str(repro.proven_digest(tmp_path, CELL, INPUTS))


def test_inputs_that_change_between_the_two_builds_stop_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's inputs hash is the one both builds had: a run whose inputs changed between them (an edit, a
    new lock, a new base) stops in one line, like a Debian snapshot that moved; equal inputs give a verdict."""
    from builder.engine.model import BuildOutcome
    from builder.imaging.orchestrate import Export

    seen: list[str] = []

    def export(engine: Any, spec: Any, cfg: Any, dest: Path, log_path: Path, on_line: Any) -> Export:
        seen.append(str(dest))
        _layout(dest, [BASE, OURS])
        return Export(BuildOutcome(True, None, "buildkit"), Snapshot("s"), 1700000000, inputs.pop(0))

    monkeypatch.setattr(repro, "export_reproducible", export)
    spec = SimpleNamespace(name=CELL)
    cfg = SimpleNamespace(log_dir=tmp_path / "logs")
    inputs = [INPUTS, INPUTS]
    verdict = repro.reproduce(None, spec, cfg, tmp_path / "one", None, lambda *a: None)  # type: ignore[arg-type]
    assert verdict.same and verdict.inputs == INPUTS and len(seen) == 2
    inputs = [INPUTS, "sha256:" + "2" * 64]
    with pytest.raises(StepFailed, match=rf"^{CELL}: the inputs changed between the two builds \({INPUTS} then "
                                         r"sha256:2{64}: an edit, a new lock or a new base while it ran\); run it again$"):
        repro.reproduce(None, spec, cfg, tmp_path / "two", None, lambda *a: None)  # type: ignore[arg-type]
