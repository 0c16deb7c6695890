"""`build.py lock`: resolve each cell for its target with uv and write ``locks/<cell>/pylock.toml``.

Per cell, two runs of ``uv pip compile`` (about 1-2 s each), both for the cell's Python and
``<arch>-manylinux_2_<glibc>`` and ``--only-binary :all:`` (an sdist is never an option):

1. the resolution, as requirements.txt: the pins. The existing lock's pins are its preferences (uv
   keeps them unless ``--upgrade`` / ``--upgrade-package``), and a devel cell also prefers its
   runtime sibling's pins, so the two share the torch and tools layers;
2. the same pins as constraints, written as pylock.toml: every wheel that fits, with URL, size
   and sha256. Of those, the lock keeps the one the target's installer takes.

uv runs with the host's index, proxy and CA settings (the same ones a build carries; index
credentials only ever in uv's environment, never in argv or in the lock: URLs are written
without them), ``UV_PYTHON_DOWNLOADS=never`` and ``--no-config``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

from builder.common.errors import StepFailed
from builder.lock import model, uvbin
from builder.lock.model import CellLock, Package, Wheel
from builder.lock.net import NetConfig, redact
from builder.lock.target import LAYERS, PYPI, best_wheel, target, target_tags, wanted
from builder.matrix import ImageSpec

_PIN_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


@dataclass(frozen=True)
class LockOptions:
    upgrade: bool = False
    upgrade_packages: tuple[str, ...] = ()
    jobs: int = 3


def uv_binary() -> str:
    """The uv that resolves: the project venv's (pyproject pins it), else one on PATH."""
    here = Path(sys.executable).parent / "uv"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    for d in os.environ.get("PATH", "").split(os.pathsep):
        cand = Path(d) / "uv"
        if d and cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    raise StepFailed("uv is not installed: `make venv` installs it into .venv (pyproject.toml pins it)")


def uv_version(uv: str) -> str:
    out = subprocess.run([uv, "--version"], capture_output=True, text=True, check=False, timeout=30).stdout
    return out.split()[1] if len(out.split()) > 1 else "unknown"


def uv_env(net: NetConfig, ca_file: Path | None, index: str) -> dict[str, str]:
    """uv's environment: the host's proxies and CA, the index (a PyPI mirror from PIP_INDEX_URL for
    PyPI cells), nothing of the user's uv configuration."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    carried = dict(net.env)
    env.update({k: v for k, v in carried.items() if not k.startswith("PIP_")})
    env.update(UV_PYTHON_DOWNLOADS="never", UV_NO_PROGRESS="1")
    if ca_file is not None:
        env["SSL_CERT_FILE"] = str(ca_file)
    mirror = carried.get("PIP_INDEX_URL", "")
    if index == PYPI:
        if mirror:
            env["UV_DEFAULT_INDEX"] = mirror
        extra = carried.get("PIP_EXTRA_INDEX_URL", "")
        if extra:
            env["UV_INDEX"] = extra
    else:  # a PyTorch index first, then PyPI (or its mirror) for everything else
        env["UV_INDEX"] = index
        env["UV_DEFAULT_INDEX"] = mirror or PYPI
    return env


def parse_compiled(text: str) -> dict[str, str]:
    """uv's requirements.txt (``--no-annotate``) -> canonical name -> pinned version."""
    pins: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _PIN_RE.match(line)
        if not m:
            raise StepFailed(f"uv wrote a line this lock cannot use: {line!r} (only exact pins of wheels)")
        pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def pick_wheels(pylock_text: str, spec_name: str, python: str, platform: str) -> dict[str, tuple[str, Wheel]]:
    """uv's pylock.toml -> package -> (version, the one wheel the target installs)."""
    data = model.toml(pylock_text)
    tags = target_tags(platform, python)
    out: dict[str, tuple[str, Wheel]] = {}
    for entry in data.get("packages", []):
        name = canonicalize_name(str(entry["name"]))
        wheels = {str(w.get("name") or w["url"].rsplit("/", 1)[-1]): w for w in entry.get("wheels", [])}
        chosen = best_wheel(sorted(wheels), tags)
        if chosen is None:
            raise StepFailed(f"{spec_name}: {name} {entry.get('version')} has no wheel for {platform} / Python "
                             f"{python} (the cell installs wheels only)")
        w = wheels[chosen]
        out[name] = (str(entry["version"]), Wheel(chosen, redact(str(w["url"])), int(w["size"]),
                                                  str(w["hashes"]["sha256"])))
    return out


class Resolver:
    def __init__(self, root: Path, net: NetConfig, opts: LockOptions,
                 run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> None:
        self.root = root
        self.net = net
        self.opts = opts
        self.run = run
        self.uv = uv_binary()
        self.version = uv_version(self.uv)

    def _uv(self, args: Sequence[str], env: Mapping[str, str], cwd: Path, what: str) -> None:
        argv = [self.uv, "pip", "compile", "--no-config", "--quiet", "--no-header", "--only-binary", ":all:", *args]
        r = self.run(argv, cwd=cwd, env=dict(env), capture_output=True, text=True, check=False, timeout=600)
        if r.returncode != 0:
            raise StepFailed(f"{what}: uv pip compile failed (exit {r.returncode}):\n  "
                             + "\n  ".join((r.stderr or r.stdout).strip().splitlines()[-15:]))

    def preferences(self, spec: ImageSpec, sibling: CellLock | None) -> dict[str, str]:
        """Pins uv should keep: the cell's current lock (unless --upgrade), else its runtime sibling's."""
        prefs: dict[str, str] = {}
        if sibling is not None:
            prefs.update(sibling.pins())
        path = model.lock_path(self.root, spec.name)
        if path.exists() and not self.opts.upgrade:
            prefs.update(model.read(path).pins())
        for name in self.opts.upgrade_packages:
            prefs.pop(canonicalize_name(name), None)
        return {} if self.opts.upgrade else prefs

    def layers(self, spec: ImageSpec, layers: Mapping[str, Sequence[str]], env: Mapping[str, str],
               common: Sequence[str], work: Path) -> dict[str, str]:
        """Package -> the layer that installs it: the first layers' requirements resolved alone, within
        the cell's pins (-c). An extra a later layer asks for (cuda-toolkit[nvcc] of devel, on torch's own
        cuda-toolkit) stays in that later layer."""
        where: dict[str, str] = {}
        names = [layer for layer in LAYERS if layers.get(layer)]
        for i, layer in enumerate(names[:-1]):
            reqs = [r for prefix in names[: i + 1] for r in layers[prefix]]
            (work / f"{layer}.in").write_text("".join(f"{r}\n" for r in reqs), encoding="utf-8")
            self._uv([f"{layer}.in", "-c", "pins.txt", *common, "--no-annotate", "-o", f"{layer}.txt"], env, work,
                     f"{spec.name} ({layer} layer)")
            for name in parse_compiled((work / f"{layer}.txt").read_text(encoding="utf-8")):
                where.setdefault(name, layer)
        where[""] = names[-1]  # everything else: the last layer
        return where

    def lock(self, spec: ImageSpec, sibling: CellLock | None = None) -> CellLock:
        tgt = target(spec)
        layers = wanted(spec)
        with tempfile.TemporaryDirectory(prefix="ptmg-lock-") as tmp:
            work = Path(tmp)
            ca = None
            if self.net.ca_pem:
                ca = work / "ca.pem"
                ca.write_bytes(self.net.ca_pem)
            env = uv_env(self.net, ca, tgt.index)
            (work / "cell.in").write_text("".join(f"{r}\n" for layer in layers.values() for r in layer),
                                          encoding="utf-8")
            prefs = self.preferences(spec, sibling)
            (work / "resolved.txt").write_text("".join(f"{k}=={v}\n" for k, v in sorted(prefs.items())),
                                               encoding="utf-8")
            common = ["--python-version", tgt.python, "--python-platform", tgt.platform]
            upgrade = [a for n in self.opts.upgrade_packages for a in ("--upgrade-package", n)]
            self._uv(["cell.in", *common, "--no-annotate", "-o", "resolved.txt", *upgrade], env, work,
                     spec.name)
            pins = parse_compiled((work / "resolved.txt").read_text(encoding="utf-8"))
            (work / "pins.txt").write_text("".join(f"{k}=={v}\n" for k, v in sorted(pins.items())), encoding="utf-8")
            self._uv(["cell.in", "-c", "pins.txt", *common, "-o", "pylock.toml"], env, work, spec.name)
            wheels = pick_wheels((work / "pylock.toml").read_text(encoding="utf-8"), spec.name, tgt.python,
                                 tgt.platform)
            where = self.layers(spec, layers, env, common, work)
        missing = sorted(set(pins) - set(wheels))
        if missing or any(wheels[n][0] != v for n, v in pins.items() if n in wheels):
            raise StepFailed(f"{spec.name}: uv's two resolutions disagree ({', '.join(missing) or 'versions'}); "
                             "run `build.py lock` again")
        packages = tuple(Package(n, wheels[n][0], where.get(n, where[""]), wheels[n][1]) for n in sorted(pins))
        return CellLock(spec.name, tgt, layers, packages, f"pt-multi-gpu build.py lock (uv {self.version})")


def sibling_of(spec: ImageSpec, cells: Sequence[ImageSpec]) -> ImageSpec | None:
    """A devel cell's runtime cell: same torch, Python, platform, index, tools and pip."""
    if spec.flavour == "runtime":
        return None
    for c in cells:
        if c.flavour == "runtime" and (c.torch, c.python, c.platform, c.wheel_source, c.tools, c.pip, c.base) == \
                (spec.torch, spec.python, spec.platform, spec.wheel_source, spec.tools, spec.pip, spec.base):
            return c
    return None


def lock_cells(root: Path, cells: Sequence[ImageSpec], all_cells: Sequence[ImageSpec], net: NetConfig,
               opts: LockOptions, on_done: Callable[[CellLock, bool], None]) -> list[CellLock]:
    """Lock every cell (runtime cells first: devel cells prefer their pins); write changed files."""
    resolver = Resolver(root, net, opts)
    done: dict[str, CellLock] = {}

    def one(spec: ImageSpec) -> CellLock:
        sib = sibling_of(spec, all_cells)
        sib_lock = done.get(sib.name) if sib else None
        if sib is not None and sib_lock is None and model.lock_path(root, sib.name).exists():
            sib_lock = model.read(model.lock_path(root, sib.name))
        lock = resolver.lock(spec, sib_lock)
        path = model.lock_path(root, spec.name)
        text = model.dumps(lock)
        changed = not path.exists() or path.read_text(encoding="utf-8") != text
        if changed:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        on_done(lock, changed)
        return lock

    out: list[CellLock] = []
    for wave in ([c for c in cells if c.flavour == "runtime"], [c for c in cells if c.flavour != "runtime"]):
        with ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
            for lock in pool.map(one, wave):
                done[lock.cell] = lock
                out.append(lock)
    return out


def lock_uv(root: Path, net: NetConfig) -> bool:
    """Write locks/pylock.uv.toml (uv's musllinux wheels for each build-host machine); True if it changed."""
    resolver = Resolver(root, net, LockOptions())
    wheels: dict[str, Wheel] = {}
    with tempfile.TemporaryDirectory(prefix="ptmg-lock-uv-") as tmp:
        work = Path(tmp)
        ca = None
        if net.ca_pem:
            ca = work / "ca.pem"
            ca.write_bytes(net.ca_pem)
        env = uv_env(net, ca, PYPI)
        (work / "uv.in").write_text(f"uv=={uvbin.UV_VERSION}\n", encoding="utf-8")
        for machine, plat in sorted(uvbin.HOST_PLATFORMS.items()):
            out = f"pylock.{machine.replace('_', '')}.toml"
            resolver._uv(["uv.in", "--python-version", "3.11", "--python-platform", plat, "-o", out], env, work,
                         "uv")
            data = model.toml((work / out).read_text(encoding="utf-8"))
            cands = [w for p in data["packages"] for w in p["wheels"] if "musllinux" in str(w.get("name") or w["url"])]
            if not cands:
                raise StepFailed(f"uv {uvbin.UV_VERSION} has no musllinux wheel for {machine} on the index")
            w = cands[0]
            name = str(w.get("name") or w["url"].rsplit("/", 1)[-1])
            wheels[machine] = Wheel(name, redact(str(w["url"])), int(w["size"]), str(w["hashes"]["sha256"]))
    text = uvbin.dumps(uvbin.UV_VERSION, wheels, f"pt-multi-gpu build.py lock (uv {resolver.version})")
    path = uvbin.uv_lock_path(root)
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return True


def remove_stale(root: Path, cells: Sequence[ImageSpec]) -> list[Path]:
    """Delete lock folders of cells that are gone; the removed paths."""
    names = {c.name for c in cells}
    base = root / model.LOCK_DIR
    gone = [p for p in sorted(base.iterdir()) if p.is_dir() and (p / model.LOCK_NAME).exists()
            and p.name not in names] if base.is_dir() else []
    for p in gone:
        (p / model.LOCK_NAME).unlink()
        if not any(p.iterdir()):
            p.rmdir()
    return gone
