"""The entrypoint's modules, importable as the image imports them: by bare name (`import common`),
with entrypoint/ and the repository root (ptmg_contract.py) on sys.path, as supervisor.py and
the healthcheck arrange it inside the image. Nothing here needs root, Docker or the image."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENTRYPOINT = ROOT / "entrypoint"

for folder in (str(ROOT), str(ENTRYPOINT)):  # entrypoint/ ends up first, as in the image
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)

import common  # noqa: E402

# A `common` from anywhere else would make every test here test the wrong code.
assert Path(common.__file__).resolve().parent == ENTRYPOINT, common.__file__
