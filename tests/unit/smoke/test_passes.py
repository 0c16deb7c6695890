"""Smoke-pass records: two `build.py test` at once (two terminals, or the docker tier's runs side by
side) each keep their record; a reader never sees a half-written file."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from builder.smoke import passes


def test_records_written_at_once_are_all_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each writer reads the records, then writes them back with its own: without one writer at a time,
    the last to write drops what the others added in between. The read is slowed so that every writer
    reads before any writes, as two processes finishing together can."""
    load = passes._load

    def slow_load(root: Path) -> dict[str, dict[str, object]]:
        data = load(root)
        time.sleep(0.3)
        return data

    monkeypatch.setattr(passes, "_load", slow_load)
    ids = [f"sha256:{n:064x}" for n in range(4)]
    start = threading.Barrier(len(ids))

    def record(image_id: str) -> None:
        start.wait()
        passes.record_pass(tmp_path, image_id, "cell", passed=3, skipped=0)

    threads = [threading.Thread(target=record, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    monkeypatch.setattr(passes, "_load", load)
    kept = [i for i in ids if passes.smoke_pass(tmp_path, i) is not None]
    assert kept == ids, f"kept {len(kept)} of {len(ids)} records"


def test_a_record_is_read_back_and_its_file_has_no_temporary_left_beside_it(tmp_path: Path) -> None:
    rec = passes.record_pass(tmp_path, "sha256:" + "a" * 64, "cell", passed=5, skipped=1, nodes=2)
    assert passes.smoke_pass(tmp_path, rec.image_id) == rec
    assert passes.smoke_pass(tmp_path, "sha256:" + "b" * 64) is None
    left = sorted(p.name for p in passes.state_dir(tmp_path).iterdir())
    assert left == ["smoke-passes.json", "smoke-passes.lock"], left
