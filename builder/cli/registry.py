"""The verb registry: each verb is a name, a help line, its arguments and a function.

The parser, ``build.py --help`` and the README's verb table are all made from it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from builder.cli.context import Context


def _no_arguments(_p: argparse.ArgumentParser) -> None:
    pass


@dataclass(frozen=True)
class Verb:
    """One `build.py` verb. ``run`` returns 0 (ok) or 1 (something failed); bad input raises
    :class:`builder.common.errors.InputError` (exit 2)."""

    name: str
    help: str  # one line: `build.py --help` and the README
    usage: str  # the README's first column, e.g. "matrix [--json]"
    run: Callable[[Context], int]
    add_arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments
    description: str = ""  # `build.py VERB --help`; defaults to help
