"""build.py's top level: what a failure that is no one's input looks like to the user."""

from __future__ import annotations

import errno

import pytest

from builder.cli import main as cli_main
from builder.cli.verbs import VERBS
from builder.common.errors import EXIT_FAILED


def _failing_verb(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    import dataclasses

    def run(_ctx: object) -> int:
        raise exc

    verbs = tuple(dataclasses.replace(v, run=run) if v.name == "render" else v for v in VERBS)
    monkeypatch.setattr(cli_main, "VERBS", verbs)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_is_one_line_with_the_fix(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                              code: int) -> None:
    """CI's run once ended in a traceback when a build's log found the disk full (buildkit.py's write)."""
    _failing_verb(monkeypatch, OSError(code, "No space left on device", "build-logs/cell.log"))
    assert cli_main.main(["render"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "build-logs/cell.log" in err
    assert "Fix: free disk space" in err and "Traceback" not in err


def test_another_os_error_is_not_called_a_full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    _failing_verb(monkeypatch, OSError(errno.EIO, "Input/output error"))
    with pytest.raises(OSError, match="Input/output"):
        cli_main.main(["render"])
