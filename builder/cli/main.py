"""The `build.py` command line: parse, load the matrix, run one verb, map failures to exit codes.

This is the only place that turns exceptions into exit codes: 0 ok, 1 a step failed
(:class:`StepFailed`, which covers every engine error), 2 bad input (:class:`InputError`:
a flag, images.yaml, a setting; always with where and what would be right), 130
interrupted. Anything else is a bug and shows its traceback. Results go to stdout,
logs to stderr.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.verbs import VERBS
from builder.common.errors import EXIT_FAILED, EXIT_INVALID, InputError, StepFailed
from builder.common.log import log
from builder.common.paths import project_root
from builder.matrix import ImageSpec, load_matrix, platforms, select
from builder.render.dockerfile import docker_dir_for, source_name


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def parser() -> types.Parser:
    common = types.Parser(add_help=False)
    common.add_argument("--config", type=Path, default=None,
                        help="the matrix file (default: the project's images.yaml; env PTMG_CONFIG)")
    common.add_argument("--only", action="append", default=[], metavar="PATTERN", type=types.text,
                        help="select cells whose name matches this glob (repeatable)")
    common.add_argument("--exclude", action="append", default=[], metavar="PATTERN", type=types.text,
                        help="drop cells whose name matches this glob (repeatable)")
    common.add_argument("--dry-run", action="store_true", help="print what would happen, change nothing")
    common.add_argument("--json", action="store_true", help="machine-readable output on stdout")

    p = types.Parser(
        prog="build.py",
        description="Validate, render, build, test and publish the PyTorch multi-GPU images declared in images.yaml.",
        epilog="Exit status: 0 ok, 1 something failed, 2 invalid input. Logs go to stderr, results to stdout.",
    )
    sub = p.add_subparsers(dest="verb", metavar="VERB", required=True, parser_class=types.Parser)
    for verb in VERBS:
        sp = sub.add_parser(verb.name, parents=[common], help=verb.help, description=verb.description or verb.help)
        verb.add_arguments(sp)
    return p


def _context(args: object) -> Context:
    config = getattr(args, "config", None)
    if config is None:
        config = Path(os.environ.get("PTMG_CONFIG") or project_root() / "images.yaml")
    display = _display(config)
    matrix = load_matrix(config, display)
    cells = select(matrix.cells, getattr(args, "only", ()), getattr(args, "exclude", ()))
    wanted = getattr(args, "platforms", None)  # build, test, base, publish: --platforms
    if wanted:
        cells = _on_platforms(cells, wanted)
    return Context(args, matrix, cells, display, source_name(config), docker_dir_for(config),  # type: ignore[arg-type]
                   verbs=tuple((v.usage, v.help) for v in VERBS))


def _on_platforms(cells: tuple[ImageSpec, ...], wanted: tuple[str, ...]) -> tuple[ImageSpec, ...]:
    """The selected cells on the ``--platforms`` asked for; the others are named in one log line."""
    host = platforms.host_platform()
    kept, left = platforms.choose(cells, wanted, host)
    if left:
        names = ", ".join(f"{c.name} ({c.platform})" for c in left)
        hint = "--platforms all" if wanted == (platforms.NATIVE,) else "--platforms all or another list"
        if not kept:
            raise InputError(f"--platforms {','.join(wanted)}: leaves none of the selected cells ({names}); "
                             f"add {hint} (env PTMG_PLATFORMS; make PLATFORMS=all)")
        log.info("not covering %s: --platforms %s (this host is %s); add %s for them", names, ",".join(wanted),
                 host, hint)
    return kept


def disk_full(exc: OSError) -> str:
    """One line for a write that found the disk full (a build's log, an export, a report), with the fix."""
    where = f" writing {exc.filename}" if exc.filename else ""
    reason = os.strerror(exc.errno or errno.ENOSPC).lower()
    return (f"error: {reason}{where}. Fix: free disk space (`docker system df`, `docker builder prune`, "
            "`docker image prune`) and run it again; what was being written is incomplete")


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    verb = next(v for v in VERBS if v.name == args.verb)
    ctx: Context | None = None
    try:
        ctx = _context(args)
        return verb.run(ctx)
    except InputError as exc:
        for line in exc.lines:
            print(line, file=sys.stderr)
        return EXIT_INVALID
    except StepFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(disk_full(exc), file=sys.stderr)
        return EXIT_FAILED
    finally:
        if ctx is not None:
            try:
                ctx.close()
            except StepFailed as exc:
                print(f"warning: cleanup after the run failed: {exc}", file=sys.stderr)
