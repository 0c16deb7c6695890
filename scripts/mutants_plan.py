"""What `make mutants` mutates, with which tests, and which surviving mutants are accepted.

Pure and stdlib-only (the unit tier imports it without the mutation tool): the plan of
safety modules (each with the unit test files that guard it), the mutation operators kept
(one or two meaningful replacements per operator instead of cosmic-ray's every pair), the
mutations skipped because they cannot change behaviour (type annotations, log messages),
and the list of accepted survivors read from docs/testing.md. scripts/mutants.py runs it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = "docs/testing.md"
SECTION = "## Mutation testing"


@dataclass(frozen=True)
class Target:
    """One module under mutation: the unit test files that must kill its mutants (fastest
    first: each mutant stops at the first failure), and optionally the functions to mutate
    (qualified names, `Class.method`; a nested function goes with its parent): () is all."""

    path: str
    tests: tuple[str, ...]
    only: tuple[str, ...] = ()


_U = "tests/unit/"
_E = _U + "entrypoint/"
# Each target runs only the files that kill its mutants (a file that killed none in a full run, each
# mutant's first failure read from its session, is not run: it only added seconds to every mutant).
PLAN: tuple[Target, ...] = (
    # The root start and the services' input checks.
    Target("entrypoint/rootstart.py", (_E + "test_rootstart.py",)),
    Target("entrypoint/common.py", (_E + "test_common.py", _E + "test_services.py"),
           only=("_Reader", "load_settings", "read_secret", "own_dir", "state_dir", "private_dir", "write_file",
                 "write_json_atomic")),
    Target("entrypoint/services.py", (_E + "test_services.py",),
           only=("child_env", "prepare_jupyter", "prepare_tensorboard", "_key_lines", "collect_authorized_keys",
                 "ensure_host_keys", "write_session_env", "plan_sshd", "permit_open", "prepare_sshd")),
    # The lock store and the lock check.
    Target("builder/lock/store.py", (_U + "lock/test_store.py",)),
    Target("builder/lock/net.py", (_U + "lock/test_store.py",), only=("CutShort", "check_whole", "transient")),
    Target("builder/common/paths.py", (_U + "lock/test_store.py",), only=("sha256_file",)),
    Target("builder/lock/check.py", (_U + "lock/test_resolve.py",)),
    # The audit and publish gates.
    Target("builder/audit/osv.py", (_U + "audit/test_osv.py",),
           only=("Advisory", "_roundup", "cvss3_score", "rating", "severity_of", "_v", "_in_range", "affects",
                 "advisory", "OsvDir", "query_all")),
    Target("builder/audit/python.py", (_U + "audit/test_osv.py",),
           only=("_applies", "_counts", "audit_packages", "lock_packages", "audit_locks", "unused_allow_entries",
                 "gate_reason")),
    Target("builder/audit/debian.py", (_U + "audit/test_debian.py",), only=("parse_simulation", "_marks", "evaluate")),
    Target("builder/publish/freshness.py", (_U + "publish/test_freshness.py",)),
    Target("builder/publish/gates.py", (_U + "publish/test_gates.py",)),
    Target("builder/publish/vulns.py", (_U + "audit/test_osv.py",), only=("python_gate", "combine")),
    # The zstd layer pusher: diff_ids against the config's, the config against the image, what a retry skips.
    Target("builder/publish/zstdpush.py", (_U + "publish/test_zstdpush.py",)),
    Target("builder/common/digests.py", (_U + "publish/test_zstdpush.py", _U + "attest/test_rebuild.py")),
    Target("builder/cli/verbs/publish.py", (_U + "cli/verbs/test_publish.py", _U + "publish/test_gates.py"),
           only=("run",)),
    # The smoke verdicts, the GPU planning and the watchdog.
    Target("smoke_tests/ddp_plan.py", tuple(_U + f for f in ("smoke_tests/test_ddp_checks.py", "smoke/test_gpus.py",
                                                            "smoke_tests/test_ddp_rules.py"))),
    Target("smoke_tests/ddp_checks.py", tuple(_U + f for f in ("smoke_tests/test_ddp_checks.py", "smoke/test_gpus.py",
                                                              "project/test_gpu_host_checks.py"))),
    Target("smoke_tests/ddp_watchdog.py", tuple(_U + f for f in ("smoke_tests/test_ddp_rules.py",
                                                                "smoke_tests/test_ddp_watchdog.py"))),
    Target("smoke_tests/smokelib.py", tuple(_U + f for f in ("smoke_tests/test_smokelib.py", "smoke/test_gpus.py",
                                                            "smoke_tests/test_ddp_checks.py"))),
    # build.py repro: whether the engine can, the epoch, the layouts and what differs; dropping one build's records.
    Target("builder/imaging/repro.py", (_U + "imaging/test_repro.py",),
           only=("cannot", "read_layout", "layer_entries", "compare_entries", "differing_files",
                 "Verdict.same")),
    Target("builder/imaging/os_snapshot.py", (_U + "imaging/test_repro.py",), only=("Snapshot.epoch",)),
    Target("builder/engine/buildcache.py", (_U + "imaging/test_repro.py",), only=("BuildCache.drop_build_records",)),
    # A --no-cache build runs alone on its engine and platform (20.10's solver crash); cached builds at once.
    Target("builder/engine/solverturn.py", (_U + "engine/test_solverturn.py",)),
    Target("builder/common/flock.py", (_U + "engine/test_solverturn.py",), only=("held",)),
    # The build's wheel server: only the lock's wheels, the bounded wait, the 503s; which builds use it.
    Target("builder/lock/wheelserver.py", (_U + "lock/test_wheelserver.py",)),
    Target("builder/imaging/supply.py", (_U + "lock/test_wheelserver.py",),
           only=("transport", "server_address", "served")),
    # YAML loading: the one safe loader (duplicate keys, control characters, alias bombs, size).
    Target("builder/common/yamlpos.py", (_U + "common/test_yamlpos.py",)),
    # The image without its entrypoint: the startup module's private HOME and noexec rule, pip's hint
    # (a Python script without .py; profile.sh is shell, which cosmic-ray cannot mutate: docs/testing.md).
    Target("entrypoint/ptmg_userenv.py", (_U + "entrypoint/test_userenv.py",)),
    Target("entrypoint/pip-hint", (_U + "entrypoint/test_pip_hint.py",)),
    # The HPC export: the runtime files, the all-or-nothing write, the digest the verb reports.
    Target("builder/export/runtime_files.py", (_U + "export/test_runtime_files.py",)),
    Target("builder/export/squash.py", (_U + "export/test_squash.py",)),
    Target("builder/cli/verbs/export.py", (_U + "cli/verbs/test_export.py",), only=("run",)),
    # Whether a cell runs on the host's GPUs; what the engine can do, never read off a version.
    Target("builder/smoke/gpufit.py", (_U + "smoke/test_gpufit.py",)),
    Target("builder/engine/capabilities.py", (_U + "engine/test_capabilities.py",)),
    # The build context: what the image may see, the cell's wheels, the pip constraint.
    Target("builder/lock/staging.py", (_U + "lock/test_staging.py", _U + "lock/test_store.py")),
    # The registry client: manifests classified, digests checked, credentials only to the registry's origin.
    Target("builder/publish/client.py", (_U + "publish/test_client.py", _U + "publish/test_client_auth.py",
                                         _U + "publish/test_zstdpush.py")),
    # build.py repro's verb: the exit status and the named files.
    Target("builder/cli/verbs/repro.py", (_U + "imaging/test_repro.py",), only=("digest", "run")),
)

# Kept operators. cosmic-ray replaces each binary operator by every other one and each comparison
# by all six others; most of those pairs say nothing the kept ones do not (`a + b` -> `a << b`), and
# the run would not fit its time. A name absent from BINARY/COMPARISON/UNARY is kept whole.
BINARY = {("Add", "Sub"), ("Sub", "Add"), ("Mul", "Div"), ("Div", "Mul"), ("FloorDiv", "Mul"),
          ("Mod", "FloorDiv"), ("Pow", "Mul"), ("LShift", "RShift"), ("RShift", "LShift"),
          ("BitOr", "BitAnd"), ("BitAnd", "BitOr"), ("BitXor", "BitOr")}
COMPARISON = {("Eq", "NotEq"), ("NotEq", "Eq"), ("Is", "IsNot"), ("IsNot", "Is"),
              ("Lt", "GtE"), ("Lt", "LtE"), ("LtE", "Gt"), ("LtE", "Lt"),
              ("Gt", "LtE"), ("Gt", "GtE"), ("GtE", "Lt"), ("GtE", "Gt")}
UNARY = {("USub", "UAdd"), ("Delete", "Not")}
#: Calls whose arguments are a message for a person: their text is not a behaviour under test.
LOG_CALLS = {"info", "warn", "warning", "debug"}


def operator_kept(name: str) -> bool:
    """Whether a cosmic-ray operator name (`core/ReplaceBinaryOperator_Add_Mul`) is in the kept set."""
    kind, _, pair = name.removeprefix("core/").partition("_")
    a, _, b = pair.partition("_")
    table = {"ReplaceBinaryOperator": BINARY, "ReplaceComparisonOperator": COMPARISON,
             "ReplaceUnaryOperator": UNARY}.get(kind)
    return table is None or (a, b) in table


@dataclass(frozen=True)
class Span:
    start: tuple[int, int]  # (line, column): 1-based line, 0-based column in characters
    end: tuple[int, int]

    def holds(self, pos: tuple[int, int]) -> bool:
        return self.start <= pos < self.end


class ModuleMap:
    """Where each mutation position of one source file lies: which function, and whether it is in a
    type annotation or a log message (mutations there cannot change what the code does)."""

    def __init__(self, source: str) -> None:
        self._lines = source.splitlines()
        self.functions: list[tuple[str, Span]] = []
        self.inert: list[tuple[str, Span]] = []
        self.signatures: list[Span] = []  # `def f(...)` up to the body: only defaults there do anything
        self.defaults: list[Span] = []
        self.dotted_excepts: list[Span] = []  # `a.B` in `except (X, a.B)`: cosmic-ray cannot replace it
        self._walk(ast.parse(source), "")

    def _span(self, node: ast.AST) -> Span:
        def char(line: int, col: int) -> int:  # ast columns count UTF-8 bytes
            text = self._lines[line - 1] if line <= len(self._lines) else ""
            return len(text.encode()[:col].decode(errors="ignore"))
        start = (node.lineno, char(node.lineno, node.col_offset))  # type: ignore[attr-defined]
        end_line = node.end_lineno or node.lineno  # type: ignore[attr-defined]
        return Span(start, (end_line, char(end_line, node.end_col_offset or 0)))  # type: ignore[attr-defined]

    def _walk(self, node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                span = self._span(child)
                if child.decorator_list:  # a decorator is its function's (it starts on the `def` line)
                    span = Span((min(d.lineno for d in child.decorator_list), 0), span.end)
                self.functions.append((name, span))
                name += "."
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = child.args
                self.signatures.append(Span(self._span(child).start, self._span(child.body[0]).start))
                self.defaults += [self._span(d) for d in (*args.defaults, *args.kw_defaults) if d is not None]
                for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
                    if a is not None and a.annotation is not None:
                        self.inert.append(("a type annotation", self._span(a.annotation)))
                if child.returns is not None:
                    self.inert.append(("a type annotation", self._span(child.returns)))
            elif isinstance(child, ast.AnnAssign):
                self.inert.append(("a type annotation", self._span(child.annotation)))
            elif isinstance(child, ast.Call) and _is_log_call(child.func):
                self.inert.append(("a log message", self._span(child)))
            elif isinstance(child, ast.Call) and _is_dataclass(child.func):
                # frozen=False only permits assignments the code never makes (mypy --strict refuses them)
                self.inert += [("a dataclass's frozen flag", self._span(k.value)) for k in child.keywords
                               if k.arg == "frozen"]
            elif isinstance(child, ast.ExceptHandler) and isinstance(child.type, ast.Tuple):
                self.dotted_excepts += [self._span(e) for e in child.type.elts if not isinstance(e, ast.Name)]
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                self.inert.append(("a TYPE_CHECKING block", self._span(child)))
            self._walk(child, name)

    def function_at(self, pos: tuple[int, int]) -> str:
        """The innermost function or class holding `pos` (qualified), or '<module>'."""
        found = "<module>"
        for name, span in self.functions:  # parents come before their children: the last is innermost
            if span.holds(pos):
                found = name
        return found

    def inert_at(self, pos: tuple[int, int]) -> str | None:
        why = next((why for why, span in self.inert if span.holds(pos)), None)
        if why is None and any(s.holds(pos) for s in self.signatures) and not any(d.holds(pos) for d in self.defaults):
            why = "a parameter list's * or /"  # cosmic-ray reads the bare `*` there as a multiplication
        return why


def _is_log_call(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute):
        return func.attr in LOG_CALLS | {"error", "exception"} and isinstance(func.value, ast.Name) \
            and func.value.id in {"log", "logger", "logging"}
    return isinstance(func, ast.Name) and func.id in LOG_CALLS


def _is_dataclass(func: ast.expr) -> bool:
    return (isinstance(func, ast.Name) and func.id == "dataclass") or \
        (isinstance(func, ast.Attribute) and func.attr == "dataclass")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def in_scope(target: Target, function: str) -> bool:
    return not target.only or any(function == f or function.startswith(f + ".") for f in target.only)


def skip_reason(target: Target, where: ModuleMap, operator: str, pos: tuple[int, int]) -> str | None:
    """Why a mutation is not run (None: run it)."""
    if not operator_kept(operator):
        return "operator not in the kept set"
    if not in_scope(target, where.function_at(pos)):
        return "outside the target's functions"
    if operator == "core/ExceptionReplacer" and any(s.holds(pos) for s in where.dotted_excepts):
        # cosmic-ray 8.7 fails to make this mutant (it sets `.value` on the dotted name's node)
        return "a dotted name in an except tuple, which cosmic-ray cannot replace"
    inert = where.inert_at(pos)
    return f"in {inert}" if inert else None


# ------------------------------------------------------------------ accepted survivors
@dataclass(frozen=True)
class Accepted:
    """A surviving mutant that is equivalent or harmless, as docs/testing.md lists it:

        - `path::function` `` line before `` -> `` line after ``: why

    (the arrow may be `->` or `→`; an `after` of `*` accepts every mutant of that line). Keyed by
    the mutated line's text, not its number, so an edit elsewhere in the file keeps it, and a
    change of the line itself asks for a new look."""

    path: str
    function: str
    before: str
    after: str
    why: str
    line: int  # in docs/testing.md


_ACCEPTED = re.compile(r"^- `(?P<path>[^`]+?)::(?P<function>[^`]+)` ``\s?(?P<before>.+?)\s?`` (?:->|→) "
                       r"``\s?(?P<after>.+?)\s?``: (?P<why>\S.*)$")


class AcceptedListError(ValueError):
    pass


def read_accepted(doc: Path) -> list[Accepted]:
    """The accepted survivors of the doc's mutation-testing section; a malformed entry is an error
    that names its line."""
    if not doc.exists():
        return []
    out: list[Accepted] = []
    inside = False
    for n, text in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        if text.startswith("## "):
            inside = text.strip() == SECTION
        if not inside or not text.startswith("- `") or "::" not in text.split(" ", 2)[1]:
            continue
        m = _ACCEPTED.match(text)
        if not m:
            raise AcceptedListError(f"{doc.name}:{n}: an accepted mutant reads "
                                    "- `path::function` `` before `` -> `` after ``: why")
        out.append(Accepted(m["path"], m["function"], m["before"].strip(), m["after"].strip(), m["why"], n))
    return out


def diff_lines(diff: str) -> tuple[str, str]:
    """The first removed and added line of a unified diff, stripped (a mutation changes one line;
    one that only removes, a decorator, reads as `(deleted)`)."""
    def first(sign: str) -> str:
        return next((x[1:].strip() for x in diff.splitlines()
                     if x.startswith(sign) and not x.startswith(sign * 3) and x[1:].strip()), "(deleted)")
    return first("-"), first("+")
