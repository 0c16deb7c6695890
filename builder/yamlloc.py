"""YAML with source positions.

PyYAML's composer keeps a line and column for every node; this module turns a
document into plain Python values plus a table of where each value came from,
so that every later error can say ``images.yaml:14:12``. It also rejects the
things plain ``yaml.safe_load`` silently accepts, such as duplicate keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Path_ = tuple[str | int, ...]


@dataclass(frozen=True, order=True)
class Loc:
    """A position in a file; line and column are 1-based, as editors show them."""

    file: str
    line: int = 0
    col: int = 0

    def __str__(self) -> str:
        if self.line <= 0:
            return self.file
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True, order=True)
class Problem:
    """One thing wrong with an input, with where it is and what would be right."""

    loc: Loc
    message: str

    def __str__(self) -> str:
        return f"{self.loc}: {self.message}"


class ProblemsError(Exception):
    """Raised with every problem found, never just the first."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = tuple(sorted(set(problems)))
        super().__init__("\n".join(str(p) for p in self.problems))


@dataclass(frozen=True)
class Located:
    """A loaded document: the plain value and where each part of it came from."""

    value: Any
    file: str
    _keys: dict[Path_, Loc]
    _values: dict[Path_, Loc]

    def at(self, path: Path_) -> Loc:
        """Where the value at ``path`` starts (falls back to the nearest parent)."""
        while path not in self._values and path:
            path = path[:-1]
        return self._values.get(path, Loc(self.file, 1, 1))

    def key_at(self, path: Path_) -> Loc:
        """Where the key of the mapping entry at ``path`` is written."""
        return self._keys.get(path) or self.at(path)


def read_text(path: Path, display: str) -> str:
    """Read a config file as UTF-8, turning every OS-level failure into a Problem."""
    loc = Loc(display)
    if not path.exists():
        raise ProblemsError([Problem(loc, "file not found; pass an existing file with --config PATH")])
    if path.is_dir():
        raise ProblemsError(
            [Problem(loc, "is a directory, not a file; pass the YAML file itself, e.g. --config images.yaml")]
        )
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ProblemsError([Problem(loc, f"cannot be read: {exc.strerror}")]) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ProblemsError(
            [Problem(Loc(display, line, col),
                     f"is not valid UTF-8 (byte 0x{raw[exc.start]:02x}); save the file as UTF-8")]
        ) from None


def load(text: str, display: str) -> Located:
    """Parse one YAML document, keeping positions; malformed YAML becomes a Problem."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        loc = Loc(display, mark.line + 1, mark.column + 1) if mark else Loc(display)
        what = exc.problem or "malformed YAML"
        raise ProblemsError([Problem(loc, f"malformed YAML: {what}")]) from None
    except yaml.YAMLError as exc:
        raise ProblemsError([Problem(Loc(display), f"malformed YAML: {exc}")]) from None
    keys: dict[Path_, Loc] = {}
    values: dict[Path_, Loc] = {}
    problems: list[Problem] = []
    constructor = yaml.SafeLoader("")  # builds scalars exactly as safe_load would

    def loc_of(n: yaml.Node) -> Loc:
        return Loc(display, n.start_mark.line + 1, n.start_mark.column + 1)

    def convert(n: yaml.Node, path: Path_) -> Any:
        values[path] = loc_of(n)
        if isinstance(n, yaml.MappingNode):
            out: dict[Any, Any] = {}
            for k_node, v_node in n.value:
                key = convert(k_node, (*path, "<key>"))
                if not isinstance(key, str):
                    problems.append(Problem(loc_of(k_node), f"keys must be text, got {key!r}"))
                    continue
                if key in out:
                    first = keys[(*path, key)]
                    problems.append(
                        Problem(loc_of(k_node), f"duplicate key {key!r} (first at line {first.line}); keep one")
                    )
                    continue
                keys[(*path, key)] = loc_of(k_node)
                out[key] = convert(v_node, (*path, key))
            values.pop((*path, "<key>"), None)
            return out
        if isinstance(n, yaml.SequenceNode):
            return [convert(item, (*path, i)) for i, item in enumerate(n.value)]
        return constructor.construct_object(n, deep=True)

    try:
        value = convert(node, ()) if node is not None else None
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark
        loc = Loc(display, mark.line + 1, mark.column + 1) if mark else Loc(display)
        raise ProblemsError([Problem(loc, f"malformed YAML: {exc.problem}")]) from None
    finally:
        constructor.dispose()
    if problems:
        raise ProblemsError(problems)
    return Located(value, display, keys, values)

