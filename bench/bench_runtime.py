"""Benchmark the image runtime: start-to-ready per service and all together, and
`docker stop` time. Prints a markdown table (for BENCHMARKS.md) on stdout.

    python bench/bench_runtime.py [--image TAG] [--repeat 3] [--json]

"Ready" is measured from the host, the way a user meets it: from just before
`docker run` (create + start) until the service answers on its published port
(Jupyter: /api/status answers; TensorBoard: 200 through Jupyter's proxy, or its
direct port when Jupyter is off; sshd: an SSH-2.0 banner). The supervisor's own
"ready: ... (N s after start)" log line is shown beside it. Ports are published
on 127.0.0.1 only; every container is labelled and removed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support import host_port, wait_until

TOKEN = "ptmg-bench-token"
READY = re.compile(r"\[ptmg\] ready: .*\(([\d.]+) s after start\)")
LOCAL = "127.0.0.1"


@dataclass(frozen=True)
class Scenario:
    name: str
    env: dict[str, str]
    ports: tuple[str, ...]
    checks: tuple[str, ...]  # jupyter | tensorboard-proxy | tensorboard-direct | sshd
    command: list[str] | None = None


@dataclass
class Result:
    scenario: str
    ready_s: list[float] = field(default_factory=list)
    reported_s: list[float] = field(default_factory=list)
    stop_s: list[float] = field(default_factory=list)


def _jupyter(c: Any) -> Callable[[], bool]:
    url = f"http://{LOCAL}:{host_port(c, '8888/tcp')}/api/status"
    return lambda: requests.get(url, timeout=2).status_code in (200, 403)


def _tb_proxy(c: Any) -> Callable[[], bool]:
    url = f"http://{LOCAL}:{host_port(c, '8888/tcp')}/tensorboard/"
    return lambda: requests.get(url, headers={"Authorization": f"token {TOKEN}"}, timeout=2).status_code == 200


def _tb_direct(c: Any) -> Callable[[], bool]:
    url = f"http://{LOCAL}:{host_port(c, '6006/tcp')}/"
    return lambda: requests.get(url, timeout=2).status_code == 200


def _sshd(c: Any) -> Callable[[], bool]:
    port = host_port(c, "22/tcp")

    def banner() -> bool:
        with socket.create_connection((LOCAL, port), timeout=2) as s:
            s.settimeout(2)
            s.sendall(b"SSH-2.0-ptmg-bench\r\n")
            return s.recv(64).startswith(b"SSH-2.0-")

    return banner


CHECKS = {"jupyter": _jupyter, "tensorboard-proxy": _tb_proxy, "tensorboard-direct": _tb_direct, "sshd": _sshd}


def scenarios(pubkey: str) -> list[Scenario]:
    off = {"JUPYTER": "off", "TENSORBOARD": "off", "SSH": "off"}
    return [
        Scenario("jupyter", {**off, "JUPYTER": "on", "JUPYTER_TOKEN": TOKEN}, ("8888/tcp",), ("jupyter",)),
        Scenario("tensorboard (direct port)", {**off, "TENSORBOARD": "port"}, ("6006/tcp",), ("tensorboard-direct",)),
        Scenario("sshd (first start: host keys)", {**off, "SSH": "auto", "SSH_AUTHORIZED_KEYS": pubkey},
                 ("22/tcp",), ("sshd",)),
        Scenario("all: jupyter + tensorboard + sshd", {"JUPYTER_TOKEN": TOKEN, "SSH_AUTHORIZED_KEYS": pubkey},
                 ("8888/tcp", "22/tcp"), ("jupyter", "tensorboard-proxy", "sshd")),
    ]


def run_once(client: docker.DockerClient, image: str, sc: Scenario, labels: dict[str, str],
             res: Result) -> None:
    t0 = time.monotonic()
    c = client.containers.run(image, sc.command, detach=True, labels=labels, environment=sc.env,
                              ports={p: (LOCAL, None) for p in sc.ports})
    try:
        for name in sc.checks:
            wait_until(CHECKS[name](c), 120, interval=0.05, what=f"{sc.name}: {name}")
        res.ready_s.append(time.monotonic() - t0)
        def ready_line() -> re.Match[str] | None:
            return READY.search(c.logs().decode(errors="replace"))

        line = wait_until(ready_line, 30, what="the supervisor's ready line")
        assert line is not None  # wait_until returns only truthy values
        res.reported_s.append(float(line.group(1)))
        t1 = time.monotonic()
        c.stop(timeout=10)
        res.stop_s.append(time.monotonic() - t1)
    finally:
        c.remove(force=True)


def command_mode(client: docker.DockerClient, image: str, labels: dict[str, str], repeat: int) -> Result:
    """docker run IMAGE true: the entrypoint's overhead for a plain command."""
    res = Result("command mode: `docker run IMAGE true` (start to exit)")
    for _ in range(repeat):
        t0 = time.monotonic()
        c = client.containers.run(image, ["true"], detach=True, labels=labels)
        try:
            c.wait(timeout=60)
            res.ready_s.append(time.monotonic() - t0)
        finally:
            c.remove(force=True)
    return res


def fmt(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} (max {max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default=os.environ.get("PTMG_TEST_IMAGE") or "pt-multi-gpu:latest")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="raw results as JSON instead of the table")
    args = ap.parse_args(argv)

    client = docker.from_env(version="auto", timeout=120)
    labels = {"project": "pt-multi-gpu", "session": str(uuid.uuid4()), "purpose": "bench"}
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "id"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        pubkey = key.with_suffix(".pub").read_text().strip()
        results = []
        try:
            for sc in scenarios(pubkey):
                res = Result(sc.name)
                for _ in range(args.repeat):
                    run_once(client, args.image, sc, labels, res)
                results.append(res)
                print(f"{sc.name}: ready {fmt(res.ready_s)} s, stop {fmt(res.stop_s)} s", file=sys.stderr)
            results.append(command_mode(client, args.image, labels, args.repeat))
        finally:
            for c in client.containers.list(all=True, filters={"label": f"session={labels['session']}"}):
                c.remove(force=True)

    if args.json:
        print(json.dumps([r.__dict__ for r in results], indent=2))
        return 0
    cpus = os.cpu_count()
    print(f"Image `{args.image}`, {args.repeat} runs each, {cpus} CPUs; seconds, median (max).\n")
    print("| scenario | start → ready (host) | supervisor `ready` line | `docker stop` |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r.scenario} | {fmt(r.ready_s)} | {fmt(r.reported_s)} | {fmt(r.stop_s)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
