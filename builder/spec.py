"""images.yaml -> a validated, frozen list of ImageSpec.

This is the first stage of the pipeline and the only reader of images.yaml.
It reports every problem at once, each with file:line:col, what is wrong and
what would be valid. Nothing downstream ever sees an invalid cell.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import itertools
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.compat import Compat, load_compat
from builder.yamlloc import Loc, Located, Path_, Problem, ProblemsError, load, read_text

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


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "text", int: "a number", float: "a number",
            bool: "true/false", type(None): "empty"}.get(type(value), type(value).__name__)


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in v.split("."))


class _Checker:
    """Collects problems while walking the document; never stops at the first."""

    def __init__(self, doc: Located, compat: Compat) -> None:
        self.doc = doc
        self.compat = compat
        self.problems: list[Problem] = []

    def err(self, path: Path_, message: str, *, key: bool = False) -> None:
        loc = self.doc.key_at(path) if key else self.doc.at(path)
        self.problems.append(Problem(loc, message))

    # --- shape -----------------------------------------------------------------
    def mapping(self, value: Any, path: Path_, what: str) -> dict[str, Any] | None:
        if isinstance(value, dict):
            return value
        self.err(path, f"{what} must be a mapping (key: value lines), got {_type_name(value)}")
        return None

    def unknown_keys(self, m: Mapping[str, Any], allowed: Sequence[str], path: Path_, where: str) -> None:
        for k in m:
            if k not in allowed:
                self.err((*path, k), f"unknown key {k!r} in {where}{_did_you_mean(k, allowed)}; "
                         f"valid keys: {', '.join(allowed)}", key=True)

    def cell_fields(self, m: Mapping[str, Any], path: Path_) -> dict[str, Any]:
        """Type-check the fields of a cell (or defaults); return the well-typed ones."""
        self.unknown_keys(m, CELL_KEYS, path, "a cell")
        out: dict[str, Any] = {}
        for k, v in m.items():
            if k not in CELL_KEYS:
                continue
            p = (*path, k)
            if k in LIST_KEYS:
                if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                    example = "htop" if k == "apt" else "wandb==0.19.1"
                    self.err(p, f"{k} must be a list of package names, e.g. [{example}]")
                    continue
                rx = APT_RE if k == "apt" else PIP_RE
                bad = [x for x in v if not rx.match(x.strip())]
                for x in bad:
                    self.err(p, f"{x!r} is not a valid {'Debian package name' if k == 'apt' else 'pip requirement'}")
                if not bad:
                    out[k] = tuple(x.strip() for x in v)
            elif k == "cudnn":
                if isinstance(v, bool) or not isinstance(v, int | str):
                    self.err(p, f"cudnn must be the cuDNN major version, e.g. 9, got {_type_name(v)}")
                else:
                    out[k] = str(v)
            elif isinstance(v, float) and k == "cuda":
                out[k] = repr(v)  # `cuda: 12.6` reads as a float; its text is what was meant
            elif not isinstance(v, str) or isinstance(v, bool):
                hint = {"torch": "\"2.7.0\"", "torchvision": "\"0.22.0\"", "cuda": "\"12.6\"", "python": "\"3.11\"",
                        "flavour": "runtime", "base": "debian:bookworm-slim"}.get(k, "text")
                if isinstance(v, float | int) and not isinstance(v, bool) and k in ("torch", "torchvision", "python"):
                    self.err(p, f"{k} must be quoted text so YAML keeps every digit "
                             f"(3.10 would read as 3.1), e.g. {k}: {hint}")
                else:
                    self.err(p, f"{k} must be text, e.g. {hint}, got {_type_name(v)}")
            else:
                out[k] = v.strip()
        return out

    # --- one cell ----------------------------------------------------------------
    def resolve(self, fields: Mapping[str, Any], origin: Mapping[str, Path_], cell_path: Path_,
                repository: str, template: str | None) -> ImageSpec | None:
        """Check one merged cell against the compatibility data; None if it is invalid."""

        def at(key: str) -> Path_:
            return origin.get(key, cell_path)

        n_before = len(self.problems)
        torch = fields.get("torch")
        if torch is None:
            self.err(cell_path, "cell has no torch version; add e.g. torch: \"2.7.0\"")
            return None
        rel = self.compat.release(torch)
        if rel is None:
            near = self.compat.closest_torch(torch)
            known = ", ".join(sorted(self.compat.releases, key=_version_key))
            hint = f"did you mean {near[0]!r}? " if near else ""
            self.err(at("torch"), f"torch {torch} is unknown to the compatibility data; {hint}known: {known}")
            return None

        cuda = fields.get("cuda", rel.default_cuda)
        variant = rel.variants.get(cuda)
        if variant is None:
            have = ", ".join(sorted(rel.variants, key=_version_key))
            self.err(at("cuda"), f"torch {torch} has no CUDA {cuda} build; available: {have}")
        tv = fields.get("torchvision", rel.torchvision)
        if tv is None:
            self.err(at("torch"), f"torch {torch} has no matching torchvision release yet; "
                     "pick an older torch, or wait for torchvision to catch up")
        elif tv != rel.torchvision:
            pairs = self.compat.torch_for_torchvision(tv)
            other = f" (torchvision {tv} pairs with torch {pairs})" if pairs else ""
            self.err(at("torchvision"), f"torchvision {tv} does not pair with torch {torch}{other}; "
                     f"use torchvision {rel.torchvision}")
        base = fields.get("base", "debian:bookworm-slim")
        base_info = BASES.get(base)
        if base_info is None:
            self.err(at("base"), f"unknown base {base!r}{_did_you_mean(base, BASES)}; "
                     f"supported: {', '.join(BASES)}")
        python = base_info["python"] if base_info else None
        if "python" in fields and base_info and fields["python"] != python:
            others = [b for b, i in BASES.items() if i["python"] == fields["python"]]
            alt = f"; for Python {fields['python']} use base {others[0]}" if others else ""
            self.err(at("python"), f"python {fields['python']} does not match base {base}, which ships "
                     f"Python {python} (Python follows the base OS){alt}")
        if python and python not in rel.python:
            self.err(at("python") if "python" in fields else at("base"),
                     f"Python {python} (from base {base}) is outside torch {torch}'s range "
                     f"{rel.python[0]}-{rel.python[-1]}; pick a base whose Python is in that range")
        if variant is not None and "cudnn" in fields and fields["cudnn"] != str(variant.cudnn_major) \
                and fields["cudnn"] != variant.cudnn:
            self.err(at("cudnn"), f"torch {torch} with CUDA {cuda} ships cuDNN {variant.cudnn} "
                     f"(major {variant.cudnn_major}), not {fields['cudnn']}; use cudnn: {variant.cudnn_major}")
        flavour = fields.get("flavour", "runtime")
        if flavour not in FLAVOURS:
            self.err(at("flavour"), f"unknown flavour {flavour!r}{_did_you_mean(flavour, FLAVOURS)}; "
                     f"valid: {', '.join(FLAVOURS)}")
        if len(self.problems) > n_before or variant is None or base_info is None or tv is None:
            return None

        values = {"torch": torch, "torch_minor": ".".join(torch.split(".")[:2]), "torchvision": tv,
                  "cuda": cuda, "cuda_major": cuda.split(".")[0], "cudnn": str(variant.cudnn_major),
                  "python": python, "flavour": flavour, "os": base_info["os"]}
        tag = (template or "").format(**values) if template else ""
        if template and not TAG_RE.match(tag):
            self.err(("tag",), f"tag template gives {tag!r} for this cell, which is not a valid Docker tag "
                     "(letters, digits, '_', '.', '-'; at most 128)")
            return None
        return ImageSpec(
            name=tag, repository=repository, tag=tag, torch=torch, torchvision=tv, cuda=cuda,
            cuda_full=variant.cuda_full, cudnn=variant.cudnn, cudnn_major=variant.cudnn_major,
            nccl=variant.nccl, python=str(python), flavour=flavour, base=base, os=base_info["os"],
            bootstrap=base_info["bootstrap"], wheel_source=variant.source, numpy=rel.numpy,
            apt=tuple(sorted(set(fields.get("apt", ())) | set(FLAVOURS[flavour]))),
            pip=tuple(sorted(set(fields.get("pip", ())))), tools=tuple(sorted(set(fields.get("tools", ())))),
            min_driver=variant.min_driver, arch_list=variant.arch_list, latest=False,
            loc=self.doc.at(cell_path),
        )


def _check_template(checker: _Checker, template: Any) -> str | None:
    if not isinstance(template, str) or not template.strip():
        checker.err(("tag",), "tag must be a template text, e.g. \"{torch}-cuda{cuda}-cudnn{cudnn}-{flavour}\"")
        return None
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        checker.err(("tag",), f"tag template is malformed ({exc}); placeholders look like {{torch}}")
        return None
    ok = True
    for name in names:
        if name not in TAG_FIELDS:
            ok = False
            checker.err(("tag",), f"tag template has unknown placeholder {{{name}}}{_did_you_mean(name, TAG_FIELDS)}; "
                        f"valid: {', '.join('{' + k + '}' for k in TAG_FIELDS)}")
    return template if ok else None


def _expand(checker: _Checker, top: Mapping[str, Any]) -> list[tuple[dict[str, Any], dict[str, Path_], Path_]]:
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


def parse(doc: Located, compat: Compat) -> Matrix:
    """Validate a loaded images.yaml; raise ProblemsError listing every problem."""
    checker = _Checker(doc, compat)
    if doc.value is None:
        raise ProblemsError([Problem(Loc(doc.file, 1, 1), "the file is empty: the matrix is empty; add cells, "
                                     "e.g. include: [{torch: \"2.7.0\"}]")])
    top = checker.mapping(doc.value, (), "images.yaml")
    if top is None:
        raise ProblemsError(checker.problems)
    checker.unknown_keys(top, TOP_KEYS, (), "images.yaml")

    repository = top.get("repository", "pt-multi-gpu")
    if not isinstance(repository, str) or not REPO_RE.match(repository):
        checker.err(("repository",), f"repository {repository!r} is not a valid image name; "
                    "use lowercase letters, digits, '.', '_', '-' and '/', e.g. pt-multi-gpu")
        repository = "invalid"
    template = _check_template(checker, top.get("tag", "{torch}-cuda{cuda}-cudnn{cudnn}-{flavour}"))

    raw_cells = _expand(checker, top)
    if not raw_cells and not checker.problems:
        checker.err((), "the matrix is empty: add cells under include:, or axes: to multiply out; "
                    "e.g. include: [{torch: \"2.7.0\"}]")
    specs: list[ImageSpec] = []
    for fields, where, path in raw_cells:
        spec = checker.resolve(fields, where, path, repository, template)
        if spec is not None:
            specs.append(spec)

    seen: dict[str, ImageSpec] = {}
    for s in specs:
        if s.tag in seen:
            first = seen[s.tag]
            checker.problems.append(Problem(s.loc, f"duplicate cell {s.tag!r}: the same image as the cell at "
                                            f"line {first.loc.line}; change a version, flavour or base, or remove one"))
        else:
            seen[s.tag] = s
    if checker.problems:
        raise ProblemsError(checker.problems)

    # The newest torch (then newest CUDA) is `latest`; ties on flavour prefer runtime.
    newest = max(specs, key=lambda s: (_version_key(s.torch), _version_key(s.cuda), s.flavour == "runtime"))
    cells = tuple(dataclasses.replace(s, latest=s is newest) for s in specs)
    return Matrix(doc.file, repository, cells)


def load_matrix(path: Path, display: str | None = None, compat: Compat | None = None) -> Matrix:
    """Read, parse and validate a matrix file. Raises ProblemsError (never a traceback) on bad input."""
    shown = display or str(path)
    text = read_text(path, shown)
    doc = load(text, shown)
    return parse(doc, compat or load_compat())


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
