"""Helpers shared by the host-side tests (no Docker import here).

Polling goes through builder.waiting.wait_until() only (re-exported here): no scattered sleep loops.
"""

from __future__ import annotations

from typing import Any

from builder.common.waiting import WaitTimeout, wait_until

__all__ = ["WaitTimeout", "host_port", "wait_until"]


def host_port(container: Any, port: str) -> int:
    """The host port Docker published for `port` (e.g. "8888/tcp") of a docker-py Container."""
    container.reload()
    bindings = (container.attrs["NetworkSettings"]["Ports"] or {}).get(port)
    if not bindings:
        raise AssertionError(f"{port} is not published by container {container.name}")
    return int(bindings[0]["HostPort"])
