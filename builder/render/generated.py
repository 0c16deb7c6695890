"""Project files generated from images.yaml, the image contract and the verb registry.

README.md's image and verb tables, ``compose.yaml`` and ``.devcontainer/devcontainer.json``
are rendered here, so none of them is a second, hand-kept copy of a port, a path or a
cell. ``build.py render --check`` (in ``make lint``) fails when a committed copy drifts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import ptmg_contract as contract
from builder.common.paths import template_dir
from builder.common.templates import environment
from builder.common.versions import version_key
from builder.matrix import Matrix
from builder.matrix.model import DEFAULT_PLATFORM
from builder.render import readme
from builder.render.dockerfile import Rendered


def _template(name: str, matrix: Matrix) -> str:
    # An example that runs on the usual (amd64) host; not this host's: the files are the same everywhere.
    native = [c for c in matrix.cells if not c.emulated_on(DEFAULT_PLATFORM)] or list(matrix.cells)
    runtime = [c for c in native if c.flavour == "runtime"] or native
    older = [c for c in runtime if not c.latest] or runtime
    example = max(older, key=lambda c: version_key(c.torch)).ref
    return environment(template_dir("render")).get_template(name).render(
        c=contract, repository=matrix.repository, example_image=example)


def project_files(root: Path, matrix: Matrix, verbs: Sequence[tuple[str, str]]) -> list[Rendered]:
    """What the project's generated files should hold. The README keeps its prose; only the
    blocks between its markers are generated."""
    out = [Rendered(root / "compose.yaml", _template("compose.yaml.j2", matrix)),
           Rendered(root / ".devcontainer" / "devcontainer.json", _template("devcontainer.json.j2", matrix))]
    readme_path = root / "README.md"
    if readme_path.exists():
        out.append(Rendered(readme_path, readme.update(readme_path.read_text(encoding="utf-8"), matrix, verbs)))
    return out
