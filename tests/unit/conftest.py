"""The unit tier: no Docker engine, no network, seconds.

An autouse guard points DOCKER_HOST at a socket that does not exist, so a unit test that
reaches a real engine (directly, or through a `build.py` subprocess) fails here, as it would on
a machine without Docker, instead of passing only where dockerd happens to run. Python advisories
(the vulnerability audit) come from tests/fixtures/osv, an offline OSV snapshot.

No unit test passes by skipping (tests/skipguard.py): a skip or an xfail here is a failure unless
the test is marked ``allowed_skip(reason=...)``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import skipguard
from tests.docker.registry import LocalRegistry
from tests.support import NO_ENGINE, ROOT

pytest_runtest_makereport = skipguard.unit_tier_report
pytest_make_collect_report = skipguard.unit_tier_collect_report


@pytest.fixture(autouse=True)
def no_docker_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Per test, not per session: a session-scoped patch here outlives the unit tier and left
    # `pytest tests/unit tests/docker` (make test) with no engine for every docker test.
    monkeypatch.setenv("DOCKER_HOST", NO_ENGINE)
    # Python advisories from the small OSV snapshot of the tests, never from the network.
    monkeypatch.setenv("PTMG_OSV_DIR", str(ROOT / "tests" / "fixtures" / "osv"))
    yield



@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    """A real registry (Debian's docker-registry 2.8) on 127.0.0.1, one per module that asks."""
    reg = LocalRegistry(tmp_path_factory.mktemp("registry")).start()
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture
def fake_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder first on PATH for the test's stand-in tools."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return bindir
