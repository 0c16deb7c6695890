"""The image's smoke tests in real containers (builder/smoke/ against `test_image`).

- the selftest fails when the image's claims are wrong (it passes, with JUnit XML, in
  test_hpc.py: `build.py test` on both seed cells, the README's command on every cell);
- single-node DDP (2 CPU ranks over gloo) passes every check, busbw measured as nccl-tests does;
- one rank is "skipped (one rank)", never passed (and a failure when two are required);
- multi-node DDP, 2 containers x 2 ranks on a private network: world size 4;
- killing one node mid-training fails the survivor fast and names the dead node.

GPU variants (marker `gpu`) run only where PTMG_GPU_TESTS=1, and there they
require a GPU instead of skipping: every visible GPU (builder.smoke.gpus, which reads
nvidia-smi and CUDA_VISIBLE_DEVICES), one NCCL rank per GPU, on one node and on two.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from builder.engine import Engine
from builder.smoke import gpus, results, runner

GPU_RUNNER = os.environ.get("PTMG_GPU_TESTS") == "1"
needs_gpu_runner = pytest.mark.skipif(not GPU_RUNNER, reason="GPU smoke runs only with PTMG_GPU_TESTS=1")


@pytest.fixture
def engine(docker_client: Any, session_labels: dict[str, str]) -> Iterator[Engine]:
    eng = Engine(client=docker_client, labels=session_labels)
    yield eng
    # The runner removes what it starts; this catches anything a failure left behind.
    flt = {"label": [f"{k}={v}" for k, v in session_labels.items()] + ["io.pt-multi-gpu.smoke"]}
    leftovers = docker_client.containers.list(all=True, filters=flt)
    for c in leftovers:
        eng.remove(c)
    assert not leftovers, f"the smoke runner left containers behind: {[c.name for c in leftovers]}"


def _case(junit: str, name: str) -> str:
    start = junit.index(f'name="{name}"')
    end = junit.find("</testcase>", start)
    close = junit.find("/>", start)
    return junit[start:end if end != -1 and (close == -1 or end < close) else close]


def test_selftest_fails_when_the_image_lies(engine: Engine, test_image: str) -> None:
    labels = results.expect_labels(engine.image_labels(test_image))
    wrong = {**labels, "io.pt-multi-gpu.torch": "0.0.1", "io.pt-multi-gpu.python": "2.7"}
    run = runner.run_selftest(engine, test_image, expect=wrong, args=["-k", "test_env"], timeout=300)
    assert not run.ok and run.exit_code != 0
    assert set(run.failures) == {"test_versions::test_env[torch]", "test_versions::test_env[python]"}, run.summary()


def test_single_node_ddp(engine: Engine, test_image: str) -> None:
    run = runner.run_single_node(engine, test_image, nproc=2, timeout=300)
    assert run.ok, f"{run.summary()}\n{run.nodes[0].log[-4000:]}"
    r = run.result
    assert r is not None
    assert (r.world_size, r.backend, r.nodes) == (2, "gloo", 1)
    assert r.loss_decreased and r.final_loss < r.initial_loss
    assert r.params_identical and r.allreduce_exact
    assert run.passed and r.verdict == "passed", r.checks
    assert [b.nbytes for b in r.busbw] == [4096, 65536, 1 << 20, 4 << 20]
    assert all(b.time_us > 0 and b.time_us_max is not None and b.time_us_max >= b.time_us for b in r.busbw)
    assert r.bench is not None and (r.bench.warmup, r.bench.iters) == (5, 20)  # nccl-tests' -w 5 -n 20


def test_one_rank_is_skipped_never_passed(engine: Engine, test_image: str) -> None:
    run = runner.run_single_node(engine, test_image, nproc=1, timeout=300)
    assert run.ok and not run.passed, run.summary()
    assert run.verdict == "skipped (one rank)"
    r = run.result
    assert r is not None and r.world_size == 1 and r.busbw == ()
    assert dict(r.checks)["params_identical"] == "skipped: one rank, no transport exercised"
    strict = runner.run_single_node(engine, test_image, nproc=1, require_multi=True, timeout=300)
    assert not strict.ok and strict.verdict == "failed", strict.summary()


@pytest.mark.slow
def test_multinode_two_by_two(engine: Engine, test_image: str) -> None:
    run = runner.run_multinode(engine, test_image, nodes=2, nproc_per_node=2, timeout=300)
    assert run.ok, run.summary() + "\n" + "\n".join(n.log[-3000:] for n in run.nodes)
    r = run.result
    assert r is not None
    assert (r.world_size, r.backend, r.nodes) == (4, "gloo", 2)
    assert sorted(set(r.hosts)) == ["node0", "node1"]
    assert r.params_identical and r.allreduce_exact and r.loss_decreased
    assert all(n.exit_code == 0 for n in run.nodes)


@pytest.mark.slow
def test_killing_a_node_fails_the_survivor_fast_and_names_it(engine: Engine, test_image: str) -> None:
    collective_timeout = 20.0
    run = runner.run_multinode(engine, test_image, nodes=2, nproc_per_node=2, steps=5000,
                              collective_timeout_s=collective_timeout, timeout=240,
                              kill=runner.KillPlan(node=1))
    node0, node1 = run.nodes
    assert run.killed == "node1"
    assert not run.ok
    assert node1.exit_code == 137, node1.describe()
    assert node0.exit_code != 0 and not node0.timed_out, f"the survivor did not fail by itself:\n{node0.log[-4000:]}"
    assert run.culprit is not None and run.culprit.name == "node1", run.summary()
    assert "first to fail: node1" in run.summary()
    assert node0.finished_at is not None and node1.finished_at is not None
    lag = (node0.finished_at - node1.finished_at).total_seconds()
    assert 0 <= lag <= 3 * collective_timeout + 30, f"survivor took {lag:.0f}s to fail"
    assert "PTMG_DDP rank" in node0.log  # the job said which rank failed and where


def _host_plan(nodes: int = 1) -> gpus.RunPlan:
    ids, note = gpus.host_gpus(os.environ)
    assert ids, f"PTMG_GPU_TESTS=1 but no GPU: {note}"
    return gpus.plan_run(ids, nodes, None)


@pytest.mark.gpu
@needs_gpu_runner
def test_selftest_on_gpus(engine: Engine, test_image: str) -> None:
    plan = _host_plan()
    run = runner.run_selftest(engine, test_image, gpus=True, gpu_ids=plan.gpu_ids, timeout=900)
    assert run.ok, f"{run.summary()}\n{run.log[-6000:]}"
    assert run.junit_xml is not None and 'name="test_kernel[gpu0]"' in run.junit_xml
    assert "skipped" not in _case(run.junit_xml, "test_kernel[gpu0]")
    if plan.world_size >= 2:  # the NCCL hang must be named by the job, not aborted by torch
        assert "skipped" not in _case(run.junit_xml, "test_nccl_hang_names_the_rank")
    else:  # one GPU: two gloo ranks with CUDA tensors instead
        assert "skipped" not in _case(run.junit_xml, "test_gloo_cuda_two_ranks_on_one_gpu")


@pytest.mark.gpu
@needs_gpu_runner
def test_single_node_ddp_over_nccl_on_every_gpu(engine: Engine, test_image: str) -> None:
    plan = _host_plan()
    run = runner.run_plan(engine, test_image, plan)
    assert run.ok, run.summary()
    assert run.result is not None and run.result.backend == "nccl" and run.result.world_size == plan.world_size
    assert run.verdict == ("passed" if plan.world_size >= 2 else "skipped (one GPU)"), run.summary()
    if plan.world_size >= 2:
        assert max(b.nbytes for b in run.result.busbw) >= 1 << 30, results.busbw_markdown(run.result)


@pytest.mark.gpu
@needs_gpu_runner
@pytest.mark.allowed_skip(reason="a GPU runner with one GPU has none for the second node; the summary names the skip")
def test_two_nodes_over_nccl(engine: Engine, test_image: str) -> None:
    ids, _ = gpus.host_gpus(os.environ)
    if len(ids) < 2:
        pytest.skip(f"two nodes need two GPUs ({len(ids)} visible)")
    plan = gpus.plan_run(ids, 2, None)
    run = runner.run_plan(engine, test_image, plan)
    assert run.passed, run.summary() + "\n" + "\n".join(n.log[-3000:] for n in run.nodes)
    assert run.result is not None and (run.result.backend, run.result.nodes) == ("nccl", 2)
