"""pyxis 0.24.0 (built from its release source, loaded into Slurm 22.05's slurmd through
plugstack.conf) runs the sbatch script of `build.py launch --target slurm --launcher pyxis
--image-file X.sqsh` as written, on a one-node Slurm cluster on this host (slurm_local.py): enroot
4.1.2 starts the exported squashfs and the image's DDP job passes over gloo with 2 CPU ranks; a
crashing rank fails the job.

One host only: the multi-node cluster of containers (slurm_cluster.py) does not run pyxis yet
(docs/launch.md). The job runs as root (LocalSlurm submits as root); enroot's paths for it are
private to this module (slurmd's environment, which pyxis hands to enroot) and removed at its end.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import ptmg_contract as contract
from builder.smoke.results import find_ddp_result
from builder.smoke.torchrun import ddp_job_args

from .cellimage import BuiltCell
from .slurm_local import LocalSlurm, SlurmUnavailable, free_port

ROOT = Path(__file__).resolve().parents[2]
PYXIS_SO = Path("/usr/local/lib/slurm/spank_pyxis.so")
JOB_TIMEOUT = 900  # enroot unpacks the 4 GB squashfs, then a 2-rank gloo DDP job, on a busy 2-core host


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    if not PYXIS_SO.exists() or shutil.which("enroot") is None:
        pytest.fail("pyxis or enroot is not installed. Fix: PTMG_THIRDPARTY_DIR=DIR scripts/ensure-tools.sh test "
                    "(DIR: the enroot and pyxis release tarballs; `make test` uses ../shared/thirdparty)", pytrace=False)
    root = tmp_path_factory.mktemp("slurm-pyxis")
    plugstack = root / "plugstack.conf"
    plugstack.write_text(f"required {PYXIS_SO}\n")
    enroot_dir = Path(tempfile.mkdtemp(prefix="ptmg-pyxis-enroot-", dir="/var/tmp"))
    paths = {f"ENROOT_{n}_PATH": str(enroot_dir / n.lower()) for n in ("RUNTIME", "CACHE", "DATA", "TEMP")}
    cluster = LocalSlurm(root, extra_conf=(f"PlugStackConfig={plugstack}",), daemon_env=paths)
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        shutil.rmtree(enroot_dir, ignore_errors=True)
        pytest.fail(f"a local Slurm cluster can't start: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(enroot_dir, ignore_errors=True)


def generate(tmp: Path, built_cell: BuiltCell, sqsh: Path, *extra: str) -> Path:
    argv = [sys.executable, str(ROOT / "build.py"), "launch", "--target", "slurm", "--launcher", "pyxis",
            "--only", built_cell.cell, "--image-file", str(sqsh), "--nodes", "1", "--gpus-per-node", "0",
            "--nproc-per-node", "2", "--rdzv-port", str(free_port()), "--time", "00:15:00",
            "--mem", "0",  # this node's slurm.conf states no RealMemory
            "--out", str(tmp), *extra]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return tmp / built_cell.cell / "slurm.sbatch"


def run_job(slurm: LocalSlurm, script: Path, tmp: Path) -> tuple[dict[str, str], str]:
    return slurm.run(script, tmp, JOB_TIMEOUT)


def test_pyxis_runs_the_launch_script_from_the_export(slurm: LocalSlurm, built_cell: BuiltCell,
                                                      exported_sqsh: Path, tmp_path: Path) -> None:
    script = generate(tmp_path, built_cell, exported_sqsh)
    assert '--container-image="${PTMG_IMAGE}"' in script.read_text()
    info, text = run_job(slurm, script, tmp_path)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-4000:]}\n{slurm.logs()}"
    result = find_ddp_result([text])
    assert result is not None and result.ok and result.world_size == 2 and result.backend == "gloo", text[-4000:]
    slurmd_log = (slurm.root / "log" / "slurmd.log").read_text(errors="replace")
    assert "pyxis: version v0.24.0" in slurmd_log and "pyxis: starting container" in slurmd_log, slurmd_log[-3000:]


def test_a_crashing_rank_fails_the_pyxis_job(slurm: LocalSlurm, built_cell: BuiltCell, exported_sqsh: Path,
                                             tmp_path: Path) -> None:
    command = shlex.join([contract.DDP_JOB, *ddp_job_args(steps=30, timeout_s=30, phase_timeout_s=60,
                                                 extra=("--fault", "crash", "--fault-rank", "1"))])
    info, text = run_job(slurm, generate(tmp_path, built_cell, exported_sqsh, "--command", command), tmp_path)
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", f"{info}\n{text[-4000:]}"
    assert "injecting fault crash" in text and find_ddp_result([text]) is None, text[-4000:]
