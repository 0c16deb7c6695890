"""What `publish --compression zstd` buys against gzip for one real cell, measured in one run:
bytes pushed, push time, and pull + unpack time. Prints a markdown table (paste into BENCHMARKS.md).

    flock /tmp/ptmg-docker.lock nice -n 19 .venv/bin/python bench/bench_publish.py \\
        [--cell 2.7.0-cuda12.6-cudnn9-runtime] [--compression gzip,zstd]

Per compression, in turn (so the disk holds one copy at a time):
1. a loopback registry of its own (Debian's docker-registry, storage under a temporary folder);
2. `build.py publish --compression C` of the cell, under a repository name of this run only
   (``ptmg-bench-<id>``: the cell's image is tagged with it, never retagged or removed itself), with
   a smoke pass recorded in a temporary state folder and the offline advisories of the tests;
   bytes pushed = every blob in the registry's storage; push time = the first immutable tag's push
   (every layer goes up there; the other tags find them);
3. the same publish again, twice: as the weekly run does it (the freshness gate finds the image under
   the floating tag and skips the cell: "unchanged since <date>"), then with --publish-unchanged (each
   tag read and found "unchanged": the config digest is the image ID);
4. `docker pull` by digest, timed, into a fresh engine of its own (tests/docker/pullengine.py: Debian's
   Docker 28, its own data-root): the system engine (Docker 20.10) can't unpack zstd, and it holds the
   cell already, so a pull there would find the image and download nothing. Pulled image ID == the cell's.
Then the registry and the pull engine are stopped and their folders deleted.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from builder.smoke import passes  # noqa: E402
from tests.docker.pullengine import PullEngine  # noqa: E402
from tests.docker.registry import LocalRegistry  # noqa: E402

CELL = "2.7.0-cuda12.6-cudnn9-runtime"
NAMESPACE = "bench"


@dataclass
class Result:
    compression: str
    stored: int  # bytes of every blob the registry holds after the publish
    layers: int  # the layers' compressed bytes (the manifest's sizes)
    push: float  # the first immutable tag: every layer sent
    publish: float  # the whole `build.py publish` (every tag, verifications, gates)
    rerun: float
    rerun_says: str  # what the cell's report says
    forced: float  # --publish-unchanged
    forced_says: str
    pull: float  # docker pull + unpack into a fresh Docker 28
    peak_rss: int  # of the publish process, bytes
    same_image: bool


def blob_bytes(storage: Path) -> int:
    base = storage / "docker/registry/v2/blobs"
    return sum(p.stat().st_size for p in base.rglob("data")) if base.exists() else 0


def publish(config: Path, cell: str, registry: LocalRegistry, compression: str, report_dir: Path,
            env: dict[str, str], *extra: str) -> tuple[dict[str, Any], float, int]:
    """`build.py publish` in a subprocess: (report, seconds, peak RSS in bytes)."""
    argv = [sys.executable, str(ROOT / "build.py"), "publish", "--config", str(config), "--only", cell,
            "--registry", f"{registry.host}/{NAMESPACE}", "--report-dir", str(report_dir), "--compression",
            compression, "--allow-stale-os", "--osv-dir", str(ROOT / "tests/fixtures/osv"), *extra]
    report_dir.mkdir(parents=True)
    log = report_dir / "publish.log"
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=out)
        try:
            _pid, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS (KiB)
        except BaseException:  # interrupted: the publish goes too, then the caller cleans up
            proc.kill()
            proc.wait()
            raise
    seconds = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"publish --compression {compression} failed (exit {proc.returncode}):\n"
                         f"{log.read_text()[-4000:]}")
    report = json.loads((report_dir / "publish-report.json").read_text())
    return report, seconds, usage.ru_maxrss * 1024


def check_disk(need: int, floor: int) -> None:
    free = shutil.disk_usage("/var/tmp").free
    if free - need < floor:
        raise SystemExit(f"bench_publish needs ~{need / 1e9:.0f} GB for a while (the registry's copy, the pulled "
                         f"image, a save's temporary copy) and {floor / 1e9:.0f} GB left over; {free / 1e9:.0f} GB "
                         "are free: free some space or lower --min-free-gb")


def measure(compression: str, config: Path, cell_name: str, repo: str, image_id: str, work: Path,
            env: dict[str, str]) -> Result:
    reg = LocalRegistry(work / f"registry-{compression}")
    try:
        reg.start()
        report, seconds, rss = publish(config, cell_name, reg, compression, work / f"report-{compression}", env)
        (cell,) = report["cells"]
        first = next(t for t in cell["tags"] if t["kind"] == "immutable")
        assert {t["compression"] for t in cell["tags"]} == {compression}, cell["tags"]
        stored = blob_bytes(reg.storage)
        again, rerun, _ = publish(config, cell_name, reg, compression, work / f"report-{compression}-again", env)
        forced, forced_time, _ = publish(config, cell_name, reg, compression, work / f"report-{compression}-forced",
                                         env, "--publish-unchanged")
        ref = f"{reg.host}/{NAMESPACE}/{repo}@{cell['digest']}"
        with PullEngine(work) as engine:
            t0 = time.monotonic()
            engine.docker("pull", "--quiet", ref, timeout=3600)
            pull = time.monotonic() - t0
            same = engine.image_id(ref) == image_id
        return Result(compression, stored, int(cell["compressed_size"]), float(first["seconds"]), seconds, rerun,
                      says(again), forced_time, says(forced), pull, rss, same)
    finally:
        reg.stop()
        shutil.rmtree(reg.root, ignore_errors=True)


def says(report: dict[str, Any]) -> str:
    """A rerun's outcome: the tags' statuses, or the cell's "unchanged since" when the gate skipped it."""
    (cell,) = report["cells"]
    statuses = sorted({t["status"] for t in cell["tags"]})
    return "every tag " + "/".join(statuses) if statuses else str(cell["unchanged_since"]).split(" (", 1)[0]


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def table(results: list[Result]) -> str:
    rows = ["| | " + " | ".join(r.compression for r in results) + " |", "|---" * (len(results) + 1) + "|"]
    fields: list[tuple[str, Callable[[Result], str]]] = [
        ("bytes pushed (every blob in the registry)", lambda r: gb(r.stored)),
        ("of which layers (manifest sizes)", lambda r: gb(r.layers)),
        ("push: first immutable tag (every layer sent)", lambda r: f"{r.push:.1f} s"),
        ("whole `build.py publish` (every tag, gates, verification)", lambda r: f"{r.publish:.1f} s"),
        ("rerun, as the weekly run (freshness gate)", lambda r: f"{r.rerun:.1f} s: {r.rerun_says}"),
        ("rerun with --publish-unchanged", lambda r: f"{r.forced:.1f} s: {r.forced_says}"),
        ("pull + unpack into a fresh Docker 28", lambda r: f"{r.pull:.1f} s"),
        ("pulled image ID == the cell's", lambda r: "yes" if r.same_image else "**no**"),
        ("peak RSS of `build.py publish`", lambda r: f"{r.peak_rss / 2**20:.0f} MiB"),
    ]
    for name, value in fields:
        rows.append(f"| {name} | " + " | ".join(value(r) for r in results) + " |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--cell", default=CELL)
    ap.add_argument("--compression", default="gzip,zstd")
    ap.add_argument("--min-free-gb", type=float, default=20.0, help="disk to leave free at the peak (default 20)")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still runs the cleanup below
    client = docker.from_env(timeout=600)
    image = client.images.get(f"pt-multi-gpu:{a.cell}")
    repo = f"ptmg-bench-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix="ptmg-bench-publish-", dir="/var/tmp"))
    text = (ROOT / "images.yaml").read_text()
    data = yaml.safe_load(text.replace("\nrepository: pt-multi-gpu\n", f"\nrepository: {repo}\n"))
    data["include"] = [c for c in data["include"] if c.get("platform", "linux/amd64") == "linux/amd64"]
    config = work / "images.yaml"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PTMG_")}
    env.update(PTMG_STATE_DIR=str(work / "state"), DOCKER_CONFIG=str(work / "docker-config"))
    os.environ["PTMG_STATE_DIR"] = env["PTMG_STATE_DIR"]
    passes.record_pass(ROOT, str(image.id), a.cell, passed=1, skipped=0)  # the floating tags move, as in production
    image.tag(repo, a.cell)
    results = []
    try:
        for compression in a.compression.split(","):
            check_disk(int(2.2 * image.attrs["Size"]), int(a.min_free_gb * 1e9))
            print(f"measuring {compression} ...", file=sys.stderr)
            results.append(measure(compression, config, a.cell, repo, str(image.id), work, env))
            print(f"  {results[-1]}", file=sys.stderr)
    finally:
        client.images.remove(f"{repo}:{a.cell}", noprune=True)
        shutil.rmtree(work, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip()
    versions = client.version()
    print(f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, cell {a.cell} "
          f"({image.attrs['Size'] / 1e9:.2f} GB, {len(image.attrs['RootFS']['Layers'])} layers), "
          f"pushing engine Docker {versions['Version']}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}\n")
    print(table(results))
    return 0 if all(r.same_image for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
