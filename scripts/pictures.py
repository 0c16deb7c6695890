"""Make the README pictures from real runs (`make pictures`):

- docs/img/tensorboard-ddp-loss.png: the DDP smoke job (torchrun, 2 CPU ranks over
  gloo) run in the image, its TensorBoard events on a host folder, then shown by
  the image's own TensorBoard behind Jupyter's proxy, in headless Chromium;
- docs/img/jupyterlab.png: JupyterLab of the same container;
- docs/img/image-sizes.svg: each built cell's size split into base OS, torch +
  CUDA wheels, and tools + ours, from the images' layers.

    python scripts/pictures.py [--image pt-multi-gpu:latest] [--steps 200] [--out docs/img]

Every container is labelled project=pt-multi-gpu and removed again, and the
temporary folders deleted, even when something fails.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
import uuid
from html import escape
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ptmg_contract as contract
from builder.smoke.torchrun import ddp_job_args, torchrun_argv
from tests.browser import LOCAL, Chrome
from tests.support import host_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "ptmg-pictures-" + uuid.uuid4().hex[:16]
RUNS = "/workspace/runs"
JOB_OUT = f"{RUNS}/ddp-smoke"
WIDTH, HEIGHT = 1280, 800
READY_TIMEOUT = 180  # seconds; a busy 2-core host is slow to start Jupyter


def log(msg: str) -> None:
    print(f"[pictures] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------- the runs
def run_ddp(client: Any, image: str, runs: Path, labels: dict[str, str], steps: int) -> None:
    argv = torchrun_argv(nnodes=1, nproc_per_node=2, script_args=ddp_job_args(out=JOB_OUT, steps=steps))
    log(f"DDP job: {' '.join(argv)}")
    c = client.containers.run(image, list(argv), detach=True, labels=labels, shm_size=contract.SMOKE_SHM_SIZE,
                              environment={"OMP_NUM_THREADS": "1"},
                              volumes={str(runs): {"bind": RUNS, "mode": "rw"}})
    code = c.wait(timeout=900)["StatusCode"]
    if code != 0:
        raise SystemExit(f"the DDP job exited {code}:\n{c.logs().decode(errors='replace')[-3000:]}")


def start_lab(client: Any, image: str, runs: Path, labels: dict[str, str]) -> tuple[Any, str]:
    c = client.containers.run(image, detach=True, labels=labels, environment={"JUPYTER_TOKEN": TOKEN},
                              ports={"8888/tcp": (LOCAL, None)},
                              volumes={str(runs): {"bind": RUNS, "mode": "rw"}})
    url = f"http://{LOCAL}:{host_port(c, '8888/tcp')}"
    headers = {"Authorization": f"token {TOKEN}"}

    def answers() -> bool:
        c.reload()
        if c.status == "exited":
            raise SystemExit(f"the container exited:\n{c.logs().decode(errors='replace')[-3000:]}")
        return requests.get(f"{url}/api/status", headers=headers, timeout=5).status_code == 200

    wait_until(answers, READY_TIMEOUT, interval=1, what=f"Jupyter on {url}")
    wait_until(lambda: requests.get(f"{url}/tensorboard/data/runs", headers=headers, timeout=10).json(),
               READY_TIMEOUT, interval=1, what="the DDP run in TensorBoard behind Jupyter's proxy")
    return c, url


def screenshots(url: str, out: Path, profile: Path) -> None:
    chrome = Chrome(profile, WIDTH, HEIGHT)
    try:
        chrome.goto(f"{url}/lab?token={TOKEN}")
        wait_until(lambda: chrome.js("!!document.querySelector('.jp-Launcher') && "
                                     "document.querySelectorAll('.jp-LauncherCard').length > 3 && "
                                     "!!document.querySelector('.jp-DirListing-item')"),
                   READY_TIMEOUT, interval=0.5, what="JupyterLab's launcher and file browser")
        time.sleep(3)  # icons and fonts
        # Best effort: answer "No" to the "get notified about Jupyter news?" toast.
        chrome.js("Array.from(document.querySelectorAll('.Toastify button'))"
                  ".filter(b => b.textContent.trim() === 'No').forEach(b => b.click())")
        time.sleep(1)
        chrome.screenshot(out / "jupyterlab.png")
        log(f"wrote {out / 'jupyterlab.png'}")

        # The login cookie from ?token= carries over to the proxied TensorBoard.
        chrome.goto(f"{url}/tensorboard/#timeseries")
        wait_until(lambda: chrome.js("document.title === 'TensorBoard' && "
                                     "document.body.innerText.includes('ddp-smoke/tb') && "
                                     "!!document.querySelector('scalar-card line-chart canvas')"),
                   READY_TIMEOUT, interval=0.5, what="TensorBoard's loss/train chart")
        time.sleep(3)
        # Best effort: close the settings pane and widen the card, so the curve gets the room.
        chrome.js("Array.from(document.querySelectorAll('scalar-card button'))"
                  ".filter(b => /full ?size/i.test(b.getAttribute('aria-label') || b.title || ''))"
                  ".forEach(b => b.click())")
        chrome.js("Array.from(document.querySelectorAll('metrics-main-view button'))"
                  ".filter(b => b.textContent.trim() === 'Settings').forEach(b => b.click())")
        time.sleep(5)  # the chart redraws at its new size
        chrome.screenshot(out / "tensorboard-ddp-loss.png")
        log(f"wrote {out / 'tensorboard-ddp-loss.png'}")
    finally:
        chrome.close()


# ------------------------------------------------------------------ image sizes
def split_sizes(client: Any, image: Any) -> tuple[str, float, float, float]:
    """(cell, base, torch + CUDA, tools + ours) in bytes, from the image's layers."""
    labels = image.attrs["Config"].get("Labels") or {}
    cell = labels.get("io.pt-multi-gpu.cell", image.tags[0])
    history = image.history()  # newest first
    torch_layers = [h for h in history if "torch==" in (h.get("CreatedBy") or "")]
    torch = max((h["Size"] for h in torch_layers), default=0)
    try:
        base = client.images.get(labels["org.opencontainers.image.base.name"]).attrs["Size"]
    except (KeyError, docker.errors.ImageNotFound):
        base = history[-1]["Size"]  # the base image's single layer
    total = image.attrs["Size"]
    return cell, float(base), float(torch), float(total - base - torch)


def sizes_svg(rows: list[tuple[str, float, float, float]]) -> str:
    gb = 1e9
    colours = (("base OS", "#9aa5b1"), ("torch + CUDA wheels", "#ee4c2c"), ("tools + ours", "#2b6cb0"))
    bar_h, gap, left, top, chart_w = 34, 30, 250, 56, 560
    top_total = max(sum(r[1:]) for r in rows)
    scale = chart_w / (top_total / gb * 1.12)
    height = top + len(rows) * (bar_h + gap) + 60
    width = left + chart_w + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="13">',
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
           '<text x="16" y="26" font-size="16" font-weight="bold" fill="#1a202c">'
           'pt-multi-gpu image sizes (uncompressed, GB)</text>']
    x = 16
    for name, colour in colours:  # legend
        out.append(f'<rect x="{x}" y="36" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{x + 17}" y="46" fill="#2d3748">{escape(name)}</text>')
        x += 34 + 8 * len(name)
    for i, (cell, *parts) in enumerate(rows):
        y = top + 10 + i * (bar_h + gap)
        out.append(f'<text x="{left - 10}" y="{y + bar_h / 2 + 5}" text-anchor="end" '
                   f'fill="#1a202c">{escape(cell)}</text>')
        x0 = float(left)
        for value, (name, colour) in zip(parts, colours, strict=True):
            w = value / gb * scale
            out.append(f'<rect x="{x0:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{colour}">'
                       f'<title>{escape(name)}: {value / gb:.2f} GB</title></rect>')
            if w > 42:
                out.append(f'<text x="{x0 + w / 2:.1f}" y="{y + bar_h / 2 + 5}" text-anchor="middle" '
                           f'fill="#ffffff">{value / gb:.2f}</text>')
            x0 += w
        out.append(f'<text x="{x0 + 6:.1f}" y="{y + bar_h / 2 + 5}" font-weight="bold" '
                   f'fill="#1a202c">{sum(parts) / gb:.2f} GB</text>')
        detail = " · ".join(f"{name} {value / gb:.2f} GB" for value, (name, _) in zip(parts, colours, strict=True))
        out.append(f'<text x="{left}" y="{y + bar_h + 13}" font-size="11" fill="#4a5568">{escape(detail)}</text>')
    axis_y = top + len(rows) * (bar_h + gap) + 4
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + chart_w}" y2="{axis_y}" stroke="#a0aec0"/>')
    tick = 0
    while tick <= top_total / gb * 1.12:
        tx = left + tick * scale
        out.append(f'<line x1="{tx:.1f}" y1="{axis_y}" x2="{tx:.1f}" y2="{axis_y + 5}" stroke="#a0aec0"/>')
        out.append(f'<text x="{tx:.1f}" y="{axis_y + 19}" text-anchor="middle" fill="#4a5568">{tick} GB</text>')
        tick += 1
    out.append(f'<text x="{left}" y="{axis_y + 42}" fill="#718096" font-size="11">'
               'from `docker history`: base = the base image, torch + CUDA = the layer that installs torch, '
               'tools = the rest</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def image_sizes(client: Any, repo: str, out: Path) -> None:
    images = {img.id: img for img in client.images.list(repo)}.values()  # latest is one of the cells
    rows = [split_sizes(client, img) for img in images]
    if not rows:
        raise SystemExit(f"no {repo} images; run `make images` first")
    rows.sort(key=lambda r: tuple(int(p) for p in r[0].split("-")[0].split(".")))
    (out / "image-sizes.svg").write_text(sizes_svg(rows))
    log(f"wrote {out / 'image-sizes.svg'}: " + ", ".join(f"{r[0]} {sum(r[1:]) / 1e9:.2f} GB" for r in rows))


# ------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", default="pt-multi-gpu:latest", help="image for the runs (default %(default)s)")
    p.add_argument("--steps", type=int, default=200, help="DDP training steps (default %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the pictures go")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    client = docker.from_env(version="auto", timeout=300)
    session = uuid.uuid4().hex
    labels = {"project": "pt-multi-gpu", "io.pt-multi-gpu.pictures": session}
    tmp = Path(tempfile.mkdtemp(prefix="ptmg-pictures-"))
    runs = tmp / "runs"
    runs.mkdir()
    runs.chmod(0o777)  # written by the image's user pt (uid 1000)
    try:
        image_sizes(client, args.image.split(":")[0], args.out)
        run_ddp(client, args.image, runs, labels, args.steps)
        log(f"DDP job done ({time.monotonic() - t0:.0f} s); starting JupyterLab + TensorBoard")
        _, url = start_lab(client, args.image, runs, labels)
        screenshots(url, args.out, tmp / "chromium-profile")
    finally:
        for c in client.containers.list(all=True, filters={"label": f"io.pt-multi-gpu.pictures={session}"}):
            with contextlib.suppress(docker.errors.NotFound):
                c.remove(force=True, v=True)
        shutil.rmtree(tmp, ignore_errors=True)
        client.close()
    log(f"done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
