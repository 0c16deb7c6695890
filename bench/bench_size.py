"""Image sizes, where the bytes go, and what torch.compile's toolchain costs against what the
venv trim saves. Prints a markdown report (paste into BENCHMARKS.md).

    .venv/bin/python bench/bench_size.py                       # every default cell that is built
    .venv/bin/python bench/bench_size.py --cell 2.7.0-cuda12.6-cudnn9-runtime \\
        --before 2.7.0-cuda12.6-cudnn9-runtime=6000155569      # and its balance against an older build

Per cell: `docker image inspect` Size and every layer by what made it (`docker history`).
The balance, per cell:
  + what g++/python3-dev and rdma-core put in the image: the bytes of every file owned by a Debian
    package that the base packages (python3, tini, openssh-server, ...) do not pull in, read from
    the image's dpkg database in a throwaway container (labelled, removed);
  - what imagebuild/slim-venv.sh removed in each venv RUN, from the build's own log
    (build-logs/<cell>.log: "slim-venv.sh: /opt/venv A MiB -> B MiB (saved C MiB)").
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pulllib import KINDS  # noqa: E402

from builder.matrix import ImageSpec, load_matrix  # noqa: E402
from builder.render.dockerfile import BASE_APT, COMPILE_APT, RDMA_APT  # noqa: E402

DOCKER = "/usr/bin/docker"
MIB = 1 << 20

#: Run in the image: the files of every package outside the base packages' dependency closure.
DPKG_COST = r"""
import json, os, re, sys
base, groups = json.loads(sys.argv[1]), json.loads(sys.argv[2])
pkgs, deps, text = {}, {}, open("/var/lib/dpkg/status", encoding="utf-8").read()
for block in text.split("\n\n"):
    f = dict(re.findall(r"^([A-Za-z-]+): ?(.*)$", block, re.M))
    if "Package" in f and f.get("Status", "").endswith(" installed"):
        name = f["Package"]
        pkgs[name] = f
        alts = re.split(r",\s*", f.get("Depends", "") + ("," + f["Pre-Depends"] if f.get("Pre-Depends") else ""))
        deps[name] = [re.split(r"[\s(:]", a.strip())[0] for d in alts for a in d.split("|") if a.strip()]
provides = {}
for name, f in pkgs.items():
    for p in re.split(r",\s*", f.get("Provides", "")):
        if p.strip():
            provides.setdefault(re.split(r"[\s(]", p.strip())[0], []).append(name)
def closure(roots):
    seen, todo = set(), list(roots)
    while todo:
        n = todo.pop()
        for m in ([n] if n in pkgs else provides.get(n, [])):
            if m not in seen:
                seen.add(m); todo += deps.get(m, [])
    return seen
def files_bytes(names):
    seen, total = set(), 0
    for n in sorted(names):
        arch = pkgs[n].get("Architecture", "")
        for lst in (f"/var/lib/dpkg/info/{n}.list", f"/var/lib/dpkg/info/{n}:{arch}.list"):
            if os.path.exists(lst):
                for path in open(lst, encoding="utf-8").read().split("\n"):
                    try:
                        st = os.lstat(path)
                    except OSError:
                        continue
                    if not os.path.isdir(path) and (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino)); total += st.st_size
    return total
inbase = closure(base) | {n for n, f in pkgs.items() if f.get("Priority") in ("required", "important")}
out = {}
for label, roots in groups.items():
    extra = closure(roots) - inbase
    out[label] = {"packages": len(extra), "bytes": files_bytes(extra)}
    inbase |= extra
print(json.dumps(out))
"""


def sh(argv: list[str]) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])}...: {r.stderr.strip()[-2000:]}")
    return r.stdout


def layers(ref: str) -> list[tuple[str, int]]:
    """(kind, bytes) per layer of the image, oldest first; empty layers left out."""
    out = []
    text = sh([DOCKER, "history", "--no-trunc", "--human=false", "--format", "{{.Size}}\t{{.CreatedBy}}", ref])
    for line in reversed(text.splitlines()):
        size, _, made_by = line.partition("\t")
        if int(size) == 0:
            continue
        kind = kind_of(made_by) if made_by else "base image"
        out.append((kind, int(size)))
    return out


def toolchain_cost(spec: ImageSpec) -> dict[str, dict[str, int]]:
    groups = {"g++, python3-dev": list(COMPILE_APT), "rdma-core (libibverbs1, ibverbs-providers, librdmacm)":
              list(RDMA_APT[spec.os])}
    out = sh([DOCKER, "run", "--rm", "--label", "project=pt-multi-gpu", "--label", "ptmg-bench=size",
              "--entrypoint", "/usr/bin/python3", "--user", "0", spec.ref, "-c", DPKG_COST,
              json.dumps(list(BASE_APT)), json.dumps(groups)])
    return dict(json.loads(out))


def kind_of(made_by: str) -> str:
    return next((long for _, long, marker in KINDS if marker in made_by), "other")


def trim_saved(cell: str) -> dict[str, int]:
    """MiB saved by slim-venv.sh per venv layer in the cell's last build (a cached step says nothing)."""
    log = ROOT / "build-logs" / f"{cell}.log"
    if not log.exists():
        return {}
    steps: dict[str, str] = {}
    saved: dict[str, int] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"#(\d+) \[[^]]*\] RUN (.*)", line)
        if m:
            steps[m.group(1)] = kind_of(m.group(2))
        m = re.match(r"#(\d+) [\d.]+ slim-venv\.sh: \S+ \d+ MiB -> \d+ MiB \(saved (\d+) MiB\)", line)
        if m and m.group(1) in steps:
            saved[steps[m.group(1)]] = int(m.group(2))
    return saved


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cell", action="append", default=[], help="cells (glob) to measure; default: every built one")
    p.add_argument("--before", action="append", default=[], metavar="CELL=BYTES",
                   help="the cell's size before, for its balance (repeatable)")
    a = p.parse_args()
    before = {k: int(v) for k, _, v in (b.partition("=") for b in a.before)}
    cells = [c for c in load_matrix(ROOT / "images.yaml").cells
             if not a.cell or any(fnmatch.fnmatch(c.name, pat) for pat in a.cell)]
    built = [c for c in cells if subprocess.run([DOCKER, "image", "inspect", c.ref], capture_output=True,
                                                check=False).returncode == 0]
    print("| cell | size | layers (MB) |\n|---|---|---|")
    for c in built:
        size = int(sh([DOCKER, "image", "inspect", "--format", "{{.Size}}", c.ref]))
        by_kind: dict[str, int] = {}
        for kind, b in layers(c.ref):
            by_kind[kind] = by_kind.get(kind, 0) + b
        parts = "; ".join(f"{k} {b / 1e6:,.1f}" for k, b in by_kind.items())
        print(f"| {c.name} | {size:,} B ({size / 1e9:.2f} GB) | {parts} |")
    for c in built:
        saved = trim_saved(c.name)
        size = int(sh([DOCKER, "image", "inspect", "--format", "{{.Size}}", c.ref]))
        if c.flavour == "devel":
            extra = sum(b for k, b in layers(c.ref) if k.startswith("devel"))
            print(f"\n### {c.name}\n\nThe runtime cell's layers up to its tools, then {extra / MIB:,.1f} MiB of "
                  f"devel layers (slim-venv.sh there: {saved.get('devel: CUDA toolkit wheels, ninja', 0)} MiB) and "
                  "the devel cell's own OS layer and what is above it (docs/image-layout.md, \"Layers\").")
            continue
        cost = toolchain_cost(c)
        print(f"\n### {c.name}\n\n| | MiB |\n|---|---|")
        for label, v in cost.items():
            print(f"| + {label} ({v['packages']} packages) | +{v['bytes'] / MIB:,.1f} |")
        for kind, mib in saved.items():
            print(f"| - slim-venv.sh in the layer: {kind} | -{mib} |")
        net = sum(v["bytes"] for v in cost.values()) / MIB - sum(saved.values())
        print(f"| **net** | **{net:+,.1f}** |")
        if c.name in before:
            delta = size - before[c.name]
            print(f"| image: {before[c.name]:,} B before, {size:,} B now | **{delta / MIB:+,.1f}** "
                  f"({'met' if delta <= 0 else 'MISSED'}: no larger than before) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
