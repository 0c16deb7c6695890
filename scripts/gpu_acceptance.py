"""The GPU acceptance run: every GPU check of the project in one go, on a bare GPU host.

    scripts/gpu-acceptance.sh                 # run every step, report to $OUT (or ./gpu-acceptance/)
    scripts/gpu-acceptance.sh --dry-run       # no GPU needed: list the steps, check imports and commands
    scripts/gpu-acceptance.sh --out DIR --python /opt/py/bin/python3

It needs no Docker, no network and no image: the smoke tests run from this checkout with the host's
python (torch, Triton, pytest; ninja, g++, Python.h and nvcc for the compiling steps). Before any
step, one preflight names every missing prerequisite and how to get it. The whole run is bounded
by --budget (540 s: one 10-minute device call with room to start and copy back); the step limits
add up within it, and a step past its limit is killed with every process it started (torchrun's
session and its ranks included). ``gpu-acceptance.json`` and ``gpu-acceptance.txt`` (what ran, what
passed, what was skipped and why, each step's log) are rewritten after every step, so a run cut off
still says what passed; it exits 0 only when every step passed (an optional step not run for want
of a prerequisite aside).

Standard library only: it must start on a host that has nothing of this project installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
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
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_preflight  # noqa: E402 - beside this file

#: One device call is 10 minutes; the run keeps 60 s of it for starting up and copying results.
BUDGET_S = 540.0
PREFLIGHT_S = 60.0  # the probe imports torch once; the rest of the budget is the steps'
REPORT = "gpu-acceptance"
#: What the GPU-path unit tests import through builder/ (its dependencies, not a GPU host's).
UNIT_MODULES = ("pytest", "yaml", "jinja2", "docker", "requests", "packaging")
#: The GPU-path unit tests: the host's GPUs and ranks, the in-image checks, the runner, the watchdog, busbw.
GPU_PATH_UNIT = ("tests/unit/smoke/test_gpus.py", "tests/unit/smoke_tests/test_ddp_checks.py",
                 "tests/unit/smoke/test_runner_gpus.py", "tests/unit/smoke_tests/test_ddp_watchdog.py",
                 "tests/unit/smoke_tests/test_ddp_bench.py", "tests/unit/project/test_gpu_host_checks.py")


@dataclass(frozen=True)
class Step:
    """One check: a command run from the checkout, and what it needs (modules of its python, tools on
    PATH, and gpu_preflight's names: "nvcc", "Python.h", "triton-cache", "gpu")."""

    name: str
    what: str
    argv: tuple[str, ...]  # "{python}", "{unit_python}" and "{out}" are filled in
    timeout_s: float
    needs: tuple[str, ...] = ()
    files: tuple[str, ...] = ()  # relative to the checkout
    junit: bool = False  # a pytest run: counts come from its JUnit XML
    optional: bool = False  # not run for want of a prerequisite: reported, but not a failure of the run


def _pytest(python: str, name: str, *args: str) -> tuple[str, ...]:
    return (python, "-m", "pytest", "-c", str(SMOKE / "pytest.ini"), "-p", "no:cacheprovider", "-rs",
            "--junitxml", f"{{out}}/junit/{name}.xml", *args)


TORCH = ("torch", "pytest", "gpu")
STEPS: tuple[Step, ...] = (
    Step("nvidia-smi", "the host's GPUs: index, model, compute capability, driver, MIG mode",
         ("nvidia-smi", "--query-gpu=index,uuid,name,compute_cap,driver_version,mig.mode.current",
          "--format=csv,noheader"), 15, needs=("nvidia-smi",)),
    Step("gpu-path-unit", "the GPU-path unit tests (fake nvidia-smi and torch: the rules before the GPU); "
         "they need the builder's own dependencies, so a bare host may not run them",
         ("{unit_python}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=",
          "--junitxml", "{out}/junit/gpu-path-unit.xml", *GPU_PATH_UNIT), 45,
         needs=UNIT_MODULES, files=GPU_PATH_UNIT,
         junit=True, optional=True),
    Step("gpu", "CUDA, a kernel, cuDNN conv2d and the arch list on every GPU (each in a child process)",
         _pytest("{python}", "gpu", str(SMOKE / "test_gpu.py"), "--require-gpu"), 75,
         needs=TORCH, files=("smoke_tests/test_gpu.py",), junit=True),
    Step("compile", "torch.compile on CPU and on the GPU (Inductor, Triton)",
         _pytest("{python}", "compile", str(SMOKE / "test_compile.py"), "--require-gpu"), 110,
         needs=(*TORCH, "triton", "g++", "Python.h", "triton-cache"), files=("smoke_tests/test_compile.py",),
         junit=True),
    Step("cpp-extension", "torch.utils.cpp_extension.load_inline of a CUDA kernel built by nvcc, run on GPU 0",
         _pytest("{python}", "cpp-extension", str(SMOKE / "test_devel.py"), "--require-gpu"), 120,
         needs=(*TORCH, "ninja", "g++", "Python.h", "nvcc"), files=("smoke_tests/test_devel.py",), junit=True),
    Step("ddp-nccl", "the DDP job with NCCL on every GPU, its checks and the all-reduce busbw table",
         _pytest("{python}", "ddp-nccl", str(SMOKE / "test_ddp.py"), "--require-gpu", "--smoke-out",
                 "{out}/ddp", "--ddp-timeout", "100"), 115,
         needs=TORCH, files=("smoke_tests/test_ddp.py", "smoke_tests/ddp_job.py"), junit=True),
)


@dataclass
class Outcome:
    name: str
    what: str
    argv: list[str]
    status: str  # passed | failed | timed out | not run (budget) | not run (missing) | not run yet
    timeout_s: float = 0.0
    optional: bool = False
    rc: int | None = None
    seconds: float = 0.0
    tests: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # "test id: reason"
    failures: list[str] = field(default_factory=list)
    log: str = ""


def fill(argv: Sequence[str], python: str, unit_python: str, out: Path) -> list[str]:
    return [a.replace("{python}", python).replace("{unit_python}", unit_python).replace("{out}", str(out))
            for a in argv]


def step_env(python: str) -> dict[str, str]:
    """The steps' environment: the python's own bin folder first on PATH, as an activated venv has it
    (a pip-installed ninja lands there, and torch runs `ninja` from PATH)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    bindir = os.path.dirname(python)
    if bindir and bindir not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = os.pathsep.join([bindir, *([env["PATH"]] if env.get("PATH") else [])])
    return env


def preflight(steps: Sequence[Step], python: str, unit_python: str,
              env: dict[str, str]) -> tuple[dict[str, list[str]], list[str], dict[str, Any]]:
    """Every missing prerequisite of every step, at once: ({step: its problems}, warnings, the host's
    facts). Nothing runs before this."""
    modules = sorted({n for s in steps for n in s.needs if n not in gpu_preflight.NON_MODULES}
                     | set(gpu_preflight.OPTIONAL))
    facts = gpu_preflight.probe(python, modules, env, timeout=45)  # inside PREFLIGHT_S with the one below
    unit_steps = [s.name for s in steps if s.argv[0] == "{unit_python}"]
    unit_facts = facts if unit_python == python else gpu_preflight.probe(
        unit_python, sorted({n for s in steps if s.name in unit_steps for n in s.needs}), env, timeout=15)
    needs = {s.name: s.needs for s in steps}
    problems, warnings, toolkit = gpu_preflight.check(needs, facts, unit_facts, unit_steps, env)
    per_step: dict[str, list[str]] = {s.name: [f"missing file {f}" for f in s.files if not (ROOT / f).is_file()]
                                      for s in steps}
    for p in problems:
        for name in p.steps:
            per_step[name].append(p.line())
    host = {k: facts.get(k) for k in ("python", "executable", "torch", "cuda", "gpus", "torch_error", "error")
            if facts.get(k) is not None}
    host.update({"host": platform.node(), "platform": platform.platform(), "python_path": python,
                 "unit_python": unit_python, "cuda_home": toolkit.get("cuda_home"),
                 "nvcc": toolkit.get("nvcc"), "nvcc_release": toolkit.get("nvcc_release"),
                 "missing_modules": facts.get("missing", [])})
    return per_step, warnings, host


def kill_tree(pid: int) -> None:
    """Kill ``pid``, every process below it, and every process of their sessions: torchrun starts its
    own session (run_ddp), and its ranks outlive a kill of the step's process group alone."""
    for _ in range(5):
        procs = _processes()
        tree, sessions = {pid}, set()
        grew = True
        while grew:
            below = {p for p, (ppid, _sid) in procs.items() if ppid in tree} - tree
            tree |= below
            grew = bool(below)
        sessions = {procs[p][1] for p in tree if p in procs} - {os.getsid(0)}
        victims = tree | {p for p, (_ppid, sid) in procs.items() if sid in sessions}
        victims = {p for p in victims if p in procs and p != os.getpid()}
        if not victims:
            return
        for victim in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(victim, 9)
        time.sleep(0.2)


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every live (not zombie) process, from /proc."""
    found: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as fh:
                fields = fh.read().rpartition(")")[2].split()
        except OSError:
            continue
        if fields and fields[0] != "Z":  # after the name: state, ppid, pgrp, session
            found[int(entry)] = (int(fields[1]), int(fields[3]))
    return found


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


def run_step(step: Step, argv: list[str], out: Path, env: dict[str, str], limit: float) -> Outcome:
    """Run one step within ``limit`` seconds, its whole output in OUT/logs/STEP.log."""
    result = Outcome(step.name, step.what, argv, "failed", limit, step.optional)
    log = out / "logs" / f"{step.name}.log"
    result.log = str(log)
    t0 = time.monotonic()
    with open(log, "w", encoding="utf-8") as fh:
        fh.write(f"$ {shlex.join(argv)}    # limit {limit:g} s\n")
        fh.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            result.rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
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
    if result.status != "passed" and not result.failures:
        result.failures = log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
    return result


def text_report(report: dict[str, Any]) -> str:
    lines = [f"GPU acceptance run: {report['verdict'].upper()} ({report['wall_s']} s of {report['budget_s']:g} s)",
             f"host: {json.dumps(report['host'], sort_keys=True)}"]
    lines += [f"warning: {w}" for w in report["warnings"]] + [""]
    for s in report["steps"]:
        counts = ", ".join(f"{k} {v}" for k, v in s["tests"].items())
        optional = " (optional)" if s["optional"] else ""
        lines.append(f"[{s['status']}] {s['name']}{optional} ({s['seconds']} s of {s['timeout_s']:g})"
                     f"{': ' + counts if counts else ''}: {s['what']}")
        lines += [f"    skipped {x}" for x in s["skipped"]]
        lines += [f"    {x}" for x in s["failures"]]
        if s["log"]:
            lines.append(f"    log: {s['log']}")
    return "\n".join(lines) + "\n"


def verdict(outcomes: Sequence[Outcome]) -> str:
    """passed when every step passed, an optional one not run for a missing prerequisite aside."""
    bad = [o for o in outcomes if o.status != "passed" and not (o.optional and o.status == "not run (missing)")]
    return "passed" if outcomes and not bad else "failed"


def write_report(out: Path, report: dict[str, Any]) -> None:
    """OUT/gpu-acceptance.{json,txt}, each written whole (after every step: a cut-off run keeps what passed)."""
    for suffix, text in (("json", json.dumps(report, indent=2) + "\n"), ("txt", text_report(report))):
        tmp = out / f"{REPORT}.{suffix}.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out / f"{REPORT}.{suffix}")


def limits(steps: Sequence[Step], budget: float) -> dict[str, float]:
    """Each step's limit: its own, scaled down when the steps' sum would pass the budget less the preflight."""
    room = max(budget - PREFLIGHT_S, 0.0)
    total = sum(s.timeout_s for s in steps)
    scale = min(1.0, room / total) if total else 1.0
    return {s.name: round(s.timeout_s * scale, 1) for s in steps}


def command_line(a: argparse.Namespace, unit_python: str, out: Path) -> list[str]:
    """The exact command that runs what this dry run describes."""
    argv = [a.python, str(Path(__file__).resolve()), "--python", a.python, "--unit-python", unit_python,
            "--out", str(out), "--budget", f"{a.budget:g}"]
    return argv + [x for name in a.only for x in ("--only", name)]


def dry_run(a: argparse.Namespace, steps: Sequence[Step], unit_python: str, out: Path, env: dict[str, str]) -> int:
    per_step, warnings, host = preflight(steps, a.python, unit_python, env)
    step_limits = limits(steps, a.budget)
    print(f"command: {shlex.join(command_line(a, unit_python, out))}")
    print(f"time limit: {a.budget:g} s in all ({PREFLIGHT_S:g} s preflight, the steps {sum(step_limits.values()):g} s)")
    print(f"report: {out / (REPORT + '.json')} and {out / (REPORT + '.txt')}, rewritten after every step")
    print(f"logs: {out / 'logs'}/STEP.log (each step's whole output); JUnit: {out / 'junit'}/STEP.xml")
    print(f"python: {a.python} ({host.get('python', '?')}; torch {host.get('torch')}, CUDA {host.get('cuda')}, "
          f"{host.get('gpus', 0)} GPU(s)); CUDA_HOME={host.get('cuda_home')} (as torch resolves it), "
          f"nvcc {host.get('nvcc_release')}")
    blocking = 0
    for step in steps:
        problems = per_step[step.name]
        blocking += len(problems) if not step.optional else 0
        tag = "ok" if not problems else ("MISSING, optional" if step.optional else "MISSING")
        print(f"[{tag}] {step.name} ({step_limits[step.name]:g} s): {step.what}")
        print(f"    {shlex.join(fill(step.argv, a.python, unit_python, out))}")
        for problem in problems:
            print(f"    missing: {problem}")
    for w in warnings:
        print(f"warning: {w}")
    print(f"{len(steps)} steps; {'ready' if not blocking else f'{blocking} missing prerequisite(s)'}")
    return 0 if not blocking else 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-acceptance"),
                   help="report folder (default $OUT, else ./gpu-acceptance)")
    p.add_argument("--python", default=sys.executable, help="the python with torch, Triton and pytest")
    p.add_argument("--unit-python", default=None,
                   help="the python for the GPU-path unit tests (the builder's dependencies: PyYAML, Jinja2, "
                        "docker, requests; default: .venv/bin/python when there is one, else --python)")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help=f"seconds for the whole run (default {BUDGET_S:g}: one 10-minute device call with room)")
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
    env = step_env(a.python)
    out = a.out.resolve()
    if a.dry_run:
        return dry_run(a, steps, unit_python, out, env)
    for sub in ("logs", "junit"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    per_step, warnings, host = preflight(steps, a.python, unit_python, env)  # before any step: all at once
    for line in sorted({p for ps in per_step.values() for p in ps}):
        print(f"gpu-acceptance: missing: {line}", file=sys.stderr)
    for w in warnings:
        print(f"gpu-acceptance: warning: {w}", file=sys.stderr)
    step_limits = limits(steps, a.budget)
    outcomes = [Outcome(s.name, s.what, fill(s.argv, a.python, unit_python, out), "not run yet",
                        step_limits[s.name], s.optional) for s in steps]

    def report() -> dict[str, Any]:
        return {"schema": 2, "verdict": verdict(outcomes) if all(o.status != "not run yet" for o in outcomes)
                else "incomplete", "budget_s": a.budget, "wall_s": round(time.monotonic() - t0, 1), "host": host,
                "warnings": warnings, "steps": [asdict(o) for o in outcomes]}

    write_report(out, report())
    for i, step in enumerate(steps):
        left = a.budget - (time.monotonic() - t0)
        limit = min(step_limits[step.name], left)
        if per_step[step.name]:
            outcomes[i].status, outcomes[i].failures = "not run (missing)", per_step[step.name]
        elif limit < 5:
            outcomes[i].status = "not run (budget)"
        else:
            print(f"gpu-acceptance: {step.name} (limit {limit:.0f} s, {left:.0f} s left) ...", file=sys.stderr,
                  flush=True)
            outcomes[i] = run_step(step, outcomes[i].argv, out, env, limit)
        print(f"gpu-acceptance: {step.name}: {outcomes[i].status}", file=sys.stderr, flush=True)
        write_report(out, report())
    final = report()
    print(text_report(final), end="")
    return 0 if final["verdict"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
