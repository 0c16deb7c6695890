"""What the engine can do, asked of it: the image store from `docker info`, the builder from the CLIs
here (fake docker CLIs: shell scripts that answer as Docker 20.10, 28 with and without buildx), the
BuildKit level, and the one-line refusals (no buildx, unknown store)."""

from __future__ import annotations

import dataclasses
import stat
from pathlib import Path

import pytest

from builder.common.versions import Version
from builder.engine import buildkit, capabilities
from builder.engine.capabilities import CLASSIC, CONTAINERD, UNKNOWN
from builder.engine.model import BuildRequest

# `docker info` as each engine answers it (trimmed to the fields asked).
INFO_2010 = {"ServerVersion": "20.10.24+dfsg1", "Driver": "overlay2",
             "DriverStatus": [["Backing Filesystem", "extfs"], ["Supports d_type", "true"]]}
INFO_28_CLASSIC = {"ServerVersion": "28.5.2", "Driver": "overlay2",
                   "DriverStatus": [["Backing Filesystem", "extfs"], ["userxattr", "false"]]}
INFO_28_CONTAINERD = {"ServerVersion": "28.5.2", "Driver": "overlayfs",
                      "DriverStatus": [["driver-type", "io.containerd.snapshotter.v1"]]}


@pytest.mark.parametrize(("info", "kind"), [
    (INFO_2010, CLASSIC), (INFO_28_CLASSIC, CLASSIC), (INFO_28_CONTAINERD, CONTAINERD),
    ({"Driver": "stargz", "DriverStatus": None}, UNKNOWN), ({}, UNKNOWN),
    # the snapshotter decides, whatever its name (zfs, btrfs, stargz under the containerd store)
    ({"Driver": "zfs", "DriverStatus": [["driver-type", "io.containerd.snapshotter.v1"]]}, CONTAINERD),
])
def test_image_store_is_read_from_driver_status(info: dict[str, object], kind: str) -> None:
    assert capabilities.image_store(info).kind == kind


@pytest.mark.parametrize("version", ["20.10.24+dfsg1", "23.0.0", "27.5.1", "28.5.2", "29.0.0", "29.1.3", "", "dev"])
def test_the_image_store_never_follows_the_engines_version(version: str) -> None:
    """Docker 29 defaults to the containerd store on new installs, but an upgraded 29 keeps the
    classic one and a 28 can be switched: only DriverStatus says which store is in use."""
    for info, kind in ((INFO_28_CLASSIC, CLASSIC), (INFO_28_CONTAINERD, CONTAINERD), (INFO_2010, CLASSIC),
                       ({"ServerVersion": version, "Driver": "stargz"}, UNKNOWN)):
        store = capabilities.image_store({**info, "ServerVersion": version})
        assert (store.kind, store.driver) == (kind, info["Driver"]), (version, info)


def test_unknown_store_line_says_what_and_the_fix() -> None:
    line = capabilities.unknown_store_line(capabilities.image_store({"Driver": "stargz"}))
    assert "\n" not in line and "'stargz'" in line and "containerd-snapshotter" in line


def test_names_image_follows_the_store() -> None:
    cfg, man = "sha256:" + "c" * 64, "sha256:" + "m" * 64
    assert capabilities.names_image(CLASSIC, cfg, man, cfg)
    assert not capabilities.names_image(CLASSIC, man, man, cfg)
    assert capabilities.names_image(CONTAINERD, man, man, cfg)
    assert not capabilities.names_image(CONTAINERD, cfg, man, cfg)
    assert not capabilities.names_image(CONTAINERD, "", None, None)


@pytest.mark.parametrize(("reported", "api", "want"), [
    ("v0.25.1", "1.51", "0.25.1"),          # buildx reports it: that wins
    ("v0.0.0+unknown", "1.51", "0.20"),     # Debian's build reports none: the API's floor
    (None, "1.41", "0.8"),                  # Debian 12's 20.10
    (None, "1.45", "0.13"),
    (None, "1.40", None),                   # older than any engine this project knows
])
def test_buildkit_version_from_the_builder_or_the_api(reported: str | None, api: str, want: str | None) -> None:
    version, _source = capabilities.buildkit_version(reported, api)
    assert version == (Version.parse(want) if want else None)


def test_a_feature_the_builder_lacks_gets_one_line_with_the_fix() -> None:
    assert capabilities.need_feature("rewrite-timestamp (bit-identical layers)", Version.parse("0.13"), "x") is None
    line = capabilities.need_feature("rewrite-timestamp (bit-identical layers)", Version.parse("0.8"), "API 1.41")
    assert line is not None and "\n" not in line and ">= 0.13" in line and "buildx" in line
    assert capabilities.parse_inspect("Name: default\nBuildKit version: v0.0.0+unknown\n") == "v0.0.0+unknown"


@pytest.mark.parametrize(("status", "kind"), [
    ([["driver-type", "io.containerd.snapshotter.v1", "extra"]], CLASSIC),  # not a pair: not read
    (["driver-type", "io.containerd.snapshotter.v1"], CLASSIC),  # strings, not pairs
    ([["driver-type", "overlayfs"]], CLASSIC),  # another driver type
    ([["Backing Filesystem", "io.containerd.snapshotter.v1"]], CLASSIC),  # the value under another key
    ([["Backing Filesystem", "extfs"], ("driver-type", "io.containerd.snapshotter.v1")], CONTAINERD),
])
def test_only_a_driver_type_pair_naming_the_snapshotter_is_the_containerd_store(status: list[object], kind: str) -> None:
    assert capabilities.image_store({"Driver": "overlay2", "DriverStatus": status}).kind == kind


def test_features_need_their_buildkit_version_or_newer() -> None:
    names = [name for name, _ in capabilities.FEATURES]
    assert capabilities.features(None) == [(n, False) for n in names]
    assert capabilities.features(Version.parse("0.10")) == list(zip(names, [True, False, True], strict=True))
    assert capabilities.features(Version.parse("0.9.9")) == list(zip(names, [True, False, False], strict=True))
    assert capabilities.features(Version.parse("0.13")) == [(n, True) for n in names]


def test_what_a_missing_feature_line_says_the_builder_has() -> None:
    feature = "zstd layers"
    line = capabilities.need_feature(feature, Version.parse("0.8"), "at least, from the engine's API 1.41")
    assert line is not None and line.startswith(
        "zstd layers needs BuildKit >= 0.10, and this engine's builder has BuildKit 0.8 (at least, from the "
        "engine's API 1.41). Fix: ")
    unknown = capabilities.need_feature(feature, None, "unknown")
    assert unknown is not None and "and this engine's builder has a BuildKit of unknown version. Fix: " in unknown
    assert capabilities.buildkit_version(None, "abc") == (None, "unknown (API version 'abc')")
    assert capabilities.buildkit_version("v0.0.0+unknown", None) == (None, "unknown")


def _fake_cli(path: Path, version: str, buildx: bool) -> str:
    path.write_text("#!/bin/sh\n"
                    f'if [ "$1" = buildx ]; then {"echo github.com/docker/buildx 0.29.1 x; exit 0" if buildx else "exit 1"}; fi\n'
                    f'if [ "$1" = version ]; then echo {version}; exit 0; fi\nexit 1\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_cli_with_buildx_wins_and_20_10_is_used_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = _fake_cli(tmp_path / "docker2010", "20.10.24+dfsg1", buildx=False)
    new = _fake_cli(tmp_path / "docker28", "28.5.2", buildx=True)
    bare = _fake_cli(tmp_path / "docker28bare", "28.2.2", buildx=False)
    monkeypatch.setattr(buildkit, "_candidates", lambda: [old, new])
    cli = buildkit.find_buildkit_cli()
    assert cli is not None and cli.path == new and cli.buildx and "--provenance=false" in cli.argv_prefix
    # Debian 12 as it is today: its 20.10 CLI first, a 28 CLI without buildx on PATH: exactly as before.
    monkeypatch.setattr(buildkit, "_candidates", lambda: [old, bare])
    cli = buildkit.find_buildkit_cli()
    assert cli is not None and cli.path == old and cli.argv_prefix == ("build",)
    assert cli.env["DOCKER_BUILDKIT"] == "1"


def test_a_current_cli_without_buildx_is_named_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bare = _fake_cli(tmp_path / "docker", "28.2.2", buildx=False)
    monkeypatch.setattr(buildkit, "_candidates", lambda: [bare])
    assert buildkit.find_buildkit_cli() is None
    line = buildkit.missing_builder()
    assert line is not None and "\n" not in line and bare in line and "docker-buildx" in line
    monkeypatch.setattr(buildkit, "_candidates", lambda: [])
    assert buildkit.missing_builder() is None  # no CLI at all: the classic builder's case, as before


class _InfoClient:
    def __init__(self, info: dict[str, object]) -> None:
        self._info = info

    def info(self) -> dict[str, object]:
        return self._info


@pytest.mark.parametrize(("info", "want"), [(INFO_28_CONTAINERD, "sha256:manifest"), (INFO_28_CLASSIC, "sha256:config")])
def test_a_buildx_build_is_named_by_what_the_store_calls_an_image(
        info: dict[str, object], want: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The iidfile holds the config digest; in the containerd store the image ID is the manifest's
    digest (buildx's metadata file), and the steps after the build (probe, labels) look it up by ID."""
    from builder.engine import docker as engine_docker
    from builder.engine.model import BuildOutcome, BuildRequest

    monkeypatch.setattr(engine_docker, "build_with_cli", lambda *a: BuildOutcome(
        True, "sha256:config", "buildkit", manifest_digest="sha256:manifest"))
    engine = engine_docker.Engine(client=_InfoClient(info), labels={})
    req = BuildRequest(tmp_path, tmp_path / "Dockerfile", {}, {}, tmp_path / "log")
    cli = buildkit.BuildkitCli("/x/docker", buildkit.BUILDX_ARGS, {})
    assert engine.build(req, lambda _l: None, cli).image_id == want


def test_the_metadata_file_gives_the_manifest_and_config_digests(tmp_path: Path) -> None:
    meta = tmp_path / "m.json"
    meta.write_text('{"containerimage.config.digest": "sha256:c", "containerimage.digest": "sha256:m"}')
    assert buildkit._metadata(meta, "containerimage.digest") == "sha256:m"
    assert buildkit._metadata(meta, "containerimage.config.digest") == "sha256:c"
    assert buildkit._metadata(tmp_path / "absent.json", "containerimage.digest") is None
    meta.write_text("[]")
    assert buildkit._metadata(meta, "containerimage.digest") is None


def test_a_reproducible_export_writes_an_oci_folder_with_clamped_timestamps(tmp_path: Path) -> None:
    """Not --load (Docker 28's image exporter refuses rewrite-timestamp with its forced unpack):
    an OCI layout folder, every timestamp clamped to SOURCE_DATE_EPOCH."""
    req = BuildRequest(tmp_path, tmp_path / "Dockerfile", {}, {}, tmp_path / "log", oci_dest=tmp_path / "oci",
                       source_date_epoch=1764547200)
    cli = buildkit.BuildkitCli("/x/docker", buildkit.BUILDX_ARGS, {})
    argv = buildkit._prefix(cli, req)
    assert "--load" not in argv
    assert argv[argv.index("--output") + 1] == f"type=oci,tar=false,dest={tmp_path / 'oci'},rewrite-timestamp=true"
    assert buildkit._prefix(cli, dataclasses.replace(req, oci_dest=None)) == buildkit.BUILDX_ARGS
    with pytest.raises(ValueError):
        buildkit._prefix(buildkit.BuildkitCli("/usr/bin/docker", ("build",), {}), req)
