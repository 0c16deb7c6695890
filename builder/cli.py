"""The `build.py` command line: parse arguments, run one verb, map failures to exit codes.

Exit codes: 0 success, 1 something failed (a build, a check, a test), 2 bad
input (images.yaml, arguments). Results go to stdout, logs to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from docker.errors import DockerException

from builder import readme, render
from builder.compat import CompatDataError
from builder.engine import EngineError
from builder.log import log, table
from builder.spec import ImageSpec, Matrix, load_matrix, select
from builder.yamlloc import ProblemsError

ROOT = Path(__file__).resolve().parent.parent
EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


@dataclass(frozen=True)
class Context:
    """What every verb receives: the parsed arguments and the selected, validated cells."""

    args: argparse.Namespace
    matrix: Matrix
    cells: tuple[ImageSpec, ...]
    config_display: str  # the matrix file as messages show it (relative to the working directory)
    source: str  # the matrix file as generated headers name it
    docker_dir: Path  # where its rendered Dockerfiles live

    @property
    def is_default(self) -> bool:
        return self.docker_dir == render.DOCKER_DIR


Verb = Callable[[Context], int]


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# --- verbs ------------------------------------------------------------------------
def cmd_matrix(ctx: Context) -> int:
    """Print the cells: a table, or JSON for a CI job matrix."""
    rows = [c.summary() for c in ctx.cells]
    if ctx.args.json:
        print(json.dumps({"include": rows} if ctx.args.github else rows, indent=None if ctx.args.github else 2))
        return EXIT_OK
    cols = ["name", "torch", "torchvision", "cuda", "cudnn", "nccl", "python", "flavour", "base", "latest"]
    print(table(cols, [[str(r[c]) if r[c] is not None else "-" for c in cols] for r in rows]))
    return EXIT_OK


def cmd_render(ctx: Context) -> int:
    """Write docker/<cell>/Dockerfile for each cell, or check that the committed ones are current."""
    files = render.plan(ctx.cells, ctx.docker_dir, ctx.source)
    whole = not ctx.args.only and not ctx.args.exclude
    stale = render.stale_dirs(ctx.matrix.cells, ctx.docker_dir) if whole else ()
    readme_path = ROOT / "README.md"
    readme_new = None
    if readme_path.exists() and ctx.is_default:  # the README describes the project's own matrix
        readme_new = readme.update(readme_path.read_text(encoding="utf-8"), ctx.matrix)
    if ctx.args.check:
        drifted = [_display(p) for p in render.drift(files)] + [f"{_display(d)}/ (no such cell)" for d in stale]
        if whole and readme_new is not None and readme_new != readme_path.read_text(encoding="utf-8"):
            drifted.append("README.md (image table)")
        if drifted:
            log.error("rendered files drift from %s:", ctx.config_display)
            for d in drifted:
                print(d)
            log.error("fix: run `make render` (or `python build.py render`) and commit the result")
            return EXIT_FAILED
        log.info("%d Dockerfile(s) up to date", len(files))
        return EXIT_OK
    if ctx.args.dry_run:
        for f in files:
            print(_display(f.path))
        return EXIT_OK
    written = render.write(files)
    render.remove(stale)
    if whole and readme_new is not None and readme_new != readme_path.read_text(encoding="utf-8"):
        readme_path.write_text(readme_new, encoding="utf-8")
        written.append(readme_path)
    for p in written:
        log.info("wrote %s", _display(p))
    for stale_dir in stale:
        log.info("removed %s (cell no longer in %s)", _display(stale_dir), ctx.config_display)
    log.info("%d Dockerfile(s) rendered, %d changed", len(files), len(written))
    return EXIT_OK


VERBS: dict[str, tuple[Verb, str]] = {
    "matrix": (cmd_matrix, "list the cells of the matrix (validated)"),
    "render": (cmd_render, "render docker/<cell>/Dockerfile from images.yaml"),
}


def _register_later_verbs() -> None:
    """Verbs that need the Docker engine live in their own modules; import lazily."""
    from builder import commands

    VERBS.update(commands.VERBS)


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, default=Path(os.environ.get("PTMG_CONFIG", ROOT / "images.yaml")),
                        help="the matrix file (default: images.yaml; env PTMG_CONFIG)")
    common.add_argument("--only", action="append", default=[], metavar="PATTERN",
                        help="select cells whose name matches this glob (repeatable)")
    common.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                        help="drop cells whose name matches this glob (repeatable)")
    common.add_argument("--dry-run", action="store_true", help="print what would happen, change nothing")
    common.add_argument("--json", action="store_true", help="machine-readable output on stdout")

    p = argparse.ArgumentParser(
        prog="build.py",
        description="Validate, render, build, test and publish the PyTorch multi-GPU images declared in images.yaml.",
        epilog="Exit status: 0 ok, 1 something failed, 2 invalid input. Logs go to stderr, results to stdout.",
    )
    sub = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name, (fn, help_text) in VERBS.items():
        sp = sub.add_parser(name, parents=[common], help=help_text, description=(fn.__doc__ or help_text).strip())
        if name == "matrix":
            sp.add_argument("--github", action="store_true",
                            help="with --json: one line {\"include\": [...]} for a GitHub Actions matrix")
        if name == "render":
            sp.add_argument("--check", action="store_true",
                            help="exit 1 and list the files that differ from what would be rendered")
        adder = getattr(fn, "add_arguments", None)
        if adder is not None:
            adder(sp)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    _register_later_verbs()
    args = parser().parse_args(argv)
    display = _display(args.config)
    try:
        matrix = load_matrix(args.config, display)
        cells = select(matrix.cells, args.only, args.exclude)
    except ProblemsError as exc:
        for problem in exc.problems:
            print(str(problem), file=sys.stderr)
        n = len(exc.problems)
        print(f"{n} problem{'s' if n != 1 else ''} found; nothing was rendered or built.", file=sys.stderr)
        return EXIT_INVALID
    except CompatDataError as exc:
        print(f"error: the compatibility data is broken: {exc}", file=sys.stderr)
        return EXIT_INVALID
    fn = VERBS[args.verb][0]
    try:
        return fn(Context(args, matrix, cells, display, render.source_name(args.config),
                          render.docker_dir_for(args.config)))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (EngineError, DockerException) as exc:
        # The engine went away or refused mid-run: say so plainly, no traceback.
        print(f"error: the Docker engine failed: {exc}", file=sys.stderr)
        print("  fix: check `python build.py doctor`; start the engine with scripts/ensure-docker.sh", file=sys.stderr)
        return EXIT_FAILED
