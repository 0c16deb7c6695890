#!/usr/bin/env python3
"""`make mutants`: mutation testing of the safety modules with cosmic-ray (requirements-mutants.txt).

    scripts/mutants.py [--scope all|changed] [--base main] [--only TEXT] [--jobs 2] [--cold] [--report PATH]

Each mutant is one small change to a module of the plan (scripts/mutants_plan.py: the root start,
the services' input checks, the lock store and check, the audit and publish gates, the smoke
verdicts, GPU planning and watchdog, the YAML loader), tested by that module's unit test files only,
with -x and a timeout, forked from a warm pytest of the scratch copy (scripts/mutants_warm.py;
`--cold`: a fresh interpreter each). Mutants run in scratch copies of the tree (one per job) made from the files
git knows (tracked and untracked, not ignored), never in the work tree: an interrupted run leaves no
mutated file behind. `--scope changed` mutates only the modules whose file or tests differ from
--base (committed or not).

Writes the survivors with file:line and a score per module to --report (build-logs/mutants.txt) and
stdout; each module's cosmic-ray session stays in build-logs/mutants/ (`cr-report FILE`). Exit 0
when every mutant is killed or accepted in docs/testing.md, 1 when one survives unaccepted (or the
tests fail before any mutation), 2 on bad input.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mutants_plan as plan
import mutants_warm as warm

ROOT = plan.ROOT
PY = sys.executable


class Refused(Exception):
    """Bad input: exit 2 with its message."""


class Broken(Exception):
    """The run cannot measure anything (the tests fail unmutated, or import the wrong tree): exit 1."""


@dataclass(frozen=True)
class Mutant:
    path: str
    line: int
    function: str
    operator: str
    before: str
    after: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.function}: {self.operator}\n      - {self.before}\n      + {self.after}"


@dataclass
class Tally:
    target: plan.Target
    where: plan.ModuleMap
    db: Any
    total: int = 0
    skipped: int = 0
    killed: int = 0
    timeouts: int = 0
    survived: list[Mutant] = field(default_factory=list)
    accepted: list[Mutant] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the mutation could not be made or tested
    seconds: float = 0.0  # the mutant runs' time, added up

    def score(self) -> str:
        tested = self.killed + len(self.survived) + len(self.accepted)
        return f"{100 * self.killed / tested:5.1f}%" if tested else "    -"


def git(*args: str) -> str:
    r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    if r.returncode:
        raise Refused(f"git {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r.stdout


def select(scope: str, base: str, only: list[str] | None) -> list[plan.Target]:
    targets = [t for t in plan.PLAN if not only or any(o in t.path for o in only)]
    if only and not targets:
        raise Refused(f"--only {' '.join(only)}: no module of the plan matches (scripts/mutants_plan.py)")
    if scope == "changed":
        try:
            git("rev-parse", "--verify", "--quiet", f"{base}^{{commit}}")
        except Refused:
            raise Refused(f"--base {base}: no such branch or commit here") from None
        changed = set(git("diff", "--name-only", f"{base}...HEAD").split())
        changed |= set(git("diff", "--name-only", "HEAD").split())
        changed |= set(git("ls-files", "--others", "--exclude-standard").split())
        targets = [t for t in targets if {t.path, *t.tests} & changed]
    return targets


def scratch_copy(into: Path) -> None:
    """The files git knows, copied with their times (a copy's .pyc stays valid, a mutant's never is)."""
    for name in git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0"):
        src = ROOT / name
        if name and os.path.lexists(src):
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, into / name, follow_symlinks=False)


def pytest_args(tests: list[str] | tuple[str, ...], *extra: str) -> list[str]:
    """One unit test run, as lean as it gets: no plugins loaded from entry points (the unit tier
    needs none; PYTEST_DISABLE_PLUGIN_AUTOLOAD, set by main(), saves a third of a small run), no
    cache written, stop at the first failure."""
    return ["-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", "--strict-markers", *extra, *tests]


def baseline(scratch: Path, tests: list[str]) -> tuple[dict[str, float], list[str]]:
    """Run every test file once, unmutated, in `scratch` (it must pass; it writes the .pyc files the
    mutant runs reuse): each file's test time, and the installed modules the run imported (the warm
    server's to import first)."""
    probe = subprocess.run([PY, "-c", "import builder, ptmg_contract; print(builder.__file__, ptmg_contract.__file__)"],
                           cwd=scratch, capture_output=True, text=True, check=False)
    if probe.returncode or any(not Path(p).resolve().is_relative_to(scratch.resolve()) for p in probe.stdout.split()):
        raise Broken(f"in the scratch copy, the tests would import {probe.stdout.strip() or probe.stderr.strip()}, "
                     "not the scratch copy: mutants would go unseen")
    junit, dump = scratch / ".mutants-baseline.xml", scratch / ".mutants-modules.json"
    r = subprocess.run(warm.dump_argv(PY, dump, pytest_args(tests, f"--junitxml={junit}")), cwd=scratch,
                       capture_output=True, text=True, check=False)
    if r.returncode:
        raise Broken("the unit tests fail before any mutation:\n" + (r.stdout + r.stderr)[-3000:])
    times = dict.fromkeys(tests, 0.0)
    for case in ET.parse(junit).iter("testcase"):  # noqa: S314 (pytest's report, written just now)
        module = case.get("classname", "")
        for t in tests:
            if module == t[:-3].replace("/", ".") or module.startswith(t[:-3].replace("/", ".") + "."):
                times[t] += float(case.get("time", 0))
    return times, json.loads(dump.read_text(encoding="utf-8"))


def session_path(logs: Path, t: plan.Target) -> Path:
    return logs / (t.path.replace("/", "__").removesuffix(".py") + ".sqlite")


def plan_jobs(targets: list[plan.Target], logs: Path, stack: Any) -> tuple[dict[str, Tally], list[tuple[Tally, Any]]]:
    """A cosmic-ray session per module (build-logs/mutants/<module>.sqlite): every mutant, the ones
    that cannot change behaviour marked skipped with the reason, the rest to run."""
    from cosmic_ray.commands import init
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    logs.mkdir(parents=True, exist_ok=True)
    tallies: dict[str, Tally] = {}
    jobs: list[tuple[Tally, Any]] = []
    cwd = os.getcwd()
    os.chdir(ROOT)  # the sessions name modules by their path in the tree
    try:
        for t in targets:
            session = session_path(logs, t)
            session.unlink(missing_ok=True)
            db = stack.enter_context(use_db(str(session), WorkDB.Mode.create))
            init([Path(t.path)], db, {})
            tally = tallies[t.path] = Tally(t, plan.ModuleMap((ROOT / t.path).read_text(encoding="utf-8")), db)
            for item in list(db.pending_work_items):
                m = item.mutations[0]
                tally.total += 1
                why = plan.skip_reason(t, tally.where, m.operator_name, tuple(m.start_pos))
                if why:
                    tally.skipped += 1
                    db.set_result(item.job_id, WorkResult(output=why, worker_outcome=WorkerOutcome.SKIPPED))
                else:
                    jobs.append((tally, item))
    finally:
        os.chdir(cwd)
    return tallies, jobs


class Judge:
    """Files each mutant's result in its module's tally: killed, survived, accepted (docs/testing.md),
    or an error (the mutation could not be made or tested)."""

    def __init__(self, accepted: list[plan.Accepted]) -> None:
        self.ok = {(a.path, a.function, a.before, a.after) for a in accepted}
        self.ok_line = {(a.path, a.function, a.before) for a in accepted if a.after == "*"}  # any mutant of it
        self.survivors = 0

    def record(self, tally: Tally, item: Any, result: Any) -> None:
        from cosmic_ray.work_item import TestOutcome, WorkerOutcome

        m = item.mutations[0]
        mutant = Mutant(str(m.module_path), m.start_pos[0], tally.where.function_at(tuple(m.start_pos)),
                        m.operator_name.removeprefix("core/"), *plan.diff_lines(result.diff or ""))
        if result.worker_outcome != WorkerOutcome.NORMAL or result.test_outcome == TestOutcome.INCOMPETENT:
            tally.errors.append(f"{mutant.path}:{mutant.line}: {mutant.function}: {mutant.operator}: "
                                f"{result.worker_outcome}: {(result.output or '')[-500:]}")
        elif result.test_outcome == TestOutcome.SURVIVED:
            fine = (mutant.path, mutant.function, mutant.before, mutant.after) in self.ok or \
                (mutant.path, mutant.function, mutant.before) in self.ok_line
            (tally.accepted if fine else tally.survived).append(mutant)
            self.survivors += not fine
        else:
            tally.killed += 1
            tally.timeouts += result.output == "timeout"


def run_jobs(jobs: list[tuple[Tally, Any]], scratches: dict[Path, warm.Warm | None], timeouts: dict[str, float],
             judge: Judge) -> None:
    """Each mutant in a free scratch copy: its tests forked from the copy's warm pytest, or (`--cold`, or
    a server that ended) in a fresh interpreter, as cosmic-ray runs them."""
    from attrs import evolve
    from cosmic_ray.mutating import mutate_and_test

    free: queue.Queue[Path] = queue.Queue()
    for s in scratches:
        free.put(s)

    def one(tally: Tally, item: Any) -> tuple[Any, float]:
        scratch = free.get()
        began = time.monotonic()
        try:
            mutations = [evolve(m, module_path=scratch / m.module_path) for m in item.mutations]
            timeout, server = timeouts[tally.target.path], scratches[scratch]
            if server is not None:
                try:
                    return warm.mutate_and_test(mutations, server, pytest_args(tally.target.tests), timeout), \
                        time.monotonic() - began
                except warm.Cold as e:
                    print(f"mutants: {e}; this copy runs its mutants cold", file=sys.stderr, flush=True)
                    server.close()
                    scratches[scratch] = None
            command = ["env", "-C", str(scratch), PY, "-m", "pytest", *pytest_args(tally.target.tests)]
            return mutate_and_test(mutations, shlex.join(command), timeout), time.monotonic() - began
        finally:
            free.put(scratch)

    started, last = time.monotonic(), 0.0
    with ThreadPoolExecutor(max_workers=len(scratches)) as pool:
        futures: list[tuple[Tally, Any, Future[Any]]] = [(t, i, pool.submit(one, t, i)) for t, i in jobs]
        for n, (tally, item, fut) in enumerate(futures, 1):
            result, seconds = fut.result()
            tally.seconds += seconds
            tally.db.set_result(item.job_id, result)
            judge.record(tally, item, result)
            if time.monotonic() - last > 60 or n == len(futures):
                last = time.monotonic()
                print(f"mutants: {n}/{len(futures)} run, {judge.survivors} survived so far, {last - started:.0f} s",
                      file=sys.stderr, flush=True)


def reuse(targets: list[plan.Target], logs: Path, stack: Any, judge: Judge) -> dict[str, Tally]:
    """The tallies of the sessions a previous run left in `logs`, judged again (after the accepted
    list changed): nothing is run."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome

    tallies: dict[str, Tally] = {}
    for t in targets:
        session = session_path(logs, t)
        if not session.is_file():
            raise Refused(f"{session}: no session of {t.path} to reuse; run without --reuse")
        db = stack.enter_context(use_db(str(session), WorkDB.Mode.open))
        tally = tallies[t.path] = Tally(t, plan.ModuleMap((ROOT / t.path).read_text(encoding="utf-8")), db)
        for item, result in db.completed_work_items:
            tally.total += 1
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                tally.skipped += 1
            else:
                judge.record(tally, item, result)
        if db.pending_work_items:
            raise Refused(f"{session}: {len(db.pending_work_items)} mutants never ran (an interrupted run); "
                          "run without --reuse")
    return tallies


def report(tallies: dict[str, Tally], accepted: list[plan.Accepted], full: bool, seconds: float, jobs: int) -> str:
    from importlib.metadata import version
    how = "the last run's sessions judged again (--reuse)" if jobs == 0 else \
        f"{jobs} jobs, {os.cpu_count()} cores, {seconds / 60:.1f} min"
    out = [f"mutants: cosmic-ray {version('cosmic-ray')}, {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
           f"{how}", "",
           f"{'module':34} {'mutants':>7} {'run':>5} {'killed':>6} {'timeout':>7} {'survived':>8} {'accepted':>8} "
           f"{'error':>5} {'score':>6} {'time':>6}"]
    for p, t in tallies.items():
        run = t.total - t.skipped
        out.append(f"{p:34} {t.total:7} {run:5} {t.killed:6} {t.timeouts:7} {len(t.survived):8} {len(t.accepted):8} "
                   f"{len(t.errors):5} {t.score():>6} {t.seconds / 60:5.1f}m")
    out.append("(score: killed / (killed + survived + accepted); timeouts count as killed; time: the module's "
               "mutant runs added up, over all jobs; the mutants not run are in a type annotation or a log "
               "message, outside the module's listed functions, or of an operator pair not kept: "
               "scripts/mutants_plan.py)")
    for title, pick in (("SURVIVED (not accepted in docs/testing.md)", "survived"), ("ERRORS", "errors"),
                        ("accepted", "accepted")):
        entries = [e for t in tallies.values() for e in getattr(t, pick)]
        if entries:
            out += ["", f"{title}: {len(entries)}", *(f"  {e}" for e in entries)]
    if full:
        seen = {(m.path, m.function, m.before, m.after) for t in tallies.values() for m in t.accepted}
        seen |= {(p, f, b, "*") for p, f, b, _ in seen}
        stale = [a for a in accepted if (a.path, a.function, a.before, a.after) not in seen]
        if stale:
            out += ["", f"accepted in {plan.DOC} but no longer surviving (remove them): {len(stale)}",
                    *(f"  {plan.DOC}:{a.line}: {a.path}::{a.function} {a.before} -> {a.after}" for a in stale)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/mutants.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--scope", choices=("all", "changed"), default="all")
    p.add_argument("--base", default="main", help="--scope changed: the branch or commit to compare with (main)")
    p.add_argument("--only", metavar="TEXT", action="append",
                   help="only the modules whose path contains TEXT (repeatable)")
    p.add_argument("--jobs", type=int, default=2, help="mutants run at once, each in its own scratch copy (2)")
    p.add_argument("--report", type=Path, default=ROOT / "build-logs" / "mutants.txt")
    p.add_argument("--cold", action="store_true",
                   help="each mutant's tests in a fresh interpreter, not forked from a warm pytest (slower)")
    p.add_argument("--reuse", action="store_true",
                   help="run nothing: judge the sessions of the last run again (after editing the accepted list)")
    a = p.parse_args(argv)
    started = time.monotonic()
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # for the baseline and every mutant run
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # unwinds: the scratch copies go too
    try:
        if a.jobs < 1:
            raise Refused(f"--jobs {a.jobs}: needs at least 1")
        accepted = plan.read_accepted(ROOT / plan.DOC)
        targets = select(a.scope, a.base, a.only)
        if not targets:
            print(f"mutants: no module of the plan (nor its tests) differs from {a.base}; nothing to mutate")
            return 0
        try:
            import cosmic_ray  # noqa: F401
        except ImportError:
            raise Refused("cosmic-ray is not installed: `make mutants` installs requirements-mutants.txt") from None
        return run(a, targets, accepted, started)
    except (Refused, plan.AcceptedListError) as e:
        print(f"mutants: {e}", file=sys.stderr)
        return 2
    except Broken as e:
        print(f"mutants: {e}", file=sys.stderr)
        return 1


def run(a: argparse.Namespace, targets: list[plan.Target], accepted: list[plan.Accepted], started: float) -> int:
    from contextlib import ExitStack
    tests = sorted({f for t in targets for f in t.tests})
    judge = Judge(accepted)
    with tempfile.TemporaryDirectory(prefix="ptmg-mutants-") as tmp, ExitStack() as stack:
        if a.reuse:
            tallies = reuse(targets, a.report.parent / "mutants", stack, judge)
            return finish(a, tallies, accepted, started)
        scratches = [Path(tmp) / f"copy-{i}" for i in range(a.jobs)]
        for s in scratches:
            scratch_copy(s)
        print(f"mutants: {len(targets)} modules, baseline of {len(tests)} test files in {a.jobs} scratch copies",
              file=sys.stderr, flush=True)
        with ThreadPoolExecutor(max_workers=a.jobs) as pool:
            runs = [f.result() for f in [pool.submit(baseline, s, tests) for s in scratches]]
        times = {f: max(r[0][f] for r in runs) for f in tests}
        servers = {s: None if a.cold else warm.start(PY, s, runs[0][1], stack) for s in scratches}
        # A mutant gets 4x its tests' unmutated time, plus the interpreter's start: a loaded machine
        # must not turn a survivor into a "timeout" (counted as killed).
        timeouts = {t.path: 20 + 4 * sum(times[f] for f in t.tests) for t in targets}
        tallies, jobs = plan_jobs(targets, a.report.parent / "mutants", stack)
        print(f"mutants: {len(jobs)} mutants to run ({sum(t.skipped for t in tallies.values())} not run: "
              "see the report)", file=sys.stderr, flush=True)
        run_jobs(jobs, servers, timeouts, judge)
        return finish(a, tallies, accepted, started)


def finish(a: argparse.Namespace, tallies: dict[str, Tally], accepted: list[plan.Accepted], started: float) -> int:
    text = report(tallies, accepted, a.scope == "all" and a.only is None, time.monotonic() - started,
                  0 if a.reuse else a.jobs)
    a.report.parent.mkdir(parents=True, exist_ok=True)
    tmp_report = a.report.with_name(a.report.name + ".tmp")
    tmp_report.write_text(text, encoding="utf-8")
    tmp_report.replace(a.report)
    print(text, end="")
    print(f"mutants: report in {a.report}")
    return 1 if any(t.survived or t.errors for t in tallies.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
