"""Typed argument parsers: a bad flag is one located line and exit 2, never a traceback.

``build.py test --nproc 0`` -> ``build.py test: --nproc 0: must be a whole number >= 1``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from builder.common.errors import EXIT_INVALID
from builder.common.yamlpos import control_character
from builder.matrix import platforms as spec_platforms


class Parser(argparse.ArgumentParser):
    """argparse, with a one-line error (the usage is one `--help` away)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(EXIT_INVALID)


def count(minimum: int = 1, maximum: int | None = None) -> Callable[[str], int]:
    """A whole number in ``[minimum, maximum]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a whole number") from None
        if value < minimum or (maximum is not None and value > maximum):
            upper = f" and <= {maximum}" if maximum is not None else ""
            raise argparse.ArgumentTypeError(f"{value}: must be a whole number >= {minimum}{upper}")
        return value

    return parse


def one_of(*values: str) -> Callable[[str], str]:
    """One of ``values``, spelled exactly. Unlike ``choices=``, a ``type`` also checks a default taken from
    the environment (argparse passes a string default through it), so a bad env value is refused too."""

    def parse(text: str) -> str:
        if text not in values:
            raise argparse.ArgumentTypeError(f"{text!r}: must be {', '.join(values[:-1])} or {values[-1]}")
        return text

    return parse


def seconds(text: str) -> float:
    """A duration in seconds, > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number of seconds") from None
    if not 0 < value < float("inf"):  # also refuses NaN
        raise argparse.ArgumentTypeError(f"{text}: must be a number of seconds > 0")
    return value


def text(value: str) -> str:
    """One line of printable text (a newline in a flag would reach a script or a Dockerfile)."""
    bad = control_character(value)
    if bad:
        raise argparse.ArgumentTypeError(f"{value!r}: contains a control character ({bad}); "
                                         "give one line of printable text")
    return value


def platforms(text: str) -> tuple[str, ...]:
    """``native`` | ``all`` | platforms, comma-separated (builder.matrix.platforms)."""
    try:
        return spec_platforms.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def add_platforms(p: argparse.ArgumentParser, default: str, env: str | None = "PTMG_PLATFORMS") -> None:
    """The ``--platforms`` flag of the verbs that build, test or publish cells (a string default
    goes through ``type`` too, so a bad environment value is the same one-line error)."""
    emulated = "emulated, e.g. linux/arm64 on x86: much slower"
    p.add_argument("--platforms", type=platforms, default=(os.environ.get(env) if env else None) or default,
                   metavar="native|all|PLATFORM,...",
                   help=f"the cells' platforms to cover: native (this host's), all ({emulated}), or a list such as "
                        f"linux/arm64 (default {default}" + (f"; env {env})" if env else ")"))
