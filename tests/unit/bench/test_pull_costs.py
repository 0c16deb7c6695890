"""bench/pulllib.py, the pure part of bench/bench_pull.py: chain IDs as the OCI image spec defines them,
what a node holding one image pays for another (by chain ID, by diff ID, by blob digest), what several
images share, and which instruction made each layer. No engine: the layers are written here."""

from __future__ import annotations

import hashlib
import sys

import pytest

from tests.support import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import pulllib

D = [f"sha256:{c * 64}" for c in "abcdef"]


def layers(diffs: list[str], sizes: list[int], blobs: list[int] | None = None) -> list[pulllib.Layer]:
    out = [pulllib.Layer(d, c, s, f"k{i}") for i, (d, c, s) in
           enumerate(zip(diffs, pulllib.chain_ids(diffs), sizes, strict=True))]
    if blobs is None:
        return out
    return pulllib.with_blobs(out, {"layers": [{"digest": d.replace("sha256:", "sha256:b"), "size": b}
                                               for d, b in zip(diffs, blobs, strict=True)]})


def test_chain_ids_follow_the_image_spec() -> None:
    # ChainID(L0) = DiffID(L0); ChainID(L0|...|Ln) = sha256(ChainID(L0|...|Ln-1) + " " + DiffID(Ln))
    second = "sha256:" + hashlib.sha256(f"{D[0]} {D[1]}".encode()).hexdigest()
    third = "sha256:" + hashlib.sha256(f"{second} {D[2]}".encode()).hexdigest()
    assert pulllib.chain_ids(D[:3]) == [D[0], second, third]


def test_a_changed_lower_layer_renews_every_chain_above_it_but_no_blob_above_it() -> None:
    old = layers([D[0], D[1], D[2], D[3]], [75, 276, 5230, 1], blobs=[30, 90, 3000, 1])
    new = layers([D[0], D[4], D[2], D[3]], [75, 277, 5230, 1], blobs=[30, 91, 3000, 1])
    c = pulllib.cost(old, new)
    assert c["new_by_chain"] == 277 + 5230 + 1  # the same torch files, a new chain ID
    assert c["new_by_diff"] == 277
    assert c["fetch_by_blob"] == 91 and c["compressed"] == 30 + 91 + 3000 + 1
    assert [lay["new_chain"] for lay in c["layers"]] == [False, True, True, True]
    assert [lay["new_blob"] for lay in c["layers"]] == [False, True, False, False]


def test_without_blobs_there_is_no_fetch_figure() -> None:
    c = pulllib.cost(layers(D[:2], [1, 2]), layers(D[:2], [1, 2]))
    assert c["new_by_chain"] == 0 and "fetch_by_blob" not in c and c["layers"][0]["new_blob"] is None


def test_a_manifest_that_does_not_match_the_image_is_refused() -> None:
    with pytest.raises(pulllib.BenchInputError, match="2 layers, the image 3"):
        pulllib.with_blobs(layers(D[:3], [1, 2, 3]), {"layers": [{"digest": "x", "size": 1}] * 2})


def test_share_counts_a_layer_once_per_chain_and_once_per_diff() -> None:
    a = layers([D[0], D[1], D[2]], [10, 20, 100])
    b = layers([D[0], D[3], D[2]], [10, 30, 100])  # the same top files over another middle layer
    s = pulllib.share({"a": a, "b": b})
    assert s["summed"] == 270
    assert s["unique_by_chain"] == 10 + 20 + 100 + 30 + 100
    assert s["unique_by_diff"] == 10 + 20 + 100 + 30


def test_layers_are_named_by_the_instruction_that_made_them() -> None:
    history = [(75, ""), (9, "RUN useradd pt"), (3060, "RUN python3 -m venv /opt/venv && uv pip install"),
               (2170, 'RUN uv pip install && python -c "import torch, torchvision"'),
               (232, "RUN uv pip install && pip check"), (0, "ARG PTMG_OS_SNAPSHOT"),
               (276, "RUN apt-get update && apt-get install -y tini"), (0, "WORKDIR /workspace"),
               (14, "COPY ptmg_contract.py /opt/ # buildkit")]
    assert pulllib.label_layers([75, 9, 3060, 2170, 232, 276, 0, 14], history) == [
        "base", "user", "venv", "torch", "tools", "OS (apt)", "empty", "our files"]
    # Today's order: the CUDA wheels' tree first, then the base's files (docs/image-layout.md).
    history = [(3360, "COPY /ptmg-out-cuda/ / # buildkit"), (771, "COPY /ptmg-out-torch/ / # buildkit"),
               (75, "COPY / / # buildkit"), (0, "SHELL [/bin/bash]"),
               (9, "RUN useradd pt"), (14, "RUN python3 -m venv --without-pip /opt/venv && ln -s"),
               (1850, 'RUN uv pip install && python -c "import torch, torchvision"'),
               (232, "RUN uv pip install && pip check"),
               (276, "RUN |1 PTMG_OS_SNAPSHOT=x /bin/bash -o pipefail -c sh /ptmg-build/os-layer.sh apply /ptmg-build/os /"
                     " && find / -xdev -type f -perm /6000 -exec chmod ug-s {} +"),
               (1, "COPY entrypoint/ /opt/pt-multi-gpu/entrypoint/ # buildkit")]
    assert pulllib.label_layers([3360, 771, 75, 9, 14, 1850, 232, 276, 1], history) == [
        "CUDA wheels", "torch's shared files", "base", "user", "venv", "torch", "tools", "OS (apt)", "our files"]


def _served(method: str, uri: str, status: int, written: int) -> str:
    # A "response completed" line as Debian's docker-registry 2.8 logs it (logrus text, keys sorted).
    return (f'time="2026-12-05T17:30:00Z" level=info msg="response completed" go.version=go1.19.8 '
            f'http.request.host="127.0.0.1:5000" http.request.id=0d1c http.request.method={method} '
            f'http.request.remoteaddr="127.0.0.1:40112" http.request.uri="{uri}" '
            f'http.request.useragent="docker/28.5.2 go/go1.24 (linux)" http.response.contenttype="application/octet-stream" '
            f'http.response.duration=1.2s http.response.status={status} http.response.written={written}')


def test_the_registry_log_counts_only_blob_bytes_a_pull_was_served() -> None:
    blob = f"/v2/ptmg-bench-pull/blobs/sha256:{'a' * 64}"
    text = "\n".join([
        _served("GET", blob, 200, 1_000),
        _served("GET", f"/v2/ptmg-bench-pull/blobs/sha256:{'b' * 64}", 206, 24),  # a resumed download
        _served("HEAD", blob, 200, 0),
        _served("GET", "/v2/ptmg-bench-pull/manifests/b-os", 200, 2_000),  # a manifest is not a blob
        _served("GET", blob, 404, 150),  # a refusal serves no layer
        'time="2026-12-05T17:30:00Z" level=info msg="authorized request" http.request.method=GET '
        f'http.request.uri="{blob}" http.response.status=200 http.response.written=9999',
        "127.0.0.1 - - [05/Dec/2026:17:30:00 +0000] \"GET " + blob + " HTTP/1.1\" 200 1000 \"\" \"docker\"",
    ])
    assert pulllib.fetched_from_log(text) == {"bytes": 1_024, "blobs": 2}
    assert pulllib.fetched_from_log("") == {"bytes": 0, "blobs": 0}
