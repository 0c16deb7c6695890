"""A module imported when it is first used, for heavy imports most runs never need."""

from __future__ import annotations

import importlib
from typing import Any


class OnFirstUse:
    """Stands for the module ``names[0]``; the first attribute read imports every one of ``names``
    (``OnFirstUse("docker", "docker.errors")`` makes ``.errors`` work like ``import docker.errors``)."""

    def __init__(self, *names: str) -> None:
        self._names = names

    def __getattr__(self, attr: str) -> Any:
        modules = [importlib.import_module(name) for name in self._names]
        return getattr(modules[0], attr)
