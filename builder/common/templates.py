"""The one Jinja2 environment factory, for Dockerfiles and sbatch scripts alike."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import jinja2


@lru_cache(maxsize=4)
def environment(folder: Path) -> jinja2.Environment:
    """Strict (an undefined name is an error) and without HTML escaping."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(folder)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # noqa: S701 - Dockerfiles and shell scripts, not HTML
    )
