"""The host runner and `build.py test` against a scripted engine (builder/smoke/runner.py and
builder/cli/verbs/test.py), on fake hosts of 1, 2 and 8 GPUs: --nodes 2 with GPUs hands every
node container its own GPUs, a gloo fall-back fails, a host without GPUs fails before any
container; and the same rank rule in the generated launch jobs."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

import ptmg_contract as contract
from builder.cli import main as cli
from builder.cli.verbs import test as test_verb
from builder.common.errors import StepFailed
from builder.engine import RunResult
from builder.launch import LaunchConfig, render
from builder.launch.config import ImagePin, LaunchError
from builder.smoke import gpus, passes, results
from tests import support
from tests.unit.smoke.test_gpus import fake_query, uuid
from tests.unit.smoke_tests.test_ddp_checks import job_result

# --- the host runner and `build.py test`, against a scripted engine ----------------------


class ScriptedEngine:
    """A Docker engine whose containers print what the script says (selftest or DDP run)."""

    def __init__(self, ddp_result: dict[str, Any] | None, *, selftest_junit: str | None = None) -> None:
        self.ddp_result = ddp_result
        self.junit = selftest_junit or ('<testsuite tests="1"><testcase classname="test_versions" '
                                        'name="test_env[torch]"/></testsuite>')
        self.started: list[dict[str, Any]] = []

    # images
    def image_exists(self, ref: str) -> bool:
        return True

    def image_id(self, ref: str) -> str:
        return "sha256:" + "1" * 64

    def image_labels(self, ref: str) -> dict[str, str]:
        return {"io.pt-multi-gpu.torch": "2.7.0"}

    # containers
    def start(self, image: str, command: Sequence[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        c = {"image": image, "command": list(command or []), "kwargs": kwargs, "removed": False}
        self.started.append(c)
        return c

    def wait(self, c: dict[str, Any], timeout: float) -> RunResult:
        if c["command"][0] == "selftest" or self.ddp_result is None:
            return RunResult(0, "selftest")
        rank0 = c["kwargs"].get("alias", "node0") == "node0"
        return RunResult(0, contract.DDP_RESULT_MARKER + json.dumps(self.ddp_result) if rank0 else "")

    def state(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"StartedAt": "2026-01-01T00:00:00Z", "FinishedAt": "2026-01-01T00:00:09Z", "OOMKilled": False}

    def archive(self, c: dict[str, Any], path: str) -> bytes:
        import io
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            data = self.junit.encode()
            info = tarfile.TarInfo("junit.xml")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    def logs(self, c: dict[str, Any]) -> str:
        return ""

    def remove(self, c: dict[str, Any]) -> None:
        c["removed"] = True

    def cleanup_session(self) -> None:
        pass

    def network(self, name: str) -> Any:
        import contextlib

        @contextlib.contextmanager
        def net() -> Iterator[Any]:
            class Net:
                pass

            n = Net()
            n.name = name  # type: ignore[attr-defined]
            yield n

        return net()

    # what the runner asked for
    def ddp_containers(self) -> list[dict[str, Any]]:
        return [c for c in self.started if c["command"][0] == "torchrun"]

    def selftest_container(self) -> dict[str, Any]:
        (c,) = [c for c in self.started if c["command"][0] == "selftest"]
        return c


def _run_verb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: ScriptedEngine, host_gpus: int,
              *flags: str, env: dict[str, str] | None = None) -> int:
    monkeypatch.setattr(gpus, "query_smi", fake_query(host_gpus))
    monkeypatch.setenv("PTMG_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PTMG_REQUIRE_MULTI_GPU", raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    matrix = support.write_matrix(tmp_path)
    args = cli.parser().parse_args(["test", "--config", str(matrix), "--only", support.MID, "--json",
                                    "--junit-dir", str(tmp_path / "junit"), *flags])
    ctx = cli._context(args)
    ctx._engine = engine  # type: ignore[assignment]
    return test_verb.run(ctx)


def _verb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
          engine: ScriptedEngine, host_gpus: int, *flags: str,
          env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    rc = _run_verb(tmp_path, monkeypatch, engine, host_gpus, *flags, env=env)
    (report,) = json.loads(capsys.readouterr().out)
    return rc, report


def test_one_gpu_host_ddp_verdict_is_skipped_never_passed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(job_result(1, "nccl"))
    rc, report = _verb(tmp_path, monkeypatch, capsys, engine, 1, "--require-gpu")
    assert rc == 0  # nothing failed...
    assert report["ddp"]["verdict"] == "skipped (one GPU)" and report["ddp"]["verdict"] != "passed"  # ...nothing passed
    (ddp,) = engine.ddp_containers()
    assert ddp["command"][ddp["command"].index("--nproc_per_node") + 1] == "1"  # not 2: rank 1 would have no GPU
    assert ddp["kwargs"]["device_requests"][0]["device_ids"] == [uuid(0)]
    rec = passes.smoke_pass(tmp_path, report["image_id"])
    assert rec is not None and rec.ddp == "skipped (one GPU)" and rec.world_size == 1  # the record says so too


def test_one_gpu_host_with_require_multi_gpu_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(job_result(1, "nccl"))
    rc, report = _verb(tmp_path, monkeypatch, capsys, engine, 1, "--require-gpu", "--require-multi-gpu")
    assert rc == 1 and report["ddp"]["verdict"] == "failed"
    assert any("--require-multi-gpu" in p for p in report["ddp"]["problems"])
    assert "--require-multi-gpu" in engine.selftest_container()["command"]  # the in-image suite fails it too
    assert passes.smoke_pass(tmp_path, report["image_id"]) is None
    # the same from the environment (CI sets PTMG_REQUIRE_MULTI_GPU)
    engine = ScriptedEngine(job_result(1, "nccl"))
    rc, _ = _verb(tmp_path, monkeypatch, capsys, engine, 1, "--require-gpu", env={"PTMG_REQUIRE_MULTI_GPU": "1"})
    assert rc == 1


def test_eight_gpu_host_runner_and_selftest_ask_for_eight_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(job_result(8, "nccl", gpus_visible=8))
    rc, report = _verb(tmp_path, monkeypatch, capsys, engine, 8, "--require-gpu")
    assert rc == 0 and report["ddp"]["verdict"] == "passed", report["ddp"]
    (ddp,) = engine.ddp_containers()
    assert ddp["command"][ddp["command"].index("--nproc_per_node") + 1] == "8"
    assert ddp["kwargs"]["device_requests"][0]["device_ids"] == [uuid(i) for i in range(8)]
    st = engine.selftest_container()
    assert "--require-gpu" in st["command"] and "--nproc" not in st["command"]  # in-image default: every GPU
    assert st["kwargs"]["device_requests"][0]["device_ids"] == [uuid(i) for i in range(8)]


def test_cuda_visible_devices_subset_reaches_the_containers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(job_result(2, "nccl", gpus_visible=2))
    rc, _ = _verb(tmp_path, monkeypatch, capsys, engine, 8, "--require-gpu", env={"CUDA_VISIBLE_DEVICES": "6,7"})
    assert rc == 0
    (ddp,) = engine.ddp_containers()
    assert ddp["kwargs"]["device_requests"][0]["device_ids"] == [uuid(6), uuid(7)]
    assert ddp["command"][ddp["command"].index("--nproc_per_node") + 1] == "2"


def test_two_nodes_with_gpus_pass_gpu_ids_to_both_node_containers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(job_result(8, "nccl", gpus_visible=4, nodes=2))
    rc, report = _verb(tmp_path, monkeypatch, capsys, engine, 8, "--require-gpu", "--nodes", "2")
    assert rc == 0 and report["ddp"]["verdict"] == "passed", report["ddp"]
    node0, node1 = engine.ddp_containers()
    ids = [c["kwargs"]["device_requests"][0]["device_ids"] for c in (node0, node1)]
    assert ids == [[uuid(i) for i in range(4)], [uuid(i) for i in range(4, 8)]]
    for c in (node0, node1):
        assert c["command"][c["command"].index("--nproc_per_node") + 1] == "4"
        assert c["command"][c["command"].index("--nnodes") + 1] == "2"
        assert c["kwargs"]["environment"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_two_nodes_that_fell_back_to_gloo_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(job_result(4, "gloo", device="cpu", gpus_visible=0, nodes=2))
    rc, report = _verb(tmp_path, monkeypatch, capsys, engine, 4, "--require-gpu", "--nodes", "2")
    assert rc == 1 and report["ddp"]["verdict"] == "failed"
    assert any("backend gloo ran where nccl was required" in p for p in report["ddp"]["problems"])
    assert report["ddp"]["result"]["backend"] == "gloo"  # the result says which backend ran


def test_require_gpu_on_a_host_without_gpus_fails_before_any_container(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    engine = ScriptedEngine(None)
    with pytest.raises(StepFailed, match="--require-gpu: no GPU visible on this host"):
        _run_verb(tmp_path, monkeypatch, engine, 0, "--require-gpu")
    assert engine.started == []
    with pytest.raises(StepFailed, match="--nodes 2"):
        _run_verb(tmp_path, monkeypatch, engine, 1, "--require-gpu", "--nodes", "2")


def test_cpu_run_is_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(job_result(2, "gloo", device="cpu", gpus_visible=0))
    rc, report = _verb(tmp_path, monkeypatch, capsys, engine, 8, env={"PTMG_REQUIRE_MULTI_GPU": "1"})
    assert rc == 0 and report["ddp"]["verdict"] == "passed"
    (ddp,) = engine.ddp_containers()
    assert "device_requests" not in ddp["kwargs"]  # no --require-gpu: CPU ranks, whatever the host has
    assert ddp["command"][ddp["command"].index("--nproc_per_node") + 1] == "2"


def test_ddp_run_verdicts() -> None:
    node = results.NodeRun("node0", 0, False, "")
    one = results.DDPResult.from_json(job_result(1, "nccl"))
    run = results.DDPRun("img", (node,), 1, one, 1.0, expect_backend="nccl")
    assert run.ok and not run.passed and run.verdict == "skipped (one GPU)"
    assert "SKIPPED (ONE GPU)" in run.summary() and "PASS " not in run.summary()
    assert "one GPU, NCCL transport not exercised" in run.summary()
    strict = results.DDPRun("img", (node,), 1, one, 1.0, expect_backend="nccl", require_multi=True)
    assert not strict.ok and strict.verdict == "failed"
    # results from images built before the verdict field: the same rule
    old = job_result(1, "nccl")
    del old["verdict"], old["checks"]
    assert results.DDPResult.from_json(old).verdict == "skipped (one GPU)"


# --- launch: the same rule in the generated jobs -----------------------------------------


def _launch_cfg(**over: Any) -> LaunchConfig:
    base: dict[str, Any] = {"cell": support.MID, "image": ImagePin("reg/pt:1", "reg/pt:1"), "nodes": 2,
                            "gpus_per_node": 8, "nproc_per_node": 8}
    base.update(over)
    return LaunchConfig(**base)


def test_launch_asks_for_eight_ranks_on_eight_gpu_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    matrix = support.write_matrix(tmp_path)
    rc = cli.main(["launch", "--config", str(matrix), "--only", support.MID, "--target", "slurm", "--no-pin"])
    out = capsys.readouterr().out
    assert rc == 0 and "--nproc_per_node 8" in out and "--gpus-per-node=8" in out  # the default: 8 GPUs, 8 ranks
    for target in ("pytorchjob", "jobset"):
        docs = list(yaml.safe_load_all(render(target, _launch_cfg())))
        pods = [d["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"] if target == "pytorchjob" else
                d["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
                for d in docs if d["kind"] in ("PyTorchJob", "JobSet")]
        (main,) = pods[0]["containers"]
        assert main["args"][main["args"].index("--nproc_per_node") + 1] == "8"
        assert main["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "--bench-sizes" not in " ".join(_launch_cfg().script)  # the job's own sizes: up to 1 GiB on NCCL


def test_launch_refuses_more_ranks_than_gpus() -> None:
    with pytest.raises(LaunchError, match="NCCL needs one GPU per rank"):
        _launch_cfg(nproc_per_node=16)
    _launch_cfg(nproc_per_node=4)  # fewer is the user's choice
    _launch_cfg(gpus_per_node=0, nproc_per_node=4)  # CPU ranks


