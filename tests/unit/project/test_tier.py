"""The unit tier's own guard (tests/unit/conftest.py): no Docker engine answers here."""

from __future__ import annotations

import os

import pytest

from builder.engine import Engine, EngineError
from tests.support import NO_ENGINE


def test_no_engine_answers_in_the_unit_tier() -> None:
    assert os.environ["DOCKER_HOST"] == NO_ENGINE
    with pytest.raises(EngineError, match="no Docker engine answers"):
        Engine()
