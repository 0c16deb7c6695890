"""Build speed and image size benchmarks. Prints a markdown report (paste into BENCHMARKS.md).

    .venv/bin/python bench/bench_build.py [--cell 2.7.0-cuda12.6-cudnn9-runtime] [--skip-cold]

Figures (targets from the build issue):
  1. no-op rebuild of the whole default matrix                 < 2 s, nothing rebuilt
  2. rebuild after an entrypoint/-only change                   <= 10% of that cell's cold build
  3. cold build of a CUDA cell vs the floor (pip download +
     pip install of the same packages in a bare container)       <= 1.2x the floor
  4. a second cell sharing the torch version                    torch not downloaded again
  5. image size per cell next to pytorch/pytorch runtime images  <= 0.9x, and where the bytes go

"Cold" means: no layer cache (--no-cache) and an empty pip cache mount. The
floor starts from the same base with python3-venv installed and uses an empty
pip cache too. Needs every default cell built already (`make images`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from builder.render.dockerfile import core_requirements  # noqa: E402
from builder.spec import load_matrix  # noqa: E402

PY = sys.executable
DOCKER = "/usr/bin/docker"
OFFICIAL = {"2.7.1-cuda11.8-cudnn9-runtime": 6.48e9, "2.0.0-cuda11.7-cudnn8-runtime": 6.44e9}


def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload,no-any-return]


def timed_build(args: list[str]) -> tuple[float, list[dict[str, object]]]:
    start = time.monotonic()
    r = run([PY, "build.py", "build", "--json", *args])
    elapsed = time.monotonic() - start
    if r.returncode != 0:
        sys.exit(f"build failed: {r.stderr[-3000:]}")
    return elapsed, json.loads(r.stdout)


def prune_pip_cache() -> None:
    run([DOCKER, "builder", "prune", "-f", "--filter", "type=exec.cachemount"])


def floor_seconds(cell_ref: str, reqs: list[str]) -> float:
    """pip download + pip install of the same package set in a bare container with an empty cache."""
    pkgs = " ".join(repr(r) for r in reqs)
    script = (
        "set -e; python3 -m venv /tmp/v; t0=$(date +%s%N); "
        f"/tmp/v/bin/pip download -q -d /tmp/w {pkgs}; "
        f"/tmp/v/bin/pip install -q --no-index --find-links /tmp/w {pkgs}; "
        "t1=$(date +%s%N); echo FLOOR $(( (t1 - t0) / 1000000 ))"
    )
    # The cell's own image has python3-venv; a fresh venv in /tmp is a bare install target.
    r = run([DOCKER, "run", "--rm", "--label", "project=pt-multi-gpu", "--entrypoint", "bash",
             "-v", "/etc/ssl/certs/ca-certificates.crt:/ca.pem:ro", "-e", "PIP_CERT=/ca.pem",
             "-e", "PIP_NO_CACHE_DIR=1", cell_ref, "-c", script])
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("FLOOR ")]
    if not line:
        sys.exit(f"floor run failed: {r.stdout[-2000:]} {r.stderr[-2000:]}")
    return float(line[0].split()[1]) / 1000


def layer_report(ref: str) -> list[tuple[str, str]]:
    r = run([DOCKER, "history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", ref])
    rows = []
    for line in r.stdout.splitlines():
        size, _, created = line.partition("\t")
        if size not in ("0B", "0"):
            rows.append((size, " ".join(created.split())[:90]))
    return rows


def dir_report(ref: str) -> str:
    r = run([DOCKER, "run", "--rm", "--label", "project=pt-multi-gpu", "--entrypoint", "bash", ref, "-c",
             "du -sh /opt/venv/lib/python3*/site-packages/* /usr 2>/dev/null | sort -rh | head -12"])
    return r.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cell", default="2.7.0-cuda12.6-cudnn9-runtime")
    ap.add_argument("--skip-cold", action="store_true", help="skip figures 3 and 4 (minutes each)")
    a = ap.parse_args()
    cells = load_matrix(ROOT / "images.yaml").cells
    spec = next(c for c in cells if c.name == a.cell)
    out: list[str] = ["| figure | result | target |", "|---|---|---|"]

    # 1. no-op rebuild of the whole matrix
    noop, rows = timed_build([])
    statuses = {str(r["status"]) for r in rows}
    out.append(f"| no-op rebuild, whole default matrix ({len(rows)} cells) | {noop:.2f} s, statuses {sorted(statuses)} "
               "| < 2 s, nothing rebuilt |")

    cold = None
    if not a.skip_cold:
        # 3. cold build vs floor
        prune_pip_cache()
        cold, _ = timed_build(["--only", a.cell, "--force", "--no-cache"])
        floor = floor_seconds(spec.ref, [*core_requirements(spec), *spec.tools])
        out.append(f"| cold build of {a.cell} (no layer cache, empty pip cache) | {cold:.0f} s vs floor "
                   f"{floor:.0f} s = {cold / floor:.2f}x | <= 1.2x floor |")

        # 4. a second cell that shares the torch version reuses the cached wheel
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "images.yaml"
            cfg.write_text(f'repository: ptmg-bench\ninclude:\n  - {{torch: "{spec.torch}", flavour: dev}}\n')
            t, _ = timed_build(["--config", str(cfg), "--force"])
            log = (ROOT / "build-logs" / f"{spec.torch}-cuda{spec.cuda}-cudnn{spec.cudnn_major}-dev.log").read_text()
            downloaded = "Downloading torch-" in log
            reused = "File was already downloaded /tmp/wheels/torch-" in log
            out.append(f"| second cell with torch {spec.torch} (dev flavour) | {t:.0f} s; torch downloaded again: "
                       f"{'yes' if downloaded else 'no'} (pip: {'already in the wheelhouse' if reused else '?'}) "
                       "| not downloaded |")
            run([DOCKER, "image", "rm", f"ptmg-bench:{spec.torch}-cuda{spec.cuda}-cudnn{spec.cudnn_major}-dev"])

    # 2. entrypoint-only change
    touch = ROOT / "entrypoint" / ".bench-touch"
    touch.write_text(str(time.time()))
    try:
        ep, _ = timed_build(["--only", a.cell])
    finally:
        touch.unlink()
    timed_build(["--only", a.cell])  # back to the committed inputs
    ref = f" = {ep / cold * 100:.1f}% of cold" if cold else ""
    out.append(f"| rebuild after an entrypoint/-only change ({a.cell}) | {ep:.1f} s{ref} | <= 10% of cold |")

    # 5. sizes
    print("\n".join(out))
    print("\n| cell | size | vs pytorch/pytorch runtime |\n|---|---|---|")
    for c in cells:
        r = run([DOCKER, "image", "inspect", "--format", "{{.Size}}", c.ref])
        size = int(r.stdout.strip() or 0)
        key = "2.0.0-cuda11.7-cudnn8-runtime" if c.cuda.startswith("11") else "2.7.1-cuda11.8-cudnn9-runtime"
        pt = OFFICIAL[key]
        print(f"| {c.name} | {size / 1e9:.2f} GB | {size / pt:.2f}x of {pt / 1e9:.2f} GB |")
    print(f"\nLargest layers of {a.cell}:\n")
    for layer_size, created in layer_report(spec.ref):
        print(f"- {layer_size}: `{created}`")
    print(f"\nLargest directories in {a.cell}:\n\n```\n{dir_report(spec.ref)}\n```")


if __name__ == "__main__":
    main()
