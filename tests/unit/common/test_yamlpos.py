"""builder/common/yamlpos.py directly, in process: hostile or broken YAML is refused with its
position, and values keep theirs. (tests/unit/project/test_exit_codes.py drives the same refusals
through build.py, exit code and all; these are the fast checks `make mutants` runs.)"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from builder.common import yamlpos
from builder.common.yamlpos import Loc, ProblemsError


def refused(text: str, max_nodes: int = yamlpos.MAX_NODES) -> list[str]:
    with pytest.raises(ProblemsError) as exc:
        yamlpos.load(text, "m.yaml", max_nodes)
    return [str(p) for p in exc.value.problems]


def test_a_recursive_alias_is_refused_where_it_is() -> None:
    assert refused("include: &x [*x]\n") == [
        "m.yaml:1:10: an alias refers to the collection it is in (a recursive alias); write the values out instead"]


def test_aliases_that_expand_past_the_bound_are_refused() -> None:
    text = 'a: &a ["lol", "lol", "lol"]\n'
    for prev, cur in itertools.pairwise("abcd"):
        text += f"{cur}: &{cur} [{', '.join([f'*{prev}'] * 3)}]\n"
    [problem] = refused(text, max_nodes=50)
    assert problem.startswith("m.yaml:") and "expands to more than 50 values" in problem
    # Exactly at the bound is fine: a mapping, 3 keys' values... counted node by node.
    small = "a: [1, 2]\n"  # mapping + key + sequence + 2 items = 5 nodes
    assert yamlpos.load(small, "m.yaml", max_nodes=5).value == {"a": [1, 2]}
    assert refused(small, max_nodes=4)[0].startswith("m.yaml:")


@pytest.mark.parametrize(("text", "where", "says"), [
    ("a: [1, 2\n", "m.yaml:2:1:", "malformed YAML"),
    ("a: 1\nb: \x00\n", "m.yaml:2:4:", "character U+0000 is not allowed in YAML"),
    ("a: 1\n  b: 2\n", "m.yaml:2:4:", "malformed YAML"),
    ("a: !!python/object:os.system x\n", "m.yaml:1:4:", "malformed YAML"),
    ("\nb: \x00\n", "m.yaml:2:4:", "character U+0000"),  # after a leading empty line
])
def test_malformed_yaml_is_located(text: str, where: str, says: str) -> None:
    [problem] = refused(text)
    assert problem.startswith(where) and says in problem, problem


def test_a_control_character_in_any_text_value_is_refused() -> None:
    problems = refused('a: "ok"\nb: "x\\ny"\nc: ["fine", "tab\\there"]\nd: "\\u200b"\n')
    assert problems == [
        "m.yaml:2:4: text contains a control character (U+000A); values are one line of printable text",
        "m.yaml:3:13: text contains a control character (U+0009); values are one line of printable text",
        "m.yaml:4:4: text contains a control character (U+200B); values are one line of printable text"]
    assert yamlpos.control_character("plain text") is None
    assert yamlpos.control_character("a\u2028b") == "U+2028"


def test_keys_must_be_text_and_unique_and_every_one_is_reported() -> None:
    problems = refused("a: 1\n1: 2\na: 3\nb: 4\nb: 5\n")
    assert problems == ["m.yaml:2:1: keys must be text, got 1",
                        "m.yaml:3:1: duplicate key 'a' (first at line 1); keep one",
                        "m.yaml:5:1: duplicate key 'b' (first at line 4); keep one"]


def test_values_and_keys_keep_their_positions() -> None:
    doc = yamlpos.load("top:\n  list:\n    - x\n    - {k: v}\nother: 2\n", "m.yaml")
    assert doc.value == {"top": {"list": ["x", {"k": "v"}]}, "other": 2}
    assert doc.at(("top", "list", 1, "k")) == Loc("m.yaml", 4, 11)
    assert doc.at(("top", "list", 1, "absent", "deeper")) == Loc("m.yaml", 4, 7)  # the nearest parent
    assert doc.at(("top", "list", 1, "absent")) == Loc("m.yaml", 4, 7)
    assert doc.at(("nothing",)) == Loc("m.yaml", 1, 1)
    assert yamlpos.load("", "m.yaml").at(("a",)) == Loc("m.yaml", 1, 1)  # an empty file: its start
    assert doc.key_at(("other",)) == Loc("m.yaml", 5, 1)
    assert doc.key_at(("top", "list", 0)) == Loc("m.yaml", 3, 7)  # a list item has no key: its value
    top = doc.value["top"]
    assert top.line == 2 and top.at("list") == 2 and top.at("missing") == 2 and top.at(3) == 2


def test_merge_keys_come_first_and_explicit_ones_win() -> None:
    doc = yamlpos.load("base: &b {x: 1, y: 2}\nc:\n  <<: *b\n  y: 3\n", "m.yaml")
    assert doc.value["c"] == {"x": 1, "y": 3}
    assert doc.value["c"].at("x") == 1  # a merged key: where the anchor wrote it
    assert doc.key_at(("c", "x")) == Loc("m.yaml", 1, 11)
    assert ("c", "<merge>") not in doc._values and ("c", "<key>") not in doc._values
    assert refused("c:\n  <<: [1]\n") == ["m.yaml:2:8: a merge (<<) needs a mapping"]


def test_an_empty_document_is_none() -> None:
    assert yamlpos.load("", "m.yaml").value is None


def test_read_text_refuses_what_is_not_a_small_utf8_file(tmp_path: Path) -> None:
    f = tmp_path / "m.yaml"
    f.write_bytes(b"a: 1\nb: caf\xe9\n")
    with pytest.raises(ProblemsError, match=r"m\.yaml:2:7: is not valid UTF-8 \(byte 0xe9\)"):
        yamlpos.read_text(f, "m.yaml")
    f.write_bytes(b"\nb: caf\xe9\n")
    with pytest.raises(ProblemsError, match=r"m\.yaml:2:7: is not valid UTF-8"):
        yamlpos.read_text(f, "m.yaml")
    f.write_bytes(b"x" * 2048)
    assert yamlpos.read_text(f, "m.yaml", max_bytes=2048) == "x" * 2048  # exactly the limit is fine
    with pytest.raises(ProblemsError, match=r"^m\.yaml: is larger than 1 KiB; a matrix file is a few KB"):
        yamlpos.read_text(f, "m.yaml", max_bytes=2047)
    f.write_bytes(b"x" * 2049)
    with pytest.raises(ProblemsError, match=r"^m\.yaml: is larger than 2 KiB"):
        yamlpos.read_text(f, "m.yaml", max_bytes=2048)
    with pytest.raises(ProblemsError, match="file not found"):
        yamlpos.read_text(tmp_path / "absent.yaml", "absent.yaml")
    with pytest.raises(ProblemsError, match="is a directory"):
        yamlpos.read_text(tmp_path, "dir")
    assert yamlpos.MAX_BYTES == 1 << 20 and yamlpos.MAX_NODES == 100_000  # the documented bounds


def test_a_file_that_cannot_be_read_is_a_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "m.yaml"
    f.write_text("a: 1\n")

    def refuse(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "open", refuse)
    with pytest.raises(ProblemsError, match=r"^m\.yaml: cannot be read: Permission denied"):
        yamlpos.read_text(f, "m.yaml")


def test_several_problems_come_with_a_count() -> None:
    with pytest.raises(ProblemsError) as exc:
        yamlpos.load("a: 1\na: 2\nb: 1\nb: 2\n", "m.yaml")
    assert exc.value.lines[-1] == "2 problems found; nothing was rendered or built."
    with pytest.raises(ProblemsError) as one:
        yamlpos.load("a: 1\na: 2\n", "m.yaml")
    assert not one.value.lines[-1].endswith("nothing was rendered or built.")
