"""The engine boundary: the only package that imports the Docker SDK."""

from builder.engine.buildkit import BuildkitCli, find_buildkit_cli, to_classic
from builder.engine.docker import Engine
from builder.engine.model import BuildOutcome, BuildRequest, Container, EngineError, Network, RunResult

__all__ = ["BuildOutcome", "BuildRequest", "BuildkitCli", "Container", "Engine", "EngineError", "Network",
           "RunResult", "find_buildkit_cli", "to_classic"]
