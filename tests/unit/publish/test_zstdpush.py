"""`publish --compression zstd` without a daemon or a registry: `docker save` streams of each layout
(20.10's classic store, 25+'s OCI layout, the containerd store's compressed blobs) pushed as zstd
layers, the diff_id and config checks attacked, the run's memory of what went up (another tag, a
retry), the registry client's upload protocol, and the engine's save stream."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import pytest
import requests
import urllib3
import zstandard
from requests.structures import CaseInsensitiveDict

from builder.engine import Engine, EngineError
from builder.publish import address, client, faults, push, zstdpush


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def layer_tar(files: Mapping[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


EMPTY_LAYER = b"\0" * 1024  # an empty tar: no ustar magic, passes for metadata until manifest.json says otherwise


def config_of(layers: list[bytes], **extra: Any) -> bytes:
    doc = {"architecture": "amd64", "os": "linux", "config": {"Labels": {"x": "y"}}, **extra,
           "rootfs": {"type": "layers", "diff_ids": [sha(t) for t in layers]}}
    return json.dumps(doc, separators=(",", ":")).encode()


def outer_tar(entries: list[tuple[str, bytes | str]]) -> bytes:
    """A save stream: (name, bytes) files and (name, "->target") symlinks, sorted by name as dockerd writes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in sorted(entries):
            info = tarfile.TarInfo(name)
            if isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data.removeprefix("->")
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def save_2010(layers: list[bytes], config: bytes | None = None, order: list[int] | None = None) -> bytes:
    """Docker 20.10's classic store: <v1 id>/layer.tar per layer (a repeated layer is a symlink to the
    first), <config id>.json, manifest.json last. ``order``: the layers manifest.json lists."""
    config = config or config_of(layers)
    entries: list[tuple[str, bytes | str]] = []
    dirs: list[str] = []
    first: dict[bytes, str] = {}
    for data in layers:  # a v1 id names a layer's chain (its parent's v1 id and its diff_id), as dockerd's
        v1 = hashlib.sha256(f"{dirs[-1] if dirs else ''}{sha(data)}".encode()).hexdigest()
        dirs.append(v1)
        entries += [(f"{v1}/VERSION", b"1.0"), (f"{v1}/json", json.dumps({"id": v1}).encode())]
        if data in first:
            entries.append((f"{v1}/layer.tar", f"->../{first[data]}/layer.tar"))
        else:
            first[data] = v1
            entries.append((f"{v1}/layer.tar", data))
    cfg_name = sha(config).removeprefix("sha256:") + ".json"
    listed = [f"{dirs[i]}/layer.tar" for i in (order if order is not None else range(len(layers)))]
    entries += [(cfg_name, config), ("repositories", b"{}"),
                ("manifest.json", json.dumps([{"Config": cfg_name, "RepoTags": None, "Layers": listed}]).encode())]
    return outer_tar(entries)


def save_oci(layers: list[bytes], compress: list[str], config: bytes | None = None) -> bytes:
    """Docker 25+'s OCI layout: blobs/sha256/<digest> (plain in the classic store; gzip or zstd blobs,
    named by their own digest, in the containerd store), then index.json, manifest.json."""
    config = config or config_of(layers)
    entries: list[tuple[str, bytes | str]] = []
    names = []
    for data, how in zip(layers, compress, strict=True):
        blob = {"plain": data, "gzip": gzip.compress(data, mtime=0),
                "zstd": zstandard.ZstdCompressor().compress(data),
                "zstd-2-frames": zstandard.ZstdCompressor().compress(data[:len(data) // 2]) +
                zstandard.ZstdCompressor().compress(data[len(data) // 2:])}[how]
        names.append(f"blobs/sha256/{sha(blob)[7:]}")
        if (names[-1], blob) not in entries:
            entries.append((names[-1], blob))
    manifest = json.dumps({"schemaVersion": 2, "layers": [{"digest": "sha256:" + n.rsplit("/", 1)[1]}
                                                          for n in names]}).encode()
    cfg_name = f"blobs/sha256/{sha(config)[7:]}"
    entries += [(cfg_name, config), (f"blobs/sha256/{sha(manifest)[7:]}", manifest), ("oci-layout", b"{}"),
                ("index.json", json.dumps({"manifests": [{"digest": sha(manifest)}]}).encode()),
                ("manifest.json", json.dumps([{"Config": cfg_name, "Layers": names}]).encode())]
    return outer_tar(entries)


# --- fakes ------------------------------------------------------------------------------------
class SaveEngine:
    """Serves `docker save` streams in small chunks; counts them."""

    def __init__(self) -> None:
        self.saves: dict[str, bytes] = {}
        self.calls: list[str] = []

    def save(self, ref: str) -> Iterator[bytes]:
        self.calls.append(ref)
        data = self.saves[ref]
        for i in range(0, len(data), 65536):
            yield data[i:i + 65536]


@dataclass
class BlobStore:
    """A registry's blob and manifest API in memory. ``break_upload``: upload number -> the fault it
    ends with after taking part of the stream (a registry that dies mid-blob)."""

    blobs: dict[str, bytes] = field(default_factory=dict)
    manifests: dict[str, bytes] = field(default_factory=dict)
    uploads: list[str] = field(default_factory=list)
    heads: list[str] = field(default_factory=list)
    puts: list[str] = field(default_factory=list)
    break_upload: dict[int, faults.Fault] = field(default_factory=dict)
    started: int = 0

    def blob_exists(self, digest: str) -> bool | faults.Fault:
        self.heads.append(digest)
        return digest in self.blobs

    def upload_blob(self, body: bytes | Iterator[bytes], digest: str | Callable[[], str]) -> str | faults.Fault:
        self.started += 1
        if self.started in self.break_upload:
            if not isinstance(body, bytes):
                next(body, None)
            return self.break_upload[self.started]
        data = body if isinstance(body, bytes) else b"".join(body)
        want = digest() if callable(digest) else digest
        assert sha(data) == want
        self.blobs[want] = data
        self.uploads.append(want)
        return want

    def put_manifest(self, reference: str, media_type: str, body: bytes) -> str | faults.Fault:
        assert json.loads(body)["mediaType"] == media_type
        self.puts.append(reference)
        self.manifests[reference] = self.manifests[sha(body)] = body
        return sha(body)

    def manifest(self, reference: str) -> client.Remote:
        body = self.manifests.get(reference)
        if body is None:
            return client.Remote()
        return client.manifest_remote(200, {"Docker-Content-Digest": sha(body)}, body, reference)


def served_layers(store: BlobStore, reference: str) -> list[bytes]:
    """The plain tars a registry serves under ``reference`` (each zstd layer decompressed)."""
    doc = json.loads(store.manifests[reference])
    assert {x["mediaType"] for x in doc["layers"]} == {zstdpush.ZSTD_LAYER}
    out = []
    for x in doc["layers"]:
        blob = store.blobs[x["digest"]]
        assert len(blob) == x["size"] and blob.startswith(zstdpush.ZSTD_MAGIC)
        out.append(zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)).read())
    return out


LAYERS = [layer_tar({"etc/os-release": b"ID=debian\n"}), layer_tar({"blob": os.urandom(300_000)}),
          EMPTY_LAYER, layer_tar({"etc/os-release": b"ID=debian\n"}), layer_tar({"b.txt": b"b" * 5000})]


def _push(saved: bytes, config: bytes, tag: str = "t1", store: BlobStore | None = None,
          pusher: zstdpush.ZstdPusher | None = None) -> tuple[faults.Fault | None, push.PushTracker, BlobStore]:
    store = store or BlobStore()
    engine = SaveEngine()
    engine.saves[sha(config)] = saved
    pusher = pusher or zstdpush.ZstdPusher(engine, store)
    pusher.engine = engine
    tracker = push.PushTracker()
    return pusher.push(sha(config), tag, tracker), tracker, store


def _pusher(layers: list[bytes], store: BlobStore | None = None
            ) -> tuple[bytes, BlobStore, SaveEngine, zstdpush.ZstdPusher]:
    """A pusher over one image of ``layers`` (saved as 20.10 does): its config, registry, engine, pusher."""
    config, store, engine = config_of(layers), store or BlobStore(), SaveEngine()
    engine.saves[sha(config)] = save_2010(layers)
    return config, store, engine, zstdpush.ZstdPusher(engine, store)


# --- the layouts ------------------------------------------------------------------------------
@pytest.mark.parametrize("small", [zstdpush.SMALL, 1000], ids=["small-entries-whole", "every-layer-streamed"])
@pytest.mark.parametrize("layout", ["2010", "oci-plain", "oci-compressed"])
def test_a_save_is_pushed_as_zstd_layers_whose_plain_tars_are_the_images(
        layout: str, small: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zstdpush, "SMALL", small)
    config = config_of(LAYERS)
    saved = {"2010": lambda: save_2010(LAYERS),
             "oci-plain": lambda: save_oci(LAYERS, ["plain"] * 5),
             "oci-compressed": lambda: save_oci(LAYERS, ["gzip", "zstd", "plain", "gzip", "gzip"])}[layout]()
    fault, tracker, store = _push(saved, config)
    assert fault is None
    assert served_layers(store, "t1") == LAYERS  # so their digests are the config's diff_ids, in order
    doc = json.loads(store.manifests["t1"])
    assert doc["config"] == {"mediaType": zstdpush.OCI_CONFIG, "digest": sha(config), "size": len(config)}
    assert store.blobs[sha(config)] == config  # byte-exact: its digest is the classic store's image ID
    assert tracker.digest == sha(store.manifests["t1"])
    assert len(set(tracker.uploaded)) == 4 and tracker.existing == []  # the repeated layer is one blob
    remote = store.manifest("t1")
    assert (remote.config_digest, remote.compression, remote.media_type) == (sha(config), "zstd", client.OCI_MANIFEST)


def test_a_zstd_blob_of_several_frames_is_read_to_its_end() -> None:
    """zstd allows a blob of concatenated frames; reading only the first would hash half a layer."""
    fault, _, store = _push(save_oci(LAYERS[:2], ["zstd-2-frames"] * 2), config_of(LAYERS[:2]))
    assert fault is None and served_layers(store, "t1") == LAYERS[:2]


class CountingEngine(SaveEngine):
    """A SaveEngine that counts the bytes of the save it has handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.served = 0

    def save(self, ref: str) -> Iterator[bytes]:
        for chunk in super().save(ref):
            self.served += len(chunk)
            yield chunk


MIB = 1 << 20


def test_metadata_up_to_4_mib_is_read_whole_and_a_bigger_entry_streams_by() -> None:
    """An entry of up to 4 MiB (SMALL) is read whole: a config that big still is the config. A bigger
    one goes to the registry as the save streams by, whatever its name, never held in memory whole."""
    config = config_of(LAYERS[:1], pad="")
    config = config_of(LAYERS[:1], pad="x" * (4 * MIB - len(config)))
    assert len(config) == 4 * MIB
    fault, _, store = _push(save_oci(LAYERS[:1], ["plain"], config), config)
    assert fault is None and store.blobs[sha(config)] == config

    big = layer_tar({"blob": os.urandom(4 * MIB + MIB // 2)})  # an OCI blob (named by its digest), not layer.tar
    config = config_of([big])
    engine, store = CountingEngine(), BlobStore()
    engine.saves[sha(config)] = save_oci([big], ["plain"])
    served_at_upload: list[int] = []
    upload = store.upload_blob

    def watched(body: bytes | Iterator[bytes], digest: str | Callable[[], str]) -> str | faults.Fault:
        served_at_upload.append(engine.served)
        return upload(body, digest)

    store.upload_blob = watched  # type: ignore[method-assign]
    assert zstdpush.ZstdPusher(engine, store).push(sha(config), "t1", push.PushTracker()) is None
    assert served_layers(store, "t1") == [big]
    assert served_at_upload[0] < len(big), (served_at_upload, len(big))


def test_small_layers_go_to_the_pusher_as_they_stream_by_and_metadata_stays_whole() -> None:
    """A small entry is a layer when it is compressed (gzip or zstd) or a tar; the rest is metadata.
    (An empty layer, 1024 zero bytes, passes for metadata until manifest.json names it.)"""
    sent: list[str] = []

    def layer(name: str, raw: Any) -> zstdpush.Blob:
        sent.append(name)
        return zstdpush.Blob("", "", len(raw.read()))

    config = config_of([LAYERS[0], LAYERS[1], EMPTY_LAYER])
    saved = zstdpush.walk(iter([save_oci([LAYERS[0], LAYERS[1], EMPTY_LAYER], ["zstd", "gzip", "plain"], config)]),
                          layer)
    [entry] = json.loads(saved.small["manifest.json"])
    blobs = entry["Layers"]
    assert sorted(sent) == sorted(blobs[:2]) and set(saved.layers) == set(blobs[:2])
    assert blobs[2] in saved.small and f"blobs/sha256/{sha(config)[7:]}" in saved.small
    assert {"index.json", "oci-layout", "manifest.json"} <= set(saved.small)


def test_the_save_stream_skips_empty_chunks_and_ends_with_zero() -> None:
    stream = zstdpush.ChunkStream([b"ab", b"", b"cde"])
    buf = bytearray(2)
    got = [(stream.readinto(buf), bytes(buf)) for _ in range(4)]
    assert got == [(2, b"ab"), (2, b"cd"), (1, b"ed"), (0, b"ed")]
    assert zstdpush.ChunkStream([]).readinto(bytearray(4)) == 0


def test_the_manifest_is_canonical_oci() -> None:
    config = config_of(LAYERS[:2])
    blobs = [zstdpush.Blob(sha(LAYERS[0]), "sha256:" + "1" * 64, 10), zstdpush.Blob(sha(LAYERS[1]), "sha256:" + "2" * 64, 20)]
    body = zstdpush.manifest_body(config, blobs)
    assert body == zstdpush.manifest_body(config, list(blobs))
    doc = json.loads(body)
    assert list(doc) == ["schemaVersion", "mediaType", "config", "layers"] and doc["schemaVersion"] == 2
    assert doc["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert doc["layers"] == [{"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd", "digest": "sha256:" + "1" * 64,
                              "size": 10}, {"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd",
                                            "digest": "sha256:" + "2" * 64, "size": 20}]
    assert client.layer_compression(doc["layers"]) == "zstd"


def test_sniffing() -> None:
    assert [zstdpush.sniff(x) for x in (b"\x1f\x8b\x08\x00", b"\x28\xb5\x2f\xfd", b"{\"a\"", b"")] == \
        ["gzip", "zstd", "plain", "plain"]
    assert zstdpush.is_layer(LAYERS[0]) and zstdpush.is_layer(gzip.compress(b"x"))
    assert not zstdpush.is_layer(b'{"rootfs": {}}') and not zstdpush.is_layer(EMPTY_LAYER)


def test_layer_compression_of_a_manifest() -> None:
    def of(*types: str) -> list[dict[str, str]]:
        return [{"mediaType": t} for t in types]

    assert client.layer_compression(of("application/vnd.docker.image.rootfs.diff.tar.gzip")) == "gzip"
    assert client.layer_compression(of(zstdpush.ZSTD_LAYER, zstdpush.ZSTD_LAYER)) == "zstd"
    assert client.layer_compression(of("application/vnd.oci.image.layer.v1.tar")) == "none"
    assert client.layer_compression(of(zstdpush.ZSTD_LAYER, "application/vnd.oci.image.layer.v1.tar+gzip")) == "mixed"
    assert client.layer_compression([]) == "" and client.layer_compression(None) == ""


# --- the safety checks, attacked ----------------------------------------------------------------
ATTACKS = {
    # manifest.json lists the layers in another order than the config's diff_ids
    "layers-reordered": lambda: save_2010(LAYERS[:2], config_of(LAYERS[:2]), order=[1, 0]),
    # a layer's bytes are not the ones the config names
    "layer-altered": lambda: save_2010([LAYERS[0], layer_tar({"blob": b"other"})], config_of(LAYERS[:2])),
    # one layer fewer than the config names
    "layer-missing": lambda: save_oci(LAYERS[:1], ["gzip"], config_of(LAYERS[:2])),
    # one layer more
    "layer-extra": lambda: save_oci(LAYERS[:3], ["plain"] * 3, config_of(LAYERS[:2])),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_layers_that_are_not_the_configs_are_never_tagged(attack: str) -> None:
    fault, _, store = _push(ATTACKS[attack](), config_of(LAYERS[:2]))
    assert fault is not None and (fault.kind, fault.transient) == ("local", False), fault
    assert "the saved layers are not the image's" in fault.message and "nothing was tagged" in fault.message
    assert store.puts == [] and store.manifests == {}


def test_the_first_mismatch_is_named() -> None:
    a, b = (zstdpush.Blob(sha(t), "sha256:" + "0" * 64, 1) for t in LAYERS[:2])
    zstdpush.check_diff_ids(config_of(LAYERS[:2]), [a, b])
    with pytest.raises(zstdpush.SaveError, match=r"layer 2 of 2 hashes to sha256:[0-9a-f]{64}, and the config says"):
        zstdpush.check_diff_ids(config_of([LAYERS[0], LAYERS[3] + b"x"]), [a, b])
    with pytest.raises(zstdpush.SaveError, match="layer 2 of 1 hashes to nothing"):
        zstdpush.check_diff_ids(config_of(LAYERS[:2]), [a])
    with pytest.raises(zstdpush.SaveError, match=r"no rootfs\.diff_ids"):
        zstdpush.check_diff_ids(b"{}", [a])


def test_a_save_of_another_image_is_never_tagged() -> None:
    """The stream the engine gave is not the image asked for (its config has another digest)."""
    other = config_of(LAYERS[:2], created="2026-01-01T00:00:00Z")
    store = BlobStore()
    engine = SaveEngine()
    asked = sha(config_of(LAYERS[:2]))
    engine.saves[asked] = save_2010(LAYERS[:2], other)
    fault = zstdpush.ZstdPusher(engine, store).push(asked, "t1", push.PushTracker())
    assert fault is not None and fault.kind == "local" and f"not the image being published ({asked})" in fault.message
    assert store.puts == []


@pytest.mark.parametrize("broken", ["no-manifest-json", "not-json", "two-images", "no-config", "no-layer"])
def test_a_malformed_save_is_a_local_fault(broken: str) -> None:
    config = config_of(LAYERS[:1])
    entries: list[tuple[str, bytes | str]] = [("a/layer.tar", LAYERS[0]), ("c.json", config)]
    manifest = {"no-manifest-json": None, "not-json": b"[", "two-images": b"[{}, {}]",
                "no-config": json.dumps([{"Config": "missing.json", "Layers": ["a/layer.tar"]}]).encode(),
                "no-layer": json.dumps([{"Config": "c.json", "Layers": ["a/layer.tar", "b/layer.tar"]}]).encode(),
                }[broken]
    if manifest is not None:
        entries.append(("manifest.json", manifest))
    fault, _, store = _push(outer_tar(entries), config)
    assert fault is not None and (fault.kind, fault.transient) == ("local", False), fault
    said = {"no-manifest-json": "no manifest.json", "not-json": "not one image's", "two-images": "not one image's",
            "no-config": "lacks missing.json", "no-layer": "lacks b/layer.tar"}[broken]
    assert said in fault.message, fault.message
    assert store.puts == []


def test_a_corrupt_compressed_layer_is_a_local_fault_not_a_network_one() -> None:
    """A gzip error is an OSError: leaving the upload's body as one, the HTTP client would call it a
    dropped connection and the publisher would retry it as a network fault."""
    blob = gzip.compress(LAYERS[1], mtime=0)
    broken = blob[: len(blob) // 2]
    config = config_of(LAYERS[1:2])
    saved = outer_tar([(f"blobs/sha256/{sha(broken)[7:]}", broken), (f"blobs/sha256/{sha(config)[7:]}", config),
                       ("manifest.json", json.dumps([{"Config": f"blobs/sha256/{sha(config)[7:]}",
                                                      "Layers": [f"blobs/sha256/{sha(broken)[7:]}"]}]).encode())])
    fault, _, store = _push(saved, config)
    assert fault is not None and (fault.kind, fault.transient) == ("local", False) and "can't be read" in fault.message
    assert store.puts == []


# --- what the run remembers -------------------------------------------------------------------
def test_another_tag_of_the_same_image_sends_no_blob() -> None:
    config = config_of(LAYERS)
    fault, first, store = _push(save_2010(LAYERS), config)
    assert fault is None
    engine = SaveEngine()
    pusher = zstdpush.ZstdPusher(engine, store)
    engine.saves[sha(config)] = save_2010(LAYERS)
    assert pusher.push(sha(config), "t1", push.PushTracker()) is None
    uploads, saves = list(store.uploads), list(engine.calls)
    tracker = push.PushTracker()
    assert pusher.push(sha(config), "t2", tracker) is None
    assert store.uploads == uploads and engine.calls == saves  # no blob sent, the image not even read again
    assert store.manifests["t2"] == store.manifests["t1"] and tracker.digest == first.digest
    assert tracker.uploaded == [] and len(tracker.existing) == len(LAYERS)


def test_another_tag_whose_blobs_went_missing_is_pushed_again() -> None:
    config, store, _engine, pusher = _pusher(LAYERS[:2])
    assert pusher.push(sha(config), "t1", push.PushTracker()) is None
    lost = json.loads(store.manifests["t1"])["layers"][1]["digest"]
    del store.blobs[lost]  # garbage-collected between the tags
    tracker = push.PushTracker()
    assert pusher.push(sha(config), "t2", tracker) is None
    assert store.uploads[-1] == lost and tracker.uploaded == [lost[7:19]] and len(tracker.existing) == 1
    assert served_layers(store, "t2") == LAYERS[:2]


def test_a_retry_sends_only_the_layers_that_did_not_get_there() -> None:
    broken = BlobStore(break_upload={3: faults.Fault("network", "connection reset", True)})
    config, store, _engine, pusher = _pusher(LAYERS, broken)
    first = push.PushTracker()
    fault = pusher.push(sha(config), "t1", first)
    assert fault is not None and fault.transient and store.puts == []
    sent = list(store.uploads)
    assert len(sent) == 2 and len(first.uploaded) == 2
    again = push.PushTracker()
    assert pusher.push(sha(config), "t1", again) is None
    assert not set(sent) & set(store.uploads[2:]), "a layer the registry had was sent again"
    assert {x[7:19] for x in sent} <= set(again.existing)
    assert served_layers(store, "t1") == LAYERS


def test_a_retry_hashes_a_remembered_layer_to_its_end() -> None:
    """A layer the registry already has is read again on a retry, to check its bytes: all of them, not
    the first read's (the layer is bigger than one)."""
    layers = [layer_tar({"big": bytes(range(256)) * ((zstdpush.CHUNK * 3 // 2) // 256)}), LAYERS[0]]
    broken = BlobStore(break_upload={3: faults.Fault("server", "503", True)})  # the config's upload fails
    config, store, _engine, pusher = _pusher(layers, broken)
    assert pusher.push(sha(config), "t1", push.PushTracker()) is not None and len(store.uploads) == 2
    again = push.PushTracker()
    assert pusher.push(sha(config), "t1", again) is None, "a remembered layer was not hashed whole"
    assert again.uploaded == [] and len(again.existing) == 2 and served_layers(store, "t1") == layers


def test_a_known_entry_whose_bytes_changed_is_refused() -> None:
    """What the run remembers is keyed by the save's entry names; bytes that hash otherwise under a
    remembered name are refused, never tagged with the remembered blob."""
    config, store, engine, pusher = _pusher(LAYERS[:2])
    store.break_upload[3] = faults.Fault("server", "503", True)  # the config's upload fails: retry
    assert pusher.push(sha(config), "t1", push.PushTracker()) is not None
    with tarfile.open(fileobj=io.BytesIO(engine.saves[sha(config)])) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
    second = json.loads(files["manifest.json"])[0]["Layers"][1]
    files[second] = layer_tar({"blob": b"changed"})  # same entry name, other bytes
    engine.saves[sha(config)] = outer_tar(list(files.items()))
    fault = pusher.push(sha(config), "t1", push.PushTracker())
    assert fault is not None and fault.kind == "local" and "when it was sent" in fault.message
    assert store.puts == []


def test_registry_faults_and_engine_errors_become_faults() -> None:
    config, store, _engine, pusher = _pusher(LAYERS[:1])
    assert pusher.push(sha(config), "t1", push.PushTracker()) is None
    store.blob_exists = lambda d: faults.Fault("server", "HTTP 502", True)  # type: ignore[method-assign,assignment]
    fault = pusher.push(sha(config), "t2", push.PushTracker())
    assert fault == faults.Fault("server", "HTTP 502", True)

    def dead(ref: str) -> Iterator[bytes]:
        raise EngineError("the Docker engine stopped answering (save): connection reset")
        yield b""

    pusher = zstdpush.ZstdPusher(type("E", (), {"save": staticmethod(dead)})(), BlobStore())
    fault = pusher.push(sha(config), "t1", push.PushTracker())
    assert fault is not None and (fault.kind, fault.transient) == ("network", True)


# --- the registry client's upload protocol ------------------------------------------------------
class Response:
    def __init__(self, status: int, headers: Mapping[str, str] | None = None, body: bytes = b"") -> None:
        self.status_code, self.content = status, body
        self.headers = CaseInsensitiveDict(headers or {})


class UploadSession:
    """A registry's blob endpoints; records (method, url, headers, body bytes)."""

    def __init__(self, challenge: str = "", location: str = "/v2/ns/pt/blobs/uploads/u1?_state=s0") -> None:
        self.location = location  # where the POST sends the upload
        self.calls: list[tuple[str, str, dict[str, str], bytes]] = []
        self.challenge = challenge  # a method that gets one 401 first
        self.trust_env = True
        self.stored: dict[str, bytes] = {}
        self.pending = b""

    def _call(self, method: str, url: str, headers: dict[str, str], data: Any) -> Response:
        body = data if isinstance(data, bytes) or data is None else b"".join(data)
        self.calls.append((method, url, dict(headers), body or b""))
        if self.challenge == method and "Authorization" not in headers:
            self.challenge = ""
            return Response(401, {"WWW-Authenticate": 'Basic realm="r"'})
        if method == "HEAD":
            return Response(200 if url.rsplit("/", 1)[1] in self.stored else 404)
        if method == "POST":
            return Response(202, {"Location": self.location})
        if method == "PATCH":
            self.pending += body or b""
            return Response(202, {"Location": "http://127.0.0.1:5000/v2/ns/pt/blobs/uploads/u1?_state=s1"})
        digest = unquote(url.split("digest=")[1])
        if sha(self.pending) != digest:
            return Response(400, body=b'{"errors": [{"code": "DIGEST_INVALID"}]}')
        self.stored[digest] = self.pending
        return Response(201, {"Docker-Content-Digest": digest})

    def head(self, url: str, headers: dict[str, str], data: Any = None, **_: Any) -> Response:
        return self._call("HEAD", url, headers, data)

    def post(self, url: str, headers: dict[str, str], data: Any = None, **_: Any) -> Response:
        return self._call("POST", url, headers, data)

    def patch(self, url: str, headers: dict[str, str], data: Any = None, **_: Any) -> Response:
        return self._call("PATCH", url, headers, data)

    def put(self, url: str, headers: dict[str, str], data: Any = None, **_: Any) -> Response:
        return self._call("PUT", url, headers, data)


def _client(session: UploadSession) -> client.RegistryClient:
    from builder.publish import credentials

    creds = credentials.Credentials("bob", credentials.Secret("pw"), "test")
    return client.RegistryClient(address.parse_registry("127.0.0.1:5000/ns"), "pt", creds,
                                 session=session, verify=True)  # type: ignore[arg-type]


def test_upload_streams_the_body_once_then_puts_its_digest() -> None:
    s = UploadSession()
    c = _client(s)
    pulled: list[int] = []

    def body() -> Iterator[bytes]:
        for i in range(3):
            pulled.append(i)
            yield bytes([i]) * 1000

    data = b"".join(bytes([i]) * 1000 for i in range(3))
    assert c.upload_blob(body(), lambda: sha(data)) == sha(data)
    assert [(m, u) for m, u, _, _ in s.calls] == [
        ("POST", "http://127.0.0.1:5000/v2/ns/pt/blobs/uploads/"),
        ("PATCH", "http://127.0.0.1:5000/v2/ns/pt/blobs/uploads/u1?_state=s0"),
        ("PUT", f"http://127.0.0.1:5000/v2/ns/pt/blobs/uploads/u1?_state=s1&digest={sha(data).replace(':', '%3A')}")]
    assert pulled == [0, 1, 2] and s.stored[sha(data)] == data
    assert c.blob_exists(sha(data)) is True and c.blob_exists(sha(b"other")) is False


def test_upload_answers_a_challenge_before_the_stream_and_never_resends_one() -> None:
    s = UploadSession(challenge="POST")
    c = _client(s)
    assert c.upload_blob(b"abc", sha(b"abc")) == sha(b"abc")
    assert [m for m, *_ in s.calls] == ["POST", "POST", "PATCH", "PUT"]
    s = UploadSession(challenge="PATCH")
    got = _client(s).upload_blob(iter([b"abc"]), sha(b"abc"))
    assert isinstance(got, faults.Fault) and got.kind == "auth" and [m for m, *_ in s.calls] == ["POST", "PATCH"]


def test_an_upload_sent_to_another_origin_never_carries_the_credentials() -> None:
    """The registry's Location may name a storage backend (another host, port or scheme): the bytes go
    there, the registry's credentials do not. On the registry's own origin they do."""
    for elsewhere in ("http://storage.example:9000/up/u1?_state=s0", "https://127.0.0.1:5000/v2/ns/pt/blobs/uploads/u1",
                      "http://127.0.0.1:5001/v2/ns/pt/blobs/uploads/u1"):
        s = UploadSession(challenge="POST", location=elsewhere)  # the registry asks for credentials, and gets them
        _client(s).upload_blob(b"abc", sha(b"abc"))
        (_challenged, post, patch, *_rest) = s.calls
        assert post[0] == "POST" and "Authorization" in post[2]
        assert patch[1].startswith(elsewhere.split("?")[0]) and "Authorization" not in patch[2], patch
    s = UploadSession(challenge="POST", location="http://127.0.0.1:5000/v2/ns/pt/blobs/uploads/u1?_state=s0")
    assert _client(s).upload_blob(b"abc", sha(b"abc")) == sha(b"abc")
    assert [m for m, *_ in s.calls] == ["POST", "POST", "PATCH", "PUT"]
    assert all("Authorization" in headers for _m, _u, headers, _b in s.calls[1:])


def test_upload_faults() -> None:
    s = UploadSession()
    c = _client(s)
    got = c.upload_blob(b"abc", sha(b"abd"))  # the registry checks the digest: 400 DIGEST_INVALID
    assert isinstance(got, faults.Fault) and got.kind == "protocol" and "DIGEST_INVALID" in got.message

    class Down(UploadSession):
        def post(self, url: str, headers: dict[str, str], data: Any = None, **_: Any) -> Response:
            raise requests.exceptions.ConnectionError("[Errno 111] Connection refused")

    got = _client(Down()).upload_blob(b"abc", sha(b"abc"))
    assert isinstance(got, faults.Fault) and (got.kind, got.transient) == ("network", True)

    class Moved(UploadSession):
        def head(self, url: str, headers: dict[str, str], data: Any = None, **_: Any) -> Response:
            return Response(307, {"Location": "https://storage/blob"})

    assert _client(Moved()).blob_exists(sha(b"x")) is True  # a redirect to the storage: the blob is there

    class Broken(UploadSession):
        def head(self, url: str, headers: dict[str, str], data: Any = None, **_: Any) -> Response:
            return Response(503)

    there = _client(Broken()).blob_exists(sha(b"x"))
    assert isinstance(there, faults.Fault) and there.transient


# --- the engine's save stream -------------------------------------------------------------------
def test_the_engine_save_stream_translates_errors_mid_stream() -> None:
    class Api:
        def get_image(self, ref: str, chunk_size: int) -> Iterator[bytes]:
            yield b"first"
            raise urllib3.exceptions.ProtocolError("Connection broken: IncompleteRead")

    engine = Engine(client=type("C", (), {"api": Api()})(), labels={})
    stream = engine.save("sha256:" + "1" * 64)
    assert next(stream) == b"first"
    with pytest.raises(EngineError, match=r"stopped answering \(save\).*IncompleteRead"):
        next(stream)
