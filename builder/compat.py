"""Known PyTorch / CUDA / cuDNN / NCCL / Python / torchvision combinations.

A pure, typed loader for ``compat_data.yaml`` (the file beside this module;
every fact there carries its source in a comment). The data is validated on
load and every problem is reported at once, each with ``file:line``, the entry
it concerns and, for unknown keys, a suggestion. Nothing here touches Docker,
the network or the current directory.

Minimum-driver rule (see the comment in the YAML): ``CudaVariant.min_driver``
is the CUDA minor-version-compatibility floor of the variant's CUDA major,
i.e. the oldest driver that runs the pip-installed CUDA runtime;
``CudaVariant.min_driver_full`` is the driver of the exact toolkit the variant
is built with (needed for PTX JIT and some newer features).
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, final

import yaml
from yaml.nodes import MappingNode, ScalarNode

__all__ = [
    "DATA_FILE",
    "Compat",
    "CompatDataError",
    "CudaVariant",
    "FrozenMap",
    "TorchRelease",
    "load_compat",
]

DATA_FILE = Path(__file__).with_name("compat_data.yaml")
PYPI_SOURCE = "pypi"
INDEX_URL = "https://download.pytorch.org/whl/cu{}"

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


@final
class FrozenMap(Mapping[_K, _V]):
    """An immutable, hashable mapping that keeps insertion order."""

    __slots__ = ("_data",)

    def __init__(self, items: Iterable[tuple[_K, _V]] = ()) -> None:
        self._data: dict[_K, _V] = dict(items)

    def __getitem__(self, key: _K) -> _V:
        return self._data[key]

    def __iter__(self) -> Iterator[_K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        # Order-insensitive, like Mapping.__eq__.
        return hash(frozenset(self._data.items()))

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


@dataclass(frozen=True)
class CudaVariant:
    """One CUDA build of one torch release."""

    cuda: str  # "12.6"
    cuda_full: str  # "12.6.3": toolkit the binaries are built with
    cudnn: str  # "9.5.1.17"
    cudnn_major: int  # 9 (derived from cudnn)
    nccl: str | None  # None: unconfirmed
    source: str  # "pypi" or a download.pytorch.org index URL
    arch_list: tuple[str, ...]  # ("sm_50", ..., "sm_90") and PTX "compute_XX"
    min_driver: str  # minor-version-compatibility floor of the CUDA major
    min_driver_full: str  # driver of the build toolkit (CUDA_RN Table 3)

    @property
    def from_pypi(self) -> bool:
        """True for the wheel that a plain ``pip install torch`` installs."""
        return self.source == PYPI_SOURCE

    @property
    def index_url(self) -> str | None:
        """The extra index to install this variant from; None for PyPI."""
        return None if self.from_pypi else self.source


@dataclass(frozen=True)
class TorchRelease:
    """One torch patch release and its CUDA variants."""

    version: str  # "2.7.0"
    python: tuple[str, ...]  # ("3.9", ..., "3.13")
    torchvision: str | None
    torchaudio: str | None
    default_cuda: str  # CUDA of the PyPI wheel
    numpy: str | None  # pip spec needed for a working install ("<2"), or None
    variants: Mapping[str, CudaVariant]  # keyed by CUDA "12.6", ascending

    @property
    def default_variant(self) -> CudaVariant:
        """The variant published on PyPI."""
        return self.variants[self.default_cuda]


@dataclass(frozen=True)
class Compat:
    """All known releases, keyed by torch version, oldest first."""

    releases: Mapping[str, TorchRelease]

    def release(self, torch: str) -> TorchRelease | None:
        """The release with exactly this version, or None."""
        return self.releases.get(torch)

    def closest_torch(self, torch: str, n: int = 3) -> list[str]:
        """Did-you-mean suggestions for an unknown torch version.

        "2.7" or "2.7.0+cu126" suggest the patch releases of 2.7 (newest
        first); anything else falls back to difflib similarity.
        """
        wanted = torch.strip().removeprefix("v").split("+", 1)[0]
        known = list(self.releases)
        found: list[str] = []
        if wanted in self.releases:
            found.append(wanted)
        found += [v for v in reversed(known) if v.startswith(wanted + ".")]
        found += difflib.get_close_matches(wanted, known, n=n, cutoff=0.6)
        return list(dict.fromkeys(found))[:n]

    def torch_for_torchvision(self, tv: str) -> str | None:
        """The torch release paired with this torchvision version, or None."""
        wanted = tv.strip()
        for version, rel in self.releases.items():
            if rel.torchvision == wanted:
                return version
        return None


class CompatDataError(ValueError):
    """The compatibility data file is unreadable or inconsistent."""

    def __init__(self, path: Path, errors: Sequence[str]) -> None:
        self.path = path
        self.errors: tuple[str, ...] = tuple(errors)
        lines = "\n".join(f"  {e}" for e in self.errors)
        super().__init__(f"invalid compatibility data in {path} ({len(self.errors)} error(s)):\n{lines}")


def load_compat(path: Path | None = None) -> Compat:
    """Load and validate the compatibility data (default: ``DATA_FILE``).

    Results are cached per resolved path; the returned object is immutable.
    Raises CompatDataError listing every problem found.
    """
    return _load_cached((DATA_FILE if path is None else Path(path)).resolve())


@functools.lru_cache(maxsize=8)
def _load_cached(path: Path) -> Compat:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CompatDataError(path, [f"{path}: cannot read: {exc.strerror or exc}"]) from exc
    loader = _Loader(text)
    try:
        raw = loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise CompatDataError(path, [f"{where}: not valid YAML: {exc}"]) from exc
    finally:
        loader.dispose()
    errors = _Errors(path)
    for line, msg in loader.duplicates:
        errors.add(line, "", msg)
    compat = _build(raw, errors)
    if errors.items or compat is None:
        raise CompatDataError(path, errors.items or [f"{path}: no data"])
    return compat


# --------------------------------------------------------------------------
# YAML loading with line numbers and duplicate-key detection
# --------------------------------------------------------------------------

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _LineDict(dict[Any, Any]):
    """A mapping from the YAML file that remembers where it and each key are."""

    __slots__ = ("key_lines", "line")
    line: int
    key_lines: dict[Any, int]

    def at(self, key: object) -> int:
        """The line of ``key`` (for a merged key: where the anchor wrote it)."""
        return self.key_lines.get(key, self.line)


class _Loader(yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[tuple[int, str]] = []

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        # PyYAML keeps the last of duplicate keys silently; report them.
        # Keys pulled in by a `<<: *anchor` merge may be overridden: that is
        # not a duplicate, so only the explicit keys are checked.
        seen: set[str] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG or not isinstance(key_node, ScalarNode):
                continue
            key = str(key_node.value)
            if key in seen:
                self.duplicates.append((key_node.start_mark.line + 1, f"duplicate key {key!r}"))
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _construct_line_dict(loader: _Loader, node: MappingNode) -> Iterator[_LineDict]:
    data = _LineDict()
    data.line = node.start_mark.line + 1
    data.key_lines = {}
    yield data
    data.update(loader.construct_mapping(node))
    # construct_mapping has flattened `<<` merges into node.value, inherited
    # keys first, so an explicit override keeps its own line.
    for key_node, _ in node.value:
        if isinstance(key_node, ScalarNode):
            data.key_lines[loader.construct_object(key_node)] = key_node.start_mark.line + 1


_Loader.add_constructor("tag:yaml.org,2002:map", _construct_line_dict)


# --------------------------------------------------------------------------
# Validation and conversion
# --------------------------------------------------------------------------

_RE_RELEASE = re.compile(r"\d+\.\d+\.\d+")
_RE_CUDA = re.compile(r"\d+\.\d+")
_RE_CUDA_MAJOR = re.compile(r"\d+")
_RE_PYTHON = re.compile(r"3\.\d+")
_RE_CUDNN = re.compile(r"\d+\.\d+\.\d+\.\d+")
_RE_DRIVER = re.compile(r"\d+(\.\d+)*")
_RE_ARCH = re.compile(r"(sm|compute)_\d+[af]?")
_RE_NUMPY = re.compile(r"(~=|==|!=|<=|>=|<|>)\s*\d+(\.\d+)*(\s*,\s*(~=|==|!=|<=|>=|<|>)\s*\d+(\.\d+)*)*")

_TOP_KEYS = frozenset({"min_driver", "releases"})
_DRIVER_KEYS = frozenset({"minor_compat_floor", "cuda"})
_DRIVER_CUDA_KEYS = frozenset({"min_driver", "min_driver_full"})
_RELEASE_KEYS = frozenset({"python", "torchvision", "torchaudio", "default_cuda", "numpy", "variants"})
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
    return obj.at(key) if isinstance(obj, _LineDict) else None


def _vtuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def _mapping(errors: _Errors, obj: object, where: str, line: int | None) -> _LineDict | None:
    if isinstance(obj, _LineDict):
        return obj
    errors.add(line, where, f"must be a mapping, got {type(obj).__name__}")
    return None


def _check_keys(errors: _Errors, data: _LineDict, where: str, allowed: frozenset[str]) -> bool:
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
    data: _LineDict,
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
        elif floor_drv is not None and _vtuple(floor_drv) < _vtuple(floors[major]):
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
                elif floor_drv is not None and _vtuple(d) < _vtuple(floor_drv):
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


def _build_release(
    errors: _Errors, version: str, obj: object, *, line: int | None, drivers: Mapping[str, _DriverRow]
) -> TorchRelease | None:
    where = f"releases[{version!r}]"
    data = _mapping(errors, obj, where, line)
    if data is None or not _check_keys(errors, data, where, _RELEASE_KEYS):
        return None
    at = data.at
    python: list[str] = []
    py_raw = data["python"]
    if not isinstance(py_raw, list) or not py_raw:
        errors.add(at("python"), f"{where}.python", "must be a non-empty list like ['3.10', '3.11']")
    else:
        for p in py_raw:
            s = _string(errors, p, f"{where}.python", at("python"), _RE_PYTHON, example="3.11")
            if s is not None:
                python.append(s)
        if len(set(python)) != len(python) or python != sorted(python, key=_vtuple):
            errors.add(at("python"), f"{where}.python", "must be ascending without duplicates")
    tv = _field(errors, data, "torchvision", where, _RE_RELEASE, nullable=True, example="0.22.0")
    ta = _field(errors, data, "torchaudio", where, _RE_RELEASE, nullable=True, example="2.7.0")
    default = _field(errors, data, "default_cuda", where, _RE_CUDA, example="12.6")
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
        numpy=numpy,
        variants=FrozenMap(sorted(variants.items(), key=lambda kv: _vtuple(kv[0]))),
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
    return Compat(releases=FrozenMap(sorted(releases.items(), key=lambda kv: _vtuple(kv[0]))))
