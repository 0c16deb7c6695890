"""What the build benchmark's figures share: the docker client, the timed `build.py build`, BuildKit's
step times, and removing the BuildKit records a run made (bench/bench_build.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

PY = sys.executable
DOCKER = "/usr/bin/docker"  # a 20.10 client: it speaks to newer engines too (DOCKER_HOST)
LABELS = ["--label", "project=pt-multi-gpu", "--label", "ptmg-helper=bench"]


def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False, **kw)


BENCH_REPO = "ptmg-bench"


def need_disk(gb: float, what: str) -> None:
    free = shutil.disk_usage("/").free / 1e9
    if free < gb:
        sys.exit(f"{what}: {free:.1f} GB free, {gb:.0f} GB needed; free disk first (see docs/supply-chain.md)")


def timed_build(args: list[str], env: dict[str, str] | None = None) -> tuple[float, list[dict[str, Any]], str]:
    start = time.monotonic()
    r = run([PY, "build.py", "build", "--json", *args], env={**os.environ, **(env or {})})
    elapsed = time.monotonic() - start
    if r.returncode != 0:
        sys.exit(f"build failed: {r.stderr[-3000:]}")
    return elapsed, json.loads(r.stdout), r.stderr


# --- BuildKit's plain progress: step times ------------------------------------------------------
def step_times(log: str) -> dict[str, float]:
    """Seconds per step of a `--progress=plain` log: 'torch', 'tools', 'os', 'sbom', 'context', 'export'."""
    names: dict[str, str] = {}
    out: dict[str, float] = {}
    for line in log.splitlines():
        m = re.match(r"^#(\d+) (.*)$", line)
        if not m:
            continue
        vid, rest = m.groups()
        if vid not in names:
            kind = ("context" if "load build context" in rest else "export" if rest.startswith("exporting to image")
                    else "tools" if "wheelhouse/tools," in rest or "jupyterlab==" in rest
                    else "torch" if "wheelhouse/torch," in rest or ("pip download" in rest and '"torch==' in rest)
                    else "os" if re.search(r"apt(-get|_bounded) upgrade", rest)  # the "before" Dockerfile; ours
                    else "sbom" if "sbom.py" in rest else "")
            names[vid] = kind
            continue
        done = re.match(r"^DONE (\d+(?:\.\d+)?)s", rest)
        if done and names.get(vid):
            out[names[vid]] = float(done.group(1))
    return out


def context_bytes(log: str) -> str:
    m = re.findall(r"transferring context: ([\d.]+\w+) ([\d.]+)s done", log)
    return f"{m[-1][0]} in {m[-1][1]} s" if m else "-"


# --- 3. before: today's pip RUNs, cold ---------------------------------------------------------------
BENCH_TOKEN = "ptmg-bench-before"


# --- cleanup of what this run made ---------------------------------------------------------------------
def prune_own_records(since: float) -> int:
    """Remove the BuildKit records created after `since` that nothing uses (by id; never a cache mount)."""
    freed = 0
    for _ in range(8):  # children before parents: a parent frees nothing while a child holds it
        sock = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock").removeprefix("unix://")
        r = run(["curl", "-s", "--unix-socket", sock, "http://localhost/system/df"])
        records = (json.loads(r.stdout or "{}").get("BuildCache") or [])
        mine = [b for b in records if not b.get("InUse") and _epoch(str(b.get("CreatedAt", ""))) >= since
                and (b.get("Type") != "exec.cachemount" or BENCH_TOKEN in str(b.get("Description", "")))]
        if not mine:
            break
        for b in mine:
            p = run([DOCKER, "builder", "prune", "-f", "--filter", f"id={b['ID']}"])
            m = re.search(r"Total reclaimed space:\s*([\d.]+)(\w+)", p.stdout)
            if m:
                freed += int(float(m.group(1)) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}.get(m.group(2), 1))
    return freed


def _epoch(stamp: str) -> float:
    import datetime as dt

    try:
        return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")[:26] + stamp[-6:] if "+" in stamp[-6:]
                                         else stamp.replace("Z", "")[:26]).replace(
            tzinfo=dt.timezone.utc).timestamp()
    except ValueError:
        return 0.0
