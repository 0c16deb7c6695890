"""The validated matrix: :class:`ImageSpec` (one cell) and :class:`Matrix`, plus the tables
the validation checks against (bases, flavours, tag placeholders)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from builder.common.yamlpos import Loc

# What each supported base OS gives us. Python follows the base OS: Debian's own
# python3 is the interpreter the venv is made from, so there is one Python per OS.
# `bootstrap` names the debootstrap suite when the base can be made offline.
BASES: Mapping[str, Mapping[str, str]] = {
    "debian:bookworm-slim": {"os": "bookworm", "python": "3.11", "bootstrap": "bookworm"},
    "debian:bookworm": {"os": "bookworm", "python": "3.11", "bootstrap": "bookworm"},
    "debian:trixie-slim": {"os": "trixie", "python": "3.13", "bootstrap": "trixie"},
    "debian:trixie": {"os": "trixie", "python": "3.13", "bootstrap": "trixie"},
    "ubuntu:22.04": {"os": "jammy", "python": "3.10", "bootstrap": ""},
    "ubuntu:24.04": {"os": "noble", "python": "3.12", "bootstrap": ""},
}

# runtime: what users train in. dev: runtime plus a C/C++ toolchain and git for
# building extensions (the CUDA compiler is not included: see README).
FLAVOURS: Mapping[str, tuple[str, ...]] = {
    "runtime": (),
    "dev": ("build-essential", "git", "ninja-build", "python3-dev"),
}

TAG_FIELDS: Mapping[str, str] = {
    "torch": "torch version, e.g. 2.7.0",
    "torch_minor": "torch major.minor, e.g. 2.7",
    "torchvision": "torchvision version",
    "cuda": "CUDA major.minor, e.g. 12.6",
    "cuda_major": "CUDA major, e.g. 12",
    "cudnn": "cuDNN major, e.g. 9",
    "python": "Python major.minor",
    "flavour": "runtime or dev",
    "os": "base OS codename, e.g. bookworm",
}

TOP_KEYS = ("repository", "tag", "defaults", "axes", "include", "exclude")
CELL_KEYS = ("torch", "torchvision", "cuda", "cudnn", "python", "flavour", "base", "apt", "pip", "tools")
LIST_KEYS = ("apt", "pip", "tools")
REPO_RE = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$")
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
APT_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+~:-]+)?$")
PIP_RE = re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?\s*((==|>=|<=|~=|!=|<|>)\s*[A-Za-z0-9.*+!-]+\s*,?\s*)*$"
)


@dataclass(frozen=True)
class ImageSpec:
    """One validated cell of the matrix: everything later stages need, nothing more."""

    name: str  # the cell id; equal to the tag
    repository: str
    tag: str
    torch: str
    torchvision: str
    cuda: str
    cuda_full: str
    cudnn: str  # exact, as the wheel installs it, e.g. 9.5.1.17
    cudnn_major: int
    nccl: str | None
    python: str
    flavour: str
    base: str
    os: str
    bootstrap: str  # debootstrap suite, or "" when the base can only be pulled
    wheel_source: str  # "pypi" or a PyTorch index URL
    numpy: str | None  # extra pin for releases built against NumPy 1.x
    apt: tuple[str, ...]
    pip: tuple[str, ...]
    tools: tuple[str, ...]
    min_driver: str
    arch_list: tuple[str, ...]
    latest: bool
    loc: Loc

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag}"

    def summary(self) -> dict[str, Any]:
        """The machine-readable row `build.py matrix --json` prints."""
        return {
            "name": self.name,
            "image": self.ref,
            "tag": self.tag,
            "torch": self.torch,
            "torchvision": self.torchvision,
            "cuda": self.cuda,
            "cudnn": self.cudnn,
            "cudnn_major": self.cudnn_major,
            "nccl": self.nccl,
            "python": self.python,
            "flavour": self.flavour,
            "base": self.base,
            "wheel_source": self.wheel_source,
            "min_driver": self.min_driver,
            "latest": self.latest,
        }


@dataclass(frozen=True)
class Matrix:
    path: str
    repository: str
    cells: tuple[ImageSpec, ...]


