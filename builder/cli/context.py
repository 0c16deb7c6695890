"""What every verb receives: the parsed flags, the selected cells, and the run's one engine."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from builder.common.errors import InputError
from builder.common.paths import project_root
from builder.engine import Engine
from builder.matrix import ImageSpec, Matrix
from builder.render.dockerfile import docker_dir


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

    def one_image(self, verb: str, target: str | None) -> tuple[str, str]:
        """(image reference, a name for files) of the one cell or image a verb works on: ``target``
        (a cell of the matrix, else an image reference), or the one cell --only selects."""
        if target is None:
            if len(self.cells) != 1:
                raise InputError(f"{verb}: name one cell or image (CELL|IMAGE), or select exactly one with --only; "
                                 f"{len(self.cells)} selected")
            return self.cells[0].ref, self.cells[0].name
        cells = {c.name: c for c in self.matrix.cells}
        if target in cells:
            return cells[target].ref, target
        return target, target.replace("/", "_").replace(":", "-")

    def engine(self) -> Engine:
        """The run's engine, made on first use (EngineError, exit 1, when none answers)."""
        if self._engine is None:
            self._engine = Engine()
        return self._engine

    def close(self) -> None:
        """Remove what this run's engine session left behind (containers, networks)."""
        if self._engine is not None:
            self._engine.cleanup_session()
