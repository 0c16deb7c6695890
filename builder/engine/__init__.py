"""The engine boundary: the only package that imports the Docker SDK."""

from builder.engine import capabilities
from builder.engine.buildkit import BuildkitCli, buildx_facts, find_buildkit_cli, missing_builder, to_classic
from builder.engine.docker import Engine
from builder.engine.model import BuildOutcome, BuildRequest, Container, EngineError, Network, RunResult

__all__ = ["BuildOutcome", "BuildRequest", "BuildkitCli", "Container", "Engine", "EngineError", "Network",
           "RunResult", "buildx_facts", "capabilities", "find_buildkit_cli", "missing_builder", "to_classic"]
