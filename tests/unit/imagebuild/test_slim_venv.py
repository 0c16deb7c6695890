"""imagebuild/slim-venv.sh on a real (small) venv: what it removes so two builds of one lock agree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    return venv


def _site(venv: Path) -> Path:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    return Path(out)


def test_uvs_install_record_and_its_record_line_go_and_nothing_else(tmp_path: Path) -> None:
    """uv writes the install's wall-clock time to <dist>.dist-info/uv_cache.json (and lists it in
    RECORD): two builds of one lock would differ there and only there."""
    venv = _venv(tmp_path)
    sp = _site(venv)
    dist = sp / "demo-1.0.dist-info"
    dist.mkdir(parents=True)
    (sp / "demo.py").write_text("x = 1\n")
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
    (dist / "uv_cache.json").write_text('{"timestamp":{"secs_since_epoch":1796306384,"nanos_since_epoch":1}}')
    (dist / "RECORD").write_text("demo.py,sha256=abc,6\ndemo-1.0.dist-info/METADATA,sha256=def,40\n"
                                 "demo-1.0.dist-info/uv_cache.json,sha256=ghi,70\ndemo-1.0.dist-info/RECORD,,\n")
    p = subprocess.run(["bash", str(ROOT / "imagebuild" / "slim-venv.sh"), str(venv)], capture_output=True,
                       text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    assert not (dist / "uv_cache.json").exists()
    assert (dist / "RECORD").read_text() == ("demo.py,sha256=abc,6\ndemo-1.0.dist-info/METADATA,sha256=def,40\n"
                                             "demo-1.0.dist-info/RECORD,,\n")
    assert (sp / "demo.py").exists() and (dist / "METADATA").exists()

