"""`build.py launch --target slurm --launcher native` on a real multi-node Slurm cluster: a controller
and two compute nodes, all containers of the cell image plus a test-only Slurm layer (slurm_cluster.py),
on a user-defined network, with one munge key.

The job is the generated sbatch script, unmodified: only the generator's flags differ between the
tests (--command points torchrun at the image's own DDP job, writing to the shared volume, with
--node-out for a result from every node, and with its fault injection). 2 nodes x 2 CPU ranks over
gloo: world size 4. The tests share one cluster; the node-kill test runs last.

Measured on a busy 2-core host (docs/launch.md): cluster up in 5-9 s, the DDP job 25-35 s, a crashed
rank ends the job FAILED within seconds, a killed node ends it NODE_FAIL 15-20 s after `docker kill`
(SlurmdTimeout=10, MessageTimeout=5). The bounds below leave plenty of headroom.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import pytest

import ptmg_contract as contract
from builder.matrix import load_matrix
from builder.smoke.results import find_ddp_result
from builder.smoke.torchrun import ddp_job_args
from tests.support import wait_until

from .cellimage import BuiltCell
from .slurm_cluster import SlurmCluster, SlurmClusterError, build_slurm_image, finish

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NODES, NPROC = 2, 2
CLUSTER_UP_S = 120
JOB_S = 300  # submit -> COMPLETED (measured 25-35 s)
PREFLIGHT_S = 60  # a node without the image -> FAILED (measured a few seconds)
CRASH_END_S = 60  # crash seen -> the job FAILED and every node's ranks gone (measured 1-3 s)
NODE_FAIL_S = 90  # docker kill -> the job ended (measured 15-20 s)
HOSTS = {f"node{i}" for i in range(1, NODES + 1)}


@pytest.fixture(scope="module")
def slurm_image(built_cell: BuiltCell, docker_client: docker.DockerClient, session_labels: dict[str, str],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    t0 = time.monotonic()
    try:
        tag = build_slurm_image(docker_client, built_cell.cell, built_cell.ref, session_labels,
                                tmp_path_factory.mktemp("slurm-image"))
    except SlurmClusterError as exc:
        pytest.fail(str(exc), pytrace=False)
    print(f"Slurm layer {tag} built in {time.monotonic() - t0:.1f} s")
    try:
        yield tag
    finally:
        with contextlib.suppress(docker.errors.ImageNotFound):
            docker_client.images.remove(tag, force=True)


@pytest.fixture(scope="module")
def cluster(docker_client: docker.DockerClient, slurm_image: str,
            session_labels: dict[str, str]) -> Iterator[SlurmCluster]:
    c = SlurmCluster(docker_client, slurm_image, session_labels, nodes=NODES)
    try:
        c.start(timeout=CLUSTER_UP_S)
    except SlurmClusterError as exc:
        pytest.fail(str(exc), pytrace=False)
    print(f"Slurm cluster {c.id} up in {c.up_seconds:.1f} s")
    try:
        yield c
    finally:
        c.stop()
        left = c.leftovers()
        assert not left, f"left behind by Slurm cluster {c.id}: {left}"


def generate(tmp: Path, cell: str, command: str) -> str:
    """`build.py launch` itself, as a user runs it."""
    argv = [sys.executable, str(ROOT / "build.py"), "launch", "--target", "slurm", "--launcher", "native",
            "--only", cell, "--no-pin", "--nodes", str(NODES), "--gpus-per-node", "0",
            "--nproc-per-node", str(NPROC), "--time", "00:15:00", "--mem", "512M", "--command", command,
            "--out", str(tmp)]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return (tmp / cell / "slurm.sbatch").read_text()


def ddp_command(run: str, *fault: str, steps: int = 60, step_sleep_s: float = 0.0) -> str:
    """The image's DDP job, its results on the shared volume: rank 0's, and one per node. A fault
    case gets short collective and phase timeouts (a stuck rank fails in bounded time)."""
    out = f"/shared/runs/{run}"
    short = bool(fault or step_sleep_s)
    args = ddp_job_args(out=out, steps=steps, step_sleep_s=step_sleep_s, timeout_s=30 if short else 60,
                        phase_timeout_s=60 if short else 120, extra=("--node-out", out, *fault))
    return shlex.join([contract.DDP_JOB, *args])


def test_native_job_runs_ddp_across_two_nodes(cluster: SlurmCluster, built_cell: BuiltCell, tmp_path: Path) -> None:
    run = uuid.uuid4().hex[:8]
    job = cluster.sbatch(generate(tmp_path, built_cell.cell, ddp_command(run)), f"{run}.sbatch")
    info, text = finish(cluster, job, JOB_S)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-4000:]}"
    assert info["UserId"].startswith(f"{contract.USER}({contract.UID})"), info
    rows = cluster.sacct(job)
    assert {job, f"{job}.batch", f"{job}.0"} <= set(rows), rows
    assert all(r["State"] == "COMPLETED" and r["ExitCode"] == "0:0" for r in rows.values()), rows
    assert rows[f"{job}.0"]["NodeList"] == "node[1-2]", rows
    # Both nodes met at the rendezvous on the first node of the allocation.
    for n, host in enumerate(sorted(HOSTS)):
        assert f"[ptmg] node {n} of {NODES} (task {n}) on {host}: rendezvous node1:{20000 + int(job) % 10000} id {job}" \
            in text, text[-4000:]
    result = find_ddp_result([text])
    assert result is not None, text[-4000:]
    assert result.ok and result.backend == "gloo" and result.world_size == NODES * NPROC, result
    assert sorted(result.hosts) == sorted(sorted(HOSTS) * NPROC) and result.nodes == NODES, result  # ranks per host
    assert result.loss_decreased and result.params_identical and result.allreduce_exact, result
    assert json.loads(cluster.read(f"/shared/runs/{run}/result.json"))["ok"] is True
    # A result from every node (--node-out): the rendezvous numbers the nodes, any order.
    nodes = [json.loads(cluster.read(f"/shared/runs/{run}/node-{i}.json") or "{}") for i in range(NODES)]
    assert {n.get("host") for n in nodes} == HOSTS, nodes
    for i, n in enumerate(nodes):
        assert n["node_rank"] == i and n["exit"] == 0 and n["ok"] is True, n
        assert n["world_size"] == NODES * NPROC and n["local_world_size"] == NPROC, n


def test_a_node_that_does_not_run_the_image_fails_the_job_at_once(
        cluster: SlurmCluster, built_cell: BuiltCell, tmp_path: Path) -> None:
    """The job of another cell (other torch, other cell name): every node's preflight refuses it."""
    ours = {c.name: c for c in load_matrix(ROOT / "images.yaml").cells}[built_cell.cell]
    other = next(c for c in load_matrix(ROOT / "images.yaml").cells if c.torch != ours.torch)
    run = uuid.uuid4().hex[:8]
    job = cluster.sbatch(generate(tmp_path, other.name, ddp_command(run)), f"{run}.sbatch")
    info, text = finish(cluster, job, PREFLIGHT_S)
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", f"{info}\n{text[-4000:]}"
    assert "this node does not run" in text and "(task 0)" not in text, text[-4000:]  # torchrun never ran
    assert cluster.sacct(job)[f"{job}.0"]["ExitCode"] == "127:0", cluster.sacct(job)


def test_a_crashing_rank_fails_the_job_and_ends_the_other_node(
        cluster: SlurmCluster, built_cell: BuiltCell, tmp_path: Path) -> None:
    """Rank 3 (on the second node) crashes at step 3: its torchrun fails, --kill-on-bad-exit ends the
    first node's. Submitted with `sbatch --export=NONE` (a common site default): srun --export=ALL must
    still hand the tasks the script's environment."""
    run = uuid.uuid4().hex[:8]
    command = ddp_command(run, "--fault", "crash", "--fault-rank", "3", "--fault-step", "3", step_sleep_s=0.2)
    job = cluster.sbatch(generate(tmp_path, built_cell.cell, command), f"{run}.sbatch", "--export=NONE")
    try:
        wait_until(lambda: "injecting fault crash" in cluster.output(job) or cluster.job(job).get("JobState")
                   in ("FAILED", "COMPLETED", "CANCELLED"), JOB_S, interval=0.5, what=f"job {job}'s crash")
    except AssertionError:
        cluster.cancel(job)
        raise
    crashed = time.monotonic()
    info, text = finish(cluster, job, CRASH_END_S)
    ended = time.monotonic() - crashed
    for node in sorted(HOSTS):  # no rank left behind on either node
        def ranks_gone(node: str = node) -> bool:
            return not cluster.processes(node, "ddp_job.py")

        wait_until(ranks_gone, CRASH_END_S, interval=0.5, what=f"the job's ranks on {node} to end")
    gone = time.monotonic() - crashed
    print(f"job {job}: {info['JobState']} {ended:.1f} s after the crash was seen; no rank left {gone:.1f} s after")
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", f"{info}\n{text[-4000:]}"
    assert "PTMG_DDP rank 3: injecting fault crash at step 3" in text, text[-4000:]
    assert find_ddp_result([text]) is None
    rows = cluster.sacct(job)
    assert rows[job]["State"] == "FAILED" and rows[f"{job}.0"]["State"] == "FAILED", rows


def test_a_killed_node_ends_the_job_without_a_requeue(
        cluster: SlurmCluster, built_cell: BuiltCell, tmp_path: Path) -> None:
    """Last in the module: node2's container is killed mid-job. The cluster keeps Slurm's default
    JobRequeue=1, so it is the script's `#SBATCH --no-requeue` that ends the job for good."""
    run = uuid.uuid4().hex[:8]
    command = ddp_command(run, steps=600, step_sleep_s=0.5)
    job = cluster.sbatch(generate(tmp_path, built_cell.cell, command), f"{run}.sbatch")
    try:
        wait_until(lambda: contract.DDP_KILL_TRIGGER in cluster.output(job), JOB_S, interval=0.5,
                   what=f"job {job} training")
        killed = time.monotonic()
        cluster.kill("node2")
        info, text = finish(cluster, job, NODE_FAIL_S)
        took = time.monotonic() - killed
        cluster.restart("node2")  # the cluster could run the job again now: it must not
        after = cluster.job(job)
    finally:
        cluster.cancel(job)
    print(f"job {job}: {info['JobState']} (Reason={info.get('Reason')}) {took:.1f} s after docker kill node2; "
          f"sacct: {cluster.sacct(job)}")
    assert info["JobState"] in ("NODE_FAIL", "FAILED"), f"{info}\n{text[-4000:]}"
    assert info["Requeue"] == "0" and info["Restarts"] == "0", info
    assert after["JobState"] == info["JobState"] and after["Restarts"] == "0", after
