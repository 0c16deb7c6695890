"""images.yaml -> a validated, frozen list of ImageSpec.

This is the first stage of the pipeline and the only reader of images.yaml.
It reports every problem at once, each with file:line:col, what is wrong and
what would be valid. Nothing downstream ever sees an invalid cell.
"""

from __future__ import annotations

import dataclasses
import difflib
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from builder.common.versions import version_key
from builder.common.yamlpos import Loc, Located, Path_, Problem, ProblemsError, load, read_text
from builder.matrix.compat import Compat, CudaVariant, TorchRelease
from builder.matrix.compat_load import load_compat
from builder.matrix.expand import expand
from builder.matrix.model import (
    APT_RE,
    BASES,
    CELL_KEYS,
    CPU,
    DEFAULT_PLATFORM,
    FLAVOURS,
    LIST_KEYS,
    PIP_RE,
    PLATFORMS,
    REPO_RE,
    TAG_FIELDS,
    TAG_RE,
    TOP_KEYS,
    ImageSpec,
    Matrix,
)
from builder.matrix.policy import check_audit


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "text", int: "a number", float: "a number",
            bool: "true/false", type(None): "empty"}.get(type(value), type(value).__name__)


class Checker:
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
            known = ", ".join(sorted(self.compat.releases, key=version_key))
            hint = f"did you mean {near[0]!r}? " if near else ""
            self.err(at("torch"), f"torch {torch} is unknown to the compatibility data; {hint}known: {known}")
            return None

        platform = fields.get("platform", DEFAULT_PLATFORM)
        if platform not in PLATFORMS:
            self.err(at("platform"), f"unknown platform {platform!r}{_did_you_mean(platform, PLATFORMS)}; "
                     f"valid: {', '.join(PLATFORMS)}")
            platform = DEFAULT_PLATFORM
        cuda, variant = self.cuda_variant(rel, platform, fields.get("cuda"), at)
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
        if cuda == CPU and "cudnn" in fields:
            self.err(at("cudnn"), "a CPU-only cell has no cuDNN; remove cudnn:")
        if variant is not None and "cudnn" in fields and fields["cudnn"] != str(variant.cudnn_major) \
                and fields["cudnn"] != variant.cudnn:
            self.err(at("cudnn"), f"torch {torch} with CUDA {cuda} ships cuDNN {variant.cudnn} "
                     f"(major {variant.cudnn_major}), not {fields['cudnn']}; use cudnn: {variant.cudnn_major}")
        flavour = fields.get("flavour", "runtime")
        if flavour not in FLAVOURS:
            self.err(at("flavour"), f"unknown flavour {flavour!r}{_did_you_mean(flavour, FLAVOURS)}; "
                     f"valid: {', '.join(FLAVOURS)}")
        elif flavour == "devel" and cuda is not None:
            self.check_devel(rel, cuda, at)
        if len(self.problems) > n_before or cuda is None or base_info is None or tv is None:
            return None

        values = {"torch": torch, "torch_minor": ".".join(torch.split(".")[:2]), "torchvision": tv,
                  "cuda": cuda, "cuda_major": cuda.split(".")[0], "cudnn": str(variant.cudnn_major) if variant else "",
                  "python": python, "flavour": flavour, "os": base_info["os"]}
        tag = self.tag_for(fields, at, template, values, cpu=variant is None)
        if tag is None:
            return None
        arch = PLATFORMS[platform]
        return ImageSpec(
            name=tag if platform == DEFAULT_PLATFORM else f"{tag}-{arch}", repository=repository, tag=tag,
            torch=torch, torchvision=tv, cuda=cuda,
            cuda_full=variant.cuda_full if variant else "", cudnn=variant.cudnn if variant else "",
            cudnn_major=variant.cudnn_major if variant else 0, nccl=variant.nccl if variant else None,
            python=str(python), flavour=flavour, base=base, os=base_info["os"],
            bootstrap=base_info["bootstrap"], wheel_source=variant.source if variant else "pypi",
            neighbours=rel.neighbours,
            apt=tuple(sorted(set(fields.get("apt", ())))),
            pip=tuple(sorted(set(fields.get("pip", ())))), tools=tuple(sorted(set(fields.get("tools", ())))),
            min_driver=variant.min_driver if variant else "",
            min_driver_full=variant.min_driver_full if variant else "",
            arch_list=variant.arch_for(arch) if variant else (),
            latest=False, loc=self.doc.at(cell_path), platform=platform, compile_python=rel.compile_python,
            devel_toolkit=self.compat.devel_toolkit.get(cuda.split(".")[0], "") if flavour == "devel" else "",
        )

    def check_devel(self, rel: TorchRelease, cuda: str, at: Callable[[str], Path_]) -> None:
        """A devel cell needs nvcc for its CUDA from PyPI: NVIDIA publishes it for some majors only."""
        have = sorted(self.compat.devel_toolkit, key=int)
        if cuda == CPU:
            self.err(at("flavour"), "flavour devel adds a CUDA toolkit, and this cell is CPU-only; "
                     "use flavour: runtime")
            return
        major = cuda.split(".", maxsplit=1)[0]
        if major in self.compat.devel_toolkit:
            return
        own = [c for c in rel.variants if c.split(".")[0] in self.compat.devel_toolkit]
        if own:
            fix = f"give this cell cuda: \"{own[-1]}\" (torch {rel.version} has that build)"
        else:
            newest = [n for n in (self.compat.newest_with_cuda_major(m) for m in reversed(have)) if n]
            fix = (f"use a torch with a CUDA {have[-1]} build, e.g. torch: \"{newest[0][0]}\" with cuda: "
                   f"\"{newest[0][1]}\"" if newest else "use a torch with such a build")
        self.err(at("flavour"), f"flavour devel needs nvcc for CUDA {cuda} from PyPI, and NVIDIA publishes nvcc "
                 f"wheels only for CUDA {', '.join(have) or 'none'} (nvidia-cuda-nvcc-cu{major} carries ptxas, "
                 f"not nvcc); {fix}, or use flavour: runtime")

    def cuda_variant(self, rel: TorchRelease, platform: str, asked: str | None,
                     at: Callable[[str], Path_]) -> tuple[str | None, CudaVariant | None]:
        """The cell's CUDA and its variant; ("cpu", None) for CPU-only torch; (None, None) when invalid."""
        torch = rel.version
        if platform == DEFAULT_PLATFORM:
            if asked == CPU:
                self.err(at("cuda"), f"CPU-only torch for {platform} comes from download.pytorch.org/whl/cpu, which "
                         f"this builder does not support; pick a CUDA build: {', '.join(rel.variants)}")
                return None, None
            cuda = asked or rel.default_cuda
            if cuda not in rel.variants:
                have = ", ".join(sorted(rel.variants, key=version_key))
                self.err(at("cuda"), f"torch {torch} has no CUDA {cuda} build; available: {have}")
                return None, None
            return cuda, rel.variants[cuda]
        pypi = rel.aarch64_cuda  # the only CUDA build PyPI has for linux/arm64, or None (CPU-only wheel)
        if asked == CPU:
            if pypi is not None:
                self.err(at("cuda"), f"PyPI's torch {torch} for {platform} is a CUDA {pypi} build; CPU-only torch "
                         "comes from download.pytorch.org/whl/cpu, which this builder does not support; "
                         "remove `cuda: cpu`")
                return None, None
            return CPU, None
        if pypi is None:
            first = next((v for v, r in self.compat.releases.items() if r.aarch64_cuda), None)
            since = f" (PyPI's aarch64 wheels carry CUDA from torch {first} on)" if first else ""
            self.err(at("platform"), f"torch {torch} has no CUDA build for {platform} on PyPI{since}; ask for "
                     f"CPU-only torch with `cuda: cpu`, or pick a newer torch")
            return None, None
        if asked is not None and asked != pypi:
            self.err(at("cuda"), f"torch {torch} for {platform} comes only as CUDA {pypi} on PyPI; "
                     f"use cuda: \"{pypi}\"")
            return None, None
        return pypi, rel.variants[pypi]

    def tag_for(self, fields: Mapping[str, Any], at: Callable[[str], Path_], template: str | None,
                values: Mapping[str, str], *, cpu: bool) -> str | None:
        """The cell's tag: its own `tag:` template, else the matrix's; None (and a problem) when invalid."""
        own = "tag" in fields
        if own:
            template = _check_template(self, fields["tag"], at("tag"))
        where = at("tag") if own else ("tag",)
        if not template:
            return None if own else ""
        if cpu and "{cudnn}" in template:
            self.err(where, "a CPU-only cell has no cuDNN: give it its own tag without {cudnn}, "
                     "e.g. tag: \"{torch}-cpu-{flavour}\"")
            return None
        tag = template.format(**values)
        if not TAG_RE.match(tag):
            self.err(where, f"tag template gives {tag!r} for this cell, which is not a valid Docker tag "
                     "(letters, digits, '_', '.', '-'; at most 128)")
            return None
        return tag


def _check_template(checker: Checker, template: Any, where: Path_ = ("tag",)) -> str | None:
    if not isinstance(template, str) or not template.strip():
        checker.err(where, "tag must be a template text, e.g. \"{torch}-cuda{cuda}-cudnn{cudnn}-{flavour}\"")
        return None
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        checker.err(where, f"tag template is malformed ({exc}); placeholders look like {{torch}}")
        return None
    ok = True
    for name in names:
        if name not in TAG_FIELDS:
            ok = False
            checker.err(where, f"tag template has unknown placeholder {{{name}}}{_did_you_mean(name, TAG_FIELDS)}; "
                        f"valid: {', '.join('{' + k + '}' for k in TAG_FIELDS)}")
    return template if ok else None


def parse(doc: Located, compat: Compat) -> Matrix:
    """Validate a loaded images.yaml; raise ProblemsError listing every problem."""
    checker = Checker(doc, compat)
    if doc.value is None:
        raise ProblemsError([Problem(Loc(doc.file, 1, 1), "the file is empty: the matrix is empty; add cells, "
                                     "e.g. include: [{torch: \"2.7.0\"}]")])
    top = checker.mapping(doc.value, (), "the matrix file")
    if top is None:
        raise ProblemsError(checker.problems)
    checker.unknown_keys(top, TOP_KEYS, (), "images.yaml")

    repository = top.get("repository", "pt-multi-gpu")
    if not isinstance(repository, str) or not REPO_RE.match(repository):
        checker.err(("repository",), f"repository {repository!r} is not a valid image name; "
                    "use lowercase letters, digits, '.', '_', '-' and '/', e.g. pt-multi-gpu")
        repository = "invalid"
    template = _check_template(checker, top.get("tag", "{torch}-cuda{cuda}-cudnn{cudnn}-{flavour}"))
    audit = check_audit(lambda path, message, key: checker.err(path, message, key=key), top.get("audit"),
                        locate=lambda path: str(checker.doc.at(path)))

    raw_cells = expand(checker, top)
    if not raw_cells and not checker.problems:
        checker.err((), "the matrix is empty: add cells under include:, or axes: to multiply out; "
                    "e.g. include: [{torch: \"2.7.0\"}]")
    specs: list[ImageSpec] = []
    own_tag: set[str] = set()
    for fields, where, path in raw_cells:
        spec = checker.resolve(fields, where, path, repository, template)
        if spec is not None:
            specs.append(spec)
            if "tag" in fields:
                own_tag.add(spec.name)
    _check_unique(checker, specs)
    if checker.problems:
        raise ProblemsError(checker.problems)

    # The newest torch (then newest CUDA) is `latest`; ties prefer runtime, linux/amd64 and the
    # matrix's own tag scheme (a cell with a tag: of its own is a variant, e.g. another Python).
    newest = max(specs, key=lambda s: (version_key(s.torch), version_key(s.cuda), s.flavour == "runtime",
                                       s.platform == DEFAULT_PLATFORM, s.name not in own_tag))
    cells = tuple(dataclasses.replace(s, latest=s is newest) for s in specs)
    return Matrix(doc.file, repository, cells, audit)


def _check_unique(checker: Checker, specs: Sequence[ImageSpec]) -> None:
    """One cell per name; cells that share a tag (one per platform) must be the same image otherwise."""
    seen: dict[str, ImageSpec] = {}
    by_tag: dict[str, ImageSpec] = {}
    for s in specs:
        if s.name in seen:
            first = seen[s.name]
            checker.problems.append(Problem(s.loc, f"duplicate cell {s.name!r}: the same image as the cell at "
                                            f"line {first.loc.line}; change a version, flavour, base or platform, "
                                            "or remove one"))
            continue
        seen[s.name] = s
        other = by_tag.setdefault(s.tag, s)
        same = ("torch", "torchvision", "cuda", "flavour", "base", "apt", "pip", "tools")
        differs = [k for k in same if getattr(s, k) != getattr(other, k)]
        if differs:
            checker.problems.append(Problem(s.loc, f"tag {s.tag!r} also names the cell at line {other.loc.line}, "
                                            f"which differs in {', '.join(differs)}; one tag is one image on each "
                                            "platform: give this cell its own tag:"))


def load_matrix(path: Path, display: str | None = None, compat: Compat | None = None) -> Matrix:
    """Read, parse and validate a matrix file. Raises ProblemsError (never a traceback) on bad input."""
    shown = display or str(path)
    text = read_text(path, shown)
    doc = load(text, shown)
    return parse(doc, compat or load_compat())


