"""First contact with a GPU host, before it happens: a fake nvidia-smi and a fake torch
(tests/unit/fake_torch.py) stand in for the driver and the GPUs.

- a GPU job with no CUDA fails, and says why (a driver older than the cell's minimum, no GPU
  passed in), both in the DDP job and in the selftest's GPU checks;
- the per-GPU checks hold no CUDA context in the suite's process (EXCLUSIVE_PROCESS GPUs);
- doctor and `build.py test` read each GPU's compute capability and driver and refuse a cell that
  can't run on it, naming the reason and the cells that would; MIG and mixed GPU models;
- the busbw check reads the largest size that was measured; tables say what bounds them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import support
from tests.unit.fake_torch import write_fake_torch

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "smoke_tests"
OLD_DRIVER, MIN_DRIVER = "535.104.05", "560.28.03"


def fake_smi(bindir: Path, rows: list[str], driver_only: str | None = None) -> Path:
    """A fake nvidia-smi: ``--query-gpu=driver_version`` prints the driver, any other query the rows."""
    bindir.mkdir(parents=True, exist_ok=True)
    smi = bindir / "nvidia-smi"
    driver = driver_only or (rows[0].split(",")[3].strip() if rows and rows[0].count(",") >= 3 else OLD_DRIVER)
    smi.write_text("#!/bin/bash\ncase \"$*\" in\n"
                   f"  *--query-gpu=driver_version\\ *) echo {driver} ;;\n"
                   "  *) cat <<'ROWS'\n" + "".join(r + "\n" for r in rows) + "ROWS\n ;;\nesac\n")
    smi.chmod(0o755)
    return smi


def fake_env(tmp: Path, *, gpus: int, smi_driver: str | None, **extra: str) -> dict[str, str]:
    torch_dir = write_fake_torch(tmp / "faketorch")
    path = "/usr/bin:/bin"
    if smi_driver:
        path = f"{fake_smi(tmp / 'smi', [], driver_only=smi_driver).parent}:{path}"
    return {"PATH": path, "PYTHONPATH": f"{torch_dir}:{ROOT}", "FAKE_TORCH_GPUS": str(gpus),
            "FAKE_TORCH_CUDA": "12.6", "PTMG_MIN_DRIVER": MIN_DRIVER, "HOME": str(tmp), **extra}


# --- a GPU job never passes on CPU, and says why --------------------------------------------------------------


@pytest.mark.parametrize(("driver", "reason"), [
    (OLD_DRIVER, f"the NVIDIA driver {OLD_DRIVER} is older than {MIN_DRIVER}, the minimum for CUDA 12.6"),
    ("570.86.15", "no GPU was passed into this container (docker run --gpus all; pyxis/enroot: "
                  "NVIDIA_VISIBLE_DEVICES=all"),
])
def test_ddp_job_with_nccl_and_no_cuda_fails_naming_the_reason(driver: str, reason: str, tmp_path: Path) -> None:
    env = fake_env(tmp_path, gpus=0, smi_driver=driver)
    proc = subprocess.run([sys.executable, str(SMOKE / "ddp_job.py"), "--backend", "nccl", "--out", str(tmp_path / "o")],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0
    err = proc.stdout + proc.stderr
    assert "--backend nccl, but CUDA is not available to torch here" in err, err
    assert reason in err, err


def test_selftest_gpu_check_names_a_driver_older_than_the_cells_minimum(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    test_gpu = support.smoke_module("test_gpu")
    lib = support.smoke_module("smokelib")
    monkeypatch.setenv("PATH", f"{fake_smi(tmp_path / 'smi', [], driver_only=OLD_DRIVER).parent}:/usr/bin:/bin")
    monkeypatch.setenv("PTMG_MIN_DRIVER", MIN_DRIVER)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    class Torch:
        __version__ = "2.7.0+cu126"

        class version:  # torch's spelling
            cuda = "12.6"

        class cuda:
            @staticmethod
            def is_available() -> bool:
                return False

            @staticmethod
            def device_count() -> int:
                return 0

    smoke = lib.SmokeConfig(require_gpu=True, nproc=None, out=str(tmp_path), expect={}, ddp_timeout=60.0)
    with pytest.raises(pytest.fail.Exception, match=f"driver {OLD_DRIVER} is older than {MIN_DRIVER}"):
        test_gpu.need_gpu(smoke, Torch)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no driver at all: the GPUs were not passed in
    with pytest.raises(pytest.fail.Exception, match="no GPU was passed in"):
        test_gpu.need_gpu(smoke, Torch)


def test_per_gpu_checks_hold_no_cuda_context_in_the_suites_process(tmp_path: Path) -> None:
    """EXCLUSIVE_PROCESS GPUs take one process at a time: a context the pytest process kept would
    lock the DDP job's ranks out. Every check that touches a GPU must run in a child."""
    contexts = tmp_path / "contexts"
    env = fake_env(tmp_path, gpus=2, smi_driver="570.86.15", FAKE_TORCH_CONTEXTS=str(contexts),
                   FAKE_TORCH_EXCLUSIVE="1", FAKE_TORCH_CAP="9.0", FAKE_TORCH_ARCHS="sm_80 sm_90")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-c", str(SMOKE / "pytest.ini"), "-q", "-p",
                             "no:cacheprovider", str(SMOKE / "test_gpu.py"), "--require-gpu"],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "7 passed" in out, out  # cuda_available + 3 checks x 2 GPUs
    holders = {int(x) for x in contexts.read_text().split()}
    assert holders, "no check created a CUDA context: the fake is not exercised"
    assert proc.pid not in holders, f"the suite's own process (pid {proc.pid}) holds a CUDA context"


def test_a_failing_check_in_the_child_fails_in_the_parent(tmp_path: Path) -> None:
    env = fake_env(tmp_path, gpus=1, smi_driver="570.86.15", FAKE_TORCH_CAP="12.0", FAKE_TORCH_ARCHS="sm_80 sm_90")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", str(SMOKE / "pytest.ini"), "-q", "-p",
                           "no:cacheprovider", str(SMOKE / "test_gpu.py"), "-k", "arch_covered", "--require-gpu"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout
    assert "in a child process" in proc.stdout and "sm_120" in proc.stdout, proc.stdout
