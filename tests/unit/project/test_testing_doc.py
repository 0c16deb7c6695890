"""docs/testing.md names only tests that exist: every `file::test` (and `::test` after it on the
same line, which takes that file) is a test function of that file, and every `[case]` one of its
parametrised ids. A renamed or deleted test fails here, not silently in the doc."""

from __future__ import annotations

import ast
import functools
import re

import pytest

from tests.support import ROOT

DOC = ROOT / "docs" / "testing.md"
REF = re.compile(r"`((?:[\w/]+\.py)?)::(\w+)(?:\[([^\]]+)\])?`")


def references(text: str) -> list[tuple[str, str, str, int]]:
    """(file under tests/, function, case id or "", line number) for every reference."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        current = ""
        for m in REF.finditer(line):
            current = m.group(1) or current
            assert current, f"docs/testing.md:{number}: `::{m.group(2)}` names no file before it"
            found.append((current, m.group(2), m.group(3) or "", number))
    return found


@functools.cache
def _tests_of(path: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse((ROOT / "tests" / path).read_text(encoding="utf-8"))
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_test_the_doc_names_exists() -> None:
    # the claims' part: the mutation-testing section names source lines (its own test checks them)
    refs = references(DOC.read_text(encoding="utf-8").split("\n## Mutation testing\n", 1)[0])
    assert len(refs) > 100, "the doc names a test for each claim"
    missing = []
    for path, name, case, number in refs:
        if not (ROOT / "tests" / path).is_file():
            missing.append(f"docs/testing.md:{number}: no file tests/{path}")
        elif name not in _tests_of(path):
            missing.append(f"docs/testing.md:{number}: no test {name} in tests/{path}")
        elif case and case not in (ROOT / "tests" / path).read_text(encoding="utf-8"):
            missing.append(f"docs/testing.md:{number}: no case {case!r} of {name} in tests/{path}")
    assert missing == [], "\n".join(missing)


def test_the_reference_reader_takes_the_file_from_the_line() -> None:
    assert references("- x: `unit/a.py::test_b`, `::test_c[one]`\n- y: `docker/d.py::test_e`\n") == [
        ("unit/a.py", "test_b", "", 1), ("unit/a.py", "test_c", "one", 1), ("docker/d.py", "test_e", "", 2)]
    with pytest.raises(AssertionError, match="names no file"):
        references("- `::test_orphan`\n")
