"""The shape of builder/, checked from the source (AST only, nothing is imported):

- no import cycle between builder's modules, counting the imports made only for the type
  checker (under ``if TYPE_CHECKING:``) and those made inside functions;
- the stages stand in one order (:data:`STAGES`): a package imports only itself and the packages
  before it, never a later one (any kind of import, type-only and function-level too);
- only builder/engine talks to Docker (imports `docker`);
- nothing outside builder/cli (and the `python -m builder` entry point) imports builder.cli:
  the stages never reach back up to the command line;
- no module over 400 lines (the project's rule), in builder/ and in every other Python file
  the project ships or runs (entrypoint/, smoke_tests/, imagebuild/, bench/, scripts/, the
  contract, build.py): only tests/ is outside the rule; in the same files no function over 120;
- the tree names capabilities, not the project's tickets: no ``#N`` issue reference in a tracked
  file (external citations as ``owner/repo#N`` are fine);
- the label namespace (``io.pt-multi-gpu.``) is written once, in ptmg_contract.py: the code of
  builder/, entrypoint/ and smoke_tests/ takes it from there (docs, tests and rendered files
  may spell it out).

A failure names the modules (and, for a cycle, the whole loop)."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BUILDER = ROOT / "builder"
MAX_LINES = 400
#: Where the size rule applies besides the top-level .py files: everything but tests/.
SIZED = ("builder", "entrypoint", "smoke_tests", "imagebuild", "bench", "scripts")
ENTRY_POINTS = {"builder.__main__"}  # `python -m builder`: the command line's other door, like build.py

#: builder's packages, lowest first: each may import only itself and those before it. The base
#: layers (common, engine), then the pipeline (images.yaml -> Matrix -> Dockerfile -> locks -> image
#: -> smoke -> audit -> publish), then what reads the pipeline's results (launch, export, diff), the
#: host's doctor (it judges the host with the stages' own rules: the supply address, the GPU fit) and
#: the command line on top. A new package must be placed here.
STAGES = ("common", "engine", "matrix", "render", "lock", "imaging", "smoke", "audit", "attest", "publish",
          "launch", "export", "diff", "host", "cli")

#: Lazy (function-level) imports that close a loop the import-time graph does not have, each
#: with why. An entry here that no longer exists fails the test, so fixed ones get removed.
KNOWN_LAZY_EDGES_IN_A_LOOP: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Import:
    target: str  # the builder module (or package) imported, or the top-level name outside builder
    line: int
    lazy: bool  # inside a function: runs when called, not at import time
    type_only: bool  # under `if TYPE_CHECKING:`


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(BUILDER.rglob("*.py"))}


@functools.cache
def imports_of(name: str) -> tuple[Import, ...]:
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        return ".".join([*anchor, *([node.module] if node.module else [])])

    def add(target: str, line: int, lazy: bool, type_only: bool) -> None:
        top = target.partition(".")[0]
        if top != "builder":
            target = top  # outside builder only the distribution matters: docker, yaml, ...
        found.append(Import(target, line, lazy, type_only))

    def walk(node: ast.AST, lazy: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, child.lineno, lazy, type_only)
            elif isinstance(child, ast.ImportFrom):
                base = resolve(child)
                for alias in child.names:  # `from pkg import submodule` imports the submodule
                    full = f"{base}.{alias.name}"
                    add(full if full in MODULES else base, child.lineno, lazy, type_only)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                walk(child, lazy, True)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                walk(child, True, type_only)
            else:
                walk(child, lazy, type_only)

    walk(ast.parse(path.read_text(encoding="utf-8"), str(path)), False, False)
    return tuple(found)


def graph(with_lazy: bool) -> dict[str, set[str]]:
    """builder module -> the builder modules it imports when imported or type-checked (and, with_lazy,
    when used). A type-only import is an edge too: the two modules still can't be read apart."""
    return {name: {i.target for i in imports_of(name)
                   if i.target in MODULES and i.target != name and (with_lazy or not i.lazy)}
            for name in MODULES}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """One loop (a -> ... -> a) for each strongly connected component with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(g):
        if v not in index:
            strongconnect(v)
    return [_loop(g, component) for component in components]


def _loop(g: dict[str, set[str]], component: set[str]) -> list[str]:
    """A concrete path start -> ... -> start inside a strongly connected component (BFS: shortest)."""
    start = min(component)
    paths: dict[str, list[str]] = {start: [start]}
    queue = [start]
    for v in queue:
        for w in sorted(g[v] & component):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    raise AssertionError(f"no loop in {component}")


def _show(loops: list[list[str]]) -> str:
    return "\n".join(" -> ".join(loop) for loop in loops)


def _all_imports() -> Iterator[tuple[str, Import]]:
    for name in MODULES:
        for imp in imports_of(name):
            yield name, imp


# --- the checks of the checker ------------------------------------------------------------------
def test_the_cycle_finder_finds_and_names_a_loop() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(g) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_walker_sees_every_kind_of_import() -> None:
    by_target = {(i.target, i.lazy, i.type_only) for i in imports_of("builder.cli.registry")}
    assert ("builder.cli.context", False, True) in by_target  # under TYPE_CHECKING
    assert "builder.cli.context" in graph(with_lazy=False)["builder.cli.registry"]  # a type-only import ties too
    lazy = {i.target for i in imports_of("builder.imaging.base_image") if i.lazy}
    assert lazy == set() or all(t for t in lazy)
    assert len(MODULES) > 40 and "builder.engine.docker" in MODULES and "builder" in MODULES


# --- the rules ---------------------------------------------------------------------------------------
def test_no_import_cycle_at_import_time() -> None:
    loops = cycles(graph(with_lazy=False))
    assert not loops, f"import cycles under builder/ (imports under TYPE_CHECKING count):\n{_show(loops)}"


def stage_of(module: str) -> str:
    """builder.imaging.supply -> imaging; the package's root and `python -m builder` stand with the CLI."""
    parts = module.split(".")
    return "cli" if len(parts) < 2 or module in ENTRY_POINTS else parts[1]


def later_stage_imports() -> list[str]:
    """``path:line: a imports b (a later stage)`` for every import of a later stage, of any kind."""
    rank = {stage: n for n, stage in enumerate(STAGES)}
    return [f"{MODULES[name].relative_to(ROOT)}:{imp.line}: {stage_of(name)} imports {imp.target} "
            f"({stage_of(imp.target)} is a later stage)"
            for name, imp in _all_imports() if imp.target.startswith("builder.") or imp.target == "builder"
            if rank[stage_of(imp.target)] > rank[stage_of(name)]]


def test_every_package_of_builder_stands_in_the_stage_order() -> None:
    packages = {p.parent.name for p in BUILDER.glob("*/__init__.py")}
    assert packages == set(STAGES), (f"place {sorted(packages - set(STAGES))} in STAGES; "
                                     f"drop {sorted(set(STAGES) - packages)}")
    assert len(STAGES) == len(set(STAGES))


def test_no_stage_imports_a_later_one() -> None:
    bad = later_stage_imports()
    assert not bad, "a stage imports a later one (STAGES is the order):\n" + "\n".join(bad)


def test_lazy_imports_close_no_new_loop() -> None:
    g = graph(with_lazy=True)
    for edge in KNOWN_LAZY_EDGES_IN_A_LOOP:
        assert edge[1] in g[edge[0]], f"{edge} is gone: remove it from KNOWN_LAZY_EDGES_IN_A_LOOP"
        g[edge[0]].discard(edge[1])
    loops = cycles(g)
    assert not loops, f"import cycles under builder/ through function-level imports:\n{_show(loops)}"


def test_only_the_engine_imports_docker() -> None:
    bad = [f"{MODULES[name].relative_to(ROOT)}:{imp.line}" for name, imp in _all_imports()
           if imp.target == "docker" and not name.startswith("builder.engine")]
    assert not bad, "only builder/engine may import the docker SDK; found it in:\n" + "\n".join(bad)


def test_no_stage_imports_the_command_line() -> None:
    bad = [f"{MODULES[name].relative_to(ROOT)}:{imp.line} imports {imp.target}" for name, imp in _all_imports()
           if (imp.target == "builder.cli" or imp.target.startswith("builder.cli."))
           and not (name == "builder.cli" or name.startswith("builder.cli.")) and name not in ENTRY_POINTS]
    assert not bad, "only builder/cli may import builder.cli:\n" + "\n".join(bad)


def sized_modules() -> list[Path]:
    """Every Python file of the project but its tests: builder/, the contract, build.py, and what
    runs in the image or beside the build (entrypoint/, smoke_tests/, imagebuild/, bench/, scripts/),
    also a Python script without the .py suffix (entrypoint/healthcheck)."""
    found = []
    for path in sorted(ROOT.glob("*.py")) + sorted(p for top in SIZED for p in (ROOT / top).rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        if path.suffix == ".py" or (not path.suffix and path.read_bytes()[:64].startswith(b"#!")
                                    and b"python" in path.read_bytes()[:64]):
            found.append(path)
    return found


def test_the_size_rule_sees_every_part_of_the_project() -> None:
    names = {str(p.relative_to(ROOT)) for p in sized_modules()}
    assert {"build.py", "ptmg_contract.py", "builder/engine/docker.py", "entrypoint/supervisor.py",
            "smoke_tests/ddp_job.py", "smoke_tests/selftest.py", "entrypoint/healthcheck",
            "imagebuild/sbom.py", "bench/bench_build.py", "scripts/pictures.py"} <= names
    assert not any(n.startswith("tests/") for n in names)


def test_no_module_is_over_400_lines() -> None:
    sizes = {path.relative_to(ROOT): len(path.read_text(encoding="utf-8").splitlines()) for path in sized_modules()}
    big = [f"{path}: {n} lines" for path, n in sorted(sizes.items()) if n > MAX_LINES]
    assert not big, f"modules over {MAX_LINES} lines (split them):\n" + "\n".join(big)


MAX_FUNCTION_LINES = 120


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function or method of ``source`` over ``limit`` lines,
    from its ``def`` to its last line (a nested function counts inside its parent, and alone)."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > limit]


def test_the_function_measure_counts_from_def_to_the_last_line() -> None:
    method = ["class A:", "    def long(self):", *(f"        x{i} = {i}" for i in range(120))]
    short = ["def short():", *(f"    y{i} = {i}" for i in range(119))]
    source = "\n".join([*method, *short]) + "\n"
    assert long_functions(source) == [("long", 2, 121)]
    assert long_functions(source, limit=121) == []


def test_no_function_is_over_120_lines() -> None:
    long = [f"{path.relative_to(ROOT)}:{line} {name}: {n} lines" for path in sized_modules()
            for name, line, n in long_functions(path.read_text(encoding="utf-8"))]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into their phases):\n" + "\n".join(long)


# --- the image contract's literals ---------------------------------------------------------------
#: Where a label key is code: the builder on the host and what runs inside the image.
CONTRACT_USERS = ("builder", "entrypoint", "smoke_tests")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants (prose about labels, not a label)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def literals_of(path: Path, needle: str) -> list[int]:
    """Lines of ``path`` where code spells ``needle``: a string constant (not a docstring) of a
    Python module, or any line of another text file (a template, a shell script); never .md."""
    if path.suffix == ".md":
        return []
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return [n for n, line in enumerate(text.splitlines(), 1) if needle in line]
    tree = ast.parse(text, str(path))
    docs = _docstrings(tree)
    return sorted({node.lineno for node in ast.walk(tree)
                   if isinstance(node, ast.Constant) and isinstance(node.value, str)
                   and needle in node.value and id(node) not in docs})


def test_the_literal_finder_sees_code_not_prose(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text('"""io.pt-multi-gpu.cell in a docstring"""\n'
                   '# io.pt-multi-gpu.cell in a comment\n'
                   'A = {"io.pt-multi-gpu.cell": 1}\n'
                   'B = f"io.pt-multi-gpu.{A}"\n', encoding="utf-8")
    assert literals_of(mod, "io.pt-multi-gpu.") == [3, 4]
    sh = tmp_path / "t.sh.j2"
    sh.write_text("a\n--label io.pt-multi-gpu.x=1\n", encoding="utf-8")
    assert literals_of(sh, "io.pt-multi-gpu.") == [2]


def test_the_label_namespace_comes_from_the_contract() -> None:
    import ptmg_contract as contract

    needle = f"{contract.LABEL_NS}."
    bad = [f"{path.relative_to(ROOT)}:{line}" for top in CONTRACT_USERS
           for path in sorted((ROOT / top).rglob("*")) if path.is_file() and "__pycache__" not in path.parts
           for line in literals_of(path, needle)]
    assert not bad, (f"{needle!r} written as a literal (use ptmg_contract.LABEL_NS, label() or a LABEL_* "
                     "constant):\n" + "\n".join(bad))


# --- the tree speaks of capabilities, not of its tickets -------------------------------------------
#: A reference to an issue by number: ``#`` and digits, not inside a word, a path or a URL. An
#: external citation names its repository (``owner/repo#N``: the ``/`` and the word before the ``#``
#: keep it out of this pattern).
TICKET = re.compile(r"(?<![\w/&#-])#(\d+)\b")
#: ``#`` and digits that are not issue references, each with where it comes from.
NOT_TICKETS = (
    re.compile(r"\"#[0-9a-fA-F]{6}\""),  # a colour in SVG: fill="#718096"
    re.compile(r"#\d+ (\[|CACHED|DONE)"),  # BuildKit's plain progress, step ids: "#7 [3/8] RUN ..."
    re.compile(r"(mov x\d+, |svc )#\d+"),  # arm64 assembly immediates (builder/engine/emulation.py)
    re.compile(r"restart #\d+ in"),  # the supervisor's restart count in its log line
)
#: The compatibility data's citations of pytorch/pytorch issues and PRs, listed by number under its
#: PT_ISSUES source (builder/matrix/compat_data.yaml); allowed in that file only.
PYTORCH_CITATIONS = frozenset({"107302", "133593", "145167", "157517", "163764", "172352", "175253"})
CITING_FILE = "builder/matrix/compat_data.yaml"


def ticket_refs(path: str, text: str) -> list[str]:
    """``path:line: #N`` for every issue reference in ``text`` that is not an allowed citation."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern in NOT_TICKETS:
            line = pattern.sub("", line)
        for m in TICKET.finditer(line):
            if path == CITING_FILE and m.group(1) in PYTORCH_CITATIONS:
                continue
            found.append(f"{path}:{n}: {m.group(0)}")
    return found


def tracked_texts() -> Iterator[tuple[str, str]]:
    """(path, text) of every file git tracks here that is text (UTF-8, no NUL byte)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in sorted(out.decode().split("\0")):
        path = ROOT / name
        if not name or not path.is_file():
            continue
        raw = path.read_bytes()
        if b"\0" in raw:
            continue
        try:
            yield name, raw.decode("utf-8")
        except UnicodeDecodeError:
            continue


def test_the_ticket_finder_tells_tickets_from_citations() -> None:
    h = "#"  # kept apart, so that this file holds no reference itself
    text = "\n".join([
        f"({h}13) Security updates",  # 1: a ticket
        f"the pip torch RUN before {h}13, met since {h}12",  # 2: two
        f"NVIDIA/enroot{h}205 and pytorch/pytorch{h}21980",  # 3: external citations
        f'fill="{h}718096" and `{h}7 [3/8] RUN` and "{h}8 CACHED"',  # 4: a colour, BuildKit step ids
        f"mov x8, {h}101 / svc {h}0 / restart {h}1 in 1 s",  # 5: assembly, a restart count
        f"PT_ISSUES {h}133593, {h}175253 (arch lists)",  # 6: pytorch issues, allowed in the data only
        f"https://example.org/page{h}1 and path/to/file{h}L12",  # 7: URL fragments
    ])
    assert ticket_refs("x.md", text) == [f"x.md:1: {h}13", f"x.md:2: {h}13", f"x.md:2: {h}12",
                                         f"x.md:6: {h}133593", f"x.md:6: {h}175253"]
    assert ticket_refs(CITING_FILE, text) == [f"{CITING_FILE}:1: {h}13", f"{CITING_FILE}:2: {h}13",
                                              f"{CITING_FILE}:2: {h}12"]


def test_no_tracked_file_names_a_ticket() -> None:
    texts = dict(tracked_texts())
    assert "README.md" in texts and "docker/2.7.0-cuda12.6-cudnn9-runtime/Dockerfile" in texts
    bad = [ref for path, text in texts.items() for ref in ticket_refs(path, text)]
    assert not bad, ("an issue reference by number (name the capability instead; cite another project "
                     "as owner/repo#N):\n" + "\n".join(bad))
