"""The smoke runner against a fake engine (builder/smoke/runner.py): a multi-node run starts every
node, collects every exit and cleans up (also when the engine fails), a node's kill plan, the GPU
ids per node, a single node run standalone, and the selftest with the image's labels and JUnit."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

import ptmg_contract as contract
from builder.engine import RunResult
from builder.smoke import runner, torchrun
from tests.unit.smoke.test_results import JUNIT, _line, _tar, sample_result

# --- builder.smoke orchestration against a fake engine ---------------------------


class FakeContainer:
    def __init__(self, name: str, command: list[str], kwargs: dict[str, Any], log: str, code: int) -> None:
        self.name, self.command, self.kwargs, self.log, self.code = name, command, kwargs, log, code
        self.removed = False
        self.killed = False


class FakeEngine:
    """Records what the runner asks of the engine; each container 'runs' a scripted log."""

    def __init__(self, logs: Sequence[str], codes: Sequence[int], *, wait_raises: bool = False,
                 labels: dict[str, str] | None = None, archive: bytes | None = None) -> None:
        self.logs_, self.codes, self.wait_raises = list(logs), list(codes), wait_raises
        self.labels_ = labels or {}
        self.archive_ = archive
        self.started: list[FakeContainer] = []
        self.networks: list[str] = []
        self.removed_networks: list[str] = []
        self.archived: list[str] = []

    def image_labels(self, ref: str) -> dict[str, str]:
        return dict(self.labels_)

    def _make(self, command: Sequence[str] | None, kwargs: dict[str, Any]) -> FakeContainer:
        i = len(self.started)
        c = FakeContainer(f"c{i}", list(command or []), kwargs, self.logs_[i], self.codes[i])
        self.started.append(c)
        return c

    def start(self, image: str, command: Sequence[str] | None = None, **kwargs: Any) -> FakeContainer:
        return self._make(command, kwargs)

    def start_on_network(self, image: str, command: Sequence[str] | None, *, network: str, alias: str,
                         **kwargs: Any) -> FakeContainer:
        return self._make(command, {**kwargs, "network": network, "alias": alias})

    def wait(self, container: FakeContainer, timeout: float) -> RunResult:
        if self.wait_raises:
            raise RuntimeError("engine went away")
        code = 137 if container.killed else container.code
        return RunResult(code, container.log)

    def state(self, container: FakeContainer) -> dict[str, Any]:
        second = 5 if container.killed else 9
        return {"StartedAt": "2026-01-01T00:00:00Z", "FinishedAt": f"2026-01-01T00:00:0{second}.5Z",
                "OOMKilled": False}

    def logs(self, container: FakeContainer) -> str:
        return container.log

    def kill(self, container: FakeContainer, signal: str = "SIGKILL") -> None:
        container.killed = True

    def archive(self, container: FakeContainer, path: str) -> bytes | None:
        self.archived.append(path)
        return self.archive_

    def remove(self, container: FakeContainer) -> None:
        container.removed = True

    @contextlib.contextmanager
    def network(self, name: str) -> Iterator[Any]:
        self.networks.append(name)

        class Net:
            pass

        net = Net()
        net.name = name  # type: ignore[attr-defined]
        try:
            yield net
        finally:
            self.removed_networks.append(name)


def _engine(fake: FakeEngine) -> Any:
    return fake


def test_multinode_starts_every_node_collects_every_exit_and_cleans_up() -> None:
    ok_log = _line(sample_result())
    fake = FakeEngine(logs=[ok_log, "node1 log"], codes=[0, 0])
    run = runner.run_multinode(_engine(fake), "img:1", nodes=2, nproc_per_node=2, steps=5, timeout=60)
    assert run.ok, run.summary()
    assert [n.name for n in run.nodes] == ["node0", "node1"]
    assert len(fake.networks) == 1 and fake.removed_networks == fake.networks
    assert all(c.removed for c in fake.started)
    for i, c in enumerate(fake.started):
        assert c.kwargs["alias"] == c.kwargs["hostname"] == f"node{i}"
        assert c.kwargs["network"] == fake.networks[0]
        assert c.kwargs["shm_size"] == contract.SMOKE_SHM_SIZE
        assert c.kwargs["environment"]["GLOO_SOCKET_IFNAME"] == "eth0"
        assert c.kwargs["environment"]["NCCL_SOCKET_IFNAME"] == "eth0"
        assert "device_requests" not in c.kwargs
        argv = c.command
        assert argv[argv.index("--rdzv_endpoint") + 1] == "node0:29400"
        assert argv[argv.index("--nnodes") + 1] == "2"
    ids = {c.command[c.command.index("--rdzv_id") + 1] for c in fake.started}
    assert len(ids) == 1  # one rendezvous id shared by every node


def test_multinode_failure_of_one_node_fails_the_run() -> None:
    fake = FakeEngine(logs=[_line(sample_result()), "boom"], codes=[0, 1])
    run = runner.run_multinode(_engine(fake), "img", nodes=2, timeout=60)
    assert not run.ok
    assert run.culprit is not None and run.culprit.name == "node1"


def test_multinode_cleans_up_when_the_engine_fails() -> None:
    fake = FakeEngine(logs=["", ""], codes=[0, 0], wait_raises=True)
    with pytest.raises(RuntimeError, match="engine went away"):
        runner.run_multinode(_engine(fake), "img", nodes=2, timeout=60)
    assert all(c.removed for c in fake.started) and fake.removed_networks == fake.networks


def test_multinode_kill_plan_kills_the_node_and_names_it() -> None:
    marker = runner.KillPlan().when
    fake = FakeEngine(logs=[f"PTMG_DDP rank 0: {marker}loss=1", "node1"], codes=[1, 0])
    run = runner.run_multinode(_engine(fake), "img", nodes=2, timeout=60, kill=runner.KillPlan(node=1))
    assert fake.started[1].killed and not fake.started[0].killed
    assert run.killed == "node1"
    assert not run.ok
    assert run.culprit is not None and run.culprit.name == "node1"  # it stopped first (state times)
    assert "--step-sleep" in fake.started[0].command  # the run is slowed down so the kill lands mid-training


def test_multinode_kill_plan_that_never_fires_is_an_error() -> None:
    fake = FakeEngine(logs=["nothing", "nothing"], codes=[0, 0])
    with pytest.raises(runner.SmokeError, match="never injected"):
        runner.run_multinode(_engine(fake), "img", nodes=2, timeout=60,
                            kill=runner.KillPlan(node=1, within_s=0.2))
    assert all(c.removed for c in fake.started)


def test_multinode_gpu_ids_per_node() -> None:
    fake = FakeEngine(logs=["", ""], codes=[0, 0])
    runner.run_multinode(_engine(fake), "img", nodes=2, nproc_per_node=1, gpu_ids=torchrun.split_gpus(2, 2), timeout=60)
    assert [c.kwargs["device_requests"][0]["device_ids"] for c in fake.started] == [["0"], ["1"]]
    with pytest.raises(ValueError, match="one entry per node"):
        runner.run_multinode(_engine(fake), "img", nodes=2, gpu_ids=[["0"]])


def test_single_node_runs_torchrun_standalone() -> None:
    fake = FakeEngine(logs=[_line(sample_result(world_size=2, nodes=1, backend="nccl"))], codes=[0])
    run = runner.run_single_node(_engine(fake), "img", nproc=2, gpus=True)
    assert run.ok and run.passed and run.world_size == 2
    c = fake.started[0]
    assert "--standalone" in c.command and c.removed
    assert c.kwargs["device_requests"] == [{"count": -1, "capabilities": [["gpu"]]}]
    # GPUs given, gloo ran: a fall-back is a failure, not a GPU pass
    fell_back = FakeEngine(logs=[_line(sample_result(world_size=2, nodes=1))], codes=[0])
    run = runner.run_single_node(_engine(fell_back), "img", nproc=2, gpus=True)
    assert not run.ok and "backend gloo ran where nccl was required" in run.summary()


def test_selftest_passes_the_image_labels_and_collects_junit() -> None:
    fake = FakeEngine(logs=["summary"], codes=[0], labels={"io.pt-multi-gpu.torch": "2.7.0", "project": "x"},
                      archive=_tar("junit.xml", JUNIT.encode()))
    run = runner.run_selftest(_engine(fake), "img", gpus=True)
    c = fake.started[0]
    assert c.command[0] == "selftest" and "--require-gpu" in c.command
    assert json.loads(c.command[c.command.index("--expect-json") + 1]) == {"io.pt-multi-gpu.torch": "2.7.0"}
    assert fake.archived == [c.command[c.command.index("--junit") + 1]]
    assert c.removed
    assert run.counts.failed == 1 and not run.ok  # JUnit says a check failed, whatever the exit code
    assert "FAILED test_versions::test_env[cuda]" in run.summary()


def test_selftest_without_junit_is_a_failure() -> None:
    fake = FakeEngine(logs=["crashed early"], codes=[0], archive=None)
    run = runner.run_selftest(_engine(fake), "img", expect={})
    assert run.junit_xml is None and not run.ok
