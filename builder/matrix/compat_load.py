"""Load and validate ``compat_data.yaml`` into :class:`builder.matrix.compat.Compat`.

Every problem is reported at once, each with ``file:line``, the entry it concerns and,
for unknown keys, a suggestion. Read through the one YAML-with-positions loader
(:mod:`builder.common.yamlpos`), which also handles the file's ``<<: *anchor`` merges.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from builder.common.versions import Version
from builder.common.yamlpos import ProblemsError, load, read_text
from builder.matrix.compat import (
    DATA_FILE,
    INDEX_URL,
    PYPI_SOURCE,
    Compat,
    CompatDataError,
    CudaVariant,
    FrozenMap,
    TorchRelease,
)
from builder.matrix.compat_fields import (
    _RE_CUDA,
    _RE_CUDA_MAJOR,
    _RE_CUDNN,
    _RE_DRIVER,
    _RE_PIP_NAME,
    _RE_RELEASE,
    _arch_list,
    _at,
    _check_keys,
    _Errors,
    _field,
    _key_ok,
    _mapping,
    _neighbours,
    _python_list,
    _string,
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

_TOP_KEYS = frozenset({"min_driver", "devel_toolkit", "releases"})
_DRIVER_KEYS = frozenset({"minor_compat_floor", "cuda"})
_DRIVER_CUDA_KEYS = frozenset({"min_driver", "min_driver_full"})
_RELEASE_KEYS = frozenset({"python", "torchvision", "torchaudio", "default_cuda", "aarch64_cuda", "compile_python",
                           "neighbours", "variants"})
_VARIANT_KEYS = frozenset({"cuda_full", "cudnn", "nccl", "source", "arch_list"})
_VARIANT_OPTIONAL = frozenset({"aarch64_arch_list"})


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
    if data is None or not _check_keys(errors, data, where, _VARIANT_KEYS, _VARIANT_OPTIONAL):
        return None
    at = data.at
    cuda_full = _field(errors, data, "cuda_full", where, _RE_RELEASE, example=f"{cuda}.0")
    cudnn = _field(errors, data, "cudnn", where, _RE_CUDNN, example="9.5.1.17")
    nccl = _field(errors, data, "nccl", where, _RE_RELEASE, nullable=True, example="2.26.2")
    source = _field(errors, data, "source", where)
    arch = _arch_list(errors, data, "arch_list", where)
    arm = _arch_list(errors, data, "aarch64_arch_list", where) if "aarch64_arch_list" in data else []
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
        aarch64_arch_list=tuple(arm),
        min_driver=row.min_driver,
        min_driver_full=full_drv,
    )


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
    neighbours = _neighbours(errors, data, where)
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
    if default is None or neighbours is None or not python or vdata is None:
        return None
    return TorchRelease(
        version=version,
        python=tuple(python),
        torchvision=tv,
        torchaudio=ta,
        default_cuda=default,
        aarch64_cuda=aarch64,
        compile_python=tuple(compile_python),
        neighbours=neighbours,
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

