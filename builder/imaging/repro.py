"""`build.py repro CELL`: is the cell's image bit-identical when built again from scratch?

Two uncached builds of the cell, each exported as an OCI layout (the exporter's rewrite-timestamp
clamps every file's timestamp in the layers to SOURCE_DATE_EPOCH; the config's and the history's
``created`` are SOURCE_DATE_EPOCH too). Same lock, same base image, same Debian snapshot: the
manifest digests must be equal. When they are not, the layers that differ are read side by side and
the files that differ are named (path, and what differs: content, mode, owner, size, link, time).
With ``--against DIGEST`` one build is compared with a digest printed by an earlier run, on this
machine or another (docs/supply-chain.md).

SOURCE_DATE_EPOCH is the Debian snapshot's newest Release date (:meth:`Snapshot.epoch`): the same for every
build of one snapshot, and a real date (the archive state the OS layer applied), not 1970.
Only the exporter reads it: no RUN declares it, so it never keys the layer cache.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import re
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

from builder.common.errors import StepFailed
from builder.common.log import log
from builder.engine import BuildkitCli, Engine
from builder.engine.buildkit import buildx_facts
from builder.engine.capabilities import CONTAINERD, Store, buildkit_version, need_feature
from builder.imaging.orchestrate import BuildConfig, export_reproducible, failure_text
from builder.matrix import ImageSpec

FEATURE = "rewrite-timestamp (bit-identical layers)"
#: A digest as the exporter writes it.
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
#: How many differing files a report names (the rest are counted).
SHOWN = 40
NO_BUILDX = ("build.py repro needs the buildx CLI (an OCI export with rewrite-timestamp), and {have}. Fix: Docker "
             ">= 26 with the buildx plugin (Debian: docker.io >= 26 and docker-buildx; Docker's repository: "
             "docker-ce and docker-buildx-plugin)")
NOT_CONTAINERD = ("build.py repro exports an OCI layout, which buildx's docker driver writes only from the "
                  "containerd image store, and this engine uses the {store} store. Fix: turn on the containerd "
                  "image store (daemon.json \"features\": {{\"containerd-snapshotter\": true}}, the default of "
                  "new Docker 29 installs) and restart dockerd")


def cannot(cli: BuildkitCli | None, store: Store, api_version: str | None) -> str | None:
    """None when this engine can make a reproducible export, else the one line that says what is missing
    and the fix (asked of the CLI and the engine, never read off a version string)."""
    if cli is None or not cli.buildx:
        return NO_BUILDX.format(have=f"{cli.describe()} is what builds here" if cli else "no docker CLI builds here")
    reported = buildx_facts(cli)[1]
    version, source = buildkit_version(reported, api_version)
    missing = need_feature(FEATURE, version, source)
    if missing is not None:
        return missing
    if store.kind != CONTAINERD:
        return NOT_CONTAINERD.format(store=store.kind)
    return None


# --- the OCI layout ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class OciImage:
    """One image in an OCI layout folder, as the exporter wrote it."""

    folder: Path
    manifest_digest: str
    config_digest: str
    layers: tuple[str, ...]  # blob digests, base first
    diff_ids: tuple[str, ...]  # the uncompressed layers' digests, the same order

    def blob(self, digest: str) -> Path:
        algo, _, hexd = digest.partition(":")
        return self.folder / "blobs" / algo / hexd


class LayoutError(Exception):
    """The folder is not the one-image OCI layout the exporter writes."""


def read_layout(folder: Path) -> OciImage:
    try:
        index = json.loads((folder / "index.json").read_text(encoding="utf-8"))
        (desc,) = index["manifests"]
        manifest_digest = str(desc["digest"])
        probe = OciImage(folder, manifest_digest, "", (), ())
        manifest = json.loads(probe.blob(manifest_digest).read_text(encoding="utf-8"))
        config_digest = str(manifest["config"]["digest"])
        config = json.loads(probe.blob(config_digest).read_text(encoding="utf-8"))
        layers = tuple(str(layer["digest"]) for layer in manifest["layers"])
        diff_ids = tuple(str(d) for d in config["rootfs"]["diff_ids"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LayoutError(f"{folder} is not a one-image OCI layout: {exc}") from None
    if len(layers) != len(diff_ids):
        raise LayoutError(f"{folder}: {len(layers)} layers but {len(diff_ids)} diff_ids")
    return OciImage(folder, manifest_digest, config_digest, layers, diff_ids)


# --- what differs -----------------------------------------------------------------------------------
Entry = tuple[str, int, int, int, int, str, int, str]  # type, mode, uid, gid, size, link, mtime, sha256
FIELDS = ("type", "mode", "owner", "group", "size", "link", "mtime", "content")


def plain_stream(raw: IO[bytes]) -> IO[bytes]:
    """The plain tar of a layer read once, front to back: gzip (BuildKit's default), zstd (``publish
    --compression zstd``) or plain tar, told by the magic bytes and decompressed on the fly."""
    f = io.BufferedReader(cast(Any, raw), 1 << 20)
    head = f.peek(4)[:4]
    if head.startswith(b"\x1f\x8b"):
        return cast(IO[bytes], gzip.GzipFile(fileobj=f))
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        import zstandard

        return cast(IO[bytes], zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True))
    return f


def _open_blob(path: Path) -> IO[bytes]:
    """A layer blob, uncompressed (gzip, as BuildKit writes them by default, or plain tar)."""
    with path.open("rb") as f:
        magic = f.read(2)
    return cast(IO[bytes], gzip.open(path, "rb")) if magic == b"\x1f\x8b" else path.open("rb")


def layer_entries(stream: IO[bytes]) -> dict[str, Entry]:
    """path -> what a tar stream says of it, the content as a sha256, read once and in order."""
    out: dict[str, Entry] = {}
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for m in tar:
            content = ""
            if m.isreg():
                f = tar.extractfile(m)
                assert f is not None
                h = hashlib.sha256()
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                content = h.hexdigest()
            out["/" + m.name.lstrip("./")] = (m.type.decode("ascii", "replace"), m.mode, m.uid, m.gid, m.size,
                                             m.linkname, int(m.mtime), content)
    return out


def compare_entries(a: dict[str, Entry], b: dict[str, Entry], names: tuple[str, str] = ("the first build",
                    "the second build"), ignore: frozenset[str] = frozenset()) -> Iterator[str]:
    """One line per path that differs: only in one, or which fields differ (``ignore``: fields not compared)."""
    for path in sorted(a.keys() | b.keys()):
        if path not in b:
            yield f"{path}: only in {names[0]}"
        elif path not in a:
            yield f"{path}: only in {names[1]}"
        else:
            what = [name for name, x, y in zip(FIELDS, a[path], b[path], strict=True) if x != y and name not in ignore]
            if what:
                yield f"{path}: {', '.join(what)} differ"


def differing_files(a: OciImage, b: OciImage) -> list[str]:
    """What differs between two builds, layer by layer (only the layers whose diff_ids differ are read)."""
    lines: list[str] = []
    if len(a.diff_ids) != len(b.diff_ids):
        lines.append(f"the first build has {len(a.diff_ids)} layers, the second {len(b.diff_ids)}")
    for n, (da, db) in enumerate(zip(a.diff_ids, b.diff_ids, strict=False), start=1):
        if da == db:
            continue
        with _open_blob(a.blob(a.layers[n - 1])) as fa, _open_blob(b.blob(b.layers[n - 1])) as fb:
            diff = list(compare_entries(layer_entries(fa), layer_entries(fb)))
        lines.append(f"layer {n}: {len(diff)} path(s) differ" if diff else
                     f"layer {n}: the same files, in another order or tar encoding")
        lines += [f"  {d}" for d in diff]
    if not lines and a.config_digest != b.config_digest:
        lines.append("every layer is the same; the image configs differ (labels, history or created)")
    return lines


def shown(lines: Sequence[str], limit: int = SHOWN) -> list[str]:
    return list(lines[:limit]) + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])


# --- the run ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Build:
    manifest_digest: str
    config_digest: str
    seconds: float


@dataclass(frozen=True)
class Verdict:
    builds: tuple[Build, ...]
    expected: str | None  # --against
    epoch: int
    snapshot: str
    differs: tuple[str, ...]  # what differs, when it does (named files, or why none can be named)
    inputs: str = ""  # the inputs hash the builds had (the one `build.py build` labels the cell's image with)

    @property
    def same(self) -> bool:
        want = self.expected or self.builds[0].manifest_digest
        return all(b.manifest_digest == want for b in self.builds)


def reproduce(engine: Engine, spec: ImageSpec, cfg: BuildConfig, workdir: Path, against: str | None,
              on_line: Callable[[str, str], None]) -> Verdict:
    """Build ``spec`` from scratch twice (once with ``against``) into OCI layouts under ``workdir``, compare."""
    images: list[OciImage] = []
    builds: list[Build] = []
    epoch, snapshot, inputs = 0, "", ""
    for n in range(1 if against else 2):
        dest = workdir / "ab"[n]
        log_path = cfg.log_dir / f"{spec.name}.repro-{'ab'[n]}.log"
        log.info("%s: build %d of %d, from scratch, into %s", spec.name, n + 1, 1 if against else 2, dest)
        t0 = time.monotonic()
        done = export_reproducible(engine, spec, cfg, dest, log_path, on_line)
        outcome, snap, epoch = done.outcome, done.snapshot, done.epoch
        if not outcome.ok:
            raise StepFailed(f"{spec.name}: build {n + 1} failed\n" +
                             failure_text(outcome.failed_step, outcome.tail, log_path))
        if snapshot and snap.key != snapshot:
            raise StepFailed(f"{spec.name}: Debian published updates between the two builds (snapshot {snapshot} "
                             f"then {snap.key}); run it again")
        if inputs and done.inputs != inputs:
            raise StepFailed(f"{spec.name}: the inputs changed between the two builds ({inputs} then {done.inputs}: "
                             "an edit, a new lock or a new base while it ran); run it again")
        snapshot, inputs = snap.key, done.inputs
        try:
            image = read_layout(dest)
        except LayoutError as exc:
            raise StepFailed(f"{spec.name}: {exc}") from None
        images.append(image)
        builds.append(Build(image.manifest_digest, image.config_digest, time.monotonic() - t0))
    verdict = Verdict(tuple(builds), against, epoch, snapshot, (), inputs)
    if verdict.same:
        return verdict
    if against:
        why = ("the rebuild is not the image that was published; build it twice here (without --against) to see "
               "whether this machine's builds agree with each other, and check that the lock, the base image and "
               "the Debian snapshot are the published one's")
        return dataclasses.replace(verdict, differs=(why,))
    return dataclasses.replace(verdict, differs=tuple(differing_files(images[0], images[1])))


# --- the report, and what publish signs of it -------------------------------------------------------
#: A repro report is a few hundred bytes; a file far larger is not one (read no more than this).
REPORT_LIMIT = 1 << 20


def report_path(folder: Path, cell: str) -> Path:
    return folder / f"{cell}.repro.json"


def write_report(folder: Path, cell: str, report: dict[str, Any]) -> Path:
    """``<folder>/<cell>.repro.json``, written whole or not at all (a temporary file, then a rename)."""
    path = report_path(folder, cell)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@dataclass(frozen=True)
class Proven:
    """A manifest digest ``build.py repro`` got from every build of a cell (two from scratch, or one that
    matched ``--against``), and what it built from."""

    manifest: str
    config: str
    source_date_epoch: int
    os_snapshot: str
    inputs: str
    buildx: str = ""  # the buildx and BuildKit that built it ("" when the report does not say)
    buildkit: str = ""


class _NoInputs(ValueError):
    """A report from before repro recorded the inputs hash."""


def _report_fields(raw: bytes) -> tuple[str, bool, Proven, list[str], str | None]:
    """(cell, same, what the first build gave, every build's manifest digest, --against) of a report's bytes;
    ValueError naming the first thing that is not as ``build.py repro`` writes it."""
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    builds = data.get("builds")
    if not isinstance(builds, list) or not builds or not all(isinstance(b, dict) for b in builds):
        raise ValueError("no builds")
    if not data.get("inputs"):
        raise _NoInputs
    manifests, config, against = [b.get("manifest") for b in builds], builds[0].get("config"), data.get("against")
    named = [("a build's manifest", m) for m in manifests] + [("the config", config), ("inputs", data.get("inputs"))]
    for what, value in named + ([("against", against)] if against is not None else []):
        if not isinstance(value, str) or not DIGEST.fullmatch(value):
            raise ValueError(f"{what} {value!r} is not sha256: and 64 lowercase hex digits")
    epoch, snapshot, cell = data.get("source_date_epoch"), data.get("os_snapshot"), data.get("cell")
    if type(epoch) is not int or epoch < 0:
        raise ValueError(f"source_date_epoch {epoch!r} is not a whole number of seconds")
    if not isinstance(snapshot, str) or not isinstance(cell, str):
        raise ValueError("its cell and os_snapshot are not strings")
    tools = [str(data.get(k) or "")[:100] for k in ("buildx", "buildkit")]
    proven = Proven(str(manifests[0]), str(config), epoch, snapshot, str(data["inputs"]), *tools)
    return cell, data.get("same") is True, proven, [str(m) for m in manifests], against


def proven_digest(folder: Path, cell: str, inputs: str) -> Proven | str:
    """The bit-identical digest the repro report of ``cell`` in ``folder`` proved for the inputs hash
    ``inputs`` (the image's LABEL_INPUTS_HASH), or one line saying why there is none to sign. Nothing in the
    report is taken on trust: every digest is checked for its form, and every build must have given the same
    manifest (and ``--against``'s, where it was given)."""
    path = report_path(folder, cell)
    try:
        with path.open("rb") as fh:
            raw = fh.read(REPORT_LIMIT + 1)
    except FileNotFoundError:
        return f"no repro report ({path}; `build.py repro {cell}` writes it)"
    except OSError as exc:
        return f"{path} cannot be read: {exc.strerror or exc}"
    if len(raw) > REPORT_LIMIT:
        return f"{path} is not a repro report: over {REPORT_LIMIT} bytes"
    try:
        named, same, proven, manifests, against = _report_fields(raw)
    except _NoInputs:
        return f"{path} records no inputs hash (an older build.py wrote it); run `build.py repro {cell}` again"
    except (ValueError, RecursionError) as exc:
        return f"{path} is not a repro report: {str(exc)[:200]}"
    if named != cell:
        return f"{path} is the report of cell {named!r}, not {cell}"
    if not same or len(set(manifests)) != 1 or (against is not None and against != proven.manifest):
        return f"{path}: its builds differed (not bit-identical), so no digest was proven"
    if proven.inputs != inputs:
        return (f"{path} was made from other inputs ({proven.inputs}) than the image ({inputs or 'no inputs label'}): "
                f"the Dockerfile, our files, the lock, the base or the Debian snapshot changed since; run "
                f"`build.py repro {cell}` again")
    return proven
