"""The Slurm script `build.py launch` writes (builder/launch/slurm.py), run under bash with stand-in
`scontrol`, `srun`, `docker`, `apptainer` and `torchrun` commands: each node must get the right
rendezvous, its own node rank, and (docker) every variable it needs through `-e`; the stand-in srun
drops the environment as Slurm does under `sbatch --export=NONE` unless srun says `--export=ALL`;
the native launcher's preflight runs against a stand-in cell file and venv. The DDP job's result
from every node (--node-out) for multi-node jobs. Real Slurm runs are in tests/docker/test_slurm.py
(one node, docker launcher) and tests/docker/test_slurm_multinode.py (a cluster of containers of
the image, native launcher). No Docker, no cluster."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import ptmg_contract as contract
from builder.launch import config, slurm
from tests.unit.launch.test_config import CELL, CH_IMAGE, ROOT, TORCH, cfg

# --- Slurm: run the script with stand-ins for scontrol, srun and the launchers ------------------------------

FAKES = {
    "scontrol": """#!/bin/bash
[ "$1 $2" = "show hostnames" ] || { echo "scontrol: unexpected $*" >&2; exit 2; }
printf 'gpu-a01\\ngpu-a02\\ngpu-a03\\n' | head -n "$SLURM_NNODES"
""",
    # One task per node: run the command once per node with that node's SLURM_NODEID/PROCID;
    # fail like srun does when any task failed. The tasks' environment as Slurm makes it: srun's
    # --export, else SLURM_EXPORT_ENV (what `sbatch --export=NONE` leaves to the script), else ALL;
    # NONE keeps only Slurm's own variables (and the stand-ins' plumbing).
    "srun": """#!/bin/bash
echo "srun $*" >> "$FAKE_LOG"
export_env=${SLURM_EXPORT_ENV:-ALL}
while [[ "$1" == --* ]]; do
    case "$1" in --export=*) export_env=${1#--export=} ;; esac
    shift
done
rc=0
for ((i = 0; i < SLURM_NNODES; i++)); do
    if [ "$export_env" = NONE ]; then
        env -i PATH="$FAKE_BIN:/usr/bin:/bin" FAKE_LOG="$FAKE_LOG" FAKE_BIN="$FAKE_BIN" SLURM_JOB_ID="$SLURM_JOB_ID" \
            SLURM_NNODES="$SLURM_NNODES" SLURM_JOB_NODELIST="$SLURM_JOB_NODELIST" SLURM_NODEID=$i SLURM_PROCID=$i \
            "$@" || rc=$?
    else
        SLURM_NODEID=$i SLURM_PROCID=$i "$@" || rc=$?
    fi
done
exit $rc
""",
    # docker run ... IMAGE bash -c SCRIPT: run SCRIPT with ONLY the variables passed by -e (as Docker does).
    "docker": """#!/bin/bash
echo "docker $*" >> "$FAKE_LOG"
[ "$1" = run ] || exit 0
args=("$@"); n=${#args[@]}
keep=(PATH="$FAKE_BIN:/usr/bin:/bin" FAKE_LOG="$FAKE_LOG" FAKE_FAIL_NODE="${FAKE_FAIL_NODE-}")
for ((i = 0; i < n; i++)); do
    if [ "${args[i]}" = -e ]; then name=${args[i+1]}; keep+=("$name=${!name-}"); fi
done
exec env -i "${keep[@]}" bash -c "${args[n-1]}"
""",
    "apptainer": """#!/bin/bash
echo "apptainer $*" >> "$FAKE_LOG"
args=("$@"); n=${#args[@]}
exec bash -c "${args[n-1]}"
""",
    # ch-run [OPTIONS] IMAGE -- CMD...: the host's environment passes through.
    "ch-run": """#!/bin/bash
echo "ch-run $*" >> "$FAKE_LOG"
args=("$@"); n=${#args[@]}
[ "${args[n-4]}" = -- ] || { echo "ch-run: no -- before the command" >&2; exit 64; }
exec bash -c "${args[n-1]}"
""",
    "torchrun": """#!/bin/bash
echo "torchrun node=$NODE_RANK $*" >> "$FAKE_LOG"
[ -n "${FAKE_FAIL_NODE:-}" ] && [ "$NODE_RANK" = "$FAKE_FAIL_NODE" ] && exit 3
exit 0
""",
}


@pytest.fixture
def fake_bin(tmp_path: Path) -> Iterator[Path]:
    if not shutil.which("bash"):
        pytest.fail("bash is needed to run the generated Slurm script")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in FAKES.items():
        p = bindir / name
        p.write_text(text)
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    yield bindir


def native_node(script: str, tmp: Path, cell: str | None = CELL, torch: str | None = f"{TORCH}+cu126") -> str:
    """The script with the image's cell file and venv moved to a stand-in node under ``tmp``: the
    node has the cell file ``cell`` (None: none) and torch ``torch`` in its venv (None: none)."""
    node = tmp / "node"
    cell_file, venv = node / "cell", node / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True, exist_ok=True)
    if cell is not None:
        cell_file.write_text(cell + "\n")
    if torch is not None:
        (site / f"torch-{torch}.dist-info").mkdir()
    return script.replace(contract.CELL_FILE, str(cell_file)).replace(contract.VENV, str(venv))


def run_sbatch(script: str, bindir: Path, tmp: Path, nodes: int, **env: str) -> tuple[int, list[str], str]:
    path = tmp / "job.sbatch"
    path.write_text(script)
    log = tmp / "fake.log"
    full = {"PATH": f"{bindir}:/usr/bin:/bin", "FAKE_LOG": str(log), "FAKE_BIN": str(bindir),
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-a[01-03]", "SLURM_NNODES": str(nodes),
            "SLURM_SUBMIT_DIR": str(tmp), **env}
    r = subprocess.run(["bash", str(path)], env=full, cwd=tmp, capture_output=True, text=True, timeout=60,
                       check=False)
    return r.returncode, log.read_text().splitlines() if log.exists() else [], r.stderr


def for_launcher(launcher: str, script: str, tmp: Path) -> str:
    """The script, with a stand-in node for the native launcher (its preflight looks at the node)."""
    return native_node(script, tmp) if launcher == "native" else script


@pytest.mark.parametrize("launcher", config.LAUNCHERS)
def test_slurm_script_gives_each_node_its_rank_and_the_rendezvous(
        launcher: str, fake_bin: Path, tmp_path: Path) -> None:
    mounts = {"native": (), "charliecloud": ("/scratch/data:/data",)}.get(launcher, ("/scratch/data:/data:ro",))
    c = cfg(nodes=2, launcher=launcher, mounts=mounts, env=(("MY_FLAG", "a b'c"),))
    script = slurm.render_slurm(c)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    rc, lines, stderr = run_sbatch(for_launcher(launcher, script, tmp_path), fake_bin, tmp_path, nodes=2)
    assert rc == 0, stderr
    runs = [ln for ln in lines if ln.startswith("torchrun ")]
    assert [r.split()[1] for r in runs] == ["node=0", "node=1"], lines
    for r in runs:
        assert "--rdzv_endpoint gpu-a01:24242 --rdzv_id 4242" in r  # 20000 + the job id % 10000
        assert "--nnodes 2 --nproc_per_node 4" in r
        assert f"{contract.DDP_JOB} --out" in r
    srun = next(ln for ln in lines if ln.startswith("srun "))
    assert "--kill-on-bad-exit=1" in srun and "--ntasks-per-node=1" in srun and "--export=ALL" in srun
    if launcher == "native":
        assert srun.startswith("srun --kill-on-bad-exit=1 --export=ALL --label --nodes=2 --ntasks-per-node=1 "
                               "--cpus-per-task=16 --gpus-per-node=4 bash -c ")
        assert not any(ln.startswith(("docker ", "apptainer ")) for ln in lines) and "--container" not in srun
    elif launcher == "pyxis":
        assert f"--container-image=pt-multi-gpu:{CELL}" in srun
        assert f"--container-mounts={tmp_path}/ptmg-ddp-4242:{tmp_path}/ptmg-ddp-4242,/scratch/data:/data:ro" in srun
        # HOME bound whatever the site's enroot default, the ENTRYPOINT off whatever the site's pyxis default;
        # no --container-env, no named container
        assert "--container-workdir=/workspace --container-mount-home --no-container-entrypoint bash -c " in srun, srun
        assert not any(f in srun for f in ("--container-entrypoint", "--container-env", "--container-name")), srun
    elif launcher == "apptainer":
        app = next(ln for ln in lines if ln.startswith("apptainer "))
        assert app.startswith("apptainer exec --nv --env LIBRARY_PATH=/.singularity.d/libs "
                              f"--bind {tmp_path}/ptmg-ddp-4242 --bind /scratch/data:/data:ro docker://pt-multi-gpu:")
    elif launcher == "charliecloud":
        ch = [ln for ln in lines if ln.startswith("ch-run ")]
        assert len(ch) == 2 and ch[0].startswith(f"ch-run --home --set-env --bind=/scratch/data:/data {CH_IMAGE} -- ")
    else:
        docker = [ln for ln in lines if ln.startswith("docker run ")]
        assert len(docker) == 2
        assert "--name ptmg-4242-0 " in docker[0] and "--name ptmg-4242-1 " in docker[1]
        for d in docker:
            assert "--network host --shm-size 8g" in d
            assert "--label project=pt-multi-gpu" in d
            assert '--gpus "device=all"' in d  # SLURM_JOB_GPUS unset here: all of the host's
            assert "-v /scratch/data:/data:ro" in d


def test_slurm_docker_passes_slurms_gpus_and_the_env(fake_bin: Path, tmp_path: Path) -> None:
    c = cfg(nodes=1, launcher="docker", env=(("MY_FLAG", "a b'c"),))
    (fake_bin / "torchrun").write_text('#!/bin/bash\necho "torchrun node=$NODE_RANK flag=$MY_FLAG '
                                       'nccl=$NCCL_DEBUG" >> "$FAKE_LOG"\n')
    rc, lines, stderr = run_sbatch(slurm.render_slurm(c), fake_bin, tmp_path, nodes=1, SLURM_JOB_GPUS="2,3")
    assert rc == 0, stderr
    assert any('--gpus "device=2,3"' in ln for ln in lines), lines
    assert "torchrun node=0 flag=a b'c nccl=WARN" in lines


@pytest.mark.parametrize("launcher", config.LAUNCHERS)
def test_slurm_script_fails_when_a_node_fails(launcher: str, fake_bin: Path, tmp_path: Path) -> None:
    script = for_launcher(launcher, slurm.render_slurm(cfg(nodes=2, launcher=launcher)), tmp_path)
    rc, lines, _ = run_sbatch(script, fake_bin, tmp_path, nodes=2, FAKE_FAIL_NODE="1")
    assert rc != 0
    assert sum(ln.startswith("torchrun ") for ln in lines) == 2


@pytest.mark.parametrize("launcher", config.LAUNCHERS)
def test_every_srun_exports_the_scripts_environment(launcher: str, fake_bin: Path, tmp_path: Path) -> None:
    """Under `sbatch --export=NONE` (a site default at some centres) srun inherits SLURM_EXPORT_ENV=NONE
    and its tasks would get none of PTMG_*: every srun line says --export=ALL. Without it, the
    stand-in srun (like Slurm) starts the tasks without the script's environment and the job fails."""
    script = slurm.render_slurm(cfg(nodes=2, launcher=launcher))
    sruns = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    assert sruns and all(" --export=ALL " in ln for ln in sruns), sruns
    rc, lines, stderr = run_sbatch(for_launcher(launcher, script, tmp_path), fake_bin, tmp_path, nodes=2,
                                   SLURM_EXPORT_ENV="NONE")
    assert rc == 0, stderr
    assert [ln.split()[1] for ln in lines if ln.startswith("torchrun ")] == ["node=0", "node=1"], lines
    without = tmp_path / "without"
    without.mkdir()
    rc, lines, _ = run_sbatch(for_launcher(launcher, script.replace(" --export=ALL", ""), without), fake_bin,
                              without, nodes=2, SLURM_EXPORT_ENV="NONE")
    assert rc != 0 and not any(ln.startswith("torchrun ") for ln in lines), lines


@pytest.mark.parametrize(("cell", "torch", "runs"), [
    (CELL, f"{TORCH}+cu126", True),   # the image's cell file
    (CELL, None, True),               # the cell file decides, not the venv
    (None, f"{TORCH}+cu126", True),   # an image without the cell file: its torch (local version)
    (None, TORCH, True),              # ... or a torch without one
    ("2.0.1-cuda11.7-cudnn8-runtime", f"{TORCH}+cu126", False),  # another cell
    (None, "2.0.1", False),           # another torch
    (None, f"{TORCH}1", False),       # not a prefix match: 2.7.01 is not 2.7.0
    (None, None, False),              # no image at all
])
def test_native_preflight_refuses_a_node_that_does_not_run_the_image(
        cell: str | None, torch: str | None, runs: bool, fake_bin: Path, tmp_path: Path) -> None:
    script = native_node(slurm.render_slurm(cfg(nodes=2, launcher="native")), tmp_path, cell=cell, torch=torch)
    rc, lines, stderr = run_sbatch(script, fake_bin, tmp_path, nodes=2)
    torchruns = [ln for ln in lines if ln.startswith("torchrun ")]
    if runs:
        assert rc == 0 and len(torchruns) == 2, stderr
    else:
        assert rc == 127 and not torchruns, (rc, stderr)
        assert f"this node does not run pt-multi-gpu:{CELL}" in stderr
        assert (f"runs cell {cell} " if cell else f"no torch {TORCH} in ") in stderr


def test_slurm_header() -> None:
    text = slurm.render_slurm(cfg(nodes=3, gpus_per_node=8, nproc_per_node=8, partition="gpu", account="ml",
                                   time_limit="02:00:00"))
    sbatch = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert sbatch == ["#SBATCH --job-name=ptmg-ddp", "#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1",
                      "#SBATCH --no-requeue", "#SBATCH --time=02:00:00", "#SBATCH --gpus-per-node=8",
                      "#SBATCH --cpus-per-task=32", "#SBATCH --mem=139264M", "#SBATCH --partition=gpu",
                      "#SBATCH --account=ml", "#SBATCH --output=ptmg-ddp-%j.out"]
    cpu = slurm.render_slurm(cfg(gpus_per_node=0, nproc_per_node=2, launcher="docker"))
    assert "--gpus" not in cpu
    apptainer = slurm.render_slurm(cfg(gpus_per_node=0, nproc_per_node=2, launcher="apptainer"))
    assert re.search(r'^ +apptainer exec --bind "\$\{PTMG_JOB_DIR\}" \\$', apptainer, re.M), "no --nv without GPUs"


# --- the DDP job's result from every node (--node-out), for multi-node jobs ------------------------------------


def _ddp_job() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ptmg_ddp_job_node_out", ROOT / "smoke_tests" / "ddp_job.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # parses no arguments and imports no torch at import time
    return module


def test_ddp_job_writes_a_result_from_every_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = _ddp_job()
    out = tmp_path / "shared"
    env = {"RANK": "2", "LOCAL_RANK": "0", "GROUP_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(job, "run", lambda *a, **k: 0)
    assert job.main(["--node-out", str(out), "--phase-timeout", "30"]) == 0
    assert json.loads((out / "node-1.json").read_text()) == {
        "schema": 1, "node_rank": 1, "host": socket.gethostname(), "rank": 2, "local_world_size": 2,
        "world_size": 4, "exit": 0, "ok": True}
    assert sorted(p.name for p in out.iterdir()) == ["node-1.json"]  # written whole (no .tmp left)

    def broken(*a: Any, **k: Any) -> int:
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(job, "run", broken)  # a failed collective: the node reports its exit status
    assert job.main(["--node-out", str(out), "--phase-timeout", "30"]) == 1
    failed = json.loads((out / "node-1.json").read_text())
    assert failed["exit"] == 1 and failed["ok"] is False

    monkeypatch.setenv("LOCAL_RANK", "1")  # only each node's local rank 0 writes
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.setattr(job, "run", lambda *a, **k: 0)
    assert job.main(["--node-out", str(out), "--phase-timeout", "30"]) == 0
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert job.main(["--phase-timeout", "30"]) == 0  # no --node-out: no file
    assert not (out / "node-0.json").exists()
