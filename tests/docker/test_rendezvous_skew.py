"""Start-up skew at the c10d rendezvous, in real containers: a node whose torchrun starts 150 s
before the endpoint node's still joins (docs/launch.md promises up to 600 s).

Two containers of the image on a private, labelled network, one CPU rank each over gloo, the
torchrun command `build.py launch` writes (builder.smoke.torchrun.torchrun_argv with the launch's
join timeout). node0 hosts the rendezvous (the endpoint names it) and sleeps SKEW_S before its
torchrun starts, as a node still pulling its image would; node1's torchrun starts at once and
keeps trying to reach node0:29400. With torch's default read_timeout (60 s) node1 gives up after
about 72 s (RendezvousConnectionError), which this test reports as soon as it happens.
"""

from __future__ import annotations

import shlex
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import ptmg_contract as contract
from builder.engine import Container, Engine
from builder.launch.config import JOIN_TIMEOUT_S
from builder.smoke.results import find_ddp_result
from builder.smoke.torchrun import ddp_job_args, torchrun_argv

pytestmark = pytest.mark.slow

SKEW_S = 150
JOB_S = 300  # both nodes, after node0's torchrun starts, on a busy 2-core host


@pytest.fixture
def engine(docker_client: Any, session_labels: dict[str, str]) -> Iterator[Engine]:
    eng = Engine(client=docker_client, labels=session_labels)
    yield eng
    flt = {"label": [f"{k}={v}" for k, v in session_labels.items()] + [contract.LABEL_SMOKE]}
    leftovers = docker_client.containers.list(all=True, filters=flt)
    for c in leftovers:
        c.remove(force=True)
    assert not leftovers, f"containers left behind: {[c.name for c in leftovers]}"


def test_a_node_up_150_s_before_the_endpoints_node_still_joins(engine: Engine, docker_client: Any,
                                                                test_image: str) -> None:
    run_id = uuid.uuid4().hex[:12]
    argv = torchrun_argv(nnodes=2, nproc_per_node=1, script_args=ddp_job_args(timeout_s=60, phase_timeout_s=120),
                         rdzv_endpoint=f"node0:{contract.RDZV_PORT}", rdzv_id=run_id, join_timeout_s=JOIN_TIMEOUT_S)
    env = {**contract.MULTINODE_ENV, "OMP_NUM_THREADS": "1"}
    containers: list[Container] = []
    t0 = time.monotonic()
    with engine.network(f"ptmg-skew-{run_id}") as net:
        def start(name: str, command: list[str]) -> Container:
            c = engine.start(test_image, command, network=net.name, alias=name, hostname=name,
                             name=f"ptmg-skew-{run_id}-{name}", shm_size=contract.SMOKE_SHM_SIZE, environment=env,
                             extra_labels={contract.LABEL_SMOKE: run_id, contract.LABEL_NODE: name})
            containers.append(c)
            return c

        try:
            # node0 exists (its name resolves) but its torchrun starts SKEW_S later: a port not yet open.
            late = start("node0", ["bash", "-c", f"sleep {SKEW_S}; exec {shlex.join(argv)}"])
            early = start("node1", list(argv))
            while time.monotonic() - t0 < SKEW_S:
                if docker_client.containers.get(early.id).status == "exited":
                    pytest.fail(f"node1 gave up after {time.monotonic() - t0:.0f} s, before node0's torchrun "
                                f"started ({SKEW_S} s):\n{engine.logs(early)[-3000:]}", pytrace=False)
                time.sleep(5)
            waited = [engine.wait(c, max(1.0, t0 + SKEW_S + JOB_S - time.monotonic())) for c in (early, late)]
            logs = [engine.logs(c) for c in (early, late)]
        finally:
            for c in containers:
                engine.remove(c)
    took = time.monotonic() - t0
    print(f"skew {SKEW_S} s: both nodes done {took:.0f} s after node1 started, exits "
          f"{[w.exit_code for w in waited]}")
    assert [w.exit_code for w in waited] == [0, 0], "\n---\n".join(log[-3000:] for log in logs)
    result = find_ddp_result(logs)
    assert result is not None and result.ok and result.world_size == 2 and result.backend == "gloo", result
