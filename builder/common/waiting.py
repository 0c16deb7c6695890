"""Polling: the one wait_until() helper for the builder, the tests and the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

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
