"""The bare-host GPU checks on a real bare host: a venv of its own (not --system-site-packages)
holding torch's CPU wheel and pytest alone, no TensorBoard, requests, PyYAML or torchvision.

- the acceptance run: each step runs (nvidia-smi, a stand-in on PATH) or is reported not run with
  its missing prerequisite by name (no GPU, no Triton, no PyYAML for the optional unit step),
  every one listed before any step starts, with a report;
- CUDA_HOME: the preflight's resolution is torch.utils.cpp_extension's own, case by case;
- the DDP job (torchrun, 2 gloo ranks, real torch) passes its checks without TensorBoard, the
  events check skipping with the reason;
- a seed template's rank ends once it has trained, whatever the interpreter's teardown would do.

The venv is built once (about 30 s: pip takes torch from the local wheel store) and kept under
~/.cache/pt-multi-gpu/bare-host/, keyed by this python and what it installs; the tests then take
about 40 s on two cores.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu_acceptance.py"
PACKAGES = ("torch==2.13.0", "pytest")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pt-multi-gpu" / "bare-host"


def _build(venv: Path) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *PACKAGES],
                         capture_output=True, text=True, timeout=900, check=False)
    assert pip.returncode == 0, f"pip install {' '.join(PACKAGES)} into the bare venv failed:\n{pip.stderr[-2000:]}"
    (venv / "complete").write_text(" ".join(PACKAGES) + "\n")


@pytest.fixture(scope="module")
def bare_python() -> Iterator[str]:
    """The bare venv's python, built on first use (one builder at a time: a lock beside it)."""
    base = getattr(sys, "_base_executable", sys.executable)
    key = hashlib.sha256(f"{base} {sys.version} {' '.join(PACKAGES)}".encode()).hexdigest()[:12]
    venv = CACHE / key
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / "complete").is_file():
            _build(venv)
    cfg = (venv / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg, cfg
    yield str(venv / "bin" / "python")


def _bare_env(tmp: Path, python: str) -> dict[str, str]:
    """The host's PATH (its g++, ninja, nvcc) after the venv's bin, a stand-in nvidia-smi first."""
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, GPU-0, Stand-in GPU, 9.0, 580.65.06, [N/A]'\n")
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "CUDA_HOME", "CUDA_PATH")}
    temp = tmp / "tmp"  # torchrun's torchelastic_* and the suite's folders: under the test's folder, not /tmp
    temp.mkdir(exist_ok=True)
    env.update(PATH=os.pathsep.join([str(bindir), os.path.dirname(python), os.environ.get("PATH", "")]),
               HOME=str(tmp), TMPDIR=str(temp))
    return env


def test_the_bare_venv_has_torch_and_pytest_alone(bare_python: str, tmp_path: Path) -> None:
    code = ("import importlib.util as u, torch, pytest; "
            "print(torch.__version__, [m for m in ('yaml', 'requests', 'tensorboard', 'torchvision', 'docker') "
            "if u.find_spec(m)])")
    out = subprocess.run([bare_python, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=tmp_path).stdout  # not the checkout: its docker/ folder would import as `docker`
    assert out.split()[0].startswith("2.13.0") and out.strip().endswith("[]"), out


def test_the_acceptance_run_on_a_bare_host_runs_or_names_what_each_step_lacks(bare_python: str,
                                                                               tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([bare_python, str(SCRIPT), "--python", bare_python, "--unit-python", bare_python,
                           "--out", str(out)], env=_bare_env(tmp_path, bare_python), cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((out / "gpu-acceptance.json").read_text())
    status = {s["name"]: s for s in report["steps"]}
    assert status["nvidia-smi"]["status"] == "passed", status["nvidia-smi"]
    assert "Stand-in GPU" in Path(status["nvidia-smi"]["log"]).read_text()
    why = {name: " | ".join(s["failures"]) for name, s in status.items() if name != "nvidia-smi"}
    assert all(status[n]["status"] == "not run (missing)" for n in why), status
    assert "python module yaml" in why["gpu-path-unit"] and status["gpu-path-unit"]["optional"]
    for name in ("gpu", "compile", "cpp-extension", "ddp-nccl"):
        assert "no GPU visible to torch (torch.cuda.device_count() is 0, a CPU-only torch)" in why[name], why
    assert "python module triton" in why["compile"], why
    assert report["host"]["torch"].startswith("2.13.0") and report["host"]["gpus"] == 0
    assert any("tensorboard not installed" in w for w in report["warnings"]), report["warnings"]
    missing = [line for line in proc.stderr.splitlines() if line.startswith("gpu-acceptance: missing: ")]
    first_step = next(i for i, line in enumerate(proc.stderr.splitlines()) if "nvidia-smi (limit" in line)
    assert missing and all(proc.stderr.splitlines().index(m) < first_step for m in missing), proc.stderr


def test_cuda_home_is_resolved_as_torch_resolves_it(bare_python: str, tmp_path: Path) -> None:
    """gpu_preflight.find_cuda_home against torch.utils.cpp_extension._find_cuda_home, in one torch process."""
    wrapper_bin = tmp_path / "wrap" / "bin"
    wrapper_bin.mkdir(parents=True)
    (wrapper_bin / "nvcc").write_text("#!/bin/sh\nexec /usr/local/cuda-13.0/bin/nvcc \"$@\"\n")
    (wrapper_bin / "nvcc").chmod(0o755)
    cases = [{"CUDA_HOME": "/opt/cuda-x"}, {"CUDA_PATH": "/opt/cuda-y"}, {"CUDA_HOME": "", "CUDA_PATH": "/opt/z"},
             {"PATH": f"{wrapper_bin}:/usr/bin:/bin"}, {"PATH": "/nonexistent"}]
    code = f"""
import json, os, sys
sys.path.insert(0, {str(ROOT / 'scripts')!r})
import gpu_preflight
from torch.utils import cpp_extension
rows = []
for case in json.loads(sys.argv[1]):
    for k in ("CUDA_HOME", "CUDA_PATH"):
        os.environ.pop(k, None)
    os.environ.update(case)
    rows.append([cpp_extension._find_cuda_home(), gpu_preflight.find_cuda_home(dict(os.environ))])
print(json.dumps(rows))
"""
    proc = subprocess.run([bare_python, "-c", code, json.dumps(cases)], capture_output=True, text=True, timeout=120,
                          check=True, env={k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")})
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(torch_says == ours for torch_says, ours in rows), list(zip(cases, rows, strict=True))
    assert rows[3][0] == str(tmp_path / "wrap"), "the nvcc on PATH decides before /usr/local/cuda"


def test_the_ddp_job_passes_its_checks_without_tensorboard(bare_python: str, tmp_path: Path) -> None:
    out = tmp_path / "st"
    proc = subprocess.run([bare_python, str(ROOT / "smoke_tests" / "selftest.py"), "--out", str(out),
                           "-k", "test_ddp and not hang and not gloo_cuda", "--timeout", "120"],
                          env=_bare_env(tmp_path, bare_python), capture_output=True, text=True, timeout=240,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = {line.split()[1]: line for line in proc.stdout.splitlines()
            if line.split()[:1] in (["PASS"], ["FAIL"], ["ERROR"], ["SKIP"])}
    assert "TensorBoard not installed" in rows["test_ddp[tensorboard-events]"], rows
    for check in ("exit-code", "loss-decreases", "params-identical", "allreduce-exact", "busbw-table", "verdict"):
        assert rows[f"test_ddp[{check}]"].split()[0] == "PASS", rows


def test_a_seed_templates_rank_ends_once_it_has_trained_whatever_the_teardown_would_do(bare_python: str,
                                                                                         tmp_path: Path) -> None:
    """seed_003 as torchrun runs it (``__main__``, one gloo rank on real torch), beside a thread that never
    ends: the interpreter's teardown is where torch 2.14.1's gloo aborted about one rank in a hundred
    (a worker thread freeing the last collective took the GIL during Py_FinalizeEx) and torch 2.0.1's
    hung. The rank must train, print its line and end at once with status 0."""
    seed = ROOT / "smoke_tests" / "seeds" / "seed_003_simplenet_ddp.py"
    code = textwrap.dedent(f"""
        import runpy, sys, threading
        threading.Thread(target=threading.Event().wait, name="teardown-hang").start()  # not a daemon
        sys.argv = [{str(seed)!r}]
        runpy.run_path({str(seed)!r}, run_name="__main__")
    """)
    env = _bare_env(tmp_path, bare_python)
    # MASTER_PORT 0: the lone rank's store takes a free port of its own, which no other rank needs to know
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0",
               OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run([bare_python, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=90, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the rank outlived its work by the test's 90 s: {e.stdout!r} {e.stderr!r}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "seed_003 done: world_size=1 epochs=10" in proc.stdout, proc.stdout
