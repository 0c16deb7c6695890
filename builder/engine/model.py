"""What crosses the engine boundary: plain data and opaque handles, never an SDK object."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.common.errors import StepFailed


class EngineError(StepFailed):
    """The engine could not do what was asked; the message says what and how to fix it."""


@dataclass(frozen=True)
class Container:
    """A container this engine started. Opaque: pass it back to the engine's methods."""

    id: str
    name: str
    _obj: Any = field(repr=False, compare=False)


@dataclass(frozen=True)
class Network:
    """A network this engine made. Opaque, like :class:`Container`."""

    id: str
    name: str
    _obj: Any = field(repr=False, compare=False)


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    output: str
    timed_out: bool = False


@dataclass(frozen=True)
class BuildRequest:
    """One image build: everything the engine needs, nothing it must work out."""

    context: Path
    dockerfile: Path
    labels: Mapping[str, str]
    secrets: Mapping[str, Path]  # id -> file on the host
    log_path: Path
    no_cache: bool = False
    build_args: Mapping[str, str] = field(default_factory=dict)  # --build-arg NAME=VALUE (never secrets)
    platform: str | None = None  # --platform, e.g. linux/arm64 (BuildKit; emulated when not the host's)
    #: Reproducible export (buildx only): write an OCI layout folder here instead of loading the image
    #: into the engine, with SOURCE_DATE_EPOCH for the config and history and every file's timestamp in
    #: the layers clamped to it (the exporter's rewrite-timestamp; BuildKit >= 0.13).
    oci_dest: Path | None = None
    source_date_epoch: int | None = None


@dataclass(frozen=True)
class BuildOutcome:
    ok: bool
    image_id: str | None
    builder: str  # "buildkit" or "classic"
    failed_step: str = ""
    tail: tuple[str, ...] = ()
    #: buildx's containerimage.digest: the manifest's digest, which is the image ID in the containerd
    #: image store (the iidfile holds the config digest, the ID in the classic store)
    manifest_digest: str | None = None
