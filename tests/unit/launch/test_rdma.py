"""RDMA in the generated jobs: what NCCL needs for InfiniBand/RoCE/EFA between nodes.

Slurm: every node raises its locked-memory soft limit; the docker launcher gives a node that has
/dev/infiniband the devices, unlimited memlock and IPC_LOCK, and passes NCCL's network settings
(NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ...) through by name. Kubernetes: --rdma-resource asks the
device plugin for the RDMA devices and adds IPC_LOCK; checked against the client models as the
other manifests are (tests/unit/launch/test_kubernetes.py).
"""

from __future__ import annotations

import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import ptmg_contract as contract
from builder.cli import main as cli
from builder.launch import LaunchError, config, kubernetes, slurm
from tests.support import write_matrix
from tests.unit.launch.test_config import CELL, cfg
from tests.unit.launch.test_kubernetes import assert_valid
from tests.unit.launch.test_slurm import FAKES, for_launcher, run_sbatch

RDMA_FLAGS = "--device {ib} --cap-add IPC_LOCK --ulimit memlock=-1:-1"


@pytest.fixture
def bindir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "bin"
    d.mkdir()
    for name, text in FAKES.items():
        p = d / name
        p.write_text(text)
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    # docker as the real one does it: `-e NAME` with NAME unset in the caller sets nothing.
    (d / "docker").write_text(FAKES["docker"].replace('keep+=("$name=${!name-}")',
                                                      '[ -n "${!name+x}" ] && keep+=("$name=${!name}")'))
    # torchrun reports what NCCL would see: the passed-through settings and the memlock soft limit.
    (d / "torchrun").write_text('#!/bin/bash\necho "torchrun node=$NODE_RANK hca=${NCCL_IB_HCA-unset} '
                                'ifname=${NCCL_SOCKET_IFNAME-unset} memlock=$(ulimit -S -l)" >> "$FAKE_LOG"\n')
    yield d


def _docker_runs(lines: list[str]) -> list[str]:
    return [ln for ln in lines if ln.startswith("docker run ")]


def test_docker_launcher_without_rdma_on_the_node(bindir: Path, tmp_path: Path) -> None:
    script = slurm.render_slurm(cfg(nodes=2, launcher="docker"))
    absent = tmp_path / "no-infiniband"
    rc, lines, stderr = run_sbatch(script.replace(contract.IB_DEVICE_DIR, str(absent)), bindir, tmp_path, nodes=2)
    assert rc == 0, stderr
    runs = _docker_runs(lines)
    assert len(runs) == 2 and not any("--device" in r or "IPC_LOCK" in r or "memlock" in r for r in runs), runs
    assert [ln.split()[1:4] for ln in lines if ln.startswith("torchrun ")] == [
        ["node=0", "hca=unset", "ifname=unset"], ["node=1", "hca=unset", "ifname=unset"]]


def test_docker_launcher_gives_an_rdma_node_its_devices_memlock_and_the_nccl_settings(
        bindir: Path, tmp_path: Path) -> None:
    script = slurm.render_slurm(cfg(nodes=2, launcher="docker"))
    ib = tmp_path / "infiniband"
    ib.mkdir()
    rc, lines, stderr = run_sbatch(script.replace(contract.IB_DEVICE_DIR, str(ib)), bindir, tmp_path, nodes=2,
                                   NCCL_IB_HCA="mlx5_0,mlx5_1", NCCL_SOCKET_IFNAME="ib0")
    assert rc == 0, stderr
    for run in _docker_runs(lines):
        assert RDMA_FLAGS.format(ib=ib) in run, run
        for name in contract.NCCL_NET_ENV:
            assert f"-e {name} " in run, name
    torchruns = [ln for ln in lines if ln.startswith("torchrun ")]
    assert len(torchruns) == 2
    assert all("hca=mlx5_0,mlx5_1 ifname=ib0" in t for t in torchruns), torchruns


@pytest.mark.parametrize("launcher", config.LAUNCHERS)
def test_every_node_raises_its_locked_memory_soft_limit(launcher: str, bindir: Path, tmp_path: Path) -> None:
    script = slurm.render_slurm(cfg(nodes=1, launcher=launcher))
    assert 'ulimit -S -l "$(ulimit -H -l)"' in script
    hard = subprocess.run(["bash", "-c", "ulimit -H -l"], capture_output=True, text=True, check=True).stdout.strip()
    # The job starts with a small soft limit, as srun propagates it from a login shell.
    small = for_launcher(launcher, script, tmp_path).replace("set -euo pipefail\n", "set -euo pipefail\nulimit -S -l 64\n", 1)
    rc, lines, stderr = run_sbatch(small, bindir, tmp_path, nodes=1)
    assert rc == 0, stderr
    (torchrun,) = [ln for ln in lines if ln.startswith("torchrun ")]
    assert torchrun.endswith(f"memlock={hard}"), (torchrun, hard)


def test_the_script_still_parses_and_names_the_rdma_settings() -> None:
    for launcher in config.LAUNCHERS:
        script = slurm.render_slurm(cfg(launcher=launcher))
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    docker = slurm.render_slurm(cfg(launcher="docker"))
    assert f"if [ -d {contract.IB_DEVICE_DIR} ]; then" in docker
    assert RDMA_FLAGS.format(ib=contract.IB_DEVICE_DIR) in docker


# --- Kubernetes ----------------------------------------------------------------------------------------------

RESOURCES = (("rdma/rdma_shared_device_a", 1), ("vpc.amazonaws.com/efa", 4))


def _pods(target: str, c: config.LaunchConfig) -> list[dict[str, Any]]:
    if target == "pytorchjob":
        doc = yaml.safe_load(kubernetes.render_pytorchjob(c))
        assert_valid(doc, "KubeflowOrgV1PyTorchJob")
        return [r["template"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
    docs = list(yaml.safe_load_all(kubernetes.render_jobset(c)))
    template = docs[1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert_valid(template, "V1PodTemplateSpec")
    return [template]


@pytest.mark.parametrize("target", ["pytorchjob", "jobset"])
def test_kubernetes_rdma_resources_and_ipc_lock(target: str) -> None:
    c = cfg(nodes=2, gpus_per_node=8, nproc_per_node=8, rdma_resources=RESOURCES,
            env=(("NCCL_IB_HCA", "mlx5"),))
    for pod in _pods(target, c):
        (main,) = [x for x in pod["spec"]["containers"] if x["name"] == config.CONTAINER]
        limits = main["resources"]["limits"]
        assert {k: limits[k] for k in ("nvidia.com/gpu", "rdma/rdma_shared_device_a", "vpc.amazonaws.com/efa")} == {
            "nvidia.com/gpu": 8, "rdma/rdma_shared_device_a": 1, "vpc.amazonaws.com/efa": 4}
        assert main["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert {"name": "NCCL_IB_HCA", "value": "mlx5"} in main["env"]
    for pod in _pods(target, cfg(nodes=2)):  # no RDMA asked for: nothing added
        (main,) = [x for x in pod["spec"]["containers"] if x["name"] == config.CONTAINER]
        assert "securityContext" not in main and main["resources"]["limits"]["nvidia.com/gpu"] == 4
        assert not any("/" in k and k != "nvidia.com/gpu" for k in main["resources"]["limits"])


@pytest.mark.parametrize("resources", [(("efa", 1),), (("rdma/hca", 0),), (("Bad Name/x", 1),)])
def test_bad_rdma_resources_are_refused(resources: tuple[tuple[str, int], ...]) -> None:
    with pytest.raises(LaunchError, match="--rdma-resource"):
        cfg(rdma_resources=resources)


def test_verb_takes_rdma_resources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    matrix = write_matrix(tmp_path / "m")
    rc = cli.main(["launch", "--config", str(matrix), "--only", CELL, "--target", "pytorchjob", "--no-pin",
                   "--rdma-resource", "rdma/rdma_shared_device_a=1"])
    assert rc == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    main = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert main["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["launch", "--config", str(matrix), "--only", CELL, "--target", "pytorchjob", "--no-pin",
                  "--rdma-resource", "rdma/hca"])
    assert exit_info.value.code == 2
    assert "expected NAME=COUNT" in capsys.readouterr().err
