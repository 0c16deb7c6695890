"""What a smoke run yields (builder/smoke/results.py), pure: the DDP result line from any node, its
missing fields named, the busbw table, docker's times, the node that died first, the run's
verdict and summary, JUnit, a file out of a tar, our labels only, and GPU ids per node."""

from __future__ import annotations

import io
import json
import tarfile
from datetime import UTC, datetime
from typing import Any

import pytest

import ptmg_contract as contract
from builder.smoke import results, torchrun
from tests.support import smoke_module

ddp_plan = smoke_module("ddp_plan")


def test_result_marker_is_shared() -> None:
    assert contract.DDP_RESULT_MARKER == ddp_plan.RESULT_MARKER


def sample_result(**over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "schema": 1, "ok": True, "world_size": 4, "backend": "gloo", "nodes": 2, "hosts": ["node0", "node0", "node1", "node1"],
        "local_world_size": 2, "device": "cpu", "torch": "2.7.0+cu126", "steps": 60, "steps_per_s": 120.5,
        "initial_loss": 6.5, "final_loss": 0.15, "loss_decreased": True, "params_identical": True,
        "params_sha256": "ab", "allreduce_exact": True, "tensorboard_dir": "/tmp/tb", "wall_s": 3.5,
        "busbw": [{"bytes": 4096, "time_us": 1475.0, "algbw_GBps": 0.0028, "busbw_GBps": 0.0042},
                  {"bytes": 1048576, "time_us": 3450.0, "algbw_GBps": 0.304, "busbw_GBps": 0.456}],
    }
    data.update(over)
    return data


def _line(data: dict[str, Any]) -> str:
    return contract.DDP_RESULT_MARKER + json.dumps(data)


def test_find_ddp_result_parses_rank0s_line_from_any_node() -> None:
    r = results.find_ddp_result(["node1 noise", "a\n" + _line(sample_result()) + "\nb"])
    assert r is not None
    assert (r.world_size, r.backend, r.nodes, r.hosts[-1]) == (4, "gloo", 2, "node1")
    assert r.busbw[1] == results.BusBandwidth(1048576, 3450.0, 0.304, 0.456)
    assert results.find_ddp_result(["no marker"]) is None
    assert results.find_ddp_result([contract.DDP_RESULT_MARKER + '{"world_size": 2}']) is None  # malformed: ignored


def test_ddp_result_from_json_names_what_is_missing() -> None:
    data = sample_result()
    del data["params_identical"]
    with pytest.raises(ValueError, match="params_identical"):
        results.DDPResult.from_json(data)


def test_busbw_markdown() -> None:
    r = results.DDPResult.from_json(sample_result())  # schema 1: no bench settings, no per-rank max
    table = results.busbw_markdown(r).splitlines()
    assert table[0].startswith("| size |") and len(table) == 4
    assert table[3] == "| 1 MiB | 3450.0 | - | 0.304 | 0.456 | - | bandwidth |"


@pytest.mark.parametrize(("text", "want"), [
    ("2026-11-30T03:37:28.285123456Z", datetime(2026, 11, 30, 3, 37, 28, 285123, tzinfo=UTC)),
    ("2026-11-30T03:37:28Z", datetime(2026, 11, 30, 3, 37, 28, tzinfo=UTC)),
    ("2026-11-30T05:37:28.5+02:00", datetime(2026, 11, 30, 3, 37, 28, 500000, tzinfo=UTC)),
    ("0001-01-01T00:00:00Z", None),
    ("", None),
    (None, None),
])
def test_parse_docker_time(text: str | None, want: datetime | None) -> None:
    assert results.parse_docker_time(text) == want


def _node(name: str, code: int, second: int | None, timed_out: bool = False) -> results.NodeRun:
    at = None if second is None else datetime(2026, 1, 1, 0, 0, second, tzinfo=UTC)
    return results.NodeRun(name, code, timed_out, "log", finished_at=at)


def test_first_failure_is_the_node_that_died_first() -> None:
    nodes = [_node("node0", 1, 40), _node("node1", 137, 12), _node("node2", 0, 41)]
    culprit = results.first_failure(nodes)
    assert culprit is not None and culprit.name == "node1"
    assert results.first_failure([_node("node0", 0, 1)]) is None
    # a node still running at the deadline has no stop time: it comes last
    hung = [_node("node0", 124, None, timed_out=True), _node("node1", 1, 30)]
    assert results.first_failure(hung) == hung[1]


def test_ddp_run_verdict_and_summary() -> None:
    result = results.DDPResult.from_json(sample_result())
    good = results.DDPRun("img", (_node("node0", 0, 1), _node("node1", 0, 2)), 2, result, 30.0)
    assert good.ok and good.world_size == 4 and good.culprit is None
    assert "PASS" in good.summary() and "world size 4" in good.summary()

    bad = results.DDPRun("img", (_node("node0", 1, 50), _node("node1", 137, 20)), 2, None, 60.0, killed="node1")
    assert not bad.ok and [n.name for n in bad.failed_nodes] == ["node0", "node1"]
    text = bad.summary()
    assert "FAIL" in text and "first to fail: node1" in text and "SIGKILL" in text and "no DDP result" in text

    wrong_size = results.DDPRun("img", (_node("node0", 0, 1),), 2, result, 1.0)  # result says 4 ranks, 1x2 ran
    assert not wrong_size.ok
    failed_check = results.DDPResult.from_json(sample_result(ok=False, params_identical=False))
    assert not results.DDPRun("img", (_node("node0", 0, 1), _node("node1", 0, 2)), 2, failed_check, 1.0).ok


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pt-multi-gpu-selftest"
 errors="1" failures="1" skipped="2" tests="6" time="3.2"><testcase classname="test_versions" name="test_env[torch]" time="0.1"/>
<testcase classname="test_versions" name="test_env[cuda]" time="0.1"><failure message="AssertionError">x</failure></testcase>
<testcase classname="test_gpu" name="test_kernel[no-gpu]" time="0"><skipped type="pytest.skip" message="no GPU">s</skipped></testcase>
<testcase classname="test_gpu" name="test_cuda_available" time="0"><skipped type="pytest.skip" message="no GPU">s</skipped></testcase>
<testcase classname="test_ddp" name="test_ddp[exit-code]" time="9"><error message="fixture">e</error></testcase>
<testcase classname="test_ddp" name="test_ddp[world-size]" time="0"/></testsuite></testsuites>"""


def test_parse_junit() -> None:
    counts, failures = results.parse_junit(JUNIT)
    assert counts == results.TestCounts(tests=6, passed=2, failed=1, errors=1, skipped=2)
    assert failures == ("test_versions::test_env[cuda]", "test_ddp::test_ddp[exit-code]")
    bare, _ = results.parse_junit('<testsuite tests="1"><testcase classname="a" name="b"/></testsuite>')
    assert bare.passed == 1


def _tar(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_extract_file() -> None:
    assert results.extract_file(_tar("junit.xml", b"<x/>")) == b"<x/>"
    empty = io.BytesIO()
    with tarfile.open(fileobj=empty, mode="w"):
        pass
    assert results.extract_file(empty.getvalue()) is None


def test_expect_labels_keeps_only_ours() -> None:
    labels = {"io.pt-multi-gpu.torch": "2.7.0", "project": "pt-multi-gpu", "org.opencontainers.image.title": "x"}
    assert results.expect_labels(labels) == {"io.pt-multi-gpu.torch": "2.7.0"}


def test_split_gpus() -> None:
    assert torchrun.split_gpus(4, 2) == (("0", "1"), ("2", "3"))
    assert torchrun.split_gpus(3, 2) == (("0",), ("1",))
    with pytest.raises(ValueError):
        torchrun.split_gpus(1, 2)


