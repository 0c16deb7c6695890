"""entrypoint/diagnostics.py: nvidia-smi's CSV, the driver check and the /dev/shm check. Warnings
only: these never raise, so the tests read what they print."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import diagnostics
import ptmg_contract as contract
from diagnostics import Gpu

SMI = """\
0, NVIDIA H100 80GB HBM3, 550.54.15, 81559 MiB
1, NVIDIA H100 80GB HBM3, 550.54.15, 81559 MiB

garbage line
2, Tesla V100-SXM2-32GB, 470.57.02, 32768 MiB, extra
"""


def test_parse_nvidia_smi() -> None:
    assert diagnostics.parse_nvidia_smi(SMI) == [
        Gpu("0", "NVIDIA H100 80GB HBM3", "550.54.15", "81559 MiB"),
        Gpu("1", "NVIDIA H100 80GB HBM3", "550.54.15", "81559 MiB"),
        Gpu("2", "Tesla V100-SXM2-32GB", "470.57.02", "32768 MiB"),
    ]
    assert diagnostics.parse_nvidia_smi("") == []
    assert diagnostics.parse_nvidia_smi("No devices were found\n") == []


def _env(need: str = "525.60.13") -> dict[str, str]:
    return {contract.ENV_MIN_DRIVER: need, contract.ENV_CUDA: "12.6"}


@pytest.mark.parametrize("driver", ["470.57.02", "525.60.12", "unknown"])
def test_an_old_driver_warns(driver: str, capsys: pytest.CaptureFixture[str]) -> None:
    diagnostics.check_driver(driver, _env())
    err = capsys.readouterr().err
    assert f"WARNING: NVIDIA driver {driver} is older than 525.60.13, the minimum for CUDA 12.6" in err
    assert "upgrade the host driver to >= 525.60.13" in err


@pytest.mark.parametrize("driver", ["525.60.13", "550.54.15", "1000.1"])
def test_a_new_enough_driver_is_reported(driver: str, capsys: pytest.CaptureFixture[str]) -> None:
    diagnostics.check_driver(driver, _env())
    assert capsys.readouterr().err == f"[ptmg] NVIDIA driver {driver} (image needs >= 525.60.13)\n"


def test_driver_without_a_minimum_or_without_a_driver(capsys: pytest.CaptureFixture[str]) -> None:
    diagnostics.check_driver("550.54.15", {})
    assert capsys.readouterr().err == "[ptmg] NVIDIA driver 550.54.15\n"
    diagnostics.check_driver(None, _env())
    diagnostics.check_driver("", _env())
    assert capsys.readouterr().err == ""


def test_version_tuple_is_lenient() -> None:
    assert diagnostics.version_tuple("550.54.15") == (550, 54, 15)
    assert diagnostics.version_tuple("not-a-version") == (0,)


def test_shm_on_a_big_filesystem_is_quiet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    st = os.statvfs(tmp_path)
    if st.f_blocks * st.f_frsize < diagnostics.SHM_MIN_BYTES:
        pytest.fail(f"{tmp_path} is on a filesystem under 1 GiB; this test needs a bigger one")
    diagnostics.check_shm(str(tmp_path))
    assert capsys.readouterr().err == ""


def test_shm_missing_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    diagnostics.check_shm(str(tmp_path / "no-shm"))
    err = capsys.readouterr().err
    assert f"WARNING: {tmp_path / 'no-shm'} is missing" in err and diagnostics.SHM_FIX in err


def test_small_shm_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = os.statvfs

    class Small:
        f_frsize = 4096
        f_blocks = 64 * 1024 * 1024 // 4096  # Docker's default --shm-size: 64 MiB

    def statvfs(path: Any) -> Any:
        return Small() if str(path) == str(tmp_path) else real(path)

    monkeypatch.setattr(os, "statvfs", statvfs)
    diagnostics.check_shm(str(tmp_path))
    err = capsys.readouterr().err
    assert "WARNING: /dev/shm is only 64 MiB (< 1 GiB)" in err and "--shm-size=8g" in err
