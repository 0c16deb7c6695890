"""Prose names only what exists: every repository path and every ``builder.x.y`` dotted name that
the project's prose mentions resolves in this tree.

Prose is: every tracked Markdown file (README.md, docs/, BENCHMARKS.md, the READMEs beside the
code), images.yaml, the compatibility data (builder/matrix/compat_data.yaml), and the docstrings
and comments of every tracked Python file (tests included). Nothing is imported: paths are looked
up on disk, dotted names in the modules' source (AST).

What counts as a path (pragmatic, so that prose about other systems is left alone):

- a token that starts with a top-level entry of this repository (``builder/``, ``tests/``,
  ``docs/``, ``images.yaml``, ...) or with a package of builder/ (``matrix/compat_data.yaml``,
  read under builder/), not preceded by ``/`` or ``~`` (an absolute path in the image, a URL);
- a bare file name with one of the project's extensions (``.py``, ``.yaml``, ``.md``, ``.j2``,
  ``.sh``, ...), which must be the name of some tracked file.

A path resolves from the repository's root, from the folder of the file that names it, under
builder/ or under tests/ (docs/testing.md names ``docker/test_runtime.py``); ``*`` and ``<...>``
placeholders match any one name; ``smoke_tests/ddp_plan.plan_ranks`` is a name in
smoke_tests/ddp_plan.py and ``smoke_tests/smokelib`` that module. A dotted name resolves to a module
of builder/ and then, part by part, to a name that module defines or imports (a class's members
too). A failure names each stale mention as ``file:line: name``."""

from __future__ import annotations

import ast
import functools
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

#: What a file named bare (no folder) must end in to be taken for one of ours: code, templates and
#: docs. Data names (``manifest.json``, ``job.yaml``) are mostly what a command writes, not files here.
EXTENSIONS = ("py", "md", "j2", "sh")
DOTTED = re.compile(r"(?<![\w./-])builder(?:\.[A-Za-z_]\w*)+")
BARE = re.compile(rf"(?<![\w./~$<>{{}}*-])[\w-][\w.-]*\.(?:{'|'.join(EXTENSIONS)})(?![\w/-])")

#: Names that look like this project's files but are other projects' (each with whose it is), and
#: the placeholder this rule is stated with.
OTHERS = frozenset({
    "train.py", "setup.py",  # the user's training script and package in the examples
    "sitecustomize.py", "usercustomize.py",  # Python's startup hooks (the site module)
    "eval_frame.py", "RELEASE.md",  # pytorch/pytorch's, cited by the compatibility data
    ".github/scripts/generate_binary_build_matrix.py", ".ci/manywheel/build_cuda.sh",  # pytorch/pytorch's
    "generate_binary_build_matrix.py",  # pytorch/test-infra's
    "common/install_cuda.sh",  # pytorch/builder's
    "image-format.md", "98-nvidia.sh",  # NVIDIA/enroot's (a doc; the GPU hook in its conf/hooks/)
    "50-slurm-pytorch.sh",  # NVIDIA/enroot's PyTorch hook (conf/hooks/extra/)
    "tests/utils/tracked_container.py",  # jupyter/docker-stacks'
    "builder.x.y",  # any dotted name (docs/architecture.md, this module)
})


@functools.cache
def tracked() -> tuple[str, ...]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return tuple(n for n in out.decode().split("\0") if n and (ROOT / n).exists())


@functools.cache
def basenames() -> frozenset[str]:
    return frozenset(Path(n).name for n in tracked())


@functools.cache
def heads() -> frozenset[str]:
    """The first part a repository path may start with: the top-level entries and builder's packages."""
    top = {n.split("/")[0] for n in tracked()}
    packages = {p.parent.name for p in (ROOT / "builder").glob("*/__init__.py")}
    return frozenset(top | packages)


def path_pattern() -> re.Pattern[str]:
    alternatives = "|".join(re.escape(h) for h in sorted(heads(), key=len, reverse=True))
    segment = r"/[\w.*<{$][\w.*<>{}$-]*"
    return re.compile(rf"(?<![\w./~$-])(?:{alternatives})(?:{segment})*/?")


# --- finding the mentions ------------------------------------------------------------------------
def mentions(text: str) -> Iterator[tuple[int, str, str]]:
    """(line, kind, token) for every path ("path"), bare file name ("file") and dotted name ("dotted")."""
    paths = path_pattern()
    for n, line in enumerate(text.splitlines(), 1):
        spans: list[tuple[int, int]] = []
        for m in paths.finditer(line):
            token = m.group(0).rstrip(".")
            if "/" in token.strip("/") or Path(token.strip("/")).suffix or token.endswith("/"):
                spans.append(m.span())
                yield n, "path", token
        for m in DOTTED.finditer(line):
            yield n, "dotted", m.group(0)
        for m in BARE.finditer(line):
            if not any(a <= m.start() < b for a, b in spans):
                yield n, "file", m.group(0)


def prose_of_python(source: str) -> str:
    """The docstrings and comments of a module, each on its own line number (the rest blanked)."""
    lines = [""] * (source.count("\n") + 2)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            lines[tok.start[0] - 1] += " " + tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                for i, text in enumerate(first.value.value.splitlines()):
                    lines[first.lineno - 1 + i] += " " + text
    return "\n".join(lines)


def prose_files() -> Iterator[tuple[str, str]]:
    """(path, prose) of every file whose prose is checked."""
    for name in tracked():
        path = ROOT / name
        if name.endswith(".md") or name in ("images.yaml", "builder/matrix/compat_data.yaml"):
            yield name, path.read_text(encoding="utf-8")
        elif name.endswith(".py"):
            yield name, prose_of_python(path.read_text(encoding="utf-8"))


# --- resolving them ------------------------------------------------------------------------------
def path_exists(token: str, where: str) -> bool:
    token = re.sub(r"<[^>/]*>|\{[^}/]*\}|\$\w+", "*", token.strip("/"))
    for base in (ROOT, (ROOT / where).parent, ROOT / "builder", ROOT / "tests"):
        if "*" in token:
            if any(base.glob(token)):
                return True
        elif (base / token).exists() or (base / f"{token}.py").is_file():
            return True
        folder, _, last = token.rpartition("/")
        module, dot, attr = last.partition(".")
        source = base / folder / f"{module}.py"
        if dot and "*" not in token and source.is_file() and attr.split(".")[0] in defined(source):
            return True  # smoke_tests/ddp_plan.plan_ranks: a name in a module, written with its folder
    return False


def module_source(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.cache
def defined(path: Path) -> dict[str, ast.AST | None]:
    """The names a module defines or imports at its top level (a class maps to its node)."""
    names: dict[str, ast.AST | None] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                names[node.name] = node
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names[node.name] = None
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Name):
                            names[sub.id] = None
            elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
                names[node.target.id] = None
            elif isinstance(node, ast.Import | ast.ImportFrom):
                for alias in node.names:
                    names[(alias.asname or alias.name).split(".")[0]] = None
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body)
                visit(node.orelse)

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return names


def dotted_exists(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        source = module_source(".".join(parts[:cut]))
        if source is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        scope = defined(source)
        if rest[0] not in scope:
            return False
        node = scope[rest[0]]
        if len(rest) == 1 or not isinstance(node, ast.ClassDef):
            return True  # a member of a value is not followed
        members = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
        members |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        members |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        return rest[1] in members
    return False


def stale(where: str, text: str) -> list[str]:
    """``where:line: token`` for each mention in ``text`` that names nothing here."""
    found = []
    for line, kind, token in mentions(text):
        if token in OTHERS:
            continue
        ok = {"path": lambda t: path_exists(t, where), "file": lambda t: t in basenames(),
              "dotted": dotted_exists}[kind](token)
        if not ok:
            found.append(f"{where}:{line}: {token}")
    return found


# --- the checks of the checker -------------------------------------------------------------------
def test_the_finder_sees_paths_files_and_dotted_names() -> None:
    text = ("see `builder/matrix/validate.py` and builder/imaging/ (compat.py, job.yaml)\n"
            "run /opt/pt-multi-gpu/x.py or https://example.org/builder/a.py, an entrypoint/-only change\n"
            "it calls builder.matrix.validate.Checker.mapping.\n")
    assert list(mentions(text)) == [(1, "path", "builder/matrix/validate.py"), (1, "path", "builder/imaging/"),
                                    (1, "file", "compat.py"), (2, "path", "entrypoint/"),
                                    (3, "dotted", "builder.matrix.validate.Checker.mapping")]


def test_a_stale_name_is_reported_with_its_place() -> None:
    text = ("the data is `builder/compat_data.yaml` (builder/matrix/compat_data.yaml now)\n"
            "checked by builder/compat.py and builder.records; the template is launch/sbatch.sh.j2\n"
            "builder.smoke.torchrun.torchrun_argv is real, builder.smoke.torchrun_argv is not;\n"
            "templates: builder/launch/templates/*.j2, docker/<cell>/Dockerfile, nowhere.py\n"
            "docker/test_build.py, smoke_tests/ddp_plan.plan_ranks, smoke_tests/ddp_plan.no_such_name\n")
    assert stale("docs/x.md", text) == [
        "docs/x.md:1: builder/compat_data.yaml", "docs/x.md:2: builder/compat.py", "docs/x.md:2: launch/sbatch.sh.j2",
        "docs/x.md:2: builder.records", "docs/x.md:3: builder.smoke.torchrun_argv", "docs/x.md:4: nowhere.py",
        "docs/x.md:5: smoke_tests/ddp_plan.no_such_name"]


def test_python_prose_is_its_docstrings_and_comments() -> None:
    source = '"""Module: builder/a.py"""\nX = "builder/b.py"  # builder/c.py\n\ndef f():\n    """builder/d.py"""\n'
    prose = prose_of_python(source).splitlines()
    assert "builder/a.py" in prose[0] and "builder/b.py" not in prose[1] and "builder/c.py" in prose[1]
    assert "builder/d.py" in prose[4]


# --- the rule ------------------------------------------------------------------------------------
def test_prose_names_only_what_exists() -> None:
    files = dict(prose_files())
    assert {"README.md", "docs/architecture.md", "images.yaml", "builder/matrix/compat_data.yaml",
            "builder/publish/publisher.py", "smoke_tests/README.md"} <= set(files)
    bad = [entry for where, text in files.items() for entry in stale(where, text)]
    assert not bad, "prose names what does not exist (fix the name, or drop it):\n" + "\n".join(bad)
