"""The second engine (Docker 28 with buildx, `scripts/engine28.sh`) as a test fixture's value: the user's
environment that points at it, a client, and `build.py` run exactly as a user on that engine types it.

`started(store, ...)` starts it in one image store, copies the cell's base in from the system engine, and
stops it again (containers, daemon, data-root, bridge and rules), pass or fail. test_modern_engine.py
runs in both stores; test_reproducible.py in the containerd store only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest

from builder.matrix import load_matrix

from .cellimage import DEFAULT_CELL, ROOT

SCRIPT = ROOT / "scripts" / "engine28.sh"
CELL = os.environ.get("PTMG_MODERN_CELL", DEFAULT_CELL)  # the 2.7.0 seed cell: the smallest default cell
TIMES: dict[str, float] = {}


@dataclass
class Modern:
    store: str
    env: dict[str, str]  # the user's view: DOCKER_HOST, DOCKER_CONFIG (buildx), the engine's CLI first on PATH
    client: docker.DockerClient
    tmp: Path

    def build_py(self, *args: str, timeout: float = 1800, **env: str) -> subprocess.CompletedProcess[str]:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, str(ROOT / "build.py"), *args], cwd=ROOT, env={**self.env, **env},
                           capture_output=True, text=True, timeout=timeout, check=False)
        key = f"{self.store} build.py {args[0]}"
        TIMES[key] = TIMES.get(key, 0) + time.monotonic() - t0
        return p

    def image(self) -> Any:
        return self.client.images.get(f"pt-multi-gpu:{CELL}")


def _script(*args: str) -> str:
    p = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=900, check=False)
    if p.returncode != 0:
        pytest.fail(f"scripts/engine28.sh {' '.join(args)} failed (exit {p.returncode}):\n{p.stderr[-3000:]}",
                    pytrace=False)
    sys.stderr.write(p.stderr)  # what it did and how long its stop took (shown with -s)
    return p.stdout


def _copy_base(system: docker.DockerClient, env: dict[str, str], ref: str) -> None:
    """The cell's base from the system engine (read-only there: docker save) into the second engine's
    load. Without one there, build.py bootstraps it on the second engine as on a fresh machine."""
    try:
        system.images.get(ref)
    except docker.errors.ImageNotFound:
        return
    save = subprocess.Popen(["/usr/bin/docker", "-H", "unix:///var/run/docker.sock", "save", ref],
                            stdout=subprocess.PIPE)
    load = subprocess.run(["docker", "load"], stdin=save.stdout, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert save.stdout is not None
    save.stdout.close()
    assert save.wait(timeout=60) == 0 and load.returncode == 0, load.stderr


@contextmanager
def started(store: str, system: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Modern]:
    t0 = time.monotonic()
    try:
        lines = dict(line.split("=", 1) for line in _script("start", store).splitlines() if "=" in line)
        env = {**os.environ, "DOCKER_HOST": lines["DOCKER_HOST"], "DOCKER_CONFIG": lines["DOCKER_CONFIG"],
               "PATH": f"{lines['PTMG_E28_BIN']}:{os.environ.get('PATH', '')}",
               "PTMG_STATE_DIR": str(tmp_path_factory.mktemp(f"state-{store}")),
               "PTMG_OSV_DIR": str(ROOT / "tests" / "fixtures" / "osv")}
        client = docker.DockerClient(base_url=lines["DOCKER_HOST"], version="auto", timeout=600)
        spec = next(c for c in load_matrix(ROOT / "images.yaml").cells if c.name == CELL)
        _copy_base(system, env, spec.base_ref)
        TIMES[f"{store} engine start + base copy"] = time.monotonic() - t0
        yield Modern(store, env, client, tmp_path_factory.mktemp(f"modern-{store}"))
        client.close()
    finally:
        t1 = time.monotonic()
        _script("stop")  # containers, daemon, data-root, bridge and rules: gone, pass or fail
        TIMES[f"{store} engine stop"] = time.monotonic() - t1
        print("\nmodern engine times: " + ", ".join(f"{k} {v:.0f} s" for k, v in TIMES.items() if store in k))
