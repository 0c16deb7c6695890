"""`build.py launch` when GPUs are asked for, and `--image-file`: the generated Slurm script run
under bash with stand-ins for srun, the runtimes (docker, apptainer, ch-run) and torchrun that
record their argv and the environment each node's torchrun gets.

- every launcher passes `--backend nccl` to the DDP job when GPUs are asked for (gloo otherwise),
  in the Slurm script and in the Kubernetes manifests;
- pyxis: NVIDIA_VISIBLE_DEVICES=all and NVIDIA_DRIVER_CAPABILITIES=compute,utility reach the
  tasks (enroot's GPU hook does nothing without them); apptainer: --nv and LIBRARY_PATH (Triton
  links with -lcuda); docker: --gpus of the step's GPUs before the job's; every srun asks for
  the GPUs (the step's SLURM_STEP_GPUS, CUDA_VISIBLE_DEVICES on native nodes);
- the rendezvous waits 600 s for the nodes;
- `--image-file` runs a squashfs/SIF file by its absolute path; Charliecloud runs one with ch-run;
  a bad path is exit 2.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import builder.cli.main as cli
from builder.launch import LaunchError, config, render, slurm
from tests.support import write_matrix
from tests.unit.launch.test_config import CELL, cfg
from tests.unit.launch.test_slurm import fake_bin, for_launcher, run_sbatch

__all__ = ["fake_bin"]  # the fixture, used by name

#: torchrun stand-in that also says what GPU environment it got.
TORCHRUN_ENV = """#!/bin/bash
echo "torchrun node=$NODE_RANK nvd=${NVIDIA_VISIBLE_DEVICES-unset} caps=${NVIDIA_DRIVER_CAPABILITIES-unset} \
lib=${LIBRARY_PATH-unset} $*" >> "$FAKE_LOG"
"""
#: apptainer stand-in that applies `--env K=V` as Apptainer does (the variable is set in the container).
APPTAINER_ENV = """#!/bin/bash
echo "apptainer $*" >> "$FAKE_LOG"
args=("$@"); n=${#args[@]}; envs=()
for ((i = 0; i < n; i++)); do [ "${args[i]}" = --env ] && envs+=("${args[i+1]}"); done
exec env "${envs[@]}" bash -c "${args[n-1]}"
"""


def _torchruns(fake: Path, tmp: Path, script: str, nodes: int = 2, **env: str) -> tuple[list[str], list[str]]:
    (fake / "torchrun").write_text(TORCHRUN_ENV)
    (fake / "apptainer").write_text(APPTAINER_ENV)
    rc, lines, stderr = run_sbatch(script, fake, tmp, nodes=nodes, **env)
    assert rc == 0, stderr
    return [ln for ln in lines if ln.startswith("torchrun ")], lines


def _launcher_cfg(launcher: str, gpus: int, **kw: Any) -> Any:
    return cfg(launcher=launcher, gpus_per_node=gpus, nproc_per_node=gpus or 2, **kw)


@pytest.mark.parametrize("launcher", [x for x in config.LAUNCHERS if x != "charliecloud"])
@pytest.mark.parametrize("gpus", [4, 0])
def test_every_launcher_asks_the_job_for_nccl_when_gpus_are_requested(launcher: str, gpus: int, fake_bin: Path,
                                                                      tmp_path: Path) -> None:
    script = for_launcher(launcher, slurm.render_slurm(_launcher_cfg(launcher, gpus)), tmp_path)
    runs, lines = _torchruns(fake_bin, tmp_path, script)
    assert len(runs) == 2
    want = "--backend nccl" if gpus else "--backend gloo"
    assert all(want in r for r in runs), runs
    srun = next(ln for ln in lines if ln.startswith("srun "))
    assert ("--gpus-per-node=4" in srun) == bool(gpus), srun  # the step gets the GPUs (SLURM_STEP_GPUS)
    assert all("--rdzv_conf join_timeout=600" in r for r in runs), runs  # node start-up skews by minutes


@pytest.mark.parametrize("target", ["pytorchjob", "jobset"])
def test_kubernetes_jobs_ask_for_nccl_and_wait_600s(target: str) -> None:
    for gpus, backend in ((8, "nccl"), (0, "gloo")):
        docs = list(yaml.safe_load_all(render(target, cfg(gpus_per_node=gpus, nproc_per_node=gpus or 2))))
        text = yaml.safe_dump(docs)
        args = re.findall(r"- --backend\n\s+- (\w+)", text)
        assert args and set(args) == {backend}, text[:2000]
        assert "join_timeout=600" in text


def test_pyxis_gives_the_tasks_the_nvidia_variables_only_with_gpus(fake_bin: Path, tmp_path: Path) -> None:
    runs, _ = _torchruns(fake_bin, tmp_path, slurm.render_slurm(_launcher_cfg("pyxis", 4)))
    assert all("nvd=all caps=compute,utility" in r for r in runs), runs
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    runs, _ = _torchruns(fake_bin, cpu, slurm.render_slurm(_launcher_cfg("pyxis", 0)))
    assert all("nvd=unset caps=unset" in r for r in runs), runs


def test_apptainer_binds_the_driver_and_sets_library_path(fake_bin: Path, tmp_path: Path) -> None:
    runs, lines = _torchruns(fake_bin, tmp_path, slurm.render_slurm(_launcher_cfg("apptainer", 4)))
    app = [ln for ln in lines if ln.startswith("apptainer ")]
    assert app and all(ln.startswith("apptainer exec --nv ") for ln in app), app
    assert all("lib=/.singularity.d/libs" in r for r in runs), runs  # Triton's -lcuda finds libcuda there


def test_docker_prefers_the_steps_gpus_to_the_jobs(fake_bin: Path, tmp_path: Path) -> None:
    _, lines = _torchruns(fake_bin, tmp_path, slurm.render_slurm(_launcher_cfg("docker", 2)), nodes=1,
                          SLURM_JOB_GPUS="0,1,2,3", SLURM_STEP_GPUS="2,3")
    assert any('--gpus "device=2,3"' in ln for ln in lines), lines
    other = tmp_path / "job-only"
    other.mkdir()
    _, lines = _torchruns(fake_bin, other, slurm.render_slurm(_launcher_cfg("docker", 2)), nodes=1,
                          SLURM_JOB_GPUS="0,1")
    assert any('--gpus "device=0,1"' in ln for ln in lines), lines


# --- --image-file and Charliecloud ---------------------------------------------------------------------------

CH_RUN = """#!/bin/bash
echo "ch-run $*" >> "$FAKE_LOG"
args=("$@"); n=${#args[@]}
[ "${args[n-4]}" = -- ] || { echo "ch-run: no -- before the command" >&2; exit 64; }
CH_RUNNING="Weird Al Yankovic" exec bash -c "${args[n-1]}"
"""


def _image(tmp: Path, name: str) -> str:
    path = tmp / "images" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"hsqs")
    return str(path)


def test_image_file_runs_the_file_by_its_absolute_path(fake_bin: Path, tmp_path: Path) -> None:
    sqsh, sif = _image(tmp_path, "pt.sqsh"), _image(tmp_path, "pt.sif")
    _, lines = _torchruns(fake_bin, tmp_path, slurm.render_slurm(_launcher_cfg("pyxis", 4, image_file=sqsh)))
    srun = next(ln for ln in lines if ln.startswith("srun "))
    assert f"--container-image={sqsh} " in srun, srun
    app = tmp_path / "app"
    app.mkdir()
    _, lines = _torchruns(fake_bin, app, slurm.render_slurm(_launcher_cfg("apptainer", 4, image_file=sif)))
    assert all(ln.startswith(f"apptainer exec --nv --env LIBRARY_PATH=/.singularity.d/libs --bind {app}/ptmg-ddp-4242 "
                             f"{sif} bash -c ")
               for ln in lines if ln.startswith("apptainer ")), lines


def test_charliecloud_runs_the_squashfs_with_ch_run(fake_bin: Path, tmp_path: Path) -> None:
    sqsh = _image(tmp_path, "pt.sqsh")
    (fake_bin / "ch-run").write_text(CH_RUN)
    (fake_bin / "ch-run").chmod(0o755)
    c = _launcher_cfg("charliecloud", 0, image_file=sqsh, mounts=("/scratch/data:/data",))
    runs, lines = _torchruns(fake_bin, tmp_path, slurm.render_slurm(c))
    assert [r.split()[1] for r in runs] == ["node=0", "node=1"] and all("--backend gloo" in r for r in runs)
    ch = [ln for ln in lines if ln.startswith("ch-run ")]
    assert len(ch) == 2
    assert all(ln.startswith(f"ch-run --home --set-env --bind=/scratch/data:/data {sqsh} -- bash -c ") for ln in ch), ch


@pytest.mark.parametrize(("kw", "match"), [
    ({"launcher": "charliecloud", "image_file": ""}, "--launcher charliecloud runs an exported squashfs: give --image-file"),
    ({"launcher": "charliecloud", "image_file": "/x/pt.sqsh", "gpus_per_node": 4},
     "ch-fromhost --nvidia"),
    ({"launcher": "charliecloud", "image_file": "/x/pt.sif", "gpus_per_node": 0, "nproc_per_node": 2},
     "--image-file /x/pt.sif: --launcher charliecloud runs a .sqsh"),
    ({"launcher": "charliecloud", "image_file": "/x/pt.sqsh", "gpus_per_node": 0, "nproc_per_node": 2,
      "mounts": ("/a:/b:ro",)}, "ch-run's --bind has no mode"),
    ({"launcher": "pyxis", "image_file": "/x/pt.sif"}, "--launcher pyxis runs a .sqsh"),
    ({"launcher": "apptainer", "image_file": "/x/pt.sqsh"}, "--launcher apptainer runs a .sif"),
    ({"launcher": "docker", "image_file": "/x/pt.sqsh"}, "--launcher docker runs no image file"),
    ({"launcher": "pyxis", "image_file": "x/pt.sqsh"}, "an absolute path"),
])
def test_bad_image_files_and_charliecloud_gpus_are_refused(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(LaunchError, match=re.escape(match)):
        cfg(**kw)


def test_verb_resolves_the_image_file_and_refuses_a_bad_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    matrix = write_matrix(tmp_path / "matrix")
    sqsh = _image(tmp_path, "pt.sqsh")
    monkeypatch.chdir(tmp_path)
    base = ["launch", "--config", str(matrix), "--only", CELL, "--target", "slurm", "--no-pin"]
    assert cli.main([*base, "--image-file", "images/pt.sqsh"]) == 0
    out = capsys.readouterr().out
    assert f"PTMG_IMAGE={sqsh}\n" in out and "--container-image=\"${PTMG_IMAGE}\"" in out
    for argv, message in ((["--image-file", "images/missing.sqsh"], "no such file"),
                          (["--image-file", "images"], "not a file"),
                          (["--image-file", "images/pt.sqsh", "--launcher", "apptainer"], "runs a .sif"),
                          (["--image-file", "images/pt.sqsh", "--target", "jobset"], "--target slurm only")):
        assert cli.main([*base, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
