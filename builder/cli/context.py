"""What every verb receives: the parsed flags, the selected cells, and the run's one engine."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from builder.common.paths import project_root
from builder.engine import Engine
from builder.render.dockerfile import docker_dir
from builder.spec import ImageSpec, Matrix


@dataclass
class Context:
    args: argparse.Namespace
    matrix: Matrix
    cells: tuple[ImageSpec, ...]
    config_display: str  # the matrix file as messages show it (relative to the working directory)
    source: str  # the matrix file as generated headers name it
    docker_dir: Path  # where its rendered Dockerfiles live
    verbs: tuple[tuple[str, str], ...] = ()  # (usage, help) of every verb: the README's verb table
    _engine: Engine | None = field(default=None, repr=False)

    @property
    def root(self) -> Path:
        return project_root()

    @property
    def is_default(self) -> bool:
        """True for the project's own images.yaml (whose Dockerfiles live in docker/)."""
        return self.docker_dir == docker_dir()

    def engine(self) -> Engine:
        """The run's engine, made on first use (EngineError, exit 1, when none answers)."""
        if self._engine is None:
            self._engine = Engine()
        return self._engine

    def close(self) -> None:
        """Remove what this run's engine session left behind (containers, networks)."""
        if self._engine is not None:
            self._engine.cleanup_session()
