"""The GPU acceptance run: every GPU check of the project in one go, on a bare GPU host.

    scripts/gpu-acceptance.sh                 # run every step, report to $OUT (or ./gpu-acceptance/)
    scripts/gpu-acceptance.sh --dry-run       # no GPU needed: list the steps, check imports and commands
    scripts/gpu-acceptance.sh --out DIR --python /opt/py/bin/python3

It needs no Docker, no network and no image: the smoke tests run from this checkout with the host's
python (torch, Triton, pytest; nvcc for the CUDA extension step). The whole run is bounded by
--budget (600 s): each step gets its own limit, capped by what is left. It writes
``gpu-acceptance.json`` and ``gpu-acceptance.txt`` (what ran, what passed, what was skipped and why,
the logs) and exits 0 only when every step passed.

Standard library only: it must start on a host that has nothing of this project installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "smoke_tests"
BUDGET_S = 600.0
REPORT = "gpu-acceptance"


@dataclass(frozen=True)
class Step:
    """One check: a command run from the checkout, the modules it imports, what it needs on PATH."""

    name: str
    what: str
    argv: tuple[str, ...]  # "{python}", "{unit_python}" and "{out}" are filled in
    timeout_s: float
    imports: tuple[str, ...] = ()
    files: tuple[str, ...] = ()  # relative to the checkout
    tools: tuple[str, ...] = ()  # executables that must resolve (nvidia-smi, nvcc)
    junit: bool = False  # a pytest run: counts come from its JUnit XML


def _pytest(python: str, name: str, *args: str) -> tuple[str, ...]:
    return (python, "-m", "pytest", "-c", str(SMOKE / "pytest.ini"), "-p", "no:cacheprovider", "-rs",
            "--junitxml", f"{{out}}/junit/{name}.xml", *args)


STEPS: tuple[Step, ...] = (
    Step("nvidia-smi", "the host's GPUs: index, model, compute capability, driver, MIG mode",
         ("nvidia-smi", "--query-gpu=index,uuid,name,compute_cap,driver_version,mig.mode.current",
          "--format=csv,noheader"), 30, tools=("nvidia-smi",)),
    Step("gpu-path-unit", "the GPU-path unit tests (fake nvidia-smi and torch: the rules before the GPU)",
         ("{unit_python}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=",
          "--junitxml", "{out}/junit/gpu-path-unit.xml", "tests/unit/test_gpu_path.py",
          "tests/unit/test_gpu_first_contact.py"), 120,
         imports=("pytest", "yaml", "jinja2"), files=("tests/unit/test_gpu_path.py",
                                                      "tests/unit/test_gpu_first_contact.py"), junit=True),
    Step("gpu", "CUDA, a kernel, cuDNN conv2d and the arch list on every GPU (each in a child process)",
         _pytest("{python}", "gpu", str(SMOKE / "test_gpu.py"), "--require-gpu"), 120,
         imports=("torch", "pytest"), files=("smoke_tests/test_gpu.py",), junit=True),
    Step("compile", "torch.compile on CPU and on the GPU (Inductor, Triton)",
         _pytest("{python}", "compile", str(SMOKE / "test_compile.py"), "--require-gpu"), 150,
         imports=("torch", "triton", "pytest"), files=("smoke_tests/test_compile.py",), junit=True),
    Step("cpp-extension", "torch.utils.cpp_extension.load_inline of a CUDA kernel built by nvcc, run on GPU 0",
         _pytest("{python}", "cpp-extension", str(SMOKE / "test_devel.py"), "--require-gpu"), 180,
         imports=("torch", "pytest"), files=("smoke_tests/test_devel.py",), tools=("nvcc",), junit=True),
    Step("ddp-nccl", "the DDP job with NCCL on every GPU, its checks and the all-reduce busbw table",
         _pytest("{python}", "ddp-nccl", str(SMOKE / "test_ddp.py"), "--require-gpu", "--smoke-out",
                 "{out}/ddp"), 240,
         imports=("torch", "pytest"), files=("smoke_tests/test_ddp.py", "smoke_tests/ddp_job.py"), junit=True),
)


@dataclass
class Outcome:
    name: str
    what: str
    argv: list[str]
    status: str  # passed | failed | timed out | not run (budget) | not run (missing)
    rc: int | None = None
    seconds: float = 0.0
    tests: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # "test id: reason"
    failures: list[str] = field(default_factory=list)
    log: str = ""


def resolve_tool(name: str, env: dict[str, str]) -> str | None:
    if name == "nvcc":
        home = env.get("CUDA_HOME") or env.get("CUDA_PATH") or "/usr/local/cuda"
        candidate = Path(home) / "bin" / "nvcc"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name, path=env.get("PATH"))


def module_missing(python: str, modules: Sequence[str], env: dict[str, str]) -> list[str]:
    """The modules of ``modules`` that ``python`` can't find (found by spec: nothing is imported)."""
    if not modules:
        return []
    if python == sys.executable:
        return [m for m in modules if importlib.util.find_spec(m) is None]
    code = ("import importlib.util, sys; "
            "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")
    proc = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True, timeout=60, env=env,
                          check=False)
    return proc.stdout.split() if proc.returncode == 0 else list(modules)


def fill(argv: Sequence[str], python: str, unit_python: str, out: Path) -> list[str]:
    return [a.replace("{python}", python).replace("{unit_python}", unit_python).replace("{out}", str(out))
            for a in argv]


def preflight(step: Step, python: str, unit_python: str, env: dict[str, str]) -> list[str]:
    """What keeps ``step`` from running here: a missing file, tool, interpreter or module."""
    problems = [f"missing file {f}" for f in step.files if not (ROOT / f).is_file()]
    problems += [f"{t} not found (PATH{', CUDA_HOME' if t == 'nvcc' else ''})" for t in step.tools
                 if resolve_tool(t, env) is None]
    interpreter = unit_python if step.argv[0] == "{unit_python}" else python
    if step.argv[0].startswith("{"):
        if not (shutil.which(interpreter) or Path(interpreter).is_file()):
            return [*problems, f"python {interpreter} not found"]
        problems += [f"{interpreter} can't import {m}" for m in module_missing(interpreter, step.imports, env)]
    return problems


def junit_counts(path: Path) -> tuple[dict[str, int], list[str], list[str]]:
    """(counts, skipped "id: reason", failed "id: message") of a pytest JUnit XML file."""
    root = ET.parse(path).getroot()  # noqa: S314 - our own pytest's report
    counts = {"tests": 0, "passed": 0, "failed": 0, "skipped": 0}
    skipped, failed = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        counts["tests"] += 1
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed"] += 1
            failed.append(f"{name}: {(bad.get('message') or '').splitlines()[0] if bad.get('message') else ''}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            skipped.append(f"{name}: {case.find('skipped').get('message', '')}")  # type: ignore[union-attr]
        else:
            counts["passed"] += 1
    return counts, skipped, failed


def run_step(step: Step, python: str, unit_python: str, out: Path, env: dict[str, str], left_s: float) -> Outcome:
    argv = fill(step.argv, python, unit_python, out)
    result = Outcome(step.name, step.what, argv, "failed")
    problems = preflight(step, python, unit_python, env)
    if problems:
        result.status, result.failures = "not run (missing)", problems
        return result
    limit = min(step.timeout_s, left_s)
    if limit < 5:
        result.status = "not run (budget)"
        return result
    log = out / "logs" / f"{step.name}.log"
    result.log = str(log)
    t0 = time.monotonic()
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            result.rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            result.status = "timed out"
    result.seconds = round(time.monotonic() - t0, 1)
    junit = out / "junit" / f"{step.name}.xml"
    if step.junit and junit.is_file():
        result.tests, result.skipped, result.failures = junit_counts(junit)
    if result.status != "timed out":
        result.status = "passed" if result.rc == 0 else "failed"
        if result.rc == 0 and step.junit and not result.tests.get("passed"):
            result.status, result.failures = "failed", ["pytest reported no passed test"]
    if result.status == "failed" and not result.failures:
        result.failures = log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
    return result


def host_facts(python: str, env: dict[str, str]) -> dict[str, Any]:
    code = ("import json, sys\ntry:\n import torch\n d = {'torch': torch.__version__, 'cuda': torch.version.cuda, "
            "'gpus': torch.cuda.device_count() if torch.cuda.is_available() else 0}\nexcept Exception as e:\n"
            " d = {'torch': None, 'error': repr(e)}\nd['python'] = sys.version.split()[0]\nprint(json.dumps(d))")
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=False)
        facts: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
        facts = {"error": repr(exc)}
    facts.update({"host": platform.node(), "python_path": python, "platform": platform.platform()})
    return facts


def text_report(report: dict[str, Any]) -> str:
    lines = [f"GPU acceptance run: {report['verdict'].upper()} ({report['wall_s']} s of {report['budget_s']:g} s)",
             f"host: {json.dumps(report['host'], sort_keys=True)}", ""]
    for s in report["steps"]:
        counts = ", ".join(f"{k} {v}" for k, v in s["tests"].items())
        lines.append(f"[{s['status']}] {s['name']} ({s['seconds']} s){': ' + counts if counts else ''}: {s['what']}")
        lines += [f"    skipped {x}" for x in s["skipped"]]
        lines += [f"    {x}" for x in s["failures"]]
        if s["log"]:
            lines.append(f"    log: {s['log']}")
    return "\n".join(lines) + "\n"


def dry_run(steps: Sequence[Step], python: str, unit_python: str, out: Path, env: dict[str, str]) -> int:
    problems_total = 0
    for step in steps:
        problems = preflight(step, python, unit_python, env)
        problems_total += len(problems)
        print(f"[{'ok' if not problems else 'MISSING'}] {step.name}: {step.what}")
        print(f"    {' '.join(fill(step.argv, python, unit_python, out))}")
        for p in problems:
            print(f"    missing: {p}")
    total = sum(s.timeout_s for s in steps)
    print(f"{len(steps)} steps, limits {total:g} s in all, capped at the run's budget; "
          f"{'ready' if not problems_total else f'{problems_total} problem(s)'}")
    return 0 if not problems_total else 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-acceptance"),
                   help="report folder (default $OUT, else ./gpu-acceptance)")
    p.add_argument("--python", default=sys.executable, help="the python with torch, Triton and pytest")
    p.add_argument("--unit-python", default=None,
                   help="the python for the unit tests (needs PyYAML and Jinja2; default: .venv/bin/python when "
                        "there is one, else --python)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run (default 600)")
    p.add_argument("--only", action="append", default=[], metavar="STEP", help="run only these steps (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="check what can be checked without a GPU, run nothing")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    names = {s.name for s in STEPS}
    unknown = [n for n in a.only if n not in names]
    if unknown:
        print(f"gpu-acceptance: --only {unknown[0]!r}: steps are {', '.join(sorted(names))}", file=sys.stderr)
        return 2
    steps = [s for s in STEPS if not a.only or s.name in a.only]
    venv = ROOT / ".venv" / "bin" / "python"
    unit_python = a.unit_python or (str(venv) if venv.is_file() else a.python)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    out = a.out.resolve()
    if a.dry_run:
        return dry_run(steps, a.python, unit_python, out, env)
    for sub in ("logs", "junit"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    host = host_facts(a.python, env)  # inside the budget: it imports torch once
    outcomes = []
    for step in steps:
        left = a.budget - (time.monotonic() - t0)
        print(f"gpu-acceptance: {step.name} ({left:.0f} s left) ...", file=sys.stderr, flush=True)
        outcomes.append(run_step(step, a.python, unit_python, out, env, left))
        print(f"gpu-acceptance: {step.name}: {outcomes[-1].status}", file=sys.stderr, flush=True)
    ok = all(o.status == "passed" for o in outcomes)
    report = {"schema": 1, "verdict": "passed" if ok else "failed", "budget_s": a.budget,
              "wall_s": round(time.monotonic() - t0, 1), "host": host,
              "steps": [asdict(o) for o in outcomes]}
    for suffix, text in (("json", json.dumps(report, indent=2) + "\n"), ("txt", text_report(report))):
        tmp = out / f"{REPORT}.{suffix}.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out / f"{REPORT}.{suffix}")
    print(text_report(report), end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
