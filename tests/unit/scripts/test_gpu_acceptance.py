"""The GPU acceptance run on this CPU host: its dry run, its preflight, one real step, a cut-off run
and a step past its limit. A fake torch (and fake Triton, TensorBoard, requests), a fake nvidia-smi,
nvcc, ninja and g++ stand in for what a GPU host has; PATH holds nothing else, so each can be taken
away. The bare-host run with a real torch is tests/unit/project/test_bare_host.py."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.unit.fake_torch import write_fake_torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu_acceptance.py"
STEPS = ("nvidia-smi", "gpu-path-unit", "gpu", "compile", "cpp-extension", "ddp-nccl")
#: The expected GPU host's python: torch 2.11 (cu130), Triton 3.6, tensorboard, requests, ninja, pytest, nvcc 13.0.
EXPECTED = ("triton", "tensorboard", "requests")


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_acceptance_under_test", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _tool(path: Path, body: str = "echo fake") -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def _host(tmp: Path, *, torch: bool = True, nvcc: str | None = "13.0", smi: bool = True, ninja: bool = True,
          gxx: bool = True, modules: tuple[str, ...] = EXPECTED, gpus: int = 1) -> dict[str, str]:
    """The environment of a GPU host as the script sees it, each part optional; PATH is only its bin/."""
    bindir, cuda = tmp / "bin", tmp / "cuda"
    for d in (bindir, cuda / "bin", cuda / "include"):
        d.mkdir(parents=True, exist_ok=True)
    (cuda / "include" / "cuda_runtime.h").write_text("/* fake */\n")
    if smi:
        _tool(bindir / "nvidia-smi")
    if ninja:
        _tool(bindir / "ninja", "echo 1.13.0")
    if gxx:
        _tool(bindir / "g++")
    if nvcc:
        _tool(cuda / "bin" / "nvcc", f"echo 'Cuda compilation tools, release {nvcc}, V{nvcc}.88'")
    temp = tmp / "tmp"  # the suites' own folders (ptmg-smoke-*, ptmg-child-*) go here, not to the host's /tmp
    temp.mkdir(exist_ok=True)
    pkgs = tmp / "pkgs"
    if torch:
        write_fake_torch(pkgs)
    for name in modules:
        (pkgs / name).mkdir(parents=True, exist_ok=True)
        (pkgs / name / "__init__.py").write_text("")
    return {"PATH": str(bindir), "CUDA_HOME": str(cuda), "PYTHONPATH": str(pkgs), "HOME": str(tmp),
            "TMPDIR": str(temp), "FAKE_TORCH_GPUS": str(gpus)}


def _run(env: dict[str, str], *args: str, unit_python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--python", sys.executable, "--unit-python", unit_python,
                           *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)


def test_dry_run_prints_the_command_its_limit_and_where_everything_lands(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run(_host(tmp_path), "--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in STEPS:
        assert f"[ok] {name} (" in proc.stdout, proc.stdout
    lines = proc.stdout.splitlines()
    assert lines[0] == (f"command: {sys.executable} {SCRIPT} --python {sys.executable} --unit-python "
                        f"{sys.executable} --out {out} --budget 540"), lines[0]
    assert lines[1].startswith("time limit: 540 s in all"), lines[1]
    assert f"report: {out}/gpu-acceptance.json and {out}/gpu-acceptance.txt" in proc.stdout
    assert f"logs: {out}/logs/STEP.log" in proc.stdout
    assert f"CUDA_HOME={tmp_path / 'cuda'} (as torch resolves it), nvcc 13.0" in proc.stdout
    assert "ready" in proc.stdout and not out.exists(), "a dry run writes nothing"


def test_the_budget_fits_one_ten_minute_call_and_the_limits_fit_the_budget() -> None:
    mod = _load()
    assert mod.BUDGET_S <= 540
    limits = mod.limits(mod.STEPS, mod.BUDGET_S)
    assert mod.PREFLIGHT_S + sum(limits.values()) <= mod.BUDGET_S, limits
    assert limits == {s.name: s.timeout_s for s in mod.STEPS}, "the default budget cuts no step's own limit"
    small = mod.limits(mod.STEPS, 300)
    assert mod.PREFLIGHT_S + sum(small.values()) <= 300 + 0.5, small


def test_the_preflight_lists_every_missing_prerequisite_at_once(tmp_path: Path) -> None:
    env = _host(tmp_path, nvcc="12.8", smi=False, ninja=False, gxx=False, modules=(), gpus=0)
    env["TRITON_CACHE_DIR"] = "/proc/ptmg-not-writable"
    proc = _run(env, "--dry-run")
    assert proc.returncode == 1, proc.stdout
    for missing in ("nvidia-smi not on PATH", "ninja not on PATH (stops cpp-extension): pip install ninja",
                    "g++ not on PATH (stops compile, cpp-extension): apt-get install g++",
                    "nvcc is CUDA 12.8, torch is built for CUDA 13.0", "python module triton",
                    "Triton's cache /proc/ptmg-not-writable not writable",
                    "no GPU visible to torch (torch.cuda.device_count() is 0)"):
        assert f"missing: {missing}" in proc.stdout, (missing, proc.stdout)
    assert "missing prerequisite(s)" in proc.stdout


def test_a_run_names_every_missing_prerequisite_before_any_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run({**_host(tmp_path, ninja=False, smi=False), "OUT": str(out)}, "--only", "nvidia-smi",
                "--only", "cpp-extension")
    assert proc.returncode == 1
    first = proc.stderr.splitlines()[:2]
    assert [line.split(" (stops")[0] for line in first] == ["gpu-acceptance: missing: ninja not on PATH",
                                                            "gpu-acceptance: missing: nvidia-smi not on PATH"], first
    report = json.loads((out / "gpu-acceptance.json").read_text())
    assert [s["status"] for s in report["steps"]] == ["not run (missing)", "not run (missing)"]


def test_an_nvcc_of_another_minor_warns_as_torch_does(tmp_path: Path) -> None:
    proc = _run(_host(tmp_path, nvcc="13.1"), "--dry-run", "--only", "cpp-extension")
    assert proc.returncode == 0, proc.stdout
    assert "warning: nvcc is CUDA 13.1, torch is built for CUDA 13.0: another minor" in proc.stdout


def test_cuda_home_is_torchs_the_nvcc_on_path_before_usr_local_cuda(tmp_path: Path) -> None:
    """No CUDA_HOME: torch takes the folder above the first nvcc on PATH. A wrapper there (as
    /usr/local/bin/nvcc exec'ing a versioned toolkit) gives a CUDA_HOME without headers: named."""
    env = _host(tmp_path)
    del env["CUDA_HOME"]
    _tool(tmp_path / "bin" / "nvcc", f"exec {tmp_path}/cuda/bin/nvcc \"$@\"")
    proc = _run(env, "--dry-run", "--only", "cpp-extension")
    assert f"CUDA_HOME={tmp_path} (as torch resolves it)" in proc.stdout, proc.stdout
    assert f"missing: no include/cuda_runtime.h under CUDA_HOME={tmp_path}" in proc.stdout, proc.stdout
    assert proc.returncode == 1


@pytest.mark.parametrize("modules", [EXPECTED, ("triton",)], ids=["expected-host", "without-optional"])
def test_the_expected_gpu_host_and_one_without_the_optional_modules_are_ready(
        modules: tuple[str, ...], tmp_path: Path) -> None:
    """torch, Triton, pytest, ninja, g++ and nvcc 13.0 are enough; tensorboard and requests are
    not needed (the GPU-path unit step needs the builder's own dependencies: optional)."""
    bare = tmp_path / "bare-python"
    _tool(bare, f"exec {sys.executable} -I -S \"$@\"")  # no site-packages: no PyYAML, docker, requests
    proc = _run(_host(tmp_path, modules=modules), "--dry-run", unit_python=str(bare))
    assert proc.returncode == 0, proc.stdout
    assert "[MISSING, optional] gpu-path-unit" in proc.stdout and "python module yaml" in proc.stdout
    assert ("warning: python module tensorboard not installed" in proc.stdout) == ("tensorboard" not in modules)
    for name in STEPS:
        assert f"{name} (" in proc.stdout


def test_a_step_runs_and_the_report_says_what_passed_and_keeps_its_log(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run({**_host(tmp_path), "OUT": str(out)}, "--only", "gpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "gpu-acceptance.json").read_text())
    (step,) = report["steps"]
    assert report["verdict"] == "passed" and step["status"] == "passed"
    assert step["tests"] == {"tests": 4, "passed": 4, "failed": 0, "skipped": 0}
    log = Path(step["log"])
    assert log == out / "logs" / "gpu.log" and log.read_text().startswith("$ " + sys.executable), log.read_text()
    assert "4 passed" in log.read_text()
    assert "[passed] gpu" in (out / "gpu-acceptance.txt").read_text()
    failing = _run({**_host(tmp_path), "OUT": str(out), "FAKE_TORCH_CAP": "12.0"}, "--only", "gpu")
    assert failing.returncode == 1
    report = json.loads((out / "gpu-acceptance.json").read_text())
    assert report["verdict"] == "failed" and any("test_arch_covered" in f for f in report["steps"][0]["failures"])


def test_a_run_cut_off_mid_step_still_says_what_passed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    slow = tmp_path / "slow-python"
    _tool(slow, f'[ "$1" = -m ] && sleep 120; exec {sys.executable} "$@"')  # the preflight's probe runs, pytest hangs
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--python", sys.executable, "--unit-python", str(slow),
                             "--only", "nvidia-smi", "--only", "gpu-path-unit", "--out", str(out)],
                            env=_host(tmp_path), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    report: dict[str, object] = {}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            path = out / "gpu-acceptance.json"
            report = json.loads(path.read_text()) if path.is_file() else {}
            if [s["status"] for s in report.get("steps", [])] == ["passed", "not run yet"]:  # type: ignore[union-attr]
                break
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the device call's cap: nothing more gets written
        proc.wait()
    assert report.get("verdict") == "incomplete", report
    steps = report["steps"]
    assert isinstance(steps, list) and steps[0]["name"] == "nvidia-smi" and steps[0]["status"] == "passed"


def test_a_step_past_its_limit_is_killed_with_every_session_it_started(tmp_path: Path) -> None:
    """The step's child setsid()s (as torchrun does) and starts a grandchild (a rank): both die."""
    mod = _load()
    pids = tmp_path / "pids"
    child = ("import os, subprocess, sys, time; "
             "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
             f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{os.getsid(0)}} {{g.pid}}'); time.sleep(300)")
    step_code = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}], "
                 "start_new_session=True); time.sleep(300)")
    step = mod.Step("straggler", "a step whose child runs in its own session", ("python",), 3)
    (tmp_path / "logs").mkdir()
    t0 = time.monotonic()
    outcome = mod.run_step(step, [sys.executable, "-c", step_code], tmp_path, dict(os.environ), 3)
    assert outcome.status == "timed out" and time.monotonic() - t0 < 30
    torchrun, session, rank = (int(x) for x in pids.read_text().split())
    assert session == torchrun, "the child did not start its own session"
    time.sleep(0.5)
    alive = [p for p in (torchrun, rank) if _alive(p)]
    assert not alive, f"left running after the step's timeout: {alive}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_unknown_step_is_a_usage_error(tmp_path: Path) -> None:
    proc = _run(_host(tmp_path), "--only", "nope")
    assert proc.returncode == 2 and "steps are" in proc.stderr


@pytest.mark.parametrize(("release", "passes", "says"), [
    ("13.0", True, "1 passed"),
    ("13.1", True, "nvcc is CUDA 13.1, torch was built for CUDA 13.0: a minor mismatch"),
    ("12.8", False, "the majors differ"),
])
def test_devel_toolkit_fails_on_another_major_and_warns_on_another_minor(release: str, passes: bool, says: str,
                                                                         tmp_path: Path) -> None:
    """smoke_tests/test_devel.py's toolkit check off the image, as torch.utils.cpp_extension judges
    nvcc against torch's CUDA (13.0 here): another major refuses, another minor only warns."""
    env = _host(tmp_path, nvcc=release)
    ext = tmp_path / "pkgs" / "torch" / "utils" / "cpp_extension.py"
    ext.write_text("import os\nCUDA_HOME = os.environ.get('CUDA_HOME')\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "smoke_tests" / "pytest.ini"),
                           "-p", "no:cacheprovider", str(ROOT / "smoke_tests" / "test_devel.py"), "-k", "toolkit",
                           "-rA"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert (proc.returncode == 0) == passes and says in proc.stdout, proc.stdout


def test_the_readmes_dry_run_as_typed(tmp_path: Path) -> None:
    """README: `make gpu-acceptance ARGS=--dry-run` prints the command, its limit and where things land, and
    lists what this host lacks (it has no GPU): make's exit 2 carries the script's 1, a ready host gives 0."""
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    p = subprocess.run(["make", "gpu-acceptance", "ARGS=--dry-run"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120, check=False)
    out = p.stdout + p.stderr
    assert "--budget 540" in out and "time limit: 540 s in all" in out, out[-3000:]
    assert f"report: {tmp_path / 'out'}/gpu-acceptance.json" in out, out[-3000:]
    if p.returncode != 0:
        assert p.returncode == 2 and "missing prerequisite(s)" in out and "[MISSING] nvidia-smi" in out, out[-3000:]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # a dry run writes nothing
