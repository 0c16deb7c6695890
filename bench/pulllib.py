"""What a node holding image A must fetch and store for image B (bench/bench_pull.py).

Two ways a node keeps layers, so two costs:
  - by blob digest (enroot, a registry's own dedupe): B's compressed blobs whose digest A lacks are
    fetched; a blob is the compressed tar of one layer, whatever lies below it.
  - by chain ID (Docker's classic store, containerd): an unpacked layer is kept under
    chain(n) = sha256(chain(n-1) + " " + diff_id(n)), so a layer whose files are byte for byte the
    same is stored (and, with containerd, fetched) anew when anything below it changed.

The pure part (chain IDs, the comparison, the share of a set) needs no engine; `read_layers` reads
one image's layers from the engine: diff IDs from `docker image inspect`, each layer's unpacked size
from the engine's layer store (layerdb/<chain id>/size: exact, the classic store only), and what
made it from the image's history.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

DOCKER = "/usr/bin/docker"
MB = 1e6
#: (what a layer is, in short and in bench_size.py's table, a marker of the instruction that made it);
#: first match wins. The first three layers are COPYs (docs/image-layout.md, "Layers"): the CUDA wheels'
#: tree and torch's shared files from their stages' folders (builder.render.dockerfile.SHARED_STAGES),
#: then the base's files; before them, the base came first.
KINDS = (
    ("CUDA wheels", "CUDA wheels (nvidia-*)", "COPY /ptmg-out-cuda/ / "),
    ("torch's shared files", "torch's and Triton's files that no Python changes", "COPY /ptmg-out-torch/ / "),
    ("base", "base image", "COPY / / "),
    ("devel toolkit", "devel: build-essential, git, CUDA_HOME", "cuda-home.sh"),
    ("OS (apt)", "OS packages (+ g++, python3-dev, rdma-core)", "os-layer.sh apply"),  # the OS stage's apt (06-os.j2)
    ("OS (apt)", "OS packages (+ g++, python3-dev, rdma-core)", "apt-get install"),
    ("user", "user", "useradd"),
    ("venv", "venv (links to the CUDA wheels)", "python3 -m venv"),
    ("torch", "torch + torchvision, Triton", "import torch, torchvision"),
    ("tools", "tools (JupyterLab, TensorBoard, pytest)", "pip check"),
    ("devel wheels", "devel: CUDA toolkit wheels, ninja", "pip install"),
    ("SBOM", "SBOM", "sbom.py"),
    ("our files", "our files (entrypoint/, smoke_tests/, contract)", "COPY "),
    ("our files", "our files (entrypoint/, smoke_tests/, contract)", "build_canary"),
)


class BenchInputError(Exception):
    """Bad input: one located line, exit 2."""


@dataclasses.dataclass(frozen=True)
class Layer:
    diff_id: str
    chain_id: str
    size: int  # unpacked bytes
    kind: str
    blob: str | None = None  # compressed blob digest, once pushed
    blob_size: int | None = None


def chain_ids(diff_ids: Sequence[str]) -> list[str]:
    """The OCI chain IDs of a layer stack (the image spec's ChainID(L0|...|Ln), in its config page)."""
    out: list[str] = []
    for diff in diff_ids:
        out.append(diff if not out else "sha256:" + hashlib.sha256(f"{out[-1]} {diff}".encode()).hexdigest())
    return out


def kind_of(created_by: str) -> str:
    if not created_by.strip() or created_by.startswith("ADD file:"):
        return "base"
    return next((name for name, _, marker in KINDS if marker in created_by), "other")


def label_layers(sizes: Sequence[int], history: Sequence[tuple[int, str]]) -> list[str]:
    """What made each layer: history entries (oldest first, (size, created_by)) with a size are matched in
    order to the layers with a size (the API's history says 0 both for metadata and for an empty layer);
    the first layer is what its instruction says (the CUDA wheels), or the base where it says nothing."""
    made = [by for size, by in history if size > 0]
    out, i = [], 0
    for n, size in enumerate(sizes):
        if n == 0:
            first = kind_of(made[0]) if size > 0 and made else "base"
            out.append("base" if first == "other" else first)
            if size > 0 and made:
                i += 1
            continue
        if size > 0 and i < len(made):
            out.append(kind_of(made[i]))
            i += 1
        else:
            out.append("empty")
    return out


def with_blobs(layers: Sequence[Layer], manifest: Mapping[str, Any]) -> list[Layer]:
    """The layers with their compressed blobs, from the image's registry manifest (same order as RootFS)."""
    blobs = manifest.get("layers") or []
    if len(blobs) != len(layers):
        raise BenchInputError(f"the manifest lists {len(blobs)} layers, the image {len(layers)}")
    return [dataclasses.replace(lay, blob=str(b["digest"]), blob_size=int(b["size"]))
            for lay, b in zip(layers, blobs, strict=True)]


def cost(old: Sequence[Layer], new: Sequence[Layer]) -> dict[str, Any]:
    """What a node that holds `old` pays for `new`: by chain ID (unpacked bytes stored anew) and, where the
    blobs are known, by blob digest (compressed bytes fetched)."""
    chains = {lay.chain_id for lay in old}
    diffs = {lay.diff_id for lay in old}
    blobs = {lay.blob for lay in old if lay.blob}
    total = sum(lay.size for lay in new)
    by_chain = sum(lay.size for lay in new if lay.chain_id not in chains)
    by_diff = sum(lay.size for lay in new if lay.diff_id not in diffs)
    out: dict[str, Any] = {
        "size": total, "new_by_chain": by_chain, "new_by_chain_share": by_chain / total if total else 0.0,
        "new_by_diff": by_diff,
        "layers": [{"kind": lay.kind, "size": lay.size, "blob_size": lay.blob_size,
                    "new_chain": lay.chain_id not in chains, "new_diff": lay.diff_id not in diffs,
                    "new_blob": None if lay.blob is None else lay.blob not in blobs,
                    "diff_id": lay.diff_id, "chain_id": lay.chain_id, "blob": lay.blob} for lay in new],
    }
    if all(lay.blob_size is not None for lay in new) and new:
        compressed = sum(lay.blob_size or 0 for lay in new)
        fetch = sum(lay.blob_size or 0 for lay in new if lay.blob not in blobs)
        out.update(compressed=compressed, fetch_by_blob=fetch, fetch_by_blob_share=fetch / compressed)
    return out


def share(images: Mapping[str, Sequence[Layer]]) -> dict[str, Any]:
    """Several images on one node: the bytes kept once per chain ID (what the node stores) and once per
    diff ID (what a store keyed by content would keep), against their sum."""
    summed = sum(lay.size for layers in images.values() for lay in layers)
    by_chain = {lay.chain_id: lay.size for layers in images.values() for lay in layers}
    by_diff = {lay.diff_id: lay.size for layers in images.values() for lay in layers}
    unique_chain, unique_diff = sum(by_chain.values()), sum(by_diff.values())
    return {"images": list(images), "summed": summed, "unique_by_chain": unique_chain,
            "unique_by_diff": unique_diff, "chain_ratio": unique_chain / summed if summed else 0.0,
            "diff_ratio": unique_diff / summed if summed else 0.0}


_FIELD = re.compile(r'([\w.]+)=("(?:[^"\\]|\\.)*"|\S+)')
_BLOB_URI = re.compile(r"^/v2/.+/blobs/sha256:[0-9a-f]{64}$")


def fetched_from_log(text: str) -> dict[str, int]:
    """What a registry served as blobs, from Debian's docker-registry 2.8 log (logrus text lines, `level:
    info`): the bytes written by every GET of a blob answered 200 or 206 ("response completed" lines), and
    how many. HEADs, manifests and refusals write no blob bytes and are not counted."""
    served = count = 0
    for line in text.splitlines():
        if 'msg="response completed"' not in line:
            continue
        f = {k: v.strip('"') for k, v in _FIELD.findall(line)}
        if (f.get("http.request.method") == "GET" and _BLOB_URI.match(f.get("http.request.uri", ""))
                and f.get("http.response.status") in ("200", "206")):
            served += int(f.get("http.response.written", "0") or 0)
            count += 1
    return {"bytes": served, "blobs": count}


# --- reading the engine ---------------------------------------------------------------------------------
def _docker(*argv: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The docker CLI; env (a user's environment, e.g. DOCKER_HOST naming a second engine) or this process's."""
    return subprocess.run([DOCKER, *argv], capture_output=True, text=True, check=False,
                          env=None if env is None else dict(env))


def layer_store(env: Mapping[str, str] | None = None) -> Path:
    """The classic store's layer database (layerdb/sha256/<chain id>/size); where it is not readable,
    BenchInputError with why."""
    r = _docker("info", "--format", "{{.DockerRootDir}} {{.Driver}}", env=env)
    if r.returncode != 0:
        raise BenchInputError(f"docker info: {r.stderr.strip()[-300:]}")
    root, driver = [*r.stdout.split(), "", ""][:2]
    db = Path(root) / "image" / driver / "layerdb" / "sha256"
    if not db.is_dir():
        raise BenchInputError(f"{db}: no layer database to read the layer sizes from (this needs root and "
                              "an engine with the classic image store on this host)")
    return db


def read_layers(ref: str, db: Path, env: Mapping[str, str] | None = None) -> list[Layer]:
    """One image's layers in RootFS order; BenchInputError when the engine does not hold `ref`."""
    r = _docker("image", "inspect", "--format", "{{json .RootFS.Layers}}", ref, env=env)
    if r.returncode != 0:
        raise BenchInputError(f"{ref}: not an image in the engine ({r.stderr.strip()[-200:]})")
    diffs = [str(d) for d in json.loads(r.stdout)]
    chains = chain_ids(diffs)
    sizes = []
    for chain in chains:
        f = db / chain.removeprefix("sha256:") / "size"
        if not f.is_file():
            raise BenchInputError(f"{ref}: layer {chain} has no {f}")
        sizes.append(int(f.read_text().strip() or 0))
    h = _docker("image", "history", "--no-trunc", "--human=false", "--format", "{{.Size}}\t{{.CreatedBy}}", ref,
                env=env)
    if h.returncode != 0:
        raise BenchInputError(f"{ref}: docker history: {h.stderr.strip()[-200:]}")
    hist = []
    for line in reversed(h.stdout.splitlines()):
        size, _, by = line.partition("\t")
        hist.append((int(size) if size.isdigit() else 0, by))
    kinds = label_layers(sizes, hist)
    return [Layer(d, c, s, k) for d, c, s, k in zip(diffs, chains, sizes, kinds, strict=True)]


# --- printing --------------------------------------------------------------------------------------------
def cost_table(title: str, c: Mapping[str, Any]) -> list[str]:
    """A markdown table of one comparison: every layer of the new image and the two costs."""
    out = [f"### {title}", "", "| layer | unpacked | compressed | new chain ID | new blob |", "|---|---|---|---|---|"]
    for lay in c["layers"]:
        comp = "-" if lay["blob_size"] is None else f"{lay['blob_size'] / MB:,.1f} MB"
        blob = "-" if lay["new_blob"] is None else ("**yes**" if lay["new_blob"] else "no")
        out.append(f"| {lay['kind']} | {lay['size'] / MB:,.1f} MB | {comp} | "
                   f"{'**yes**' if lay['new_chain'] else 'no'} | {blob} |")
    out += ["", f"- stored anew by chain ID (Docker, containerd): **{c['new_by_chain'] / MB:,.1f} MB** of "
                f"{c['size'] / MB:,.1f} MB unpacked (**{c['new_by_chain_share']:.1%}**)",
            f"- new by diff ID (same files, wherever they sit): {c['new_by_diff'] / MB:,.1f} MB"]
    if "fetch_by_blob" in c:
        out.append(f"- fetched by blob digest (enroot): **{c['fetch_by_blob'] / MB:,.1f} MB** of "
                   f"{c['compressed'] / MB:,.1f} MB compressed (**{c['fetch_by_blob_share']:.1%}**)")
    return [*out, ""]


def share_table(s: Mapping[str, Any]) -> list[str]:
    return ["### Images on one node", "", *[f"- {name}" for name in s["images"]], "",
            f"- summed: {s['summed'] / MB:,.1f} MB",
            f"- unique by chain ID (what the node stores): **{s['unique_by_chain'] / MB:,.1f} MB = "
            f"{s['chain_ratio']:.3f}x** the sum",
            f"- unique by diff ID (if equal files were equal layers wherever they sit): "
            f"{s['unique_by_diff'] / MB:,.1f} MB = {s['diff_ratio']:.3f}x", ""]
