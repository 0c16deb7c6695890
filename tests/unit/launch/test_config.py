"""`build.py launch`'s configuration (builder/launch/config.py): the image pin (a digest of the same
repository first), the flags it refuses, and rendering that is the same in any process. The
`cfg()` here is the launch config the other launch tests start from (no Docker, no cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from builder import launch
from builder.launch import ImagePin, LaunchConfig, LaunchError, config
from tests.support import MID

ROOT = Path(__file__).resolve().parents[3]
CELL = MID
DIGEST = "sha256:" + "ab" * 32


TORCH = "2.7.0"  # the torch of `cfg()`'s cell, as the verb passes it


#: Charliecloud runs an exported squashfs, CPU ranks only (ch-run injects no GPU driver).
CH_IMAGE = "/shared/images/pt.sqsh"


def cfg(**kw: Any) -> LaunchConfig:
    base: dict[str, Any] = {"cell": CELL, "image": ImagePin(ref=f"pt-multi-gpu:{CELL}", tag_ref=f"pt-multi-gpu:{CELL}"),
                            "nodes": 2, "gpus_per_node": 4, "nproc_per_node": 4, "torch": TORCH}
    if kw.get("launcher") == "charliecloud":
        base.update(image_file=CH_IMAGE, gpus_per_node=0)
    base.update(kw)
    return LaunchConfig(**base)


# --- image pinning -------------------------------------------------------------------------------


def test_pin_prefers_a_digest_of_the_same_repository() -> None:
    attrs = {"Id": "sha256:1111", "RepoDigests": [f"zz.io/other@{DIGEST}",
                                                  f"registry.example:5000/pt-multi-gpu@{'sha256:' + 'cd' * 32}"]}
    pin = config.pin_image("registry.example:5000/pt-multi-gpu:2.7.0", attrs)
    assert pin.ref == f"registry.example:5000/pt-multi-gpu@sha256:{'cd' * 32}"
    assert pin.pinned and pin.digest == "sha256:" + "cd" * 32 and pin.image_id == "sha256:1111"
    assert "pinned by digest" in pin.note


def test_pin_falls_back_to_another_repository_then_to_the_tag() -> None:
    pin = config.pin_image("pt-multi-gpu:x", {"Id": "sha256:1", "RepoDigests": [f"b.io/p@{DIGEST}", f"a.io/p@{DIGEST}"]})
    assert pin.ref == f"a.io/p@{DIGEST}"
    local = config.pin_image("pt-multi-gpu:x", {"Id": "sha256:1", "RepoDigests": []})
    assert local.ref == "pt-multi-gpu:x" and not local.pinned and "local image id sha256:1" in local.note
    absent = config.pin_image("pt-multi-gpu:x", None)
    assert absent.ref == "pt-multi-gpu:x" and absent.image_id is None and "not found locally" in absent.note


@pytest.mark.parametrize(("ref", "want"), [
    ("nvcr.io/nvidia/pytorch:24.01-py3", "nvcr.io#nvidia/pytorch:24.01-py3"),
    ("localhost:5000/pt-multi-gpu:x", "localhost:5000#pt-multi-gpu:x"),
    ("localhost/pt:x", "localhost#pt:x"),
    ("ghcr.io/org/pt-multi-gpu@" + DIGEST, "ghcr.io#org/pt-multi-gpu@" + DIGEST),
    ("pt-multi-gpu:x", "pt-multi-gpu:x"),
    ("library/ubuntu:22.04", "library/ubuntu:22.04"),
])
def test_pyxis_spells_the_registry_with_a_hash(ref: str, want: str) -> None:
    assert config.pyxis_image(ref) == want


# --- configuration checks ---------------------------------------------------------------------------


@pytest.mark.parametrize(("kw", "match"), [
    ({"name": "Bad_Name"}, "--name"),
    ({"name": "x" * 41}, "--name"),
    ({"nodes": 0}, "--nodes"),
    ({"nproc_per_node": 0}, "--nproc-per-node"),
    ({"launcher": "podman"}, "--launcher"),
    ({"mounts": ("/data:/data'",)}, "--mount"),
    ({"mounts": ("relative",)}, "--mount"),
    ({"env": (("1BAD", "x"),)}, "--env"),
    ({"shm_size": "lots"}, "--shm-size"),
    ({"launcher": "native", "mounts": ("/data:/data:ro",)}, "--mount '/data:/data:ro': --launcher native runs no container"),
])
def test_bad_flags_are_refused(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(LaunchError, match=match):
        cfg(**kw)


RENDER_ALL = """
import json, sys
from builder import launch
from builder.launch import ImagePin, LaunchConfig, config
cell = sys.argv[1]
c = LaunchConfig(cell=cell, image=ImagePin(ref=f"pt-multi-gpu:{cell}", tag_ref=f"pt-multi-gpu:{cell}"), nodes=2,
                 gpus_per_node=4, nproc_per_node=4, torch="2.7.0", env=(("B", "2"), ("A", "1")))
print(json.dumps({target: launch.render(target, c) for target in config.TARGETS}))
"""


def test_rendering_is_the_same_in_any_process(tmp_path: Path) -> None:
    """Byte-identical job files from fresh interpreters (other hash seeds, other working directories)
    and from this one."""

    def fresh(seed: str, cwd: Path) -> dict[str, str]:
        cwd.mkdir()
        r = subprocess.run([sys.executable, "-c", RENDER_ALL, CELL], cwd=cwd, capture_output=True, text=True,
                           timeout=120, check=True, env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)})
        return dict(json.loads(r.stdout))

    first = fresh("1", tmp_path / "a")
    assert sorted(first) == sorted(config.TARGETS)
    assert fresh("2", tmp_path / "b") == first
    here = cfg(env=(("B", "2"), ("A", "1")))
    assert {target: launch.render(target, here) for target in config.TARGETS} == first


