"""Jobs a shared cluster schedules well: what `build.py launch` asks the scheduler for and how its
nodes meet, run under bash with the stand-ins of tests/unit/launch/test_slurm.py (no cluster).

- the c10d rendezvous: a node up before the endpoint's node keeps trying as long as the join waits
  (read_timeout = join_timeout; torch's default read_timeout is 60 s);
- sbatch: cores and memory per node with stated defaults (--cpus-per-task, --mem, --exclusive), a
  rendezvous port from the job id, `srun --label`, the DDP job's record copied out of the container
  into the job's directory;
- Kubernetes: cpu and memory requests (the memory-backed /dev/shm counted) equal to the limits, so
  the pods are of the Guaranteed QoS class;
- pyxis + --rdma: MELLANOX_VISIBLE_DEVICES for enroot's Mellanox hook;
- Apptainer without --image-file: the verb says to export a SIF once;
- a LaunchConfig is checked when it is made, and each derived value is computed once.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

import builder.cli.main as cli
import ptmg_contract as contract
from builder.launch import LaunchError, config, kubernetes, render, slurm
from builder.smoke import results
from builder.smoke import torchrun as torchrun_mod
from tests.support import write_matrix
from tests.unit.launch.test_config import CELL, cfg
from tests.unit.launch.test_kubernetes import assert_valid
from tests.unit.launch.test_slurm import FAKES, fake_bin, for_launcher, run_sbatch
from tests.unit.smoke.test_results import sample_result

__all__ = ["fake_bin"]  # the fixture, used by name

GiB_MiB = 1024


def _conf(argv: list[str] | tuple[str, ...]) -> dict[str, int]:
    text = argv[list(argv).index("--rdzv_conf") + 1]
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}


# --- the rendezvous ---------------------------------------------------------------------------------------------


def test_the_rendezvous_keeps_trying_to_connect_as_long_as_the_join_waits() -> None:
    argv = torchrun_mod.torchrun_argv(nnodes=2, nproc_per_node=2, rdzv_endpoint="n1:29400", rdzv_id="7",
                                      join_timeout_s=300)
    assert _conf(argv) == {"join_timeout": 300, "read_timeout": 300}
    c = cfg(nodes=2)
    line = next(ln for ln in slurm.render_slurm(c).splitlines() if "--rdzv_conf" in ln)
    conf = _conf(line.split())
    assert conf["read_timeout"] >= conf["join_timeout"] == config.JOIN_TIMEOUT_S == 600, line
    for target in ("pytorchjob", "jobset"):
        docs = list(yaml.safe_load_all(render(target, c)))
        pod = docs[-1]["spec"]
        spec = (pod["pytorchReplicaSpecs"]["Master"]["template"]["spec"] if target == "pytorchjob"
                else pod["replicatedJobs"][0]["template"]["spec"]["template"]["spec"])
        conf = _conf(spec["containers"][0]["args"])
        assert conf["read_timeout"] >= conf["join_timeout"] == 600, (target, conf)


# --- sbatch: resources ------------------------------------------------------------------------------------------


def _sbatch(text: str) -> list[str]:
    return [ln.removeprefix("#SBATCH ") for ln in text.splitlines() if ln.startswith("#SBATCH ")]


def test_sbatch_asks_for_cores_and_memory_per_node_with_stated_defaults() -> None:
    gpu = _sbatch(slurm.render_slurm(cfg(gpus_per_node=8, nproc_per_node=8)))
    # 4 cores and 16 GiB per GPU rank, plus the 8g of /dev/shm
    assert "--cpus-per-task=32" in gpu and f"--mem={8 * 16 * GiB_MiB + 8 * GiB_MiB}M" in gpu, gpu
    cpu = _sbatch(slurm.render_slurm(cfg(gpus_per_node=0, nproc_per_node=2, shm_size="512m")))
    assert "--cpus-per-task=2" in cpu and f"--mem={2 * 2 * GiB_MiB + 512}M" in cpu, cpu  # 1 core, 2 GiB per CPU rank
    asked = _sbatch(slurm.render_slurm(cfg(cpus_per_task=48, mem="500G")))
    assert "--cpus-per-task=48" in asked and f"--mem={500 * GiB_MiB}M" in asked and "--exclusive" not in asked
    whole = slurm.render_slurm(cfg(exclusive=True))
    assert "--exclusive" in _sbatch(whole) and "--mem=0" in _sbatch(whole)
    assert not any(ln.startswith("--cpus-per-task") for ln in _sbatch(whole))  # every core of the node
    assert '--cpus-per-task="${SLURM_CPUS_ON_NODE}"' in next(ln for ln in whole.splitlines() if ln.startswith("srun "))
    assert "--mem=64M" in _sbatch(slurm.render_slurm(cfg(exclusive=True, mem="64")))  # sbatch's unit: MiB


@pytest.mark.parametrize(("kw", "match"), [({"cpus_per_task": 0}, "--cpus-per-task"), ({"mem": "lots"}, "--mem"),
                                           ({"mem": "8g"}, "--mem"), ({"rdzv_port": 70000}, "--rdzv-port")])
def test_bad_resources_are_refused_when_the_config_is_made(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(LaunchError, match=match):
        cfg(**kw)


@pytest.mark.parametrize("launcher", config.LAUNCHERS)
def test_each_nodes_task_gets_the_cores_and_labels_its_output(launcher: str, fake_bin: Path, tmp_path: Path) -> None:
    """srun 22.05-23.02 does not take --cpus-per-task from sbatch: the srun line says it too."""
    script = for_launcher(launcher, slurm.render_slurm(cfg(launcher=launcher, cpus_per_task=12)), tmp_path)
    rc, lines, stderr = run_sbatch(script, fake_bin, tmp_path, nodes=2)
    assert rc == 0, stderr
    srun = next(ln for ln in lines if ln.startswith("srun ")).split(" bash -c ")[0].split()
    assert "--label" in srun and "--cpus-per-task=12" in srun, srun


def test_the_result_line_is_read_whole_from_srun_labels_pieces() -> None:
    """srun --label cuts a line longer than its buffer (the result line is a few KB) into pieces and
    labels each: the job output's result is still found, and a piece of another task ends it."""
    line = contract.DDP_RESULT_MARKER + json.dumps(sample_result(hosts=["node0"] * 200))
    pieces = [line[i:i + 1024] for i in range(0, len(line), 1024)]
    assert len(pieces) > 2
    out = "\n".join(["0: [ptmg] node 0 of 2", *(f"0: {p}" for p in pieces), "1: [ptmg] done"])
    r = results.find_ddp_result(["1: noise", out])
    assert r is not None and r.ok and r.world_size == 4 and len(r.hosts) == 200
    interleaved = "\n".join([f"0: {pieces[0]}", f"1: {pieces[1]}", *(f"0: {p}" for p in pieces[1:])])
    assert results.find_ddp_result([interleaved]) is None  # never joined across tasks
    assert results.find_ddp_result([line]) is not None  # without labels, as before


def test_the_rendezvous_port_comes_from_the_job_id(fake_bin: Path, tmp_path: Path) -> None:
    script = slurm.render_slurm(cfg(launcher="native", nodes=2))
    endpoints = []
    for job in ("4242", "12345", "998"):
        run = tmp_path / job
        run.mkdir()
        rc, lines, stderr = run_sbatch(for_launcher("native", script, run), fake_bin, run, nodes=2, SLURM_JOB_ID=job)
        assert rc == 0, stderr
        (endpoint,) = {ln.split("--rdzv_endpoint ")[1].split()[0] for ln in lines if ln.startswith("torchrun ")}
        endpoints.append(endpoint)
    assert endpoints == ["gpu-a01:24242", "gpu-a01:22345", "gpu-a01:20998"]
    fixed = slurm.render_slurm(cfg(rdzv_port=29500))
    assert "PTMG_RDZV_PORT=29500\n" in fixed


# --- sbatch: the DDP job's record -------------------------------------------------------------------------------

#: torchrun stand-in: the node that "runs rank 0" (node 0) writes the record where --out says.
TORCHRUN_RECORD = """#!/bin/bash
echo "torchrun node=$NODE_RANK $*" >> "$FAKE_LOG"
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do [ "${args[i]}" = --out ] && out=${args[i+1]}; done
if [ "$NODE_RANK" = 0 ]; then
    mkdir -p "$out/tb" && echo '{"ok": true, "node": 0}' > "$out/result.json" && echo event > "$out/tb/events"
fi
"""
#: docker stand-in that also copies (`docker cp NAME:PATH DEST`): the stand-in's container is the host.
DOCKER_CP = FAKES["docker"].replace('[ "$1" = run ] || exit 0', '''if [ "$1" = cp ]; then cp -r "${2#*:}" "$3"; exit $?; fi
[ "$1" = run ] || exit 0''')


@pytest.mark.parametrize("launcher", [x for x in config.LAUNCHERS if x != "charliecloud"])
def test_the_ddp_jobs_record_is_copied_to_the_jobs_directory(launcher: str, fake_bin: Path, tmp_path: Path) -> None:
    (fake_bin / "torchrun").write_text(TORCHRUN_RECORD)
    (fake_bin / "docker").write_text(DOCKER_CP)
    job = str(random.randrange(10**6, 10**7))  # its own /tmp/ptmg-JOB, also under pytest-xdist
    node_tmp = Path(f"/tmp/ptmg-{job}")
    try:
        script = for_launcher(launcher, slurm.render_slurm(cfg(launcher=launcher, nodes=2)), tmp_path)
        rc, lines, stderr = run_sbatch(script, fake_bin, tmp_path, nodes=2, SLURM_JOB_ID=job)
        assert rc == 0, stderr
        job_dir = tmp_path / f"ptmg-ddp-{job}"
        assert json.loads((job_dir / "result.json").read_text()) == {"ok": True, "node": 0}, stderr
        assert (job_dir / "tb" / "events").is_file()
        assert f"[ptmg] result: {job_dir}/result.json" in stderr
        assert all(f"--out /tmp/ptmg-{job} " in ln for ln in lines if ln.startswith("torchrun ")), lines
        if launcher == "docker":
            assert any(ln.startswith(f"docker cp ptmg-{job}-0:/tmp/ptmg-{job}/result.json ") for ln in lines), lines
        else:
            assert not node_tmp.exists(), "the node's /tmp folder is removed once copied"
    finally:
        shutil.rmtree(node_tmp, ignore_errors=True)
    # a user's command has no record to copy: no folders, and torchrun is the node's process (exec)
    own = slurm.render_slurm(cfg(launcher=launcher, command=("/workspace/train.py",)))
    assert "PTMG_JOB_DIR" not in own and "PTMG_RESULT_TMP" not in own and "exec torchrun " in own


# --- Kubernetes: requests, Guaranteed QoS ----------------------------------------------------------------------


def _pods(target: str, c: config.LaunchConfig) -> list[dict[str, Any]]:
    doc = list(yaml.safe_load_all(render(target, c)))[-1]
    if target == "pytorchjob":
        return [r["template"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
    return [doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]]


def _qos(pod: dict[str, Any]) -> str:
    """The QoS class Kubernetes gives a pod (pkg/apis/core/helper/qos): Guaranteed when every
    container has cpu and memory limits equal to its requests."""
    containers = pod["spec"]["containers"] + pod["spec"].get("initContainers", [])
    resources = [c.get("resources", {}) for c in containers]
    if not any(r.get("requests") or r.get("limits") for r in resources):
        return "BestEffort"
    for r in resources:
        limits, requests = r.get("limits", {}), r.get("requests", r.get("limits", {}))
        if any(limits.get(k) is None or str(limits[k]) != str(requests.get(k)) for k in ("cpu", "memory")):
            return "Burstable"
    return "Guaranteed"


@pytest.mark.parametrize("target", ["pytorchjob", "jobset"])
def test_kubernetes_pods_request_cores_and_memory_with_shm_counted_and_are_guaranteed(target: str) -> None:
    c = cfg(gpus_per_node=8, nproc_per_node=8, selftest_init=True)
    for pod in _pods(target, c):
        assert_valid(pod, "V1PodTemplateSpec")
        main = pod["spec"]["containers"][0]
        assert main["resources"]["requests"] == {"cpu": "32", "memory": f"{8 * 16 * GiB_MiB + 8 * GiB_MiB}Mi",
                                                 "nvidia.com/gpu": 8}
        assert _qos(pod) == "Guaranteed"
    asked = cfg(gpus_per_node=0, nproc_per_node=2, cpus_per_task=6, mem="20G", shm_size="2g")
    for pod in _pods(target, asked):
        assert pod["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "6", "memory": f"{20 * GiB_MiB}Mi"}
        assert _qos(pod) == "Guaranteed"


def test_the_verb_refuses_slurm_only_flags_for_kubernetes(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    matrix = write_matrix(tmp_path / "m")
    for flag in (["--exclusive"], ["--rdma"], ["--mem", "0"]):
        rc = cli.main(["launch", "--config", str(matrix), "--only", CELL, "--target", "jobset", "--no-pin", *flag])
        assert rc == 2
        assert f"{' '.join(flag)}: for --target slurm only" in capsys.readouterr().err


# --- pyxis + RDMA; Apptainer's image ---------------------------------------------------------------------------

TORCHRUN_MLNX = """#!/bin/bash
echo "torchrun node=$NODE_RANK mlnx=${MELLANOX_VISIBLE_DEVICES-unset}" >> "$FAKE_LOG"
"""


@pytest.mark.parametrize("rdma", [True, False])
def test_pyxis_sets_mellanox_visible_devices_when_rdma_is_asked_for(rdma: bool, fake_bin: Path,
                                                                   tmp_path: Path) -> None:
    (fake_bin / "torchrun").write_text(TORCHRUN_MLNX)
    script = slurm.render_slurm(cfg(launcher="pyxis", rdma=rdma))
    rc, lines, stderr = run_sbatch(script, fake_bin, tmp_path, nodes=2)
    assert rc == 0, stderr
    want = "all" if rdma else "unset"
    assert [ln for ln in lines if ln.startswith("torchrun ")] == [f"torchrun node={n} mlnx={want}" for n in (0, 1)]


def test_the_verb_passes_rdma_and_resources_to_the_slurm_script(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    matrix = write_matrix(tmp_path / "m")
    rc = cli.main(["launch", "--config", str(matrix), "--only", CELL, "--target", "slurm", "--no-pin", "--rdma",
                   "--cpus-per-task", "20", "--mem", "300G"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "export MELLANOX_VISIBLE_DEVICES=all\n" in text
    assert "--cpus-per-task=20" in _sbatch(text) and f"--mem={300 * GiB_MiB}M" in _sbatch(text)


def test_apptainer_without_a_sif_is_told_to_export_one(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    matrix = write_matrix(tmp_path / "m")
    argv = ["launch", "--config", str(matrix), "--only", CELL, "--target", "slurm", "--no-pin",
            "--launcher", "apptainer"]
    assert cli.main(argv) == 0
    out = capfd.readouterr()
    said = out.err + caplog.text
    assert "every node converts docker://" in said and "--format sif" in said and "--image-file" in said, said
    assert "build.py export CELL --format sif" in out.out  # the script's own comment says so too
    caplog.clear()
    sif = tmp_path / "pt.sif"
    sif.write_bytes(b"SIF")
    assert cli.main([*argv, "--image-file", str(sif)]) == 0
    assert "every node converts" not in capfd.readouterr().err + caplog.text


# --- checked once, derived once --------------------------------------------------------------------------------


def test_a_launch_config_is_checked_when_made_and_its_script_made_once(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LaunchError, match="--nodes"):
        cfg(nodes=0)  # no unchecked LaunchConfig exists for a renderer to take
    calls: list[dict[str, Any]] = []

    def counted(**kw: Any) -> tuple[str, ...]:
        calls.append(kw)
        return torchrun_mod.ddp_job_args(**kw)

    monkeypatch.setattr(config, "ddp_job_args", counted)
    c = cfg()
    kubernetes.render_pytorchjob(c)
    kubernetes.render_jobset(c)
    assert len(calls) == 1, calls
