"""`build.py base`: make each selected cell's base image available: local, else pull, else debootstrap.

A base without the release's -updates and -security apt suites is refused, with the fix.
"""

from __future__ import annotations

import argparse
import os

from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.errors import StepFailed
from builder.common.log import log, table
from builder.imaging import apt_sources, base_foreign, base_image
from builder.matrix.model import DEFAULT_PLATFORM


def add_arguments(p: argparse.ArgumentParser) -> None:
    types.add_platforms(p, "native")
    p.add_argument("--mirror", default=os.environ.get("PTMG_DEBIAN_MIRROR", base_image.DEFAULT_MIRROR),
                   type=types.text, help="Debian mirror for debootstrap (env PTMG_DEBIAN_MIRROR)")
    p.add_argument("--security-mirror", type=types.text,
                   default=os.environ.get(apt_sources.ENV_SECURITY_MIRROR, apt_sources.DEFAULT_SECURITY_MIRROR),
                   help="Debian security mirror a bootstrapped base lists (env PTMG_DEBIAN_SECURITY_MIRROR)")
    p.add_argument("--rebootstrap", action="store_true", help="bootstrap again even if the base exists")


def run(ctx: Context) -> int:
    engine = ctx.engine()
    done: dict[str, str] = {}
    failed = False
    for cell in ctx.cells:
        ref = cell.base_ref  # another platform's base has a name of its own (arm64v8/debian:...)
        if ref in done:
            continue
        if ctx.args.dry_run:
            done[ref] = "present" if engine.image_exists(ref) else "would pull or bootstrap"
            continue
        try:
            if cell.platform != DEFAULT_PLATFORM:  # made under emulation (builder/imaging/base_foreign.py)
                if ctx.args.rebootstrap and cell.bootstrap:
                    base_foreign.bootstrap(engine, cell.bootstrap, ref, cell.platform, ctx.args.mirror,
                                           security_mirror=ctx.args.security_mirror)
                    done[ref] = "bootstrapped"
                else:
                    done[ref] = base_foreign.ensure(engine, cell, ctx.args.mirror,
                                                    security_mirror=ctx.args.security_mirror).how
            elif ctx.args.rebootstrap and cell.bootstrap:
                base_image.bootstrap(engine, cell.bootstrap, cell.base, ctx.args.mirror, ctx.args.security_mirror)
                done[ref] = "bootstrapped"
            else:
                done[ref] = base_image.ensure(engine, cell, ctx.args.mirror, ctx.args.security_mirror).how
        except StepFailed as exc:
            log.error("%s", exc)
            done[ref] = "failed"
            failed = True
    print(table(["base", "status"], sorted(done.items())))
    return 1 if failed else 0


VERB = Verb("base", "make base images available: local, else pull, else debootstrap from a Debian mirror",
            "base", run, add_arguments)
