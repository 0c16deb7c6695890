"""The field-level checks of compat_data.yaml: each value parsed and checked where it is, every
problem collected with its line (builder.matrix.compat_load builds the tables from these)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from builder.common.versions import Version
from builder.common.yamlpos import PosDict

_RE_RELEASE = re.compile(r"\d+\.\d+\.\d+")
_RE_CUDA = re.compile(r"\d+\.\d+")
_RE_CUDA_MAJOR = re.compile(r"\d+")
_RE_PIP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?")
_RE_PYTHON = re.compile(r"3\.\d+")
_RE_CUDNN = re.compile(r"\d+\.\d+\.\d+\.\d+")
_RE_DRIVER = re.compile(r"\d+(\.\d+)*")
_RE_ARCH = re.compile(r"(sm|compute)_\d+[af]?")
_RE_SPECIFIER = re.compile(r"(~=|==|!=|<=|>=|<|>)\s*\d+(\.\d+)*(\s*,\s*(~=|==|!=|<=|>=|<|>)\s*\d+(\.\d+)*)*")


class _Errors:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.items: list[str] = []

    def add(self, line: int | None, where: str, msg: str) -> None:
        loc = f"{self.path}:{line}" if line else str(self.path)
        self.items.append(f"{loc}: {where}: {msg}" if where else f"{loc}: {msg}")


def _at(obj: object, key: object) -> int | None:
    """Line of ``key`` inside a loaded mapping (None if obj is not one)."""
    return obj.at(key) if isinstance(obj, PosDict) else None


def _mapping(errors: _Errors, obj: object, where: str, line: int | None) -> PosDict | None:
    if isinstance(obj, PosDict):
        return obj
    errors.add(line, where, f"must be a mapping, got {type(obj).__name__}")
    return None


def _check_keys(errors: _Errors, data: PosDict, where: str, allowed: frozenset[str],
                optional: frozenset[str] = frozenset()) -> bool:
    """Every key known, and every key of ``allowed`` but the ``optional`` ones present."""
    ok = True
    allowed = allowed | optional
    for key in data:
        if key not in allowed:
            hint = difflib.get_close_matches(str(key), sorted(allowed), n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else f" (allowed: {', '.join(sorted(allowed))})"
            errors.add(data.at(key), where, f"unknown key {key!r}{extra}")
    for key in sorted(allowed - optional - data.keys()):
        errors.add(data.line, where, f"missing key {key!r}")
        ok = False
    return ok


def _string(
    errors: _Errors,
    value: object,
    where: str,
    line: int | None,
    pattern: re.Pattern[str] | None = None,
    *,
    nullable: bool = False,
    example: str = "",
) -> str | None:
    if value is None:
        if not nullable:
            errors.add(line, where, "must not be null")
        return None
    if not isinstance(value, str):
        hint = f" (quote it: '{value}')" if isinstance(value, (int, float)) else ""
        errors.add(line, where, f"must be a quoted string, got {type(value).__name__} {value!r}{hint}")
        return None
    if pattern is not None and not pattern.fullmatch(value):
        errors.add(line, where, f"malformed value {value!r}" + (f" (expected like {example!r})" if example else ""))
        return None
    return value


def _field(
    errors: _Errors,
    data: PosDict,
    key: str,
    where: str,
    pattern: re.Pattern[str] | None = None,
    *,
    nullable: bool = False,
    example: str = "",
) -> str | None:
    """``data[key]`` as a checked string, reported as ``where.key`` at the key's line."""
    return _string(errors, data[key], f"{where}.{key}", data.at(key), pattern, nullable=nullable, example=example)


def _neighbours(errors: _Errors, data: PosDict, where: str) -> tuple[str, ...] | None:
    """``neighbours: {numpy: '<2', ...}`` as sorted requirement strings (None after an error)."""
    w = f"{where}.neighbours"
    table = _mapping(errors, data["neighbours"], w, data.at("neighbours"))
    if table is None:
        return None
    out: list[str] = []
    for name, spec in table.items():
        line = table.at(name)
        n = _key_ok(errors, name, where=w, line=line, pattern=_RE_PIP_NAME, example="numpy")
        s = _string(errors, spec, f"{w}[{name!r}]", line, _RE_SPECIFIER, example="<2")
        if n is None or s is None:
            return None
        out.append(f"{n}{s.replace(' ', '')}")
    return tuple(sorted(out))


def _key_ok(
    errors: _Errors, key: object, *, where: str, line: int | None, pattern: re.Pattern[str], example: str
) -> str | None:
    return _string(errors, key, f"{where}: key", line, pattern, example=example)


def _arch_list(errors: _Errors, data: PosDict, key: str, where: str) -> list[str]:
    """A non-empty list of CUDA targets (``[sm_80, sm_90, compute_90]``) at ``data[key]``."""
    raw, line = data[key], data.at(key)
    arch: list[str] = []
    if not isinstance(raw, list) or not raw:
        errors.add(line, f"{where}.{key}", "must be a non-empty list like [sm_80, sm_90]")
        return arch
    for a in raw:
        s = _string(errors, a, f"{where}.{key}", line, _RE_ARCH, example="sm_90")
        if s is not None:
            if s in arch:
                errors.add(line, f"{where}.{key}", f"duplicate {s!r}")
            arch.append(s)
    return arch


def _python_list(errors: _Errors, data: PosDict, key: str, where: str, *, allow_empty: bool = False) -> list[str]:
    """An ascending list of CPython minors (``['3.10', '3.11']``) at ``data[key]``."""
    out: list[str] = []
    raw = data[key]
    if not isinstance(raw, list) or (not raw and not allow_empty):
        errors.add(data.at(key), f"{where}.{key}", "must be a non-empty list like ['3.10', '3.11']")
        return out
    for p in raw:
        s = _string(errors, p, f"{where}.{key}", data.at(key), _RE_PYTHON, example="3.11")
        if s is not None:
            out.append(s)
    if len(set(out)) != len(out) or out != sorted(out, key=Version.parse):
        errors.add(data.at(key), f"{where}.{key}", "must be ascending without duplicates")
    return out
