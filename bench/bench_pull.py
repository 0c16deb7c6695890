"""What a node that holds last week's image pays for this week's: bytes fetched and bytes stored anew.
Prints a markdown report (paste into BENCHMARKS.md) and writes the figures as JSON.

    flock /tmp/ptmg-docker.lock .venv/bin/python bench/bench_pull.py [--cell 2.7.0-cuda12.6-cudnn9-runtime]
        [--change files] [--change os] [--apt-package less] [--node overlay2] [--node containerd]
        [--json build-logs/bench_pull.json]
    .venv/bin/python bench/bench_pull.py --from-images IMAGE_A IMAGE_B     # two images the engine holds
    .venv/bin/python bench/bench_pull.py --share IMAGE...                  # several images on one node

The full run, for one cell: a copy of the project's tracked tree in a temporary folder (its images.yaml
names the throwaway repository ptmg-bench-pull, so no project image is replaced; its Dockerfiles are
rendered there), a local registry (Debian's docker-registry 2.8 on 127.0.0.1, tests/docker/registry.py)
with its storage in that folder. Image A is built from the copy as it is and pushed; then, per change:
  files  one byte appended to entrypoint/start.sh in the copy (our own files);
  os     one Debian package (--apt-package) added to the cell's apt (the copy's images.yaml; the lock unchanged)
  torch  the lock's torch set changed (another release of filelock, a dependency of torch, from PyPI), the
         CUDA wheels unchanged: the torch layer installs again, as for a new torch
B is built with `build.py build` (the engine's layer cache is used, as on a CI builder) and pushed to
the same repository, and the two costs of B for a node holding A are counted (bench/pulllib.py):
by blob digest (B's compressed blobs whose digest A's manifest lacks: what enroot fetches) and by chain
ID (B's unpacked layers whose chain ID A lacks: what Docker's and containerd's stores keep anew).
Then the nodes (--node, default both stores): a fresh Docker 28 engine per image store
(tests/docker/pullengine.py) pulls A from the registry, then each B onto a node that holds A only (B is
removed from the node after it); per pull, the blob bytes the registry served (its log: what the node
really fetched) and the pull's wall time (fetch on loopback + unpack), against A's own.
B is removed after its change; at the end A, the registry, its storage and the copy, and the BuildKit
records this run made, also on failure or Ctrl-C; each node's data goes when it stops. Disk, at the
peak: A and one B (the layers B shares with A are kept once), A in the registry (3.3 GB for the 2.7.0
cell) and one node (5.8 GB, the containerd store 9 GB: blobs and snapshots); it refuses to start, to
build B and to start a node unless 15 GB stay free beyond each step's estimate.

--from-images and --share build nothing: they read the engine (diff IDs, and the unpacked size of each
layer from the classic store's layer database, so as root), and count by chain ID and by diff ID; a
blob digest is known only for a pushed image, so they give no fetched bytes.
Bad input (an unknown cell, an image the engine lacks, a package name apt would refuse): one line, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import pulllib  # noqa: E402
import yaml  # noqa: E402
from benchlib import PY, need_disk, prune_own_records  # noqa: E402

from tests.docker.pullengine import PullEngine  # noqa: E402
from tests.docker.registry import LocalRegistry  # noqa: E402

DOCKER = pulllib.DOCKER
REPO = "ptmg-bench-pull"
DEFAULT_CELL = "2.7.0-cuda12.6-cudnn9-runtime"
KEEP_FREE_GB = 15.0  # what the machine keeps free at the bench's peak
PEAK_GB = 9.5  # one more image and its push (2.7.0: 5.8 + 3.3 GB; the 3.2 GB build context is gone by the push)
APT_NAME = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")  # Debian policy 5.6.1
ACCEPT = "application/vnd.docker.distribution.manifest.v2+json"


def fail(msg: str) -> NoReturn:
    print(f"bench_pull.py: {msg}", file=sys.stderr)
    sys.exit(2)


def log(msg: str) -> None:
    print(f"[bench_pull {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(argv: list[str], cwd: Path = ROOT, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False, **kw)


# --- the temporary project copy --------------------------------------------------------------------------
def copy_tree(dest: Path) -> Path:
    """The project's tracked and untracked-not-ignored files (what a clone would build), in dest/tree."""
    tree = dest / "tree"
    r = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    if r.returncode != 0:
        fail(f"{ROOT}: git ls-files: {r.stderr.strip()}")
    for name in filter(None, r.stdout.split("\0")):
        src = ROOT / name
        if src.is_file() or src.is_symlink():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tree / name, follow_symlinks=False)
    return tree


def set_config(tree: Path, cell: str, apt: str | None) -> str:
    """The copy's images.yaml: the throwaway repository, and `apt` added to the cell's packages (as a default,
    checked to reach the cell). Returns the image reference the build will tag."""
    path = tree / "images.yaml"
    data = yaml.safe_load(path.read_text())
    data["repository"] = REPO
    if apt is not None:
        data.setdefault("defaults", {}).setdefault("apt", [])
        data["defaults"]["apt"] = sorted({*(data["defaults"]["apt"] or []), apt})
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    r = run([PY, "-c", "import sys; from pathlib import Path; from builder.matrix import load_matrix; "
             "cells = {c.name: c for c in load_matrix(Path('images.yaml')).cells}; "
             f"c = cells.get({cell!r}); print('' if c is None else c.ref); "
             f"print('' if c is None else ' '.join(c.apt))"], cwd=tree)
    if r.returncode != 0:
        fail(f"{path}: the matrix does not load: {r.stderr.strip().splitlines()[-1:]}")
    ref, _, pkgs = r.stdout.strip().partition("\n")
    if not ref:
        fail(f"--cell {cell}: no such cell in images.yaml (`build.py matrix` lists them)")
    if apt is not None and apt not in pkgs.split():
        fail(f"--apt-package {apt}: the cell {cell} sets its own apt: list, so the default does not reach it")
    return ref


def build(tree: Path, cell: str, logs: Path) -> float:
    start = time.monotonic()
    r = run([PY, "build.py", "build", "--json", "--only", cell, "--log-dir", str(logs)], cwd=tree,
            env={**os.environ, "PTMG_PROJECT_DIR": str(tree)})
    if r.returncode != 0:
        raise RuntimeError(f"build.py build failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return time.monotonic() - start


def push(ref: str, reg: LocalRegistry, tag: str) -> tuple[dict[str, Any], float]:
    """Push `ref` as REPO:tag; the manifest the registry then serves."""
    import requests

    target = f"{reg.host}/{REPO}:{tag}"
    run([DOCKER, "tag", ref, target])
    start = time.monotonic()
    r = run([DOCKER, "push", target])
    took = time.monotonic() - start
    if r.returncode != 0:
        raise RuntimeError(f"docker push {target}: {(r.stderr or r.stdout).strip()[-1000:]}")
    m = requests.get(f"{reg.url}/v2/{REPO}/manifests/{tag}", headers={"Accept": ACCEPT}, timeout=30)
    m.raise_for_status()
    return dict(m.json()), took


def remove_image(*refs: str) -> None:
    for ref in refs:
        run([DOCKER, "image", "rm", "-f", ref])


# --- one change ----------------------------------------------------------------------------------------------
#: The torch change: another release of this small package of the lock's torch set (a dependency of torch).
TORCH_SET_PACKAGE = "filelock"


def torch_set_change(lock: Path, package: str = TORCH_SET_PACKAGE) -> tuple[str, str]:
    """A torch-only change of the lock: (its new text, what changed). `package` (of the lock's torch layer,
    pure Python) moves to its newest other release with a py3-none-any wheel (PyPI's JSON API: its URL,
    size and sha256), nothing else. Its RUN, the torch layer, installs again with all of torch, as for a
    new torch; the CUDA wheels' layer below stays. Asked before anything is built, so that a host without
    PyPI fails at once."""
    import requests

    text = lock.read_text()
    block = re.search(rf'\[\[packages\]\]\nname = "{package}"\nversion = "([^"]+)"\nwheels = \[(.*)\]\n'
                      r'tool\.pt-multi-gpu\.layer = "torch"\n', text)
    if block is None:
        fail(f"{lock}: no package {package!r} in the lock's torch layer")
    old = block.group(1)
    try:
        info = requests.get(f"https://pypi.org/pypi/{package}/json", timeout=60)
        info.raise_for_status()
    except requests.RequestException as e:
        fail(f"--change torch: PyPI's JSON API for {package} did not answer ({e}); run the other changes "
             "(--change files --change os) without PyPI")
    wheels = [(v, f) for v, files in info.json()["releases"].items() for f in files
              if v != old and f["filename"].endswith("-py3-none-any.whl") and not f.get("yanked")]
    newest = max(wheels, key=lambda vf: str(vf[1]["upload_time_iso_8601"]))
    version, f = newest
    url = str(f["url"])
    if not url.startswith("https://"):  # a mirror's relative link (../../packages/packages/<h>/<h>/<hash>/<file>)
        url = "https://files.pythonhosted.org/packages/" + url.split("packages/", 2)[-1]
    wheel = (f'{{ name = "{f["filename"]}", url = "{url}", size = {f["size"]}, '
             f'hashes = {{ sha256 = "{f["digests"]["sha256"]}" }} }}')
    new = text.replace(block.group(0), f'[[packages]]\nname = "{package}"\nversion = "{version}"\n'
                                       f'wheels = [{wheel}]\ntool.pt-multi-gpu.layer = "torch"\n')
    return new, f"the lock's torch set: {package} {old} -> {version} (the CUDA wheels and everything else unchanged)"


def apply_change(tree: Path, kind: str, cell: str, apt: str, torch_lock: tuple[str, str] | None) -> str:
    if kind == "torch":
        assert torch_lock is not None
        (tree / "locks" / cell / "pylock.toml").write_text(torch_lock[0])
        return torch_lock[1]
    if kind == "files":
        start = tree / "entrypoint" / "start.sh"
        start.write_bytes(start.read_bytes() + b"\n")
        return "entrypoint/start.sh: one byte appended (a newline)"
    set_config(tree, cell, apt)
    return f"apt: {apt} added to the cell's packages (the lock unchanged)"


@contextlib.contextmanager
def cleanup_on_signal() -> Iterator[None]:
    """SIGTERM (a timeout, a killed job) unwinds like Ctrl-C, so every `finally` below runs."""
    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def full_run(a: argparse.Namespace) -> dict[str, Any]:
    need_disk(KEEP_FREE_GB + 2 * PEAK_GB, "bench_pull (A and one B)")
    db = pulllib.layer_store()
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="ptmg-bench-pull-"))
    reg: LocalRegistry | None = None
    refs: list[str] = []
    result: dict[str, Any] = {"cell": a.cell, "engine": engine_line(), "changes": {}}
    try:
        tree = copy_tree(work)
        ref = set_config(tree, a.cell, None)
        torch_lock = torch_set_change(tree / "locks" / a.cell / "pylock.toml") if "torch" in a.change else None
        reg = LocalRegistry(work / "registry").start()
        log(f"A: building {ref} from a copy of the tree in {tree}")
        refs += [ref, f"{reg.host}/{REPO}:a"]
        result["build_a_s"] = round(build(tree, a.cell, work / "logs"), 1)
        if a.selftest:
            result["selftest_a"] = selftest(ref)
        old = pulllib.read_layers(ref, db)
        manifest_a, took = push(ref, reg, "a")
        result["push_a_s"] = round(took, 1)
        old = pulllib.with_blobs(old, manifest_a)
        run([DOCKER, "tag", ref, f"{REPO}:bench-a"])  # A stays while B takes the cell's tag
        refs.append(f"{REPO}:bench-a")
        for kind in a.change:
            need_disk(KEEP_FREE_GB + (1.0 if kind == "files" else PEAK_GB), f"bench_pull (B for {kind})")
            saved = {f: f.read_bytes() for f in (tree / "images.yaml", tree / "entrypoint" / "start.sh",
                                                 tree / "locks" / a.cell / "pylock.toml")}
            what = apply_change(tree, kind, a.cell, a.apt_package, torch_lock)
            log(f"B ({kind}): {what}; building")
            refs.append(f"{reg.host}/{REPO}:b-{kind}")
            took_b = build(tree, a.cell, work / "logs")
            new = pulllib.read_layers(ref, db)
            manifest_b, took = push(ref, reg, f"b-{kind}")
            c = pulllib.cost(old, pulllib.with_blobs(new, manifest_b))
            c.update(change=what, build_s=round(took_b, 1), push_s=round(took, 1))
            result["changes"][kind] = c
            print("\n".join(pulllib.cost_table(f"{a.cell}: {kind} ({what})", c)), flush=True)
            remove_image(f"{reg.host}/{REPO}:b-{kind}", ref)  # B (A keeps its layers under its other tag)
            for f, data in saved.items():  # the copy as A was built from it
                f.write_bytes(data)
            run([DOCKER, "tag", f"{REPO}:bench-a", ref])
        result["nodes"] = {store: node_pulls(store, reg, work, [*a.change]) for store in a.node}
        for kind in a.change:
            print("\n".join(node_table(kind, result)), flush=True)
    finally:
        log("cleaning up: the bench's images, the registry and its storage, the copy, this run's build records")
        remove_image(*refs)
        if reg is not None:
            reg.stop()
        shutil.rmtree(work, ignore_errors=True)
        freed = prune_own_records(started)
        log(f"removed; {freed / 1e9:.1f} GB of build records freed; "
            f"{shutil.disk_usage('/').free / 1e9:.1f} GB free")
    return result


def node_pulls(store: str, reg: LocalRegistry, work: Path, changes: list[str]) -> dict[str, Any]:
    """A node: a fresh Docker 28 engine with the given image store (tests/docker/pullengine.py). It pulls A
    from the registry, then each B in turn (B removed again after it, so each B is pulled onto a node that
    holds A only). Per pull: the wall time (fetch from loopback + unpack) and the blob bytes the registry
    served for it (its log), which is what the node fetched."""
    # A, and one B's new layers at a time (the torch change's: about 2.5 GB unpacked, 1.3 GB compressed)
    need_disk(KEEP_FREE_GB + (13.5 if store == "containerd" else 8.5), f"bench_pull (a {store} node)")
    out: dict[str, Any] = {}
    with PullEngine(work / f"node-{store}", store=store) as node:
        out["engine"] = f"Docker {node.version()}, {store}"
        for tag in ["a", *(f"b-{kind}" for kind in changes)]:
            mark = reg.log_path.stat().st_size
            start = time.monotonic()
            node.docker("pull", "-q", f"{reg.host}/{REPO}:{tag}")
            took = time.monotonic() - start
            with reg.log_path.open("rb") as f:
                f.seek(mark)
                served = pulllib.fetched_from_log(f.read().decode(errors="replace"))
            out[tag] = {"pull_s": round(took, 1), "fetched": served["bytes"], "blobs": served["blobs"]}
            log(f"node {store}: pulled {tag} in {took:.1f} s, {served['bytes'] / 1e6:,.1f} MB "
                f"in {served['blobs']} blob(s)")
            if tag != "a":
                node.docker("image", "rm", f"{reg.host}/{REPO}:{tag}")
    return out


def node_table(kind: str, result: dict[str, Any]) -> list[str]:
    """One change, as the nodes paid it: fetched bytes (the registry's log) and the pull's time, against A's."""
    out = [f"#### {kind}: a node that holds A pulls B", "",
           "| node | A: fetched, pull + unpack | B: fetched | B: pull + unpack |", "|---|---|---|---|"]
    for node in result["nodes"].values():
        first, b = node["a"], node[f"b-{kind}"]
        share = b["fetched"] / first["fetched"] if first["fetched"] else 0.0
        out.append(f"| {node['engine']} | {first['fetched'] / 1e6:,.1f} MB, {first['pull_s']:.1f} s | "
                   f"**{b['fetched'] / 1e6:,.1f} MB ({share:.1%})** | {b['pull_s']:.1f} s |")
    return [*out, ""]


def selftest(ref: str) -> str:
    """`docker run --rm IMAGE selftest` on A (labelled, with a time limit): the layout it measures must work."""
    log(f"A: docker run --rm {ref} selftest")
    start = time.monotonic()
    r = run([DOCKER, "run", "--rm", "--label", "project=pt-multi-gpu", "--label", "ptmg-helper=bench-pull",
             "--shm-size", "1g", ref, "selftest"], timeout=900)
    tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
    verdict = f"exit {r.returncode} in {time.monotonic() - start:.0f} s: {' / '.join(tail)}"
    log(f"A: selftest {verdict}")
    if r.returncode != 0:
        raise RuntimeError(f"selftest of {ref} failed: {(r.stdout + r.stderr)[-3000:]}")
    return verdict


def engine_line() -> str:
    r = run([DOCKER, "version", "--format", "{{.Server.Version}}"])
    d = run([DOCKER, "info", "--format", "{{.Driver}}"])
    return f"Docker {r.stdout.strip() or '?'}, {d.stdout.strip() or '?'}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--cell", default=DEFAULT_CELL)
    p.add_argument("--change", action="append", choices=("files", "os", "torch"),
                   help="the kinds of change, in order (repeatable; default: files, os, torch)")
    p.add_argument("--apt-package", default="less", help="the package the os change adds (default: less)")
    p.add_argument("--node", action="append", choices=("overlay2", "containerd"),
                   help="pull A and each B on a fresh Docker 28 node with this image store (repeatable; "
                        "default: both)")
    p.add_argument("--selftest", action="store_true", help="run `docker run --rm A selftest` before pushing A")
    p.add_argument("--from-images", nargs=2, metavar=("A", "B"), help="only compare two images the engine holds")
    p.add_argument("--share", nargs="+", metavar="IMAGE", help="only count what several images share on one node")
    p.add_argument("--json", type=Path, default=ROOT / "build-logs" / "bench_pull.json", help="where the figures go")
    a = p.parse_args()
    a.change = a.change or ["files", "os", "torch"]
    a.node = a.node or ["overlay2", "containerd"]
    if not APT_NAME.match(a.apt_package):
        fail(f"--apt-package {a.apt_package!r}: not a Debian package name (lower case, digits, + - .)")
    if a.from_images and a.share:
        fail("--from-images and --share: give one of them")
    try:
        if a.from_images or a.share:
            db = pulllib.layer_store()
            if a.from_images:
                old, new = (pulllib.read_layers(ref, db) for ref in a.from_images)
                out: dict[str, Any] = {"from_images": a.from_images, "engine": engine_line(),
                                       **pulllib.cost(old, new)}
                print("\n".join(pulllib.cost_table(f"{a.from_images[1]} for a node holding {a.from_images[0]}", out)))
            else:
                out = {"engine": engine_line(), **pulllib.share({ref: pulllib.read_layers(ref, db) for ref in a.share})}
                print("\n".join(pulllib.share_table(out)))
        else:
            with cleanup_on_signal():
                out = full_run(a)
    except pulllib.BenchInputError as e:
        fail(str(e))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"figures: {a.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
