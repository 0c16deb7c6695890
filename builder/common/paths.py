"""Where things are: the project folder (images.yaml, entrypoint/, ...) and the package's templates.

The templates are package data (``builder/render/templates``, ``builder/launch/templates``),
so they are found from an editable or a regular install alike. The project folder is
what ``PTMG_PROJECT_DIR`` names, else the source checkout this package runs from, else
the first folder at or above the working directory that looks like a project.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from builder.common.errors import InputError

PACKAGE_DIR = Path(__file__).resolve().parent.parent
#: A folder is a pt-multi-gpu project when it has all of these.
MARKERS = ("images.yaml", "entrypoint", "smoke_tests", "ptmg_contract.py")


def _is_project(path: Path) -> bool:
    return all((path / m).exists() for m in MARKERS)


def cache_dir() -> Path:
    """This host's pt-multi-gpu cache folder (``$XDG_CACHE_HOME`` or ``~/.cache``): the wheel store,
    the cross-process locks."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "pt-multi-gpu"


@functools.cache
def project_root() -> Path:
    """The project folder; InputError (exit 2) with the fix when there is none."""
    given = os.environ.get("PTMG_PROJECT_DIR")
    if given:
        path = Path(given).resolve()
        if not _is_project(path):
            raise InputError(f"PTMG_PROJECT_DIR={given}: not a pt-multi-gpu project "
                             f"(it needs {', '.join(MARKERS)})")
        return path
    cwd = Path.cwd().resolve()
    for candidate in (PACKAGE_DIR.parent, cwd, *cwd.parents):
        if _is_project(candidate):
            return candidate
    raise InputError("no pt-multi-gpu project here: run build.py inside a checkout (it needs "
                     f"{', '.join(MARKERS)}), or set PTMG_PROJECT_DIR")


def template_dir(stage: str) -> Path:
    """``template_dir("render")`` -> the folder of that stage's templates (package data)."""
    return PACKAGE_DIR / stage / "templates"


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks (wheels, exported images)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
