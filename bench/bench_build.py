"""Build speed, install time and reproducibility. Prints a markdown report (paste into BENCHMARKS.md).

    flock /tmp/ptmg-docker.lock .venv/bin/python bench/bench_build.py [--cell 2.7.0-cuda12.6-cudnn9-runtime]
        [--pairs N] [--skip-cold] [--repro]

On the engine DOCKER_HOST names (default: the system's); `build.py build` picks its builder there as
a user's build would. On Docker 28 (scripts/engine28.sh start overlay2, then its environment):

    set -a; eval "$(scripts/engine28.sh start overlay2)"; set +a   # DOCKER_HOST, DOCKER_CONFIG, PTMG_E28_BIN
    docker -H unix:///var/run/docker.sock save debian:bookworm-slim | PATH=$PTMG_E28_BIN:$PATH docker load
    PATH=$PTMG_E28_BIN:$PATH .venv/bin/python bench/bench_build.py
    scripts/engine28.sh stop

Figures (targets are the project's requirements; every figure of one run comes from that run):
  1. no-op rebuild of the native default matrix                  < 2 s, nothing rebuilt
  2. the pip floor: `pip download` + `pip install` of the cell's top-level requirements into a
     fresh venv in a container of the cell's image, empty cache (no Docker build at all)
  3. before locked installs: the torch and tools RUNs as the Dockerfile had them (pip download + pip
     install, cold: no wheel cache), on the cell's own OS layer: BuildKit's step times
  4. after, cold: `build.py build --force --no-cache` with an EMPTY wheel store: the whole build
     (fetch, context transfer, every layer, export, probe)    <= 1.0x the floor (2)
     --pairs N: figures 2 and 4 N times, alternated, each cold build against the floor run just
     before it (the host's speed drifts over minutes); every ratio, the worst and the median
     and its torch RUN                                          <= 0.5x the torch RUN of (3)
     4b. where the builder is buildx (whose default is the wheel server): the same cold
     build with the wheels in the build context (PTMG_WHEEL_TRANSPORT=context), for comparison
  5. after, warm: the same with the store filled (a rebuild without the layer cache)
  6. rebuild after an entrypoint/-only change                   <= 10% of the cold build
  7. --repro: two --no-cache builds of the cell from the same lock: their file trees compared
     (path, type, mode, owner, size, sha256 of the content) and what still differs, by kind

Disk: figures 3-5 and 7 build under a throwaway repository (ptmg-bench:<cell>, from a copy of the
matrix and the cell's lock), so the cell's own image is never replaced; each such image is removed
after its figure, and the BuildKit records this run created that no image uses any more are removed
by record id (shared cache mounts are never touched). Peak: about 10 GB free is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import (  # noqa: E402
    BENCH_REPO,
    BENCH_TOKEN,
    DOCKER,
    LABELS,
    context_bytes,
    need_disk,
    prune_own_records,
    run,
    step_times,
    timed_build,
)

import ptmg_contract as contract  # noqa: E402
from builder.imaging import buildenv  # noqa: E402
from builder.lock.target import wanted  # noqa: E402
from builder.matrix import ImageSpec, load_matrix  # noqa: E402
from builder.render import dockerfile  # noqa: E402


def bench_config(workdir: Path, cell: str) -> Path:
    """The matrix under a throwaway repository, with the cell's lock beside it: bench images never
    replace a cell's own image."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "images.yaml"
    config.write_text((ROOT / "images.yaml").read_text().replace("\nrepository: pt-multi-gpu\n",
                                                                  f"\nrepository: {BENCH_REPO}\n"))
    shutil.rmtree(workdir / "locks", ignore_errors=True)
    (workdir / "locks").mkdir()
    shutil.copytree(ROOT / "locks" / cell, workdir / "locks" / cell)
    shutil.copy(ROOT / "locks" / "pylock.uv.toml", workdir / "locks" / "pylock.uv.toml")
    return config


def empty_store_of(cell: str) -> int:
    """Remove every wheel of the cell's lock from the wheel store (the next build downloads them all)."""
    from builder.lock import model
    from builder.lock.store import default_store

    names = [p.wheel.filename for p in model.read(model.lock_path(ROOT, cell)).packages]
    for n in names:
        (default_store() / n).unlink(missing_ok=True)
    return len(names)


# --- 2. the floor ----------------------------------------------------------------------------------
class Floor(NamedTuple):
    """One floor run's seconds: the download goes through the host's network one file at a time, and
    its speed drifts most."""

    download: float
    install: float

    @property
    def total(self) -> float:
        return self.download + self.install


def floor_seconds(spec: ImageSpec) -> Floor:
    """pip download + pip install of the cell's requirements in a bare venv in a container, empty cache."""
    reqs = [r for layer in wanted(spec).values() for r in layer if r != "pip"]
    pkgs = " ".join(repr(r) for r in reqs)
    script = ("set -e; python3 -m venv /tmp/v; t0=$(date +%s%N); "
              f"/tmp/v/bin/pip download -q -d /tmp/w {pkgs}; t1=$(date +%s%N); "
              f"/tmp/v/bin/pip install -q --no-index --find-links /tmp/w {pkgs}; "
              "t2=$(date +%s%N); echo FLOOR $(( (t1 - t0) / 1000000 )) $(( (t2 - t1) / 1000000 ))")
    # /tmp (the venv and the wheelhouse, ~9 GB) is a tmpfs: no disk needed. It favours the floor: the build
    # writes its 5 GB to disk, and the same floor on the container's overlay read 140-172 s against 132-137 s.
    r = run([DOCKER, "run", "--rm", *LABELS, "--user", "0", "--entrypoint", "bash", "--tmpfs", "/tmp:size=12g,exec",
             "-v", "/etc/ssl/certs/ca-certificates.crt:/ca.pem:ro", "-e", "PIP_CERT=/ca.pem",
             "-e", "PIP_NO_CACHE_DIR=1", spec.ref, "-c", script])
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("FLOOR ")]
    if not line:
        sys.exit(f"floor run failed: {r.stdout[-2000:]} {r.stderr[-2000:]}")
    download, install = (float(ms) / 1000 for ms in line[0].split()[1:3])
    return Floor(download, install)


def pip_run(reqs: list[str], spec: ImageSpec, cache_id: str, *, venv: bool) -> str:
    """A venv RUN as the Dockerfile had it before locked installs (pip download into a wheelhouse in a cache mount, pip
    install from it); the cache mount is this run's own, so it starts empty (cold) as in a fresh CI run."""
    quoted = " ".join(f'"{r}"' for r in reqs)
    cache = f"--mount=type=cache,id={cache_id},target=/tmp,uid={contract.UID},gid={contract.GID},sharing=locked"
    lines = [f"RUN {cache} \\",
             f"    --mount=type=secret,id=build-env,uid={contract.UID} \\",
             f"    --mount=type=secret,id=ca-bundle,uid={contract.UID} \\",
             "    --mount=type=bind,source=imagebuild/slim-venv.sh,target=/ptmg-build/slim-venv.sh \\",
             "    if [ -f /run/secrets/build-env ]; then . /run/secrets/build-env; fi \\"]
    lines.append(f" && : {BENCH_TOKEN} \\")
    if venv:
        lines.append(f" && python3 -m venv {contract.VENV} \\")
    lines += [f" && pip download --no-cache-dir --dest /tmp/wheels {quoted} \\",
              f" && pip install --no-cache-dir --no-index --find-links /tmp/wheels {quoted} \\"]
    if venv:
        lines.append(" && python -c 'import torch, torchvision' \\")
    lines += [f" && find {contract.VENV} ! -type l ! -perm -g+w -exec chmod g+w {{}} + \\",
              f" && bash /ptmg-build/slim-venv.sh {' '.join(dockerfile.slim_args(spec))} {contract.VENV}"]
    return "\n".join(lines) + "\n"


def before_dockerfile(spec: ImageSpec) -> str:
    """The cell's Dockerfile without its shared trees' stages and layers: the base and the user, then its OS
    layer (the same RUN: cached; pip needs the image's python3, which the venv's own RUNs take from the
    build's Python stage), then pip's RUNs as the user."""
    text = dockerfile.render(spec)
    cuda_at, image_at = text.index("# 0b. The shared trees"), text.index("# 0c. The image")
    venv_at, os_at = text.index("# 2. The venv"), text.index("# 4. OS packages")
    os_end = text.index("\n\n", text.index("\nRUN ", os_at) + 1)
    base = f"FROM {spec.base_ref}\n\n" + text[text.index("SHELL [", image_at):venv_at]
    core = [r for r in wanted(spec)["torch"] if r != "pip"]
    tools = sorted({*wanted(spec)["tools"], *core})
    cache = f"ptmg-bench-{time.time_ns()}"
    return (text[:cuda_at] + base + text[os_at:os_end] + f"\n\nUSER {contract.UID}\n\n"
            + pip_run(core, spec, cache, venv=True) + pip_run(tools, spec, cache, venv=False))


def before(spec: ImageSpec, tag: str) -> dict[str, float]:
    labels = run([DOCKER, "image", "inspect", "-f", "{{json .Config.Labels}}", spec.ref])
    snapshot = json.loads(labels.stdout or "{}").get(contract.LABEL_OS_SNAPSHOT, "")
    env = buildenv.detect(os.environ)
    with tempfile.TemporaryDirectory() as tmp, buildenv.secret_files(env) as secrets:
        df = Path(tmp) / "Dockerfile"
        df.write_text(before_dockerfile(spec))
        argv = [DOCKER, "build", "--progress=plain", "--pull=false", "-f", str(df), "-t", tag, *LABELS,
                "--build-arg", f"{contract.OS_SNAPSHOT_ARG}={snapshot}"]
        argv += [a for sid, p in sorted(secrets.items()) for a in ("--secret", f"id={sid},src={p}")]
        r = run([*argv, str(ROOT)], env={**os.environ, "DOCKER_BUILDKIT": "1"})
    if r.returncode != 0:
        sys.exit(f"the pip (before) build failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return step_times(r.stdout + r.stderr)


# --- 4. cold builds -------------------------------------------------------------------------------------
def cold_build(cell: str, config: Path, started: float, env: dict[str, str]) -> tuple[float, dict[str, Any], str]:
    """One cold build (none of the cell's wheels in the store, no layer cache): (seconds, step times
    with a 'parts' summary, a description of the build)."""
    need_disk(7, "the cold build")
    gone = empty_store_of(cell)  # cold: none of the cell's wheels in the store (they come back)
    seconds, _, err = timed_build(["--config", str(config), "--only", cell, "--force", "--no-cache"], env)
    log = (ROOT / "build-logs" / f"{cell}.log").read_text()
    run([DOCKER, "image", "rm", "-f", f"{BENCH_REPO}:{cell}"])
    prune_own_records(started)
    s: dict[str, Any] = dict(step_times(log))
    fetched = re.search(r"downloaded \(([\d.]+) GB\) in ([\d.]+) s( while the build ran)?", err)
    served = "from the wheel server at" in err
    fetch = f"{fetched.group(1)} GB in {fetched.group(2)} s" if fetched else "-"
    s["parts"] = (f"fetch {fetch}{' (during the build)' if served else ''}, context {context_bytes(log)}, "
                  f"OS {s.get('os', 0):.1f} s, torch {s.get('torch', 0):.1f} s, tools {s.get('tools', 0):.1f} s, "
                  f"SBOM {s.get('sbom', 0):.1f} s, export {s.get('export', 0):.1f} s")
    return seconds, s, f"none of its {gone} wheels in the store, no layer cache, transport " + (
        "server" if served else "context")


def engine_line() -> str:
    """Which engine, store and builder ran the figures."""
    v = run([DOCKER, "version", "--format", "{{.Server.Version}}"]).stdout.strip()
    driver = run([DOCKER, "info", "--format", "{{.Driver}} {{json .DriverStatus}}"]).stdout.strip()
    classic = f"classic store ({(driver.split() or ['?'])[0]})"
    store = "containerd image store" if "io.containerd.snapshotter" in driver else classic
    return f"engine: Docker {v}, {store}, DOCKER_HOST={os.environ.get('DOCKER_HOST', '(default)')}"


# --- 7. reproducibility ---------------------------------------------------------------------------------
SKIP = "\\( -path /proc -o -path /sys -o -path /dev -o -path /out \\) -prune -o"
TREE = (f"find / -xdev {SKIP} -printf '%p\\t%y\\t%m\\t%U:%G\\t%s\\t%l\\n' | sort > /out/meta; "
        f"find / -xdev {SKIP} -type f -print0 | sort -z | xargs -0 sha256sum > /out/sums")


def tree(ref: str, out: Path) -> tuple[dict[str, str], dict[str, str]]:
    out.mkdir(parents=True, exist_ok=True)
    r = run([DOCKER, "run", "--rm", *LABELS, "--user", "0", "--entrypoint", "sh", "-v", f"{out}:/out", ref, "-c", TREE])
    if r.returncode != 0:
        sys.exit(f"listing {ref} failed: {r.stderr[-2000:]}")
    meta = {ln.split("\t", 1)[0]: ln for ln in (out / "meta").read_text().splitlines()}
    sums = {ln[66:]: ln[:64] for ln in (out / "sums").read_text().splitlines()}
    return meta, sums


def kind_of(path: str) -> str:
    for pattern, kind in ((r"\.pyc$", ".pyc"), (r"^/opt/venv/", "venv (other)"), (r"^/var/lib/dpkg/", "dpkg database"),
                          (r"^/var/log/", "logs"), (r"^/var/cache/", "caches"), (r"^/opt/pt-multi-gpu/", "ours"),
                          (r"^/etc/", "/etc"), (r"^/usr/", "/usr")):
        if re.search(pattern, path):
            return kind
    return "other"


def repro(cell: str, config: Path, workdir: Path) -> list[str]:
    runs = []
    for name in ("A", "B"):
        need_disk(8, f"reproducibility build {name}")
        t, rows, _ = timed_build(["--config", str(config), "--only", cell, "--force", "--no-cache"])
        image_id = str(rows[0]["image_id"])
        runs.append((name, t, image_id, tree(image_id, workdir / name)))
        run([DOCKER, "image", "rm", "-f", image_id, f"{BENCH_REPO}:{cell}"])
    (_, ta, ida, (ma, sa)), (_, tb, idb, (mb, sb)) = runs
    meta_diff = sorted(p for p in set(ma) | set(mb) if ma.get(p) != mb.get(p))
    content_diff = sorted(p for p in set(sa) | set(sb) if sa.get(p) != sb.get(p))
    out = [f"| builds | A {ta:.0f} s ({ida[:19]}), B {tb:.0f} s ({idb[:19]}) |",
           f"| entries compared | {len(ma)} (A), {len(mb)} (B); regular files {len(sa)} / {len(sb)} |",
           f"| path, type, mode, owner, size or link differ | {len(meta_diff)} |",
           f"| content (sha256) differs | {len(content_diff)} |"]
    for kind, n in Counter(kind_of(p) for p in content_diff).most_common():
        out.append(f"| content differs: {kind} | {n} (e.g. `{next(p for p in content_diff if kind_of(p) == kind)}`) |")
    for kind, n in Counter(kind_of(p) for p in meta_diff).most_common():
        out.append(f"| metadata differs: {kind} | {n} (e.g. `{next(p for p in meta_diff if kind_of(p) == kind)}`) |")
    (workdir / "differs.txt").write_text("\n".join(["# content", *content_diff, "# metadata", *meta_diff]) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cell", default="2.7.0-cuda12.6-cudnn9-runtime")
    ap.add_argument("--skip-cold", action="store_true", help="skip figures 2-5 (minutes each, 6 GB of disk)")
    ap.add_argument("--pairs", type=int, default=1, choices=range(1, 10), metavar="N",
                    help="figures 2 and 4: N floor + cold build pairs, alternated (3.5-4 min each)")
    ap.add_argument("--repro", action="store_true", help="figure 7: two --no-cache builds compared")
    ap.add_argument("--workdir", type=Path, default=ROOT / "build-logs" / "bench")
    a = ap.parse_args()
    started = time.time()
    cells = load_matrix(ROOT / "images.yaml").cells
    spec = next(c for c in cells if c.name == a.cell)
    out: list[str] = [engine_line(), "", "| figure | result | target |", "|---|---|---|"]

    _, planned, _ = timed_build(["--dry-run"])
    stale = [str(r["cell"]) for r in planned if r["status"] != "skipped"]
    if stale:  # figure 1 is about an up-to-date matrix; never start building every cell from here
        out.append(f"| 1. no-op rebuild, native default matrix | not measured: not up to date ({', '.join(stale)}) | |")
    else:
        noop, rows, _ = timed_build([])
        statuses = sorted({str(r["status"]) for r in rows})
        out.append(f"| 1. no-op rebuild, native default matrix ({len(rows)} cells) | {noop:.2f} s, {statuses} "
                   "| < 2 s |")

    cold = None
    config = bench_config(a.workdir / "matrix", a.cell)
    bench_ref = f"{BENCH_REPO}:{a.cell}"
    if not a.skip_cold:
        # The floor and the cold build, alternated: the host's speed drifts over minutes (the floor
        # read 77-115 s on one machine), so each ratio compares two runs made side by side.
        pairs = []
        for _ in range(a.pairs):
            floor = floor_seconds(spec)
            cold, s, line = cold_build(a.cell, config, started, {})
            pairs.append((floor, cold, s))
        ratios = sorted(c / f.total for f, c, _ in pairs)
        floors = ", ".join(f"{f.total:.0f} s ({f.download:.0f} + {f.install:.0f})" for f, _, _ in pairs)
        out.append(f"| 2. pip floor: `pip download` + `pip install` of the same set, fresh venv, empty cache "
                   f"(download + install) | {floors} | |")
        each = ", ".join(f"{c:.0f} s = {c / f.total:.2f}x" for f, c, _ in pairs)
        worst = f"; worst {ratios[-1]:.2f}x, median {ratios[len(ratios) // 2]:.2f}x" if len(pairs) > 1 else ""
        out.append(f"| 4. after, cold ({line}): whole build, each against the floor just before it | {each}{worst} "
                   "| <= 1.0x the floor |")
        for i, (_, _, parts) in enumerate(pairs, start=1):
            out.append(f"| 4. ... of which{f' (pair {i})' if len(pairs) > 1 else ''}: {parts['parts']} | |")
        tag = f"{BENCH_REPO}:pip-before"
        need_disk(9.5, "the pip (before) build")
        try:
            b = before(spec, tag)
        finally:
            run([DOCKER, "image", "rm", "-f", tag])
        out.append(f"| 3. before locked installs: pip torch RUN / tools RUN, cold | {b.get('torch', 0):.1f} s / "
                   f"{b.get('tools', 0):.1f} s | |")
        prune_own_records(started)
        torch_after = sorted(p[2].get("torch", 0) for p in pairs)[len(pairs) // 2]
        out.append(f"| 4. torch RUN after{' (median)' if len(pairs) > 1 else ''} / before | {torch_after:.1f} s / "
                   f"{b.get('torch', 0):.1f} s = {torch_after / max(b.get('torch', 1), 0.1):.2f}x | <= 0.5x |")
        if "transport server" in line:
            other, o, oline = cold_build(a.cell, config, started, {"PTMG_WHEEL_TRANSPORT": "context"})
            out.append(f"| 4b. the same, wheels in the build context ({oline}): whole build | {other:.0f} s = "
                       f"{other / pairs[-1][0].total:.2f}x the last floor | |")
            out.append(f"| 4b. ... of which: {o['parts']} | |")
        need_disk(8, "the warm build")
        warm, _, _ = timed_build(["--config", str(config), "--only", a.cell, "--force", "--no-cache"])
        w = step_times((ROOT / "build-logs" / f"{a.cell}.log").read_text())
        run([DOCKER, "image", "rm", "-f", bench_ref])
        prune_own_records(started)
        out.append(f"| 5. after, warm store, no layer cache: whole build / torch RUN / tools RUN | {warm:.0f} s / "
                   f"{w.get('torch', 0):.1f} s / {w.get('tools', 0):.1f} s | |")

    # Untimed: one build of the cell as it is, so BuildKit holds the build context again (the
    # record pruning above drops it; a user's repeated builds keep it). Without this, figure 6
    # would time a 3 GB context re-send instead of the entrypoint layers.
    timed_build(["--only", a.cell, "--force"])
    touch = ROOT / "entrypoint" / ".bench-touch"
    touch.write_text(str(time.time()))
    try:
        ep, _, _ = timed_build(["--only", a.cell])
    finally:
        touch.unlink()
    timed_build(["--only", a.cell])
    ref = f" = {ep / cold * 100:.1f}% of cold" if cold else ""
    out.append(f"| 6. rebuild after an entrypoint/-only change | {ep:.1f} s{ref} | <= 10% of cold |")
    print("\n".join(out))

    if a.repro:
        print("\n| reproducibility: two `--no-cache` builds of " + a.cell + " | |\n|---|---|")
        print("\n".join(repro(a.cell, config, a.workdir / "repro")))
    freed = prune_own_records(started)
    print(f"\n(cleanup: {freed / 1e9:.1f} GB of this run's unused BuildKit records removed)")


if __name__ == "__main__":
    main()
