"""Test tiers by directory: tests/unit (no Docker, seconds) and tests/docker (a real engine).

Every test under tests/docker/ gets the `docker` marker here, from its path, so no module
has to remember a `pytestmark`; `-m "not docker"` and `pytest tests/unit` select the same
tests. The `gpu` and `slow` markers stay on the tests that need them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import skipguard

TESTS = Path(__file__).resolve().parent
DOCKER_TIER = TESTS / "docker"


def pytest_configure(config: pytest.Config) -> None:
    # Registered here too, so `--strict-markers` holds whatever the ini file says.
    config.addinivalue_line("markers", "docker: needs a Docker engine; builds and runs real images")
    config.addinivalue_line("markers", skipguard.MARKER_HELP)
    config.addinivalue_line("markers", "modern_engine: runs on a second, current Docker engine (scripts/engine28.sh)")
    config.addinivalue_line("markers", "repro: two cold builds on the second engine (make test-repro; not in make test)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.resolve().is_relative_to(DOCKER_TIER):
            item.add_marker(pytest.mark.docker)
