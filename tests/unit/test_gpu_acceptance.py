"""The GPU acceptance run's dry run, and one real step, on this CPU host: a fake torch (and a fake
Triton), a fake nvidia-smi and a fake nvcc stand in for what a GPU host has."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.fake_torch import write_fake_torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_acceptance.py"
STEPS = ("nvidia-smi", "gpu-path-unit", "gpu", "compile", "cpp-extension", "ddp-nccl")


def _host(tmp: Path, *, torch: bool = True, nvcc: bool = True, smi: bool = True) -> dict[str, str]:
    """The environment of a GPU host as the script sees it, each part optional."""
    bindir, cuda = tmp / "bin", tmp / "cuda"
    (cuda / "bin").mkdir(parents=True, exist_ok=True)
    bindir.mkdir(exist_ok=True)
    fakes = {bindir / "nvidia-smi": smi, cuda / "bin" / "nvcc": nvcc}
    for path, present in fakes.items():
        if present:
            path.write_text("#!/bin/sh\necho fake\n")
            path.chmod(0o755)
    temp = tmp / "tmp"  # the suites' own folders (ptmg-smoke-*, ptmg-child-*) go here, not to the host's /tmp
    temp.mkdir(exist_ok=True)
    pkgs = tmp / "pkgs"
    if torch:
        write_fake_torch(pkgs)
        (pkgs / "triton").mkdir(exist_ok=True)
        (pkgs / "triton" / "__init__.py").write_text("")
    return {"PATH": f"{bindir}:/usr/bin:/bin", "CUDA_HOME": str(cuda), "PYTHONPATH": str(pkgs), "HOME": str(tmp),
            "TMPDIR": str(temp), "FAKE_TORCH_GPUS": "1"}


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--python", sys.executable, "--unit-python", sys.executable,
                           *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)


def test_dry_run_lists_every_step_and_finds_everything_on_a_gpu_host(tmp_path: Path) -> None:
    proc = _run(_host(tmp_path), "--dry-run", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in STEPS:
        assert f"[ok] {name}: " in proc.stdout, proc.stdout
    assert "ready" in proc.stdout and not (tmp_path / "out").exists(), "a dry run writes nothing"


@pytest.mark.parametrize(("missing", "message"), [
    ({"torch": False}, "can't import torch"),
    ({"nvcc": False}, "nvcc not found"),
    ({"smi": False}, "nvidia-smi not found"),
])
def test_dry_run_names_what_is_missing(missing: dict[str, bool], message: str, tmp_path: Path) -> None:
    proc = _run(_host(tmp_path, **missing), "--dry-run")
    assert proc.returncode == 1 and "[MISSING]" in proc.stdout and message in proc.stdout, proc.stdout


def test_a_step_runs_and_the_report_says_what_passed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run({**_host(tmp_path), "OUT": str(out)}, "--only", "gpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "gpu-acceptance.json").read_text())
    (step,) = report["steps"]
    assert report["verdict"] == "passed" and step["status"] == "passed"
    assert step["tests"] == {"tests": 4, "passed": 4, "failed": 0, "skipped": 0}
    assert "[passed] gpu" in (out / "gpu-acceptance.txt").read_text()
    failing = _run({**_host(tmp_path), "OUT": str(out), "FAKE_TORCH_CAP": "12.0"}, "--only", "gpu")
    assert failing.returncode == 1
    report = json.loads((out / "gpu-acceptance.json").read_text())
    assert report["verdict"] == "failed" and any("test_arch_covered" in f for f in report["steps"][0]["failures"])


def test_unknown_step_is_a_usage_error(tmp_path: Path) -> None:
    proc = _run(_host(tmp_path), "--only", "nope")
    assert proc.returncode == 2 and "steps are" in proc.stderr
