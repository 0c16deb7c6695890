"""pyxis 0.24.0 on the multi-node Slurm 22.05 cluster (slurm_cluster.py, nodes from pyxis_cluster.py:
enroot 4.1.2 and pyxis built from their release sources, loaded through plugstack.conf).

`sbatch` runs the script of `build.py launch --target slurm --launcher pyxis --image-file X.sqsh`
as written (the session's export, conftest.exported_sqsh), as the user `pt`: 2 nodes x 2 CPU ranks
(gloo), world size 4, each node's torchrun in an enroot container of the squashfs.

- The image's DDP job passes across the nodes; its record reaches the job's directory through the
  script's --container-mounts. While it trains, each node holds the squashfs mounted (squashfuse).
- `selftest --require-gpu` on CPU fails the job, and the job log says why; the selftest names
  enroot/pyxis as its runtime (it runs in the squashfs's root, not the node's) and the image's
  environment reached it (the cell from PTMG_CELL: the job is submitted with --export=NONE, so it
  comes from the squashfs's /etc/environment, not from the submitting shell).
- A node killed mid-run ends the job NODE_FAIL or FAILED, never COMPLETED, and it is not requeued.

Runs last in the docker tier (conftest.RUN_LAST: it holds exported_sqsh, 4 GB). Every container,
network, volume and the test image carry the session's labels and are removed at the module's end.
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
from builder.smoke.results import find_ddp_result
from builder.smoke.torchrun import ddp_job_args
from tests.support import wait_until

from .cellimage import BuiltCell
from .pyxis_cluster import build_pyxis_image, node_options
from .slurm_cluster import FINAL_STATES, JOBS, SlurmCluster, SlurmClusterError, finish

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NODES, NPROC = 2, 2
HOSTS = {f"node{i}" for i in range(1, NODES + 1)}
JOB_S = 600  # submit -> COMPLETED: both nodes mount the squashfs and import torch from it on a busy 2-core host
NODE_FAIL_S = 90  # docker kill -> the job ended (SlurmdTimeout=10, MessageTimeout=5)


@pytest.fixture(scope="module")
def cluster(built_cell: BuiltCell, exported_sqsh: Path, docker_client: docker.DockerClient,
            session_labels: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    t0 = time.monotonic()
    try:
        image = build_pyxis_image(docker_client, built_cell.cell, built_cell.ref, session_labels,
                                  tmp_path_factory.mktemp("pyxis-image"))
    except (SlurmClusterError, RuntimeError) as exc:
        pytest.fail(str(exc), pytrace=False)
    print(f"Slurm + pyxis layer {image} built in {time.monotonic() - t0:.1f} s")
    c = SlurmCluster(docker_client, image, session_labels, nodes=NODES, run_options=node_options(exported_sqsh))
    try:
        try:
            c.start(timeout=120)
        except SlurmClusterError as exc:
            pytest.fail(str(exc), pytrace=False)
        print(f"Slurm cluster {c.id} (pyxis) up in {c.up_seconds:.1f} s")
        yield c
    finally:
        c.stop()
        with contextlib.suppress(docker.errors.ImageNotFound):
            docker_client.images.remove(image, force=True)
        left = c.leftovers()
        assert not left, f"left behind by Slurm cluster {c.id}: {left}"


def generate(tmp: Path, cell: str, sqsh: Path, *extra: str) -> str:
    """`build.py launch` itself, as a user runs it."""
    argv = [sys.executable, str(ROOT / "build.py"), "launch", "--target", "slurm", "--launcher", "pyxis",
            "--only", cell, "--image-file", str(sqsh), "--nodes", str(NODES), "--gpus-per-node", "0",
            "--nproc-per-node", str(NPROC), "--time", "00:15:00", "--mem", "512M", "--out", str(tmp), *extra]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return (tmp / cell / "slurm.sbatch").read_text()


def test_pyxis_runs_the_ddp_job_across_two_nodes(cluster: SlurmCluster, built_cell: BuiltCell,
                                                 exported_sqsh: Path, tmp_path: Path) -> None:
    script = generate(tmp_path, built_cell.cell, exported_sqsh)
    assert '--container-image="${PTMG_IMAGE}"' in script and str(exported_sqsh) in script, script
    job = cluster.sbatch(script, "ddp.sbatch")
    mounted: set[str] = set()

    def trained_or_ended() -> bool:  # meanwhile: which nodes hold the squashfs mounted
        mounted.update(n for n in sorted(HOSTS) if str(exported_sqsh) in cluster.processes(n, "squashfuse"))
        return contract.DDP_KILL_TRIGGER in cluster.output(job) or cluster.job(job).get("JobState") in FINAL_STATES

    wait_until(trained_or_ended, JOB_S, interval=1, what=f"job {job} training")
    info, text = finish(cluster, job, JOB_S)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-4000:]}"
    assert info["UserId"].startswith(f"{contract.USER}({contract.UID})"), info
    result = find_ddp_result([text])
    assert result is not None, text[-4000:]
    assert result.ok and result.backend == "gloo" and result.world_size == NODES * NPROC, result
    assert sorted(result.hosts) == sorted(sorted(HOSTS) * NPROC) and result.nodes == NODES, result
    assert result.loss_decreased and result.params_identical and result.allreduce_exact, result
    # The record, copied by the node that ran rank 0 into the job's directory (--container-mounts).
    record = json.loads(cluster.read(f"{JOBS}/ptmg-ddp-{job}/result.json") or "{}")
    assert record.get("ok") is True and record.get("world_size") == NODES * NPROC, record
    assert mounted == HOSTS, f"squashfuse of {exported_sqsh} seen on {sorted(mounted)}"


def test_require_gpu_on_cpu_fails_the_pyxis_job_and_says_why(cluster: SlurmCluster, built_cell: BuiltCell,
                                                             exported_sqsh: Path, tmp_path: Path) -> None:
    command = shlex.join([f"{contract.SMOKE_DIR}/selftest.py", "--require-gpu", "-k", "test_cuda_available"])
    # Submitted with --export=NONE: no PTMG_CELL from the submitting shell, only from the image (enroot's
    # /etc/environment of the squashfs).
    job = cluster.sbatch(generate(tmp_path, built_cell.cell, exported_sqsh, "--nproc-per-node", "1",
                                  "--command", command), "gpu.sbatch", "--export=NONE")
    info, text = finish(cluster, job, JOB_S)
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", f"{info}\n{text[-4000:]}"
    assert "--require-gpu: " in text and "FAIL " in text, text[-4000:]
    # In the squashfs's root (no /.dockerenv: not the node's own), with the image's environment.
    assert f"pt-multi-gpu selftest: {built_cell.cell} in enroot/pyxis" in text, text[-4000:]
    assert f"under Slurm job {job}, as uid {contract.UID}" in text, text[-4000:]


def test_a_killed_node_ends_the_pyxis_job_without_a_requeue(cluster: SlurmCluster, built_cell: BuiltCell,
                                                            exported_sqsh: Path, tmp_path: Path) -> None:
    """Last: node2's container is killed while the job trains (its results on /shared, a --mount)."""
    run = uuid.uuid4().hex[:8]
    out = f"/shared/runs/{run}"
    command = shlex.join([contract.DDP_JOB, *ddp_job_args(out=out, steps=600, step_sleep_s=0.5, timeout_s=30,
                                                          phase_timeout_s=60, extra=("--node-out", out))])
    job = cluster.sbatch(generate(tmp_path, built_cell.cell, exported_sqsh, "--mount", "/shared:/shared",
                                  "--command", command), f"{run}.sbatch")
    try:
        wait_until(lambda: contract.DDP_KILL_TRIGGER in cluster.output(job) or cluster.job(job).get("JobState")
                   in FINAL_STATES, JOB_S, interval=1, what=f"job {job} training")
        assert contract.DDP_KILL_TRIGGER in cluster.output(job), f"{cluster.job(job)}\n{cluster.output(job)[-4000:]}"
        killed = time.monotonic()
        cluster.kill("node2")
        info, text = finish(cluster, job, NODE_FAIL_S)
        took = time.monotonic() - killed
        cluster.restart("node2")
        after = cluster.job(job)
    finally:
        cluster.cancel(job)
    print(f"job {job}: {info['JobState']} (Reason={info.get('Reason')}) {took:.1f} s after docker kill node2")
    assert info["JobState"] in ("NODE_FAIL", "FAILED"), f"{info}\n{text[-4000:]}"
    assert info["Requeue"] == "0" and info["Restarts"] == "0", info
    assert after["JobState"] == info["JobState"] and after["Restarts"] == "0", after
