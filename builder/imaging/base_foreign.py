"""Base images for a platform other than the host's (linux/arm64 on an x86 host).

One local image name holds one platform, so such a base has a name of its own:
Docker Hub's per-architecture name of the same image (``ImageSpec.base_ref``, e.g.
``arm64v8/debian:bookworm-slim``). :func:`ensure` uses a local one, else pulls that name for
its platform, else bootstraps it the way :mod:`builder.imaging.base_image` bootstraps the host's
bases (same debootstrap variant, same -slim trim), with two differences:

- ``debootstrap --arch=arm64``: its second stage runs in the new root through binfmt_misc and
  qemu-user, so emulation must work first (:mod:`builder.engine.emulation`);
- the root filesystem becomes an image through a BuildKit build (``FROM scratch`` + ``ADD
  rootfs.tar /`` with ``--platform``), never ``docker import``, which records the host's
  architecture whatever ``--platform`` says (a later ``FROM`` of it then goes to a registry).
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import ptmg_contract as contract
from builder.common import flock
from builder.common.log import log
from builder.engine import BuildkitCli, BuildRequest, Engine, emulation, find_buildkit_cli
from builder.imaging import apt_sources, base_image
from builder.imaging.base_image import BaseError, BaseResult
from builder.matrix import ImageSpec
from builder.matrix.model import PLATFORMS


def architecture(engine: Engine, ref: str) -> str | None:
    """The Architecture a local image records; None when it is absent."""
    attrs = engine.image_attrs(ref)
    return None if attrs is None else str(attrs.get("Architecture") or "")


def ensure(engine: Engine, spec: ImageSpec, mirror: str = base_image.DEFAULT_MIRROR,
           cli: BuildkitCli | None = None, security_mirror: str = apt_sources.DEFAULT_SECURITY_MIRROR) -> BaseResult:
    """Make ``spec.base_ref`` (``spec.platform``) available locally: local, else pull, else bootstrap;
    like the host's bases, it must list the release's -updates and -security suites. One process
    at a time per base on this host, as for the host's bases."""
    with flock.exclusive(flock.lock_file("base", f"{spec.base_ref}-{spec.arch}")):
        return _ensure(engine, spec, mirror, cli, security_mirror)


def _ensure(engine: Engine, spec: ImageSpec, mirror: str, cli: BuildkitCli | None,
            security_mirror: str) -> BaseResult:
    ref, arch = spec.base_ref, spec.arch
    have = architecture(engine, ref)
    if have == arch:
        base_image.check_sources(engine, ref, spec.os)
        return BaseResult(ref, "local")
    if have is not None:
        raise BaseError(f"the local image {ref} is {have}, not {arch}: it can't be the {spec.platform} base of "
                        f"{spec.name}.\n  fix: `docker rmi {ref}`, then `python build.py base --platforms all` "
                        "(pulls or bootstraps it)")
    log.info("base %s (%s) is not here; pulling it", ref, spec.platform)
    pull_error = engine.pull(ref, platform=spec.platform)
    if pull_error is None and architecture(engine, ref) == arch:
        base_image.check_sources(engine, ref, spec.os)
        return BaseResult(ref, "pulled")
    if pull_error is None:
        engine.untag(ref)
        pull_error = f"the registry served a {architecture(engine, ref)} image"
    if not spec.bootstrap:
        raise BaseError(f"base image {ref} ({spec.platform}) is not available.\n"
                        f"  tried: local image (absent); pull ({pull_error.strip()[:200]})\n"
                        f"  {spec.base} cannot be bootstrapped here (only Debian bases can).\n"
                        f"  fix: `docker pull --platform {spec.platform} {ref}` on this host, or use a Debian base")
    log.info("pull failed (%s); bootstrapping %s for %s from %s", pull_error.strip()[:120], ref, spec.platform,
             mirror)
    bootstrap(engine, spec.bootstrap, ref, spec.platform, mirror, cli, security_mirror=security_mirror)
    return BaseResult(ref, "bootstrapped")


def bootstrap(engine: Engine, suite: str, ref: str, platform: str, mirror: str = base_image.DEFAULT_MIRROR,
              cli: BuildkitCli | None = None, on_line: Callable[[str], None] = lambda _line: None, *,
              security_mirror: str = apt_sources.DEFAULT_SECURITY_MIRROR) -> str:
    """debootstrap ``suite`` for ``platform``, trim it (with the official apt sources, as the host's
    bases) and build it as ``ref``. Returns the image id."""
    arch = PLATFORMS[platform]
    emu = emulation.probe(platform)
    if not emu.ok:
        raise BaseError(f"can't bootstrap {ref}: {emu.describe()}\n  fix: {emulation.FIX}")
    cli = cli or find_buildkit_cli()
    if cli is None:
        raise BaseError(f"can't make {ref}: a {platform} image needs a BuildKit build (`docker import` would "
                        "record the host's architecture), and no docker CLI here builds with BuildKit.\n"
                        "  fix: install Debian's docker.io (its 20.10 CLI builds with DOCKER_BUILDKIT=1) or buildx")
    base_image._ensure_debootstrap()
    made_by = f"debootstrap --arch={arch} --variant=minbase {suite} {mirror}"
    with tempfile.TemporaryDirectory(prefix=f"ptmg-rootfs-{arch}-", dir=os.environ.get("PTMG_TMPDIR")) as tmp:
        root, ctx = Path(tmp) / "rootfs", Path(tmp) / "context"
        ctx.mkdir()
        cmd = ["debootstrap", f"--arch={arch}", "--variant=minbase", suite, str(root), mirror]
        log.info("$ %s   (its second stage runs under %s)", " ".join(cmd), emu.describe())
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
            raise BaseError(f"debootstrap of {suite} ({arch}) failed (exit {r.returncode}):\n{tail}\n"
                            f"  fix: check that {mirror} is reachable (set PTMG_DEBIAN_MIRROR for a local mirror)")
        base_image._trim(root, security_mirror)  # the -slim trim and the release/-updates/-security sources
        subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(ctx / "rootfs.tar"), "."], check=True)
        created = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        (ctx / "Dockerfile").write_text("FROM scratch\nADD rootfs.tar /\nENV LANG=C.UTF-8\nCMD [\"bash\"]\n",
                                        encoding="utf-8")
        labels = {contract.LABEL_BASE_MADE_BY: made_by, contract.LABEL_BASE_CREATED: created,
                  contract.LABEL_BASE_APT_SUITES: " ".join(apt_sources.required_suites(suite)),
                  contract.PROJECT_LABEL[0]: contract.PROJECT_LABEL[1]}
        req = BuildRequest(ctx, ctx / "Dockerfile", labels, {}, Path(tmp) / "build.log", platform=platform)
        outcome = engine.build(req, on_line, cli)
        if not outcome.ok or outcome.image_id is None:
            raise BaseError(f"building {ref} from the {arch} root filesystem failed: {outcome.failed_step}\n"
                            + "\n".join(f"  | {t}" for t in outcome.tail[-15:]))
        engine.tag(outcome.image_id, ref)
    got = architecture(engine, ref)
    if got != arch:
        raise BaseError(f"{ref} was built for {platform} but records Architecture {got!r}")
    log.info("built %s (%s) as %s (%s)", made_by, platform, ref, outcome.image_id[:19])
    return outcome.image_id
