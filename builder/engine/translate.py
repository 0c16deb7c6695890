"""SDK and HTTP errors become :class:`EngineError`, named after the operation (every engine call)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import requests
import urllib3

from builder.common.lazy import OnFirstUse
from builder.engine.model import EngineError

F = TypeVar("F", bound=Callable[..., Any])


if TYPE_CHECKING:
    import docker
    import docker.errors
else:  # the SDK (with paramiko, where installed) takes ~0.2 s to import, and most runs of build.py
    # never reach the engine (matrix, render, lock --check, launch, every bad input)
    docker = OnFirstUse("docker", "docker.errors")


@contextlib.contextmanager
def _errors(what: str) -> Iterator[None]:
    """SDK and HTTP errors (a stream's too) leave as EngineError, named after the operation."""
    try:
        yield
    except docker.errors.DockerException as exc:
        why = getattr(exc, "explanation", None) or exc
        raise EngineError(f"the Docker engine refused {what}: {why}") from None
    except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError) as exc:
        raise EngineError(f"the Docker engine stopped answering ({what}): {exc}") from None


def _translated(fn: F) -> F:
    """Every engine call: its errors leave as EngineError (:func:`_errors`), named after the method."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _errors(fn.__name__.strip("_")):
            return fn(*args, **kwargs)

    return functools.wraps(fn)(wrapper)  # type: ignore[return-value]


__all__ = ["_errors", "_translated", "docker"]
