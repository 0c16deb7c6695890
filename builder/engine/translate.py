"""SDK and HTTP errors become :class:`EngineError`, named after the operation (every engine call)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import requests

from builder.common.lazy import OnFirstUse
from builder.engine.model import EngineError

F = TypeVar("F", bound=Callable[..., Any])


if TYPE_CHECKING:
    import docker
    import docker.errors
else:  # the SDK (with paramiko, where installed) takes ~0.2 s to import, and most runs of build.py
    # never reach the engine (matrix, render, lock --check, launch, every bad input)
    docker = OnFirstUse("docker", "docker.errors")


def _translated(fn: F) -> F:
    """SDK and HTTP errors leave as EngineError, named after the operation."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except EngineError:
            raise
        except docker.errors.DockerException as exc:
            why = getattr(exc, "explanation", None) or exc
            raise EngineError(f"the Docker engine refused {fn.__name__.strip('_')}: {why}") from None
        except requests.exceptions.RequestException as exc:
            raise EngineError(f"the Docker engine stopped answering ({fn.__name__.strip('_')}): {exc}") from None

    return wrapper  # type: ignore[return-value]


__all__ = ["_translated", "docker"]
