"""`build.py lock`: resolve each cell for its target and write locks/<cell>/pylock.toml; `--check` (make lint)
fails when images.yaml and a lock disagree; `--fetch` fills the wheel store; `--prune-store` empties it of
wheels no lock names."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.errors import InputError
from builder.common.log import human_size, log, table
from builder.imaging import buildenv
from builder.imaging.supply import net_config
from builder.lock import check, model, resolve, uvbin
from builder.lock.model import CellLock
from builder.lock.store import STORE_ENV, Store, default_store


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true",
                   help="change nothing, resolve nothing (offline): exit 1 and name each cell whose lock disagrees "
                        "with images.yaml (a pin, a tool, a new or removed cell)")
    p.add_argument("--upgrade", action="store_true", help="resolve afresh, ignoring the pins of the existing locks")
    p.add_argument("--upgrade-package", action="append", default=[], metavar="NAME", type=types.text,
                   help="let this package (and what it needs) move to its newest allowed version (repeatable)")
    p.add_argument("--fetch", action="store_true",
                   help=f"also download and verify the locked wheels into the wheel store (env {STORE_ENV})")
    p.add_argument("--prune-store", action="store_true",
                   help="remove wheels that no lock in locks/ names from the wheel store, then stop")
    p.add_argument("--ca-cert", action="append", default=[], metavar="FILE", type=types.text,
                   help="extra CA certificate (PEM) to trust for the index; repeatable (as for `build`)")


def _lock_root(ctx: Context) -> Path:
    return ctx.docker_dir.parent  # the project for its images.yaml, else the matrix file's folder


def _check(ctx: Context) -> int:
    problems = check.check(_lock_root(ctx), ctx.cells, ctx.matrix.cells)
    if not problems:
        log.info("%d lock(s) match %s", len(ctx.cells), ctx.config_display)
        return 0
    log.error("the locks disagree with %s:", ctx.config_display)
    for line in problems:
        print(line)
    log.error(check.fix_hint(problems))
    return 1


def _prune(ctx: Context) -> int:
    root = _lock_root(ctx)
    keep = {uvbin.host_wheel(root).filename} if uvbin.uv_lock_path(root).exists() else set()
    for p in sorted((root / model.LOCK_DIR).glob(f"*/{model.LOCK_NAME}")):
        keep |= {pkg.wheel.filename for pkg in model.read(p).packages}
    store = Store(default_store())
    if ctx.args.dry_run:
        extra = [f for f in store.path.glob("*.whl") if f.name not in keep]
        print(f"would remove {len(extra)} wheel(s), {human_size(sum(f.stat().st_size for f in extra))}")
        return 0
    files, size = store.prune(keep)
    log.info("wheel store %s: removed %d wheel(s) no lock names (%s)", store.path, files, human_size(size))
    return 0


def run(ctx: Context) -> int:
    a = ctx.args
    if a.check:
        return _check(ctx)
    if a.prune_store:
        return _prune(ctx)
    if a.upgrade and a.upgrade_package:
        raise InputError("--upgrade and --upgrade-package: give one (--upgrade moves every pin)")
    root = _lock_root(ctx)
    if a.dry_run:
        print(table(["cell", "lock"], [[c.name, str(model.lock_path(root, c.name).relative_to(root))]
                                       for c in ctx.cells]))
        return 0
    net = net_config(buildenv.detect(os.environ, [Path(p) for p in a.ca_cert]))
    opts = resolve.LockOptions(a.upgrade, tuple(a.upgrade_package))
    rows: list[list[str]] = []

    def done(lock: CellLock, changed: bool) -> None:
        size = sum(p.wheel.size for p in lock.packages)
        layers = " ".join(f"{n}:{len(lock.layer(n))}" for n in ("torch", "tools", "devel") if lock.layer(n))
        rows.append([lock.cell, str(len(lock.packages)), layers, human_size(size), "written" if changed else "same"])
        log.info("%s: %d packages (%s), %s", lock.cell, len(lock.packages), layers, "written" if changed else "same")

    if resolve.lock_uv(root, net):
        log.info("wrote %s (uv %s)", uvbin.uv_lock_path(root).relative_to(root), uvbin.UV_VERSION)
    locks = resolve.lock_cells(root, ctx.cells, ctx.matrix.cells, net, opts, done)
    if len(ctx.cells) == len(ctx.matrix.cells):
        for gone in resolve.remove_stale(root, ctx.matrix.cells):
            log.info("removed %s (no such cell in %s)", gone.relative_to(root), ctx.config_display)
    print(table(["cell", "packages", "layers", "wheels", "lock"], sorted(rows)))
    if a.fetch:
        store = Store(default_store(), net)
        stats = store.ensure([p.wheel for lock in locks for p in lock.packages] + [uvbin.host_wheel(root)])
        log.info("wheel store %s: %d present, %d downloaded (%s) in %.1f s", store.path, stats.present,
                 stats.downloaded, human_size(stats.bytes_downloaded), stats.seconds)
    return 0


VERB = Verb("lock", "resolve each cell's wheels for its target into `locks/<cell>/pylock.toml` (sha256 each); "
            "`--check` fails when images.yaml and a lock disagree",
            "lock [--check] [--upgrade | --upgrade-package NAME] [--fetch]", run, add_arguments,
            "Resolve the selected cells with uv for each cell's own Python and platform (not the host's) and write "
            "locks/<cell>/pylock.toml: every distribution the image installs, one wheel each, with URL, size and "
            "sha256. Existing pins are kept unless --upgrade/--upgrade-package. Builds install from these files "
            "only. --check (offline, part of make lint) exits 1 naming each cell and difference.")
