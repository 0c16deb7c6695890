"""Base images: use a local one, else pull, else bootstrap one from a Debian mirror.

Air-gapped and registry-less sites can still build: `build.py base` runs
debootstrap, trims the result the way Docker's official -slim images are
trimmed, gives it the official image's apt sources (the release, -updates and
-security), and imports it under the exact name the Dockerfiles use. Labels
record how it was made and which suites it lists.

Every base, bootstrapped, pulled or already here, must list those three suites:
:func:`check_sources` refuses one that does not, with the fix.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import ptmg_contract as contract
from builder.common import flock
from builder.common.errors import StepFailed
from builder.common.log import log
from builder.engine import Engine
from builder.imaging import apt_sources
from builder.matrix import ImageSpec

DEFAULT_MIRROR = apt_sources.DEFAULT_MIRROR

# What Docker's debian:*-slim images leave out (docs, man pages, translations);
# written into the image so later apt installs leave them out too.
SLIM_DPKG_CFG = """\
# Like Docker's official -slim images: no docs, man pages or translations.
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
"""


class BaseError(StepFailed):
    pass


@dataclass(frozen=True)
class BaseResult:
    ref: str
    how: str  # "local", "pulled", "bootstrapped"


def ensure(engine: Engine, spec: ImageSpec, mirror: str = DEFAULT_MIRROR,
           security_mirror: str = apt_sources.DEFAULT_SECURITY_MIRROR) -> BaseResult:
    """Make `spec.base` available locally, trying local, pull, then bootstrap; refuse a base
    without the release's updates and security suites (:func:`check_sources`). One process at a
    time per base on this host (:func:`flock.exclusive`): a second waits, then finds it local."""
    with flock.exclusive(flock.lock_file("base", spec.base)):
        return _ensure(engine, spec, mirror, security_mirror)


def _ensure(engine: Engine, spec: ImageSpec, mirror: str, security_mirror: str) -> BaseResult:
    if engine.image_exists(spec.base):
        check_sources(engine, spec.base, spec.os)
        return BaseResult(spec.base, "local")
    log.info("base %s is not here; pulling it", spec.base)
    pull_error = engine.pull(spec.base)
    if pull_error is None:
        check_sources(engine, spec.base, spec.os)
        return BaseResult(spec.base, "pulled")
    if not spec.bootstrap:
        raise BaseError(
            f"base image {spec.base} is not available.\n"
            f"  tried: local image (absent); pull ({pull_error.strip()[:200]})\n"
            f"  {spec.base} cannot be bootstrapped here (only Debian bases can).\n"
            f"  fix: `docker load` or `docker pull` {spec.base} on this host, or use a Debian base in images.yaml"
        )
    log.info("pull failed (%s); bootstrapping %s from %s", pull_error.strip()[:120], spec.base, mirror)
    bootstrap(engine, spec.bootstrap, spec.base, mirror, security_mirror)
    return BaseResult(spec.base, "bootstrapped")


def check_sources(engine: Engine, ref: str, release: str) -> None:
    """BaseError (with the fix) unless the base image `ref` lists `release`, -updates and -security.

    A base bootstrapped here says so in a label; any other base is read in a throwaway container.
    """
    listed = engine.image_labels(ref).get(contract.LABEL_BASE_APT_SUITES)
    if listed is not None:
        have = set(listed.split())
        missing = [s for s in apt_sources.required_suites(release) if s not in have]
    else:
        script = "cat " + " ".join(apt_sources.SOURCES_FILES) + " 2>/dev/null; true"
        r = engine.run(ref, ["-c", script], entrypoint=["/bin/sh"], timeout=300, user="0")
        if r.exit_code != 0:
            raise BaseError(f"could not read the apt sources of {ref} (exit {r.exit_code}): {r.output[-300:]}")
        missing = apt_sources.missing_suites(apt_sources.parse_sources(r.output), release)
    if missing:
        raise BaseError(apt_sources.fix_text(ref, release, missing))


def bootstrap(engine: Engine, suite: str, ref: str, mirror: str = DEFAULT_MIRROR,
              security_mirror: str = apt_sources.DEFAULT_SECURITY_MIRROR) -> str:
    """debootstrap a minimal Debian `suite`, trim it, give it the official image's apt sources
    (release, -updates, -security) and import it as `ref`. Returns the image id."""
    _ensure_debootstrap()
    made_by = f"debootstrap --variant=minbase {suite} {mirror}"
    with tempfile.TemporaryDirectory(prefix="ptmg-rootfs-", dir=os.environ.get("PTMG_TMPDIR")) as tmp:
        root = Path(tmp) / "rootfs"
        cmd = ["debootstrap", "--variant=minbase", suite, str(root), mirror]
        log.info("$ %s", " ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
            raise BaseError(f"debootstrap of {suite} failed (exit {r.returncode}):\n{tail}\n"
                            f"  fix: check that {mirror} is reachable (set PTMG_DEBIAN_MIRROR for a local mirror)")
        _trim(root, security_mirror)
        tar = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(tar), "."], check=True)
        changes = [
            'CMD ["bash"]',
            "ENV LANG=C.UTF-8",
            f'LABEL {contract.LABEL_BASE_MADE_BY}="{made_by}"',
            f'LABEL {contract.LABEL_BASE_APT_SUITES}="{" ".join(apt_sources.required_suites(suite))}"',
            f'LABEL {contract.LABEL_BASE_CREATED}="{dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}"',
            f'LABEL {contract.PROJECT_LABEL[0]}="{contract.PROJECT_LABEL[1]}"',
        ]
        image_id = engine.import_rootfs(tar, ref, changes)
    log.info("imported %s as %s (%s)", made_by, ref, image_id[:19])
    return image_id


def official_sources(root: Path, security_mirror: str | None = None) -> str:
    """Replace debootstrap's one `deb <mirror> <suite> main` by the official image's deb822 sources
    (that mirror: the suite and -updates; the security mirror: -security). Returns the suite."""
    listed = root / "etc/apt/sources.list"
    found = apt_sources.parse_sources(listed.read_text(encoding="utf-8")) if listed.is_file() else []
    if not found:
        raise BaseError(f"debootstrap left no `deb` line in {listed}; can't tell the mirror and suite")
    mirror, suite = found[0].uri, found[0].suite
    security = security_mirror or os.environ.get(apt_sources.ENV_SECURITY_MIRROR) or apt_sources.DEFAULT_SECURITY_MIRROR
    listed.unlink()
    path = root / apt_sources.DEB822_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(apt_sources.debian_sources(suite, mirror, security), encoding="utf-8")
    path.chmod(0o644)
    missing = apt_sources.missing_suites(apt_sources.parse_sources(path.read_text(encoding="utf-8")), suite)
    if missing:  # never import a base without them
        raise BaseError(f"internal: the sources written for {suite} lack {', '.join(missing)}")
    return suite


def _trim(root: Path, security_mirror: str | None = None) -> None:
    """Drop what a container never needs, as the official -slim images do, and list the suites
    the official image lists (:func:`official_sources`; every platform's bootstrap comes here)."""
    cfg = root / "etc/dpkg/dpkg.cfg.d/docker-slim"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(SLIM_DPKG_CFG, encoding="utf-8")
    for rel in ("usr/share/man", "usr/share/info", "usr/share/groff", "usr/share/lintian", "usr/share/locale",
                "var/cache/apt/archives", "var/lib/apt/lists"):
        p = root / rel
        if p.is_dir():
            shutil.rmtree(p)
            p.mkdir()
    for p in (root / "var/cache/apt").glob("*.bin"):
        p.unlink()
    (root / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
    (root / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
    doc = root / "usr/share/doc"
    if doc.is_dir():
        for d in doc.iterdir():
            if d.is_dir():
                for f in d.iterdir():
                    if f.name != "copyright":
                        shutil.rmtree(f) if f.is_dir() else f.unlink()
    official_sources(root, security_mirror)


def _ensure_debootstrap() -> None:
    if shutil.which("debootstrap"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise BaseError("debootstrap is not installed. fix: apt-get install debootstrap (as root), "
                        "or `docker load` the base image")
    log.info("installing debootstrap (apt-get install debootstrap)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=False, env=env, capture_output=True)
    r = subprocess.run(["apt-get", "install", "-y", "-qq", "debootstrap"], env=env, capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        raise BaseError(f"could not install debootstrap: {r.stderr.strip()[-300:]}")
