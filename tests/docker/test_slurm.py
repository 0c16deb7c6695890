"""The sbatch script `build.py launch --target slurm --launcher docker` writes, submitted to a
real (one-node, localhost) Slurm cluster: the image's DDP job passes over gloo with 2 CPU ranks,
and a rank that crashes fails the Slurm job.

The cluster (tests/docker/slurm_local.py) is Debian's slurm-wlm 22.05 + munge, started and
stopped by this module. The job's containers are labelled project=pt-multi-gpu and
io.pt-multi-gpu.slurm-job=<id>; whatever is left of them is removed in a finally.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

import ptmg_contract as contract
from builder.smoke.results import find_ddp_result
from builder.smoke.torchrun import ddp_job_args

from .cellimage import BuiltCell
from .slurm_local import LocalSlurm, SlurmUnavailable, free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT = 600  # container start + a 2-rank gloo DDP job on a busy 2-core host


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        pytest.fail(f"a local Slurm cluster can't start: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


def generate(tmp: Path, built_cell: BuiltCell, *extra: str) -> Path:
    """`build.py launch` itself, as a user runs it: the verb, not just the rendering function."""
    argv = [sys.executable, str(ROOT / "build.py"), "launch", "--target", "slurm", "--launcher", "docker",
            "--only", built_cell.cell, "--image", built_cell.ref, "--nodes", "1", "--gpus-per-node", "0",
            "--nproc-per-node", "2", "--shm-size", "1g", "--rdzv-port", str(free_port()), "--time", "00:15:00",
            "--mem", "0",  # this node's slurm.conf states no RealMemory
            "--out", str(tmp), *extra]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    script = tmp / built_cell.cell / "slurm.sbatch"
    assert script.exists()
    return script


def run_job(slurm: LocalSlurm, script: Path, tmp: Path,
            client: docker.DockerClient) -> tuple[dict[str, str], str]:
    def remove_containers(job_id: str) -> None:
        for c in client.containers.list(all=True, filters={"label": f"io.pt-multi-gpu.slurm-job={job_id}"}):
            c.remove(force=True)

    return slurm.run(script, tmp, JOB_TIMEOUT, after=remove_containers)


def test_slurm_job_runs_the_images_ddp_job(slurm: LocalSlurm, built_cell: BuiltCell, tmp_path: Path,
                                           docker_client: docker.DockerClient) -> None:
    script = generate(tmp_path, built_cell)
    info, text = run_job(slurm, script, tmp_path, docker_client)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-4000:]}"
    result = find_ddp_result([text])
    assert result is not None, f"no DDP result in the job output:\n{text[-4000:]}"
    assert result.ok and result.world_size == 2 and result.backend == "gloo", result
    assert result.loss_decreased and result.params_identical and result.allreduce_exact
    assert "[ptmg] node 0 of 1 (task 0)" in text
    # the record, copied out of the (removed) container into the job's directory
    record = json.loads((tmp_path / f"ptmg-ddp-{info['JobId']}" / "result.json").read_text())
    assert record["ok"] is True and record["world_size"] == 2, record
    assert "0: [ptmg] node 0 of 1" in text, "srun --label: each line names its task"
    assert not docker_client.containers.list(all=True, filters={"label": "io.pt-multi-gpu.slurm-job"})


def test_a_crashing_rank_fails_the_slurm_job(slurm: LocalSlurm, built_cell: BuiltCell, tmp_path: Path,
                                             docker_client: docker.DockerClient) -> None:
    # The DDP job's own fault injection: rank 1 exits 3 at step 3 (os._exit, no cleanup).
    command = shlex.join([contract.DDP_JOB, *ddp_job_args(steps=30, timeout_s=30, phase_timeout_s=60,
                                                 extra=("--fault", "crash", "--fault-rank", "1"))])
    script = generate(tmp_path, built_cell, "--command", command)
    info, text = run_job(slurm, script, tmp_path, docker_client)
    assert info["JobState"] == "FAILED", f"{info}\n{text[-4000:]}"
    assert info["ExitCode"] != "0:0"
    assert "injecting fault crash" in text, text[-4000:]
    assert find_ddp_result([text]) is None
