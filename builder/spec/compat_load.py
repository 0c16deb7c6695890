"""Load and validate ``compat_data.yaml`` into :class:`builder.spec.compat.Compat`.

Every problem is reported at once, each with ``file:line``, the entry it concerns and,
for unknown keys, a suggestion. Read through the one YAML-with-positions loader
(:mod:`builder.common.yamlpos`), which also handles the file's ``<<: *anchor`` merges.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from builder.common.versions import Version
from builder.common.yamlpos import PosDict, ProblemsError, load, read_text
from builder.spec.compat import (
    DATA_FILE,
    INDEX_URL,
    PYPI_SOURCE,
    Compat,
    CompatDataError,
    CudaVariant,
    FrozenMap,
    TorchRelease,
)


def load_compat(path: Path | None = None) -> Compat:
    """Load and validate the compatibility data (default: ``DATA_FILE``).

    Results are cached per resolved path; the returned object is immutable.
    Raises CompatDataError listing every problem found.
    """
    return _load_cached((DATA_FILE if path is None else Path(path)).resolve())


@functools.lru_cache(maxsize=8)
def _load_cached(path: Path) -> Compat:
    try:
        raw = load(read_text(path, str(path), missing="the compatibility data ships with the builder"), str(path)).value
    except ProblemsError as exc:
        raise CompatDataError(path, [str(p) for p in exc.problems]) from None
    errors = _Errors(path)
    compat = _build(raw, errors)
    if errors.items or compat is None:
        raise CompatDataError(path, errors.items or [f"{path}: no data"])
    return compat


# --------------------------------------------------------------------------
# Validation and conversion
# --------------------------------------------------------------------------

_RE_RELEASE = re.compile(r"\d+\.\d+\.\d+")
_RE_CUDA = re.compile(r"\d+\.\d+")
_RE_CUDA_MAJOR = re.compile(r"\d+")
_RE_PIP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?")
_RE_PYTHON = re.compile(r"3\.\d+")
_RE_CUDNN = re.compile(r"\d+\.\d+\.\d+\.\d+")
_RE_DRIVER = re.compile(r"\d+(\.\d+)*")
_RE_ARCH = re.compile(r"(sm|compute)_\d+[af]?")
_RE_NUMPY = re.compile(r"(~=|==|!=|<=|>=|<|>)\s*\d+(\.\d+)*(\s*,\s*(~=|==|!=|<=|>=|<|>)\s*\d+(\.\d+)*)*")

_TOP_KEYS = frozenset({"min_driver", "devel_toolkit", "releases"})
_DRIVER_KEYS = frozenset({"minor_compat_floor", "cuda"})
_DRIVER_CUDA_KEYS = frozenset({"min_driver", "min_driver_full"})
_RELEASE_KEYS = frozenset({"python", "torchvision", "torchaudio", "default_cuda", "aarch64_cuda", "compile_python",
                           "numpy", "variants"})
_VARIANT_KEYS = frozenset({"cuda_full", "cudnn", "nccl", "source", "arch_list"})


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


def _check_keys(errors: _Errors, data: PosDict, where: str, allowed: frozenset[str]) -> bool:
    ok = True
    for key in data:
        if key not in allowed:
            hint = difflib.get_close_matches(str(key), sorted(allowed), n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else f" (allowed: {', '.join(sorted(allowed))})"
            errors.add(data.at(key), where, f"unknown key {key!r}{extra}")
    for key in sorted(allowed - data.keys()):
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


def _key_ok(
    errors: _Errors, key: object, *, where: str, line: int | None, pattern: re.Pattern[str], example: str
) -> str | None:
    return _string(errors, key, f"{where}: key", line, pattern, example=example)


@dataclass(frozen=True)
class _DriverRow:
    min_driver: str
    full: Mapping[str, str]


def _build_drivers(errors: _Errors, obj: object, line: int) -> dict[str, _DriverRow]:
    where = "min_driver"
    data = _mapping(errors, obj, where, line)
    if data is None or not _check_keys(errors, data, where, _DRIVER_KEYS):
        return {}
    floors: dict[str, str] = {}
    fdata = _mapping(errors, data["minor_compat_floor"], f"{where}.minor_compat_floor", data.at("minor_compat_floor"))
    if fdata is not None:
        for major, drv in fdata.items():
            w = f"{where}.minor_compat_floor[{major!r}]"
            m = _key_ok(errors, major, where=w, line=fdata.at(major), pattern=_RE_CUDA_MAJOR, example="12")
            d = _string(errors, drv, w, fdata.at(major), _RE_DRIVER, example="525.60.13")
            if m is not None and d is not None:
                floors[m] = d
    rows: dict[str, _DriverRow] = {}
    cdata = _mapping(errors, data["cuda"], f"{where}.cuda", data.at("cuda"))
    if cdata is None:
        return rows
    for cuda, entry in cdata.items():
        w = f"{where}.cuda[{cuda!r}]"
        c = _key_ok(errors, cuda, where=w, line=cdata.at(cuda), pattern=_RE_CUDA, example="12.6")
        edata = _mapping(errors, entry, w, cdata.at(cuda))
        if c is None or edata is None or not _check_keys(errors, edata, w, _DRIVER_CUDA_KEYS):
            continue
        at_floor = edata.at("min_driver")
        floor_drv = _field(errors, edata, "min_driver", w, _RE_DRIVER, example="525.60.13")
        major = c.split(".")[0]
        if major not in floors:
            errors.add(edata.line, w, f"no minor_compat_floor for CUDA major {major!r}")
        elif floor_drv is not None and Version.parse(floor_drv) < Version.parse(floors[major]):
            errors.add(at_floor, f"{w}.min_driver", f"{floor_drv} is below the CUDA {major}.x floor {floors[major]}")
        full: dict[str, str] = {}
        fd = _mapping(errors, edata["min_driver_full"], f"{w}.min_driver_full", edata.at("min_driver_full"))
        if fd is not None:
            for tk, drv in fd.items():
                tw = f"{w}.min_driver_full[{tk!r}]"
                t = _key_ok(errors, tk, where=tw, line=fd.at(tk), pattern=_RE_RELEASE, example=f"{c}.0")
                d = _string(errors, drv, tw, fd.at(tk), _RE_DRIVER, example="560.35.05")
                if t is None or d is None:
                    continue
                if not t.startswith(c + "."):
                    errors.add(fd.at(tk), tw, f"toolkit {t} is not a CUDA {c} release")
                elif floor_drv is not None and Version.parse(d) < Version.parse(floor_drv):
                    errors.add(fd.at(tk), tw, f"{d} is below min_driver {floor_drv}")
                else:
                    full[t] = d
        if floor_drv is not None:
            rows[c] = _DriverRow(floor_drv, FrozenMap(full.items()))
    return rows


def _build_variant(
    errors: _Errors, cuda: str, obj: object, *, where: str, line: int | None, drivers: Mapping[str, _DriverRow]
) -> CudaVariant | None:
    data = _mapping(errors, obj, where, line)
    if data is None or not _check_keys(errors, data, where, _VARIANT_KEYS):
        return None
    at = data.at
    cuda_full = _field(errors, data, "cuda_full", where, _RE_RELEASE, example=f"{cuda}.0")
    cudnn = _field(errors, data, "cudnn", where, _RE_CUDNN, example="9.5.1.17")
    nccl = _field(errors, data, "nccl", where, _RE_RELEASE, nullable=True, example="2.26.2")
    source = _field(errors, data, "source", where)
    arch_raw = data["arch_list"]
    arch: list[str] = []
    if not isinstance(arch_raw, list) or not arch_raw:
        errors.add(at("arch_list"), f"{where}.arch_list", "must be a non-empty list like [sm_80, sm_90]")
    else:
        for a in arch_raw:
            s = _string(errors, a, f"{where}.arch_list", at("arch_list"), _RE_ARCH, example="sm_90")
            if s is not None:
                if s in arch:
                    errors.add(at("arch_list"), f"{where}.arch_list", f"duplicate {s!r}")
                arch.append(s)
    if cuda_full is not None and not cuda_full.startswith(cuda + "."):
        errors.add(at("cuda_full"), f"{where}.cuda_full", f"{cuda_full} is not a CUDA {cuda} toolkit")
        cuda_full = None
    expected_url = INDEX_URL.format(cuda.replace(".", ""))
    if source is not None and source not in (PYPI_SOURCE, expected_url):
        errors.add(at("source"), f"{where}.source", f"must be {PYPI_SOURCE!r} or {expected_url!r}, got {source!r}")
        source = None
    row = drivers.get(cuda)
    full_drv: str | None = None
    if row is None:
        errors.add(line, where, f"CUDA {cuda} has no entry in min_driver.cuda")
    elif cuda_full is not None:
        full_drv = row.full.get(cuda_full)
        if full_drv is None:
            table = f"min_driver.cuda[{cuda!r}].min_driver_full"
            errors.add(at("cuda_full"), f"{where}.cuda_full", f"toolkit {cuda_full} has no entry in {table}")
    if cuda_full is None or cudnn is None or source is None or row is None or full_drv is None or not arch:
        return None
    return CudaVariant(
        cuda=cuda,
        cuda_full=cuda_full,
        cudnn=cudnn,
        cudnn_major=int(cudnn.split(".")[0]),
        nccl=nccl,
        source=source,
        arch_list=tuple(arch),
        min_driver=row.min_driver,
        min_driver_full=full_drv,
    )


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


def _build_release(
    errors: _Errors, version: str, obj: object, *, line: int | None, drivers: Mapping[str, _DriverRow]
) -> TorchRelease | None:
    where = f"releases[{version!r}]"
    data = _mapping(errors, obj, where, line)
    if data is None or not _check_keys(errors, data, where, _RELEASE_KEYS):
        return None
    at = data.at
    python = _python_list(errors, data, "python", where)
    compile_python = _python_list(errors, data, "compile_python", where, allow_empty=True)
    if any(p not in python for p in compile_python):
        errors.add(at("compile_python"), f"{where}.compile_python",
                   f"{compile_python} lists a Python without wheels (python: {python})")
    tv = _field(errors, data, "torchvision", where, _RE_RELEASE, nullable=True, example="0.22.0")
    ta = _field(errors, data, "torchaudio", where, _RE_RELEASE, nullable=True, example="2.7.0")
    default = _field(errors, data, "default_cuda", where, _RE_CUDA, example="12.6")
    aarch64 = _field(errors, data, "aarch64_cuda", where, _RE_CUDA, nullable=True, example="13.0")
    numpy = _field(errors, data, "numpy", where, _RE_NUMPY, nullable=True, example="<2")
    variants: dict[str, CudaVariant] = {}
    vdata = _mapping(errors, data["variants"], f"{where}.variants", at("variants"))
    if vdata is not None:
        if not vdata:
            errors.add(vdata.line, f"{where}.variants", "must list at least one CUDA variant")
        for cuda, vobj in vdata.items():
            vw = f"{where}.variants[{cuda!r}]"
            c = _key_ok(errors, cuda, where=vw, line=vdata.at(cuda), pattern=_RE_CUDA, example="12.6")
            if c is None:
                continue
            variant = _build_variant(errors, c, vobj, where=vw, line=vdata.at(cuda), drivers=drivers)
            if variant is not None:
                variants[c] = variant
        if aarch64 is not None and aarch64 != default:
            errors.add(at("aarch64_cuda"), f"{where}.aarch64_cuda",
                       f"{aarch64!r} is not the PyPI variant {default!r} (PyPI has only one CUDA build per release)")
        if default is not None and default not in vdata:
            have = sorted(map(str, vdata))
            errors.add(at("default_cuda"), f"{where}.default_cuda", f"{default!r} is not among its variants {have}")
        for c, v in variants.items():
            if default is None:
                break
            sw, sline = f"{where}.variants[{c!r}].source", _at(vdata.get(c), "source")
            if v.from_pypi and c != default:
                errors.add(sline, sw, f"only the default_cuda variant ({default!r}) comes from PyPI")
            if not v.from_pypi and c == default:
                errors.add(sline, sw, f"the default_cuda variant must have source {PYPI_SOURCE!r}")
    if default is None or (numpy is None and data["numpy"] is not None) or not python or vdata is None:
        return None
    return TorchRelease(
        version=version,
        python=tuple(python),
        torchvision=tv,
        torchaudio=ta,
        default_cuda=default,
        aarch64_cuda=aarch64,
        compile_python=tuple(compile_python),
        numpy=numpy,
        variants=FrozenMap(sorted(variants.items(), key=lambda kv: Version.parse(kv[0]))),
    )


def _build(raw: object, errors: _Errors) -> Compat | None:
    top = _mapping(errors, raw, "top level", 1)
    if top is None or not _check_keys(errors, top, "top level", _TOP_KEYS):
        return None
    drivers = _build_drivers(errors, top["min_driver"], top.at("min_driver"))
    rdata = _mapping(errors, top["releases"], "releases", top.at("releases"))
    if rdata is None:
        return None
    releases: dict[str, TorchRelease] = {}
    for version, obj in rdata.items():
        v = _key_ok(errors, version, where="releases", line=rdata.at(version), pattern=_RE_RELEASE, example="2.7.0")
        if v is None:
            continue
        rel = _build_release(errors, v, obj, line=rdata.at(version), drivers=drivers)
        if rel is not None:
            releases[v] = rel
    paired: dict[str, str] = {}
    for v, rel in releases.items():
        if rel.torchvision is None:
            continue
        if rel.torchvision in paired:
            errors.add(
                _at(rdata.get(v), "torchvision"),
                f"releases[{v!r}].torchvision",
                f"{rel.torchvision} is already paired with torch {paired[rel.torchvision]}",
            )
        else:
            paired[rel.torchvision] = v
    return Compat(releases=FrozenMap(sorted(releases.items(), key=lambda kv: Version.parse(kv[0]))),
                  devel_toolkit=_build_devel(errors, top["devel_toolkit"], top.at("devel_toolkit")))


def _build_devel(errors: _Errors, obj: object, line: int | None) -> FrozenMap[str, str]:
    """``devel_toolkit``: CUDA major -> the pip requirement of that toolkit (no version)."""
    data = _mapping(errors, obj, "devel_toolkit", line)
    out: dict[str, str] = {}
    if data is None:
        return FrozenMap()
    for major, req in data.items():
        m = _key_ok(errors, major, where="devel_toolkit", line=data.at(major), pattern=_RE_CUDA_MAJOR, example="13")
        r = _string(errors, req, f"devel_toolkit[{major!r}]", data.at(major), _RE_PIP_NAME,
                    example="cuda-toolkit[cccl,cudart,nvcc]")
        if m is not None and r is not None:
            out[m] = r
    return FrozenMap(sorted(out.items()))

