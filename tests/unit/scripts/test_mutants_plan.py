"""`make mutants`: its plan names modules, tests and functions that exist (a rename must not drop a
safety module from mutation testing without a word), its accepted survivors are well formed, and
its filters skip only what cannot change behaviour. The mutation run itself is `make mutants`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import ROOT, load_module

plan = load_module("mutants_plan", ROOT / "scripts" / "mutants_plan.py")


def test_every_module_test_file_and_function_of_the_plan_exists() -> None:
    paths = [t.path for t in plan.PLAN]
    assert len(paths) == len(set(paths)), "a module is listed twice"
    for t in plan.PLAN:
        source = ROOT / t.path
        script = source.is_file() and source.read_text(encoding="utf-8").startswith("#!/opt/venv/bin/python")
        assert source.is_file() and (source.suffix == ".py" or script), f"{t.path}: no such module (renamed?)"
        assert t.tests, f"{t.path}: no test file kills its mutants"
        for test in t.tests:
            assert (ROOT / test).is_file(), f"{t.path}: its test file {test} does not exist"
        names = {name for name, _ in plan.ModuleMap(source.read_text(encoding="utf-8")).functions}
        missing = [f for f in t.only if f not in names]
        assert not missing, f"{t.path}: the plan mutates {missing}, which the module does not define"


def test_the_plan_covers_each_kind_of_safety_module() -> None:
    paths = {t.path for t in plan.PLAN}
    for kind in ("entrypoint/rootstart.py", "entrypoint/services.py", "builder/lock/store.py", "builder/lock/check.py",
                 "builder/publish/gates.py", "builder/publish/vulns.py", "smoke_tests/ddp_checks.py",
                 "smoke_tests/ddp_watchdog.py", "builder/common/yamlpos.py"):
        assert kind in paths, f"{kind} is no longer mutation-tested"


def test_accepted_survivors_in_the_doc_name_planned_modules_and_functions() -> None:
    planned = {t.path: t for t in plan.PLAN}
    for a in plan.read_accepted(ROOT / plan.DOC):
        assert a.path in planned, f"{plan.DOC}:{a.line}: {a.path} is not in the plan"
        names = {name for name, _ in plan.ModuleMap((ROOT / a.path).read_text(encoding="utf-8")).functions}
        assert a.function in names | {"<module>"}, f"{plan.DOC}:{a.line}: {a.path} has no {a.function}"
        assert a.why.strip(), f"{plan.DOC}:{a.line}: an accepted mutant says why"


def test_a_malformed_accepted_entry_is_an_error_that_names_its_line(tmp_path: Path) -> None:
    doc = tmp_path / "testing.md"
    doc.write_text("# Testing\n\n## Mutation testing\n\n"
                   "- `a.py::f` `` if x: `` -> `` if not x: ``: the branch is dead\n"
                   "- `a.py::g` if y: -> if not y\n", encoding="utf-8")
    with pytest.raises(plan.AcceptedListError, match=r"testing\.md:6: "):
        plan.read_accepted(doc)
    doc.write_text("## Other\n\n- `a.py::g` is prose there\n\n## Mutation testing\n\n"
                   "- `a.py::f` `` if x: `` → `` if not x: ``: the branch is dead\n", encoding="utf-8")
    [a] = plan.read_accepted(doc)
    assert (a.path, a.function, a.before, a.after, a.why, a.line) == \
        ("a.py", "f", "if x:", "if not x:", "the branch is dead", 7)


SOURCE = '''\
import logging
log = logging.getLogger()

@dataclass(frozen=True)
class Box:
    size: int | None = None

    def fits(self, other: int | None) -> bool | None:
        log.info("checking %s", self.size + 1)
        return self.size is not None and other < self.size

def outer(x):
    def inner(y):
        return y - 1
    return inner(x) + 1

def keywords(a, *, b=2 * 3):
    return a
'''


def test_the_filters_skip_annotations_log_messages_and_frozen_flags_only() -> None:
    where = plan.ModuleMap(SOURCE)
    assert where.function_at((6, 10)) == "Box"
    assert where.function_at((10, 40)) == "Box.fits"
    assert where.function_at((4, 0)) == "Box"  # the decorator belongs to its class
    assert where.function_at((14, 17)) == "outer.inner"
    assert where.function_at((15, 20)) == "outer"
    assert where.function_at((1, 0)) == "<module>"
    assert where.inert_at((6, 14)) == "a type annotation"  # size: int | None
    assert where.inert_at((8, 33)) == "a type annotation"  # other: int | None
    assert where.inert_at((8, 43)) == "a type annotation"  # -> bool | None
    assert where.inert_at((9, 43)) == "a log message"
    assert where.inert_at((4, 18)) == "a dataclass's frozen flag"
    assert where.inert_at((10, 31)) is None  # `is not`
    assert where.inert_at((10, 49)) is None  # `<`
    assert where.inert_at((15, 20)) is None  # `+`
    assert where.inert_at((17, 16)) == "a parameter list's * or /"  # the bare `*`
    assert where.inert_at((17, 23)) is None  # `2 * 3`, a default


def test_a_target_mutates_only_its_functions_and_the_kept_operators() -> None:
    t = plan.Target("m.py", ("t.py",), only=("outer",))
    where = plan.ModuleMap(SOURCE)
    assert plan.skip_reason(t, where, "core/ReplaceBinaryOperator_Sub_Add", (14, 17)) is None  # outer.inner
    assert plan.skip_reason(t, where, "core/NumberReplacer", (15, 22)) is None
    assert plan.skip_reason(t, where, "core/ReplaceComparisonOperator_Lt_GtE", (10, 49)) == \
        "outside the target's functions"
    assert plan.skip_reason(t, where, "core/ReplaceBinaryOperator_Add_LShift", (15, 20)) == \
        "operator not in the kept set"
    whole = plan.Target("m.py", ("t.py",))
    assert plan.skip_reason(whole, where, "core/ReplaceComparisonOperator_Lt_GtE", (10, 49)) is None
    assert plan.skip_reason(whole, where, "core/ReplaceBinaryOperator_BitOr_BitAnd", (8, 33)) == "in a type annotation"


def test_a_dotted_name_in_an_except_tuple_is_not_run() -> None:
    """cosmic-ray cannot replace `subprocess.TimeoutExpired` in `except (OSError, subprocess.TimeoutExpired)`:
    the run would count an error. The plain name beside it and a lone dotted name are still run."""
    where = plan.ModuleMap("try:\n    f()\nexcept (OSError, subprocess.TimeoutExpired):\n    pass\n"
                           "try:\n    f()\nexcept subprocess.CalledProcessError:\n    pass\n")
    whole = plan.Target("m.py", ("t.py",))
    assert plan.skip_reason(whole, where, "core/ExceptionReplacer", (3, 17)) == \
        "a dotted name in an except tuple, which cosmic-ray cannot replace"
    assert plan.skip_reason(whole, where, "core/ExceptionReplacer", (3, 8)) is None  # OSError
    assert plan.skip_reason(whole, where, "core/ExceptionReplacer", (7, 7)) is None
    assert plan.skip_reason(whole, where, "core/NumberReplacer", (3, 17)) is None


def test_a_survivor_is_keyed_by_its_line_text() -> None:
    diff = ("--- mutation diff ---\n--- a/m.py\n+++ b/m.py\n@@ -1,3 +1,3 @@\n x = 1\n"
            "-    if a == b:\n+    if a != b:\n     pass\n")
    assert plan.diff_lines(diff) == ("if a == b:", "if a != b:")
    removed = "--- mutation diff ---\n--- a/m.py\n+++ b/m.py\n@@ -1,3 +1,1 @@\n-\n-@dataclass\n class A:\n"
    assert plan.diff_lines(removed) == ("@dataclass", "(deleted)")
