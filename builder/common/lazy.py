"""A module imported when it is first used, for heavy imports most runs never need."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class OnFirstUse:
    """Stands for the module ``names[0]``; the first attribute read imports every one of ``names``
    (``OnFirstUse("docker", "docker.errors")`` makes ``.errors`` work like ``import docker.errors``)."""

    def __init__(self, *names: str) -> None:
        self._names = names
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            for name in reversed(self._names):  # the submodules first, the module itself last
                self._module = importlib.import_module(name)
        return getattr(self._module, attr)
