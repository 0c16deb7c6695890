"""`build.py verify --rebuild`'s comparison (builder/attest/rebuild.py) against a REAL registry (Debian's
docker-registry on 127.0.0.1; no engine): small hand-made images pushed over HTTP, each compared with a real
OCI layout folder written here, as BuildKit's exporter writes one. Only the engine's build is replaced (the
`build` argument of builder.cli.verbs.verify.check_rebuilds); the registry, the streaming and the tar reading
are the real ones.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import tarfile
import tracemalloc
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from builder.attest import rebuild
from builder.cli.verbs.verify import Target, check_rebuilds
from builder.common.digests import digest_of
from builder.imaging import repro
from builder.matrix import ImageSpec
from builder.publish.address import parse_registry
from builder.publish.client import RegistryClient
from builder.publish.signing import ClientStore
from tests.docker.registry import LocalRegistry

BUILT_AT = 1764900000  # the published image's files: the build's own times
EPOCH = 1796253223  # the rebuild's: SOURCE_DATE_EPOCH
SNAPSHOT = "sha256:" + "cd" * 32
CONFIG = {"Entrypoint": ["/opt/ptmg/entrypoint/start.sh"], "Cmd": ["bash"], "User": "1000:1000",
          "WorkingDir": "/workspace", "Env": ["PATH=/opt/venv/bin:/usr/bin", "PTMG=1"]}
#: name -> (content, or None for a directory, or "->target" for a symlink; mode; uid)
Files = dict[str, tuple[bytes | str | None, int, int]]
BASE: Files = {"etc": (None, 0o755, 0), "etc/os-release": (b"ID=debian\n", 0o644, 0),
               "bin": (None, 0o755, 0), "bin/sh": ("->dash", 0o777, 0), "bin/dash": (b"\x7fELF" + bytes(300), 0o755, 0)}
VENV: Files = {"opt": (None, 0o755, 0), "opt/venv": (None, 0o755, 1000),
               "opt/venv/torch.py": (b"import math\n" * 50, 0o644, 1000)}
APP: Files = {"workspace": (None, 0o775, 1000), "workspace/README": (b"hello\n", 0o644, 1000)}


def layer(files: Files, mtime: int, compress: bool = True) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, (content, mode, uid) in files.items():
            info = tarfile.TarInfo(name)
            info.mode, info.uid, info.gid, info.mtime = mode, uid, uid, mtime
            if content is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content[2:]
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    data = raw.getvalue()
    return gzip.compress(data, mtime=0) if compress else data


def _config(layers: Sequence[bytes], config: dict[str, Any], created: str) -> bytes:
    diff_ids = [digest_of(gzip.decompress(x) if x[:2] == b"\x1f\x8b" else x) for x in layers]
    return json.dumps({"architecture": "amd64", "os": "linux", "created": created, "config": config,
                       "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()


def _manifest(config: bytes, layers: Sequence[tuple[str, int]], media: str) -> bytes:
    return json.dumps({"schemaVersion": 2, "mediaType": media,
                       "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "size": len(config),
                                  "digest": digest_of(config)},
                       "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "size": size,
                                   "digest": d} for d, size in layers]}).encode()


def push(store: ClientStore, tag: str, layers: Sequence[bytes], config: dict[str, Any] | None = None,
         labels: dict[str, str] | None = None) -> str:
    """A published image: its layers as given, a config with labels and dates publish writes; its digest."""
    labels = {"org.opencontainers.image.created": "2026-12-05T06:00:00Z", **(labels or {})}
    blob = _config(layers, {**(config or CONFIG), "Labels": labels}, "2026-12-05T06:00:00Z")
    for data in [*layers, blob]:
        store.put_blob(data, digest_of(data))
    body = _manifest(blob, [(digest_of(x), len(x)) for x in layers], "application/vnd.oci.image.manifest.v1+json")
    return store.put_manifest(tag, "application/vnd.oci.image.manifest.v1+json", body)


def write_layout(folder: Path, layers: Sequence[bytes], config: dict[str, Any] | None = None) -> repro.OciImage:
    """An OCI layout folder as BuildKit's exporter writes one (index.json, blobs/sha256/...)."""
    blobs = folder / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    blob = _config(layers, config or CONFIG, "2026-12-02T23:13:43Z")
    body = _manifest(blob, [(digest_of(x), len(x)) for x in layers], "application/vnd.oci.image.manifest.v1+json")
    for data in [*layers, blob, body]:
        (blobs / digest_of(data)[7:]).write_bytes(data)
    (folder / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (folder / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest_of(body), "size": len(body)}]}))
    return repro.read_layout(folder)


@pytest.fixture
def store(registry: LocalRegistry, request: pytest.FixtureRequest) -> ClientStore:
    name = "pt-" + hashlib.sha256(request.node.name.encode()).hexdigest()[:12]
    return ClientStore(RegistryClient(parse_registry(f"{registry.host}/ns"), name, None))


def published(store: ClientStore, *files: Files) -> str:
    return push(store, "2.7.0-cuda12.6", [layer(f, BUILT_AT) for f in files])


def rebuilt(tmp_path: Path, *files: Files, config: dict[str, Any] | None = None) -> repro.OciImage:
    return write_layout(tmp_path / "layout", [layer(f, EPOCH) for f in files], config)


def test_the_same_files_with_other_times_match(store: ClientStore, tmp_path: Path) -> None:
    digest = published(store, BASE, VENV, APP)
    image = rebuilt(tmp_path, BASE, VENV, APP)
    got = rebuild.compare(store, digest, image)
    assert got.differs == [] and got.same
    assert (got.layers, got.files) == (3, len(BASE) + len(VENV) + len(APP))
    assert image.layers != tuple(digest_of(layer(f, BUILT_AT)) for f in (BASE, VENV, APP))  # the digests differ


@pytest.mark.parametrize(("change", "want"), [
    ({"etc/os-release": (b"ID=debiaN\n", 0o644, 0)}, "layer 1: 1 path(s) differ\n  /etc/os-release: content differ"),
    ({"bin/dash": (b"\x7fELF" + bytes(300), 0o775, 0)}, "/bin/dash: mode differ"),
    ({"etc/os-release": (b"ID=debian\n", 0o644, 7)}, "/etc/os-release: owner, group differ"),
    ({"bin/sh": ("->bash", 0o777, 0)}, "/bin/sh: link differ"),
    ({"etc/extra": (b"", 0o644, 0)}, "/etc/extra: only in the rebuild"),
])
def test_one_changed_file_is_named(store: ClientStore, tmp_path: Path, change: Files, want: str) -> None:
    digest = published(store, BASE, VENV)
    got = rebuild.compare(store, digest, rebuilt(tmp_path, {**BASE, **change}, VENV))
    assert not got.same and want in "\n".join(got.differs), got.differs
    assert len(got.differs) == 2, got.differs  # the layer's line and the one file: nothing else differs


def test_a_missing_layer_names_its_files(store: ClientStore, tmp_path: Path) -> None:
    digest = published(store, BASE, VENV, APP)
    got = rebuild.compare(store, digest, rebuilt(tmp_path, BASE, VENV))
    assert got.differs == ["the published image has 3 layers, the rebuild 2", "layer 3: 2 path(s) differ",
                           "  /workspace: only in the published image",
                           "  /workspace/README: only in the published image"]


def test_the_config_entrypoint_cmd_env_user_and_workdir_are_compared(store: ClientStore, tmp_path: Path) -> None:
    digest = published(store, BASE)
    config = {**CONFIG, "Env": [*CONFIG["Env"], "EXTRA=1"], "User": "root"}
    got = rebuild.compare(store, digest, rebuilt(tmp_path, BASE, config=config))
    assert got.differs == [f"config Env: published {CONFIG['Env']!r}, rebuilt {config['Env']!r}",
                           "config User: published '1000:1000', rebuilt 'root'"]


def test_a_changed_byte_in_the_registry_is_refused(registry: LocalRegistry, store: ClientStore,
                                                   tmp_path: Path) -> None:
    """The published layer is checked against the manifest's digest while it streams (an uncompressed layer here,
    so that the changed byte still reads as a tar)."""
    data = layer(VENV, BUILT_AT, compress=False)
    digest = push(store, "t", [layer(BASE, BUILT_AT), data])
    blob = registry.storage / "docker/registry/v2/blobs/sha256" / digest_of(data)[7:9] / digest_of(data)[7:] / "data"
    raw = bytearray(blob.read_bytes())
    raw[raw.index(b"import math")] ^= 1
    blob.write_bytes(bytes(raw))
    with pytest.raises(rebuild.RebuildFailed, match=f"layer 2: the registry served {len(raw)} bytes with sha256 "
                                                    f"sha256:[0-9a-f]{{64}}, not the manifest's {digest_of(data)}"):
        rebuild.compare(store, digest, rebuilt(tmp_path, BASE, VENV))


def test_a_zstd_layer_publish_pushed_is_read_too(store: ClientStore, tmp_path: Path) -> None:
    import zstandard

    plain = layer(VENV, BUILT_AT, compress=False)
    zst = zstandard.ZstdCompressor().compress(plain)
    digest = push(store, "z", [layer(BASE, BUILT_AT), zst])
    assert rebuild.compare(store, digest, rebuilt(tmp_path, BASE, VENV)).same
    assert "/opt/venv/torch.py: size, content differ" in "\n".join(
        rebuild.compare(store, digest, write_layout(tmp_path / "b", [layer(BASE, EPOCH), layer(
            {**VENV, "opt/venv/torch.py": (b"x", 0o644, 1000)}, EPOCH)])).differs)


def _random_file(path: Path, size: int) -> None:
    with path.open("wb") as f:
        for _ in range(size >> 20):
            f.write(os.urandom(1 << 20))


def _chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            yield chunk


def test_a_layer_is_streamed_never_held_in_memory(store: ClientStore, tmp_path: Path) -> None:
    """A 48 MiB layer (random bytes: gzip cannot shrink it) is compared with under 16 MiB allocated at a time (7.1 MiB
    measured, the same for a 64 MiB layer: a few 1 MiB buffers along the stream)."""
    size = 48 << 20
    _random_file(tmp_path / "weights.bin", size)
    blobs = []
    for n, mtime in ((0, BUILT_AT), (1, EPOCH)):
        path = tmp_path / f"layer-{n}.tar.gz"
        with tarfile.open(path, "w:gz", compresslevel=1) as tar:
            info = tar.gettarinfo(str(tmp_path / "weights.bin"), "opt/weights.bin")
            info.mtime, info.uid, info.gid, info.uname, info.gname = mtime, 0, 0, "", ""
            with (tmp_path / "weights.bin").open("rb") as f:
                tar.addfile(info, f)
        blobs.append(path)
    plain_digest = "sha256:" + hashlib.sha256(b"".join(_gunzip_chunks(blobs[0]))).hexdigest()
    layer_digest = digest_of(blobs[0].read_bytes())
    assert store.client.upload_blob(_chunks(blobs[0]), layer_digest) == layer_digest
    config = json.dumps({"config": CONFIG, "rootfs": {"type": "layers", "diff_ids": [plain_digest]}}).encode()
    store.put_blob(config, digest_of(config))
    body = _manifest(config, [(layer_digest, blobs[0].stat().st_size)], "application/vnd.oci.image.manifest.v1+json")
    digest = store.put_manifest("big", "application/vnd.oci.image.manifest.v1+json", body)
    folder = tmp_path / "layout"
    write_layout(folder, [])  # the folder's shape; then its one layer, moved in without reading it
    local = folder / "blobs" / "sha256" / digest_of(blobs[1].read_bytes())[7:]
    blobs[1].rename(local)
    image = repro.OciImage(folder, "", digest_of(config), (f"sha256:{local.name}",), (plain_digest,))
    (folder / "blobs" / "sha256" / digest_of(config)[7:]).write_bytes(config)
    assert blobs[0].stat().st_size > size
    tracemalloc.start()
    try:
        got = rebuild.compare(store, digest, image)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.same and got.files == 1, got.differs
    assert peak < 16 << 20, f"{peak / 2**20:.1f} MiB allocated at the peak for a {size >> 20} MiB layer"


def _gunzip_chunks(path: Path) -> Iterator[bytes]:
    with gzip.open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            yield chunk


class FakeSpec:
    name = "2.7.0-cuda12.6-cudnn9-runtime"


def test_check_rebuilds_exits_0_on_a_match_and_1_naming_the_file(store: ClientStore, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The verb's loop with the engine's build replaced by one that writes the OCI layout: what it prints."""
    digest = published(store, BASE, VENV)
    spec: Any = FakeSpec()
    files: list[Files] = [BASE, VENV]

    def build(s: ImageSpec, dest: Path) -> str:
        assert s is spec
        write_layout(dest, [layer(f, EPOCH) for f in files])
        return SNAPSHOT

    assert check_rebuilds(store, [Target(digest, spec, SNAPSHOT)], build, tmp_path / "a") == 0
    out = capsys.readouterr().out
    assert f"{spec.name}: {digest}: the rebuild matches the published image: 2 layer(s)" in out
    assert "file times are not compared" in out and "neither are the published image's digests" in out
    assert f"{spec.name}: the rebuild's manifest digest is sha256:" in out
    assert "the provenance signs no reproducible digest to compare it with" in out
    files = [BASE, {**VENV, "opt/venv/torch.py": (b"import math\n" * 49 + b"import maths\n", 0o644, 1000)}]
    with caplog.at_level(logging.ERROR):
        assert check_rebuilds(store, [Target(digest, spec, "sha256:" + "ee" * 32)], build, tmp_path / "b") == 1
    text = caplog.text
    assert "differs from the published image" in text and "/opt/venv/torch.py: size, content differ" in text
    assert f"the Debian archive moved since {digest} was built (snapshot sha256:eeee" in text


def test_the_rebuilds_digest_must_be_the_reproducible_digest_the_provenance_signs(
        store: ClientStore, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """Where the provenance signs `build.py repro`'s digest, the rebuild's manifest digest must be it byte for byte
    (exit 0, "bit-identical"); another digest is exit 1 naming both, even when every file matches."""
    digest = published(store, BASE, VENV)
    spec: Any = FakeSpec()

    def build(s: ImageSpec, dest: Path) -> str:
        write_layout(dest, [layer(f, EPOCH) for f in (BASE, VENV)])
        return SNAPSHOT

    proven = write_layout(tmp_path / "what-repro-built", [layer(f, EPOCH) for f in (BASE, VENV)]).manifest_digest
    assert check_rebuilds(store, [Target(digest, spec, SNAPSHOT, proven)], build, tmp_path / "a") == 0
    out = capsys.readouterr().out
    assert f"{spec.name}: the rebuild's manifest digest {proven} is the reproducible digest the provenance signs: " \
           "bit-identical" in out
    other = "sha256:" + "0f" * 32
    with caplog.at_level(logging.ERROR):
        assert check_rebuilds(store, [Target(digest, spec, SNAPSHOT, other)], build, tmp_path / "b") == 1
    assert "the rebuild matches the published image: 2 layer(s)" in capsys.readouterr().out  # files: the same
    assert f"{spec.name}: the rebuild's manifest digest {proven} is not the reproducible digest the provenance " \
           f"signs ({other})" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.ERROR):  # none signed: only the files, unless one is required
        assert check_rebuilds(store, [Target(digest, spec, SNAPSHOT)], build, tmp_path / "c") == 0
        assert check_rebuilds(store, [Target(digest, spec, SNAPSHOT)], build, tmp_path / "d", True) == 1
    assert "signs no reproducible digest to compare it with" in caplog.text and \
           "so --require-reproducible refuses it" in caplog.text
