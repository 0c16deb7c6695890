"""Known PyTorch / CUDA / cuDNN / NCCL / Python / torchvision combinations: the typed model.

The data lives in ``compat_data.yaml`` (beside this module; every fact there carries its
source in a comment) and is loaded and validated by :mod:`builder.matrix.compat_load`.
Nothing here touches Docker, the network or the current directory.

Minimum-driver rule (see the comment in the YAML): ``CudaVariant.min_driver``
is the CUDA minor-version-compatibility floor of the variant's CUDA major,
i.e. the oldest driver that runs the pip-installed CUDA runtime;
``CudaVariant.min_driver_full`` is the driver of the exact toolkit the variant
is built with (needed for PTX JIT and some newer features).
"""

from __future__ import annotations

import difflib
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, final

from builder.common.errors import InputError

__all__ = [
    "DATA_FILE",
    "Compat",
    "CompatDataError",
    "CudaVariant",
    "FrozenMap",
    "TorchRelease",
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
    aarch64_arch_list: tuple[str, ...]  # the linux aarch64 wheel's, where it differs; () = arch_list
    min_driver: str  # minor-version-compatibility floor of the CUDA major
    min_driver_full: str  # driver of the build toolkit (CUDA_RN Table 3)

    def arch_for(self, arch: str) -> tuple[str, ...]:
        """The CUDA targets of this variant's wheel for a platform architecture (amd64, arm64)."""
        return self.aarch64_arch_list if arch == "arm64" and self.aarch64_arch_list else self.arch_list

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
    aarch64_cuda: str | None  # CUDA of PyPI's linux aarch64 wheel; None: that wheel is CPU-only
    compile_python: tuple[str, ...]  # the Pythons torch.compile supports in this release
    neighbours: tuple[str, ...]  # what this torch needs of packages it doesn't pin: ("numpy<2", ...)
    variants: Mapping[str, CudaVariant]  # keyed by CUDA "12.6", ascending

    @property
    def default_variant(self) -> CudaVariant:
        """The variant published on PyPI."""
        return self.variants[self.default_cuda]


@dataclass(frozen=True)
class Compat:
    """All known releases, keyed by torch version, oldest first."""

    releases: Mapping[str, TorchRelease]
    #: CUDA major -> the pip requirement (no version) of a CUDA toolkit with nvcc on PyPI; the devel
    #: flavour exists only for these majors.
    devel_toolkit: Mapping[str, str] = FrozenMap()

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

    def newest_with_cuda_major(self, major: str) -> tuple[str, str] | None:
        """(torch, cuda) of the newest release with a torchvision that has a build for this CUDA
        major (its PyPI default when that is one), or None."""
        for version in reversed(list(self.releases)):
            rel = self.releases[version]
            cudas = [c for c in rel.variants if c.split(".")[0] == major]
            if cudas and rel.torchvision is not None:
                return version, (rel.default_cuda if rel.default_cuda in cudas else cudas[-1])
        return None

    def torch_for_torchvision(self, tv: str) -> str | None:
        """The torch release paired with this torchvision version, or None."""
        wanted = tv.strip()
        for version, rel in self.releases.items():
            if rel.torchvision == wanted:
                return version
        return None


class CompatDataError(InputError):
    """The compatibility data file is unreadable or inconsistent (exit 2, every problem listed)."""

    def __init__(self, path: Path, errors: Sequence[str]) -> None:
        self.path = path
        self.errors: tuple[str, ...] = tuple(errors)
        super().__init__(f"error: invalid compatibility data in {path} ({len(self.errors)} error(s)):",
                         *(f"  {e}" for e in self.errors))
