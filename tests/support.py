"""Helpers shared by the host-side tests (no Docker import here).

Polling goes through wait_until() only: no scattered sleep loops.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """wait_until() gave up; an AssertionError so pytest reports it as a test failure."""


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.25,
               what: str | None = None) -> T:
    """Call `predicate` until it returns something truthy, and return that.

    An exception raised by the predicate counts as "not yet" (a port that is not
    open, a 502 from a proxy) and is kept for the error message. After `timeout`
    seconds, raise WaitTimeout naming `what`, how many tries were made, and the
    last value or exception seen.
    """
    deadline = time.monotonic() + timeout
    tries = 0
    last: object = None
    while True:
        tries += 1
        try:
            value = predicate()
        except Exception as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if value:
                return value
            last = repr(value)
        if time.monotonic() >= deadline:
            name = what or getattr(predicate, "__name__", "condition")
            raise WaitTimeout(f"timed out after {timeout:g} s ({tries} tries) waiting for {name}; "
                              f"last result: {last}")
        time.sleep(max(0.0, min(interval, deadline - time.monotonic())))


def host_port(container: Any, port: str) -> int:
    """The host port Docker published for `port` (e.g. "8888/tcp") of a docker-py Container."""
    container.reload()
    bindings = (container.attrs["NetworkSettings"]["Ports"] or {}).get(port)
    if not bindings:
        raise AssertionError(f"{port} is not published by container {container.name}")
    return int(bindings[0]["HostPort"])
