"""Small helpers of the engine facade: the client connection and the build's input checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import docker
import requests

from builder.engine.model import EngineError


def quote_value(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def env_file_has_values(env_file: Path | None) -> bool:
    if env_file is None or not env_file.exists():
        return False
    return any(line.startswith("export ") for line in env_file.read_text(encoding="utf-8").splitlines())


def connect() -> Any:
    """A client for the engine DOCKER_HOST names (or the local socket); EngineError with the fix."""
    try:
        client = docker.from_env(timeout=600)
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
        raise EngineError(
            f"no Docker engine answers ({exc}).\n"
            "  fix: run `scripts/ensure-docker.sh` (starts dockerd as root on Debian), "
            "or start Docker and check DOCKER_HOST."
        ) from None
    return client
