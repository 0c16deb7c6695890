"""`build.py export`'s verb: where it writes by default, and what it reports (the table and
build-logs/<name>.export-<format>.json): the file's own size and sha256. The export itself:
tests/unit/export/test_squash.py."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from builder.cli.verbs import export as export_verb
from builder.export import squash
from tests.unit.export.test_squash import FakeEngine, _tool


def test_the_verb_reports_the_files_own_size_and_sha256(tmp_path: Path, fake_tools: Path) -> None:
    """build-logs/<cell>.export-<format>.json and the table: the digest of the file written, not any 64 hex."""
    _tool(fake_tools, "mksquashfs", 'cat "$1/etc/environment" "$1/etc/hello" > "$2"')
    out = tmp_path / "x.sqsh"

    class Ctx:
        args = argparse.Namespace(target="img:tag", fmt="sqsh", output=str(out))
        root = tmp_path

        def one_image(self, verb: str, target: str | None) -> tuple[str, str]:
            return "img:tag", "img-tag"

        def engine(self) -> FakeEngine:
            return FakeEngine()

    assert export_verb.run(Ctx()) == 0  # type: ignore[arg-type]
    report = json.loads((tmp_path / "build-logs" / "img-tag.export-sqsh.json").read_text())
    data = out.read_bytes()
    assert data == b"A=1\nhello\n"
    assert {k: v for k, v in report.items() if k != "seconds"} == {
        "image": "img:tag", "format": "sqsh", "path": str(out), "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest()}

@pytest.mark.parametrize(("size", "shown"), [(1_005_000_001, "1.01 GB"), (1_004_999_999, "1.00 GB")])
def test_the_verb_writes_to_exports_by_default_and_prints_what_it_reports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], size: int,
        shown: str) -> None:
    """No -o: exports/<name>.<format> under the project, run after run; the table and the JSON say the same."""
    def export(engine: Any, ref: str, fmt: str, out: Path) -> squash.Exported:
        out.write_text("x")
        return squash.Exported(out, fmt, size, "f" * 64, 12.345)

    monkeypatch.setattr(squash, "export", export)

    class Ctx:
        args = argparse.Namespace(target=None, fmt="sif", output=None)
        root = tmp_path

        def one_image(self, verb: str, target: str | None) -> tuple[str, str]:
            return "img:tag", "img-tag"

        def engine(self) -> None:
            return None

    for _ in range(2):  # the second run finds exports/ and build-logs/ there
        assert export_verb.run(Ctx()) == 0  # type: ignore[arg-type]
    out = tmp_path / "exports" / "img-tag.sif"
    text = (tmp_path / "build-logs" / "img-tag.export-sif.json").read_text()
    assert text == json.dumps({"image": "img:tag", "format": "sif", "path": str(out), "size": size,
                               "sha256": "f" * 64, "seconds": 12.3}, indent=1) + "\n"
    table = capsys.readouterr().out.splitlines()
    assert table[-1].split() == ["img:tag", "sif", str(out), *shown.split(), "f" * 64, "12", "s"]
