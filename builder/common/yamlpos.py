"""YAML with source positions: the one loader for images.yaml and the compatibility data.

PyYAML's composer keeps a line and column for every node; :func:`load` turns a document
into plain Python values plus a table of where each value came from, so that every later
error can say ``images.yaml:14:12``. It also refuses what plain ``yaml.safe_load``
silently accepts or chokes on, each as a located :class:`Problem`:

- duplicate keys, keys that are not text;
- control characters in any text value (a newline in a package name would reach a
  Dockerfile or a shell script);
- an alias that contains itself, and aliases that expand to more than ``max_nodes``
  values ("billion laughs"), so time and memory stay bounded;
- files over ``max_bytes``.

Merge keys (``<<: *anchor``) are supported: merged keys come first, explicit ones win.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from builder.common.errors import InputError

Path_ = tuple[str | int, ...]
MAX_BYTES = 1 << 20  # a matrix file is a few KB; 1 MiB is generous
MAX_NODES = 100_000  # values after alias expansion
_MERGE_TAG = "tag:yaml.org,2002:merge"


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


class ProblemsError(InputError):
    """Raised with every problem found, never just the first (exit 2)."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = tuple(sorted(set(problems)))
        n = len(self.problems)
        summary = [f"{n} problems found; nothing was rendered or built."] if n > 1 else []
        super().__init__(*(str(p) for p in self.problems), *summary)


class PosDict(dict[str, Any]):
    """A mapping from the file that remembers where it and each of its keys are."""

    __slots__ = ("key_locs", "loc")
    loc: Loc
    key_locs: dict[str, Loc]

    @property
    def line(self) -> int:
        return self.loc.line

    def at(self, key: object) -> int:
        """The line of ``key`` (for a merged key: where the anchor wrote it)."""
        found = self.key_locs.get(key) if isinstance(key, str) else None
        return (found or self.loc).line


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


def read_text(path: Path, display: str, max_bytes: int = MAX_BYTES,
              missing: str = "pass an existing file with --config PATH") -> str:
    """Read a config file as UTF-8, turning every OS-level failure into a Problem."""
    loc = Loc(display)
    if not path.exists():
        raise ProblemsError([Problem(loc, f"file not found; {missing}")])
    if path.is_dir():
        raise ProblemsError(
            [Problem(loc, "is a directory, not a file; pass the YAML file itself, e.g. --config images.yaml")]
        )
    try:
        with path.open("rb") as fh:
            raw = fh.read(max_bytes + 1)
    except OSError as exc:
        raise ProblemsError([Problem(loc, f"cannot be read: {exc.strerror}")]) from None
    if len(raw) > max_bytes:
        raise ProblemsError([Problem(loc, f"is larger than {max_bytes // 1024} KiB; a matrix file is a few KB: "
                                          "pass the right file")])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ProblemsError(
            [Problem(Loc(display, line, col),
                     f"is not valid UTF-8 (byte 0x{raw[exc.start]:02x}); save the file as UTF-8")]
        ) from None


def control_character(text: str) -> str | None:
    """The first control character in ``text`` as ``U+000A``, or None."""
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            return f"U+{ord(ch):04X}"
    return None


class _Converter:
    """Node graph -> plain values with positions, bounded in depth and size."""

    def __init__(self, display: str, max_nodes: int) -> None:
        self.display = display
        self.max_nodes = max_nodes
        self.nodes = 0
        self.keys: dict[Path_, Loc] = {}
        self.values: dict[Path_, Loc] = {}
        self.problems: list[Problem] = []
        self.active: set[int] = set()  # ids of the collection nodes being converted (alias cycles)
        self.constructor = yaml.SafeLoader("")  # builds scalars exactly as safe_load would

    def loc(self, n: yaml.Node) -> Loc:
        return Loc(self.display, n.start_mark.line + 1, n.start_mark.column + 1)

    def convert(self, n: yaml.Node, path: Path_, record: bool = True) -> Any:
        self.nodes += 1
        if self.nodes > self.max_nodes:
            raise _TooBig(self.loc(n))
        if record:
            self.values[path] = self.loc(n)
        if isinstance(n, yaml.ScalarNode):
            value = self.constructor.construct_object(n, deep=True)
            if isinstance(value, str) and (bad := control_character(value)):
                self.problems.append(Problem(self.loc(n), f"text contains a control character ({bad}); "
                                             "values are one line of printable text"))
            return value
        if id(n) in self.active:
            raise _Recursive(self.loc(n))
        self.active.add(id(n))
        try:
            if isinstance(n, yaml.SequenceNode):
                return [self.convert(item, (*path, i), record) for i, item in enumerate(n.value)]
            return self.mapping(n, path, record)
        finally:
            self.active.discard(id(n))

    def mapping(self, n: yaml.Node, path: Path_, record: bool) -> PosDict:
        out = PosDict()
        out.loc = self.loc(n)
        out.key_locs = {}
        explicit: set[str] = set()
        for k_node, v_node in n.value:
            if k_node.tag == _MERGE_TAG:
                sources = v_node.value if isinstance(v_node, yaml.SequenceNode) else [v_node]
                for src in sources:
                    merged = self.convert(src, (*path, "<merge>"), record=False)
                    if not isinstance(merged, PosDict):
                        self.problems.append(Problem(self.loc(src), "a merge (<<) needs a mapping"))
                        continue
                    for key, value in merged.items():
                        if key not in explicit:
                            out[key] = value
                            out.key_locs[key] = merged.key_locs.get(key, merged.loc)
                            if record:
                                self.keys[(*path, key)] = out.key_locs[key]
                continue
            key = self.convert(k_node, (*path, "<key>"), record=False)
            if not isinstance(key, str):
                self.problems.append(Problem(self.loc(k_node), f"keys must be text, got {key!r}"))
                continue
            if key in explicit:
                first = out.key_locs[key]
                self.problems.append(Problem(self.loc(k_node),
                                             f"duplicate key {key!r} (first at line {first.line}); keep one"))
                continue
            explicit.add(key)
            out.key_locs[key] = self.loc(k_node)
            if record:
                self.keys[(*path, key)] = self.loc(k_node)
            out[key] = self.convert(v_node, (*path, key), record)
        return out


class _TooBig(Exception):
    def __init__(self, loc: Loc) -> None:
        self.loc = loc


class _Recursive(Exception):
    def __init__(self, loc: Loc) -> None:
        self.loc = loc


def load(text: str, display: str, max_nodes: int = MAX_NODES) -> Located:
    """Parse one YAML document, keeping positions; anything wrong becomes a located Problem."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        loc = Loc(display, mark.line + 1, mark.column + 1) if mark else Loc(display)
        raise ProblemsError([Problem(loc, f"malformed YAML: {exc.problem or 'malformed YAML'}")]) from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (NUL, most controls): unmarked
        line = text.count("\n", 0, exc.position) + 1
        col = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        raise ProblemsError([Problem(Loc(display, line, col), f"malformed YAML: character U+{exc.character:04X} "
                                     "is not allowed in YAML; is this the right file?")]) from None
    except yaml.YAMLError as exc:
        raise ProblemsError([Problem(Loc(display), f"malformed YAML: {exc}")]) from None
    conv = _Converter(display, max_nodes)
    try:
        value = conv.convert(node, ()) if node is not None else None
    except _Recursive as exc:
        raise ProblemsError([Problem(exc.loc, "an alias refers to the collection it is in (a recursive "
                                     "alias); write the values out instead")]) from None
    except _TooBig as exc:
        raise ProblemsError([Problem(exc.loc, f"the document expands to more than {max_nodes} values "
                                     "(nested aliases?); write the values out instead")]) from None
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark
        loc = Loc(display, mark.line + 1, mark.column + 1) if mark else Loc(display)
        raise ProblemsError([Problem(loc, f"malformed YAML: {exc.problem}")]) from None
    finally:
        conv.constructor.dispose()
    if conv.problems:
        raise ProblemsError(conv.problems)
    return Located(value, display, conv.keys, conv.values)
