"""The matrix's shape: ``defaults`` x ``axes``, minus ``exclude``, plus ``include``; and
``--only``/``--exclude`` selection of cells."""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from builder.common.yamlpos import Loc, Path_, Problem, ProblemsError
from builder.matrix.model import CELL_KEYS, ImageSpec


class Checker(Protocol):
    """What expanding asks of the validator (:class:`builder.matrix.validate.Checker`): it reports
    located problems and type-checks a cell's fields. Named here, so expand does not import validate."""

    def err(self, path: Path_, message: str, *, key: bool = False) -> None: ...

    def mapping(self, value: Any, path: Path_, what: str) -> dict[str, Any] | None: ...

    def unknown_keys(self, m: Mapping[str, Any], allowed: Sequence[str], path: Path_, where: str) -> None: ...

    def cell_fields(self, m: Mapping[str, Any], path: Path_) -> dict[str, Any]: ...

Cell = tuple[dict[str, Any], dict[str, Path_], Path_]


def expand(checker: Checker, top: Mapping[str, Any]) -> list[tuple[dict[str, Any], dict[str, Path_], Path_]]:
    """axes x defaults, minus exclude, plus include -> (fields, where each field came from, cell path)."""
    defaults: dict[str, Any] = {}
    origin: dict[str, Path_] = {}
    if "defaults" in top:
        d = checker.mapping(top["defaults"], ("defaults",), "defaults")
        if d is not None:
            defaults = checker.cell_fields(d, ("defaults",))
            origin = {k: ("defaults", k) for k in defaults}

    cells: list[tuple[dict[str, Any], dict[str, Path_], Path_]] = []
    axes = checker.mapping(top["axes"], ("axes",), "axes") if "axes" in top else None
    if axes:
        names: list[str] = []
        lists: list[list[tuple[Any, Path_]]] = []
        checker.unknown_keys(axes, CELL_KEYS, ("axes",), "axes")
        for k, v in axes.items():
            if k not in CELL_KEYS:
                continue
            if not isinstance(v, list) or not v:
                checker.err(("axes", k), f"axis {k} must be a non-empty list of values, e.g. {k}: [a, b]")
                continue
            typed: list[tuple[Any, Path_]] = []
            for i, item in enumerate(v):
                f = checker.cell_fields({k: item}, ("axes", k, i))
                if k in f:
                    typed.append((f[k], ("axes", k, i)))
            names.append(k)
            lists.append(typed)
        for combo in itertools.product(*lists):
            fields = dict(defaults)
            where = dict(origin)
            for k, (val, p) in zip(names, combo, strict=True):
                fields[k] = val
                where[k] = p
            cells.append((fields, where, ("axes",)))

    if "exclude" in top:
        ex = top["exclude"]
        if not isinstance(ex, list):
            checker.err(("exclude",),
                        "exclude must be a list of partial cells, e.g. - {torch: \"2.0.1\", cuda: \"11.8\"}")
        else:
            for i, item in enumerate(ex):
                m = checker.mapping(item, ("exclude", i), "an exclude entry")
                if m is None:
                    continue
                f = checker.cell_fields(m, ("exclude", i))
                before = len(cells)
                cells = [c for c in cells if not all(c[0].get(k) == v for k, v in f.items())]
                if len(cells) == before and f:
                    checker.err(("exclude", i), f"exclude entry {f} matches no cell of the axes; "
                                "remove it or fix its values")

    if "include" in top:
        inc = top["include"]
        if not isinstance(inc, list):
            checker.err(("include",), "include must be a list of cells, e.g. - {torch: \"2.7.0\", cuda: \"12.6\"}")
        else:
            for i, item in enumerate(inc):
                m = checker.mapping(item, ("include", i), "an include entry")
                if m is None:
                    continue
                f = checker.cell_fields(m, ("include", i))
                if not m:
                    checker.err(("include", i), "include entry is empty; give at least torch: \"X.Y.Z\"")
                    continue
                fields = {**defaults, **f}
                where = {**origin, **{k: ("include", i, k) for k in f}}
                cells.append((fields, where, ("include", i)))
    return cells



def select(cells: Sequence[ImageSpec], only: Sequence[str] = (), exclude: Sequence[str] = ()) -> tuple[ImageSpec, ...]:
    """Filter cells by glob patterns on the cell name; a pattern that matches nothing is an error."""
    problems = []
    names = [c.name for c in cells]
    for flag, pats in (("--only", only), ("--exclude", exclude)):
        for p in pats:
            if not any(fnmatch.fnmatchcase(n, p) for n in names):
                problems.append(
                    Problem(Loc("command line"), f"{flag} {p!r} matches no cell; cells: {', '.join(names)}"))
    if problems:
        raise ProblemsError(problems)
    chosen = [c for c in cells if not only or any(fnmatch.fnmatchcase(c.name, p) for p in only)]
    return tuple(c for c in chosen if not any(fnmatch.fnmatchcase(c.name, p) for p in exclude))

