"""What the engine and its builder can do, asked of them, never read off a version string.

Two engines are in use: Debian 12's docker.io 20.10 (its own CLI builds with BuildKit 0.8 when
DOCKER_BUILDKIT=1; classic overlay2 store) and Docker 27-29 (BuildKit only through the buildx
plugin; the classic store or, the default on new Docker 29 installs, the containerd image store).
Where they differ the code asks:

- the image store: ``docker info``'s DriverStatus names ``io.containerd.snapshotter.v1`` as the
  driver-type in the containerd store; a classic store names one of Docker's graph drivers. In the
  containerd store an image's ID is its manifest (or index) digest, in the classic store its config
  digest: publish verifies each by what the store calls an ID (:func:`names_image`).
- the builder: ``docker buildx version`` answers when the plugin is there; a CLI < 23 builds with
  BuildKit through DOCKER_BUILDKIT=1 (:mod:`builder.engine.buildkit`).
- the BuildKit level: what ``docker buildx inspect`` reports, and where a distribution's build
  reports none (Debian's says ``v0.0.0+unknown``), the lowest BuildKit that engines of the API
  version the engine reports (``docker version``'s ApiVersion) carry.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from builder.common.versions import Version

CONTAINERD_SNAPSHOTTER = "io.containerd.snapshotter.v1"
#: Docker's graph drivers (the classic image store).
CLASSIC_DRIVERS = frozenset({"overlay2", "fuse-overlayfs", "btrfs", "zfs", "vfs", "aufs", "devicemapper", "overlay"})
CLASSIC, CONTAINERD, UNKNOWN = "classic", "containerd", "unknown"

#: The lowest BuildKit vendored by the engines that first spoke each API version (moby's vendor.mod
#: at each release: 20.10 -> 0.8, 23.0 -> 0.11, 25.0 -> 0.12, 26.0 -> 0.13, 27.0 -> 0.14,
#: 27.3 -> 0.16, 28.0 -> 0.20). Used only when the builder does not report its own version.
BUILDKIT_BY_API: tuple[tuple[str, str], ...] = (
    ("1.41", "0.8"), ("1.42", "0.11"), ("1.43", "0.11"), ("1.44", "0.12"), ("1.45", "0.13"),
    ("1.46", "0.14"), ("1.47", "0.16"), ("1.48", "0.20"),
)
#: What each BuildKit feature the project can use needs.
FEATURES: tuple[tuple[str, str], ...] = (
    ("cache and secret mounts", "0.8"),
    ("rewrite-timestamp (bit-identical layers)", "0.13"),
    ("zstd layers", "0.10"),
)
FIX_STORE = ("use the classic store (daemon.json \"features\": {\"containerd-snapshotter\": false}) or the "
             "containerd image store (\"containerd-snapshotter\": true), then restart dockerd")


@dataclass(frozen=True)
class Store:
    kind: str  # classic | containerd | unknown
    driver: str  # the graph driver or snapshotter as `docker info` names it


def image_store(info: Mapping[str, Any]) -> Store:
    """Which image store ``docker info`` describes (pure)."""
    driver = str(info.get("Driver") or "")
    status = info.get("DriverStatus") or []
    pairs = [tuple(p) for p in status if isinstance(p, Sequence) and not isinstance(p, str) and len(p) == 2]
    if any(str(k) == "driver-type" and str(v) == CONTAINERD_SNAPSHOTTER for k, v in pairs):
        return Store(CONTAINERD, driver)
    if driver in CLASSIC_DRIVERS:
        return Store(CLASSIC, driver)
    return Store(UNKNOWN, driver)


def unknown_store_line(store: Store) -> str:
    return (f"the engine's image store is neither Docker's classic store nor the containerd image store "
            f"(`docker info`: storage driver {store.driver or 'none'!r}, no driver-type "
            f"{CONTAINERD_SNAPSHOTTER}), so what an image ID names is unknown. Fix: {FIX_STORE}")


def names_image(store: str, image_id: str, manifest_digest: str | None, config_digest: str | None) -> bool:
    """Whether a registry's manifest is the local image ``image_id``: in the containerd store an ID is
    the manifest's (or index's) own digest, in the classic store its config's digest."""
    if not image_id:
        return False
    if store == CONTAINERD:
        return manifest_digest == image_id
    return config_digest == image_id


def buildkit_version(reported: str | None, api_version: str | None) -> tuple[Version | None, str]:
    """The builder's BuildKit version and where it comes from ("reported" or "API x.y"); (None, why)
    when neither the builder nor the API version tells."""
    m = re.match(r"v?(\d+\.\d+(?:\.\d+)?)", (reported or "").strip())
    if m and Version.parse(m.group(1)) > Version.parse("0.0.0"):
        return Version.parse(m.group(1)), "reported by buildx"
    if api_version:
        try:
            api = Version.parse(api_version)
        except ValueError:
            return None, f"unknown (API version {api_version!r})"
        known = [(Version.parse(a), Version.parse(b)) for a, b in BUILDKIT_BY_API]
        floor = [bk for a, bk in known if a <= api]
        if floor:
            return floor[-1], f"at least, from the engine's API {api_version}"
    return None, "unknown"


def parse_inspect(text: str) -> str | None:
    """``docker buildx inspect``'s ``BuildKit version:`` line (the first node's)."""
    m = re.search(r"^BuildKit version:\s*(\S+)", text, re.M)
    return m.group(1) if m else None


def features(version: Version | None) -> list[tuple[str, bool]]:
    return [(name, version is not None and version >= Version.parse(need)) for name, need in FEATURES]


def need_feature(name: str, version: Version | None, source: str) -> str | None:
    """None when the builder has the feature, else the one line that says what is missing and the fix."""
    need = dict(FEATURES)[name]
    if version is not None and version >= Version.parse(need):
        return None
    have = f"BuildKit {'.'.join(map(str, version.parts))} ({source})" if version else f"a BuildKit of {source} version"
    return (f"{name} needs BuildKit >= {need}, and this engine's builder has {have}. Fix: Docker >= 26 with the "
            "buildx plugin (Debian: docker.io >= 26 and docker-buildx; Docker's repository: docker-ce and "
            "docker-buildx-plugin)")
