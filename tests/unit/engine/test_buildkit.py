"""The classic-builder transform (builder/engine/buildkit.py's to_classic): a rendered Dockerfile
without BuildKit's mounts, its apt caches emptied in the same RUN."""

from __future__ import annotations

import pytest

from builder.engine import to_classic
from builder.matrix import ImageSpec
from builder.render import dockerfile
from tests.support import MID, small_matrix
from tests.support import cell as cell_named


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory) -> ImageSpec:
    return cell_named(small_matrix(tmp_path_factory.mktemp("matrix")), MID)


def test_to_classic_strips_mounts_and_empties_caches(cell: ImageSpec) -> None:
    text = to_classic(dockerfile.render(cell))
    assert "--mount" not in text
    assert "rm -rf /var/cache/apt/* /var/lib/apt/lists/*" in text
    # Every RUN line still continues properly.
    for line in text.splitlines():
        assert not line.startswith("    if [ -f")


