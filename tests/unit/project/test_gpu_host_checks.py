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

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import support
from tests.unit.fake_torch import write_fake_torch

ROOT = Path(__file__).resolve().parents[3]
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
    temp = tmp / "tmp"  # the suite's own results folder (ptmg-smoke-*) goes here, not to the host's /tmp
    temp.mkdir(exist_ok=True)
    return {"PATH": path, "PYTHONPATH": f"{torch_dir}:{ROOT}", "FAKE_TORCH_GPUS": str(gpus),
            "FAKE_TORCH_CUDA": "12.6", "PTMG_MIN_DRIVER": MIN_DRIVER, "HOME": str(tmp), "TMPDIR": str(temp), **extra}


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
    env = fake_env(tmp_path, gpus=1, smi_driver="570.86.15", FAKE_TORCH_CONTEXTS=str(contexts),
                   FAKE_TORCH_EXCLUSIVE="1", FAKE_TORCH_CAP="9.0", FAKE_TORCH_ARCHS="sm_80 sm_90")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-c", str(SMOKE / "pytest.ini"), "-q", "-p",
                             "no:cacheprovider", str(SMOKE / "test_gpu.py"), "--require-gpu"],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "4 passed" in out, out  # cuda_available + 3 per-GPU checks
    holders = {int(x) for x in contexts.read_text().split()}
    assert holders, "no check created a CUDA context: the fake is not exercised"
    assert proc.pid not in holders, f"the suite's own process (pid {proc.pid}) holds a CUDA context"


def test_without_a_gpu_no_child_process_is_started(tmp_path: Path) -> None:
    """A CPU host (or an emulated cell) skips the GPU checks in-process: a child per check would
    import torch once more each (minutes under qemu)."""
    imports = tmp_path / "imports"
    env = fake_env(tmp_path, gpus=0, smi_driver=None, FAKE_TORCH_IMPORTS=str(imports))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", str(SMOKE / "pytest.ini"), "-q", "-p",
                           "no:cacheprovider", str(SMOKE / "test_gpu.py")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "4 skipped" in proc.stdout, proc.stdout
    assert len(imports.read_text().split()) == 1, "a child process was started without a GPU"


def test_a_failing_check_in_the_child_fails_in_the_parent(tmp_path: Path) -> None:
    env = fake_env(tmp_path, gpus=1, smi_driver="570.86.15", FAKE_TORCH_CAP="12.0", FAKE_TORCH_ARCHS="sm_80 sm_90")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", str(SMOKE / "pytest.ini"), "-q", "-p",
                           "no:cacheprovider", str(SMOKE / "test_gpu.py"), "-k", "arch_covered", "--require-gpu"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout
    assert "in a child process" in proc.stdout and "sm_120" in proc.stdout, proc.stdout


# --- the host: doctor and `build.py test` read each GPU ------------------------------------------------------

import json  # noqa: E402

from builder.cli import main as cli  # noqa: E402
from builder.cli.verbs import test as test_verb  # noqa: E402
from builder.common.errors import StepFailed  # noqa: E402
from builder.host import doctor  # noqa: E402
from builder.smoke import gpus, results  # noqa: E402
from tests.unit.smoke.test_gpus import uuid  # noqa: E402
from tests.unit.smoke.test_runner_gpus import ScriptedEngine  # noqa: E402
from tests.unit.smoke_tests.test_ddp_checks import job_result  # noqa: E402

H200 = "NVIDIA H200, 9.0, 580.95.05, Disabled"
A100 = "NVIDIA A100-SXM4-80GB, 8.0, 580.95.05, Disabled"


def rows(*models: str) -> list[str]:
    out = []
    for i, model in enumerate(models):
        name, cap, driver, mig = (x.strip() for x in model.split(","))
        out.append(f"{i}, {uuid(i)}, {name}, {cap}, {driver}, {mig}")
    return out


def use_fake_smi(monkeypatch: pytest.MonkeyPatch, tmp: Path, *models: str) -> None:
    """nvidia-smi on PATH is the fake; query_smi runs it as it would the real one."""
    bindir = fake_smi(tmp / "smi-bin", rows(*models)).parent
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


def test_doctor_refuses_a_cell_whose_arch_list_has_no_code_for_the_gpu(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_smi(monkeypatch, tmp_path, H200, H200)
    matrix = support.small_matrix(tmp_path)
    found, why = doctor.host_gpus()
    assert len(found) == 2 and why == ""
    by_cell = {c.name: f for c in matrix.cells for f in doctor.cell_findings([c], found, why, matrix.cells)}
    old = by_cell[support.OLD]
    assert old.level == "fail", old
    assert "sm_90" in old.what and "no cubin or PTX" in old.what
    assert f"cells that run here: {support.MID}, {support.LATEST}" in old.what, old.what
    assert by_cell[support.MID].level == "ok" and "sm_90" in by_cell[support.MID].what


def test_build_py_test_refuses_a_cell_the_gpus_cant_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    use_fake_smi(monkeypatch, tmp_path, H200, H200)
    engine = ScriptedEngine(job_result(2, "nccl", gpus_visible=2))
    rc, report = _verb(tmp_path, monkeypatch, capsys, engine, support.OLD, "--require-gpu")
    assert rc == 1 and engine.started == [], "no container for a cell that can't run here"
    (problem,) = report["problems"]
    assert "sm_90" in problem and support.MID in problem and support.LATEST in problem


def test_build_py_test_names_a_driver_older_than_the_cells_minimum(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    use_fake_smi(monkeypatch, tmp_path, f"NVIDIA H200, 9.0, {OLD_DRIVER}, Disabled")
    engine = ScriptedEngine(job_result(1, "nccl"))
    rc, report = _verb(tmp_path, monkeypatch, capsys, engine, support.LATEST, "--require-gpu")
    assert rc == 1 and engine.started == []
    assert f"driver {OLD_DRIVER} is older than" in report["problems"][0] and "CUDA 13.0" in report["problems"][0]


def test_nccl_across_mig_slices_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    use_fake_smi(monkeypatch, tmp_path, "NVIDIA H200, 9.0, 570.86.15, Enabled",
                 "NVIDIA H200, 9.0, 570.86.15, Enabled")
    engine = ScriptedEngine(job_result(2, "nccl", gpus_visible=2))
    with pytest.raises(StepFailed, match=r"MIG mode is enabled on GPU 0 .*NCCL does not communicate between MIG"):
        _verb(tmp_path, monkeypatch, capsys, engine, support.MID, "--require-gpu")
    assert engine.started == []
    engine = ScriptedEngine(job_result(1, "nccl"))  # one rank: no NCCL transport, allowed
    rc, _ = _verb(tmp_path, monkeypatch, capsys, engine, support.MID, "--require-gpu", "--nproc", "1")
    assert rc == 0
    found, _ = doctor.host_gpus()
    assert any("MIG mode is enabled" in f.what for f in doctor.gpu_findings(found, {}))


@pytest.mark.parametrize(("order", "warned"), [(None, True), ("FASTEST_FIRST", True), ("PCI_BUS_ID", False)])
def test_mixed_gpu_models_warn_unless_pci_bus_order(order: str | None, warned: bool, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    use_fake_smi(monkeypatch, tmp_path, A100, H200)
    env = {} if order is None else {"CUDA_DEVICE_ORDER": order}
    engine = ScriptedEngine(job_result(2, "nccl", gpus_visible=2))
    rc, _ = _verb(tmp_path, monkeypatch, capsys, engine, support.MID, "--require-gpu", env=env)
    assert rc == 0
    assert ("CUDA_DEVICE_ORDER=PCI_BUS_ID" in caplog.text) == warned, caplog.text
    found, _ = doctor.host_gpus()
    assert any("mixed GPU models" in f.what for f in doctor.gpu_findings(found, env)) == warned
    uniform = [doctor.Gpu("NVIDIA H200", "570.86.15", (9, 0), index=str(i)) for i in range(2)]
    assert doctor.gpu_findings(uniform, {}) == []


def _verb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], engine: ScriptedEngine,
          cell: str, *flags: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """`build.py test --only CELL --json FLAGS` against the scripted engine and the fake nvidia-smi on PATH."""
    monkeypatch.setenv("PTMG_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("PTMG_REQUIRE_MULTI_GPU", raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    args = cli.parser().parse_args(["test", "--config", str(support.write_matrix(tmp_path)), "--only", cell, "--json",
                                    "--junit-dir", str(tmp_path / "junit"), *flags])
    ctx = cli._context(args)
    ctx._engine = engine  # type: ignore[assignment]
    rc = test_verb.run(ctx)
    (report,) = json.loads(capsys.readouterr().out)
    return rc, report


def test_query_smi_falls_back_to_the_short_query_on_an_old_driver(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/bash\ncase "$*" in *compute_cap*) echo \'Field "compute_cap" is not a valid field to '
                   'query.\' >&2; exit 2 ;; esac\necho "0, GPU-aaaa"\n')
    smi.chmod(0o755)
    found, why = gpus.query_smi(which=lambda _: str(smi))
    assert found == (gpus.HostGpu("0", "GPU-aaaa"),) and why == ""


# --- busbw: the largest size measured; what bounds a table ------------------------------------------------------


def test_busbw_check_reads_the_largest_size_measured_not_requested() -> None:
    checks = support.smoke_module("ddp_checks")
    lib = support.smoke_module("smokelib")
    bench = support.smoke_module("ddp_bench")
    result = job_result(2, "nccl", gpus_visible=2)
    result["busbw"] = [bench.busbw_row(256 << 20, [0.004, 0.004], 2)]  # 1 GiB did not fit the deadline
    result["bench"]["skipped_sizes"] = [1 << 30]
    smoke = lib.SmokeConfig(require_gpu=True, nproc=None, out="/tmp", expect={}, ddp_timeout=60.0)
    job = (None, result, "/tmp/ddp")
    with pytest.raises(AssertionError, match=r"largest size measured is 256 MiB .*1 GiB skipped"):
        checks.CHECKS["busbw-table"](job, smoke)
    result["bench"]["skipped_sizes"] = []  # nothing skipped: the message says no such thing
    with pytest.raises(AssertionError, match=r"largest size measured is 256 MiB; nccl-tests"):
        checks.CHECKS["busbw-table"](job, smoke)
    result["busbw"].append(bench.busbw_row(1 << 30, [0.010, 0.011], 2))
    result["bench"]["skipped_sizes"] = []
    checks.CHECKS["busbw-table"](job, smoke)


def test_busbw_tables_label_socket_bound_runs_and_per_call_overhead_rows() -> None:
    bench = support.smoke_module("ddp_bench")
    data = job_result(8, "nccl", gpus_visible=4, nodes=2)
    data["busbw"] = [bench.busbw_row(1 << 10, [20e-6, 21e-6], 8), bench.busbw_row(1 << 30, [0.05, 0.05], 8)]
    r = results.DDPResult.from_json(data)
    same_host = results.busbw_markdown(r, same_host_nodes=2)
    assert "Socket-bound: 2 containers on one host" in same_host
    lines = same_host.splitlines()
    assert next(ln for ln in lines if ln.startswith("| 1 KiB |")).endswith("| per-call overhead |")
    assert next(ln for ln in lines if ln.startswith("| 1 GiB |")).endswith("| bandwidth |")
    assert "Socket-bound" not in results.busbw_markdown(r)  # one node, or nodes on their own hosts
