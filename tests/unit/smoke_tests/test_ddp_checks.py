"""The in-image DDP checks (smoke_tests/ddp_checks.py) and the selftest's ranks, with fakes: world
size 1 is "skipped (one GPU)", never passed (--require-multi-gpu: failed); each check refuses
what it guards and passes a good job; the selftest asks for every GPU."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests import support
from tests.unit.smoke.test_gpus import ddp_bench, ddp_plan, job_tests, lib, run_ddp

# --- world size 1: never a pass ----------------------------------------------------------


def job_result(world: int, backend: str, *, device: str = "cuda:0", gpus_visible: int = 1,
               nodes: int = 1) -> dict[str, Any]:
    """What ddp_job.py prints, built with the job's own check and verdict functions."""
    checks = ddp_plan.ddp_checks(world, backend, loss_decreased=True, params_identical=True, allreduce_exact=True,
                            busbw_measured=world >= 2)
    rows = [] if world < 2 else [ddp_bench.busbw_row(1 << 30, [0.010, 0.012], world)]
    return {
        "schema": 2, "ok": True, "verdict": ddp_plan.ddp_verdict(checks, world, backend), "checks": checks,
        "world_size": world, "backend": backend, "gpus_visible": gpus_visible, "device": device,
        "nodes": nodes, "hosts": [f"node{i * nodes // world}" for i in range(world)], "local_world_size": world,
        "torch": "2.7.0+cu126", "steps": 60, "steps_per_s": 100.0, "initial_loss": 6.0, "final_loss": 0.1,
        "loss_decreased": True, "params_identical": True, "params_sha256": "ab", "allreduce_exact": True,
        "busbw": rows, "tensorboard_dir": "/tmp/tb", "wall_s": 3.0,
        "bench": {"op": "all_reduce", "reduce": "sum", "dtype": "float32", "in_place": True,
                  "warmup": ddp_bench.BENCH_WARMUP, "iters": ddp_bench.BENCH_ITERS,
                  "sizes": ddp_bench.bench_sizes("auto", backend), "skipped_sizes": []},
    }


def test_the_job_calls_world_size_1_skipped_never_passed() -> None:
    checks = ddp_plan.ddp_checks(1, "nccl", loss_decreased=True, params_identical=True, allreduce_exact=True,
                            busbw_measured=False)
    assert checks["loss_decreased"] == "passed"
    for name in ddp_plan.MULTI_RANK_CHECKS:
        assert checks[name] == "skipped: one GPU, NCCL transport not exercised"
    assert ddp_plan.ddp_verdict(checks, 1, "nccl") == "skipped (one GPU)"
    assert ddp_plan.ddp_verdict(ddp_plan.ddp_checks(1, "gloo", loss_decreased=True, params_identical=True,
                                          allreduce_exact=True, busbw_measured=None), 1, "gloo") == "skipped (one rank)"
    two = ddp_plan.ddp_checks(2, "nccl", loss_decreased=True, params_identical=True, allreduce_exact=True,
                         busbw_measured=True)
    assert ddp_plan.ddp_verdict(two, 2, "nccl") == "passed"
    bad = ddp_plan.ddp_checks(2, "nccl", loss_decreased=True, params_identical=False, allreduce_exact=True,
                         busbw_measured=True)
    assert ddp_plan.ddp_verdict(bad, 2, "nccl") == "failed"
    # a failure at world size 1 is still a failure, not a skip
    assert ddp_plan.ddp_verdict(ddp_plan.ddp_checks(1, "nccl", loss_decreased=False, params_identical=True,
                                          allreduce_exact=True, busbw_measured=None), 1, "nccl") == "failed"


def _fake_job(result: dict[str, Any], nproc: int, backend: str) -> Any:
    launch = run_ddp.Launch(0, "", False, nproc, backend, "", 1.0, "cuda")
    return launch, result, "/tmp/ddp"


def _smoke(require_multi: bool = False) -> Any:
    return lib.SmokeConfig(require_gpu=True, nproc=None, out="/tmp", expect={}, ddp_timeout=60.0,
                           require_multi_gpu=require_multi)


def _outcome(check: str, job: Any, smoke: Any) -> tuple[str, str]:
    """What the in-image check did: ("passed" | "skipped" | "failed", its message). Both outcomes are
    caught here, so a check that skips where it must fail reads as "skipped", never escapes a
    ``pytest.raises(pytest.fail.Exception)`` (a skip is not a fail) and passes the test by skipping it."""
    try:
        job_tests.CHECKS[check](job, smoke)
    except pytest.skip.Exception as exc:
        return "skipped", str(exc)
    except pytest.fail.Exception as exc:
        return "failed", str(exc)
    return "passed", ""


@pytest.mark.parametrize("check", ["params-identical", "allreduce-exact", "busbw-table", "verdict"])
def test_in_image_suite_skips_the_two_rank_checks_on_one_gpu(check: str) -> None:
    job = _fake_job(job_result(1, "nccl"), 1, "nccl")
    kind, why = _outcome(check, job, _smoke())
    assert kind == "skipped" and "one GPU, NCCL transport not exercised" in why, (kind, why)
    kind, why = _outcome(check, job, _smoke(require_multi=True))
    assert kind == "failed", f"--require-multi-gpu on one GPU must fail the check, it {kind}: {why}"
    assert re.search(r"--require-multi-gpu: .*one GPU, NCCL transport not exercised", why), why


def test_a_config_without_the_multi_gpu_flag_skips_on_one_gpu() -> None:
    smoke = lib.SmokeConfig(require_gpu=True, nproc=None, out="/tmp", expect={}, ddp_timeout=60.0)
    kind, why = _outcome("verdict", _fake_job(job_result(1, "nccl"), 1, "nccl"), smoke)
    assert kind == "skipped", (kind, why)


def test_in_image_suite_passes_eight_gpus_and_refuses_a_gloo_fallback() -> None:
    eight = _fake_job(job_result(8, "nccl", gpus_visible=8), 8, "nccl")
    for check in ("world-size", "backend", "params-identical", "allreduce-exact", "busbw-table", "verdict"):
        job_tests.CHECKS[check](eight, _smoke(require_multi=True))
    fell_back = _fake_job(job_result(2, "gloo", device="cpu"), 2, "gloo")
    with pytest.raises(AssertionError, match="--require-gpu, but the job ran gloo"):
        job_tests.CHECKS["backend"](fell_back, _smoke())
    short = _fake_job(job_result(4, "nccl", gpus_visible=8), 4, "nccl")  # 4 of 8 GPUs, nobody asked for fewer
    with pytest.raises(AssertionError):
        job_tests.CHECKS["world-size"](short, _smoke())


def _good_job(tmp_path: Path, world: int = 8, backend: str = "nccl", **launch: Any) -> Any:
    """A job every in-image check passes: its TensorBoard folder holds a (1-byte) events file, and
    its bandwidth rows sit just above the checks' limits."""
    (tmp_path / "tb").mkdir(exist_ok=True)
    (tmp_path / "tb" / "events.out.tfevents.1.host").write_bytes(b"x")
    result = job_result(world, backend, gpus_visible=world if backend == "nccl" else 0,
                        device="cuda:0" if backend == "nccl" else "cpu")
    row = {"time_us": 0.5, "busbw_GBps": 0.5, "time_us_max": 0.5}
    # NCCL's table must reach 1 GiB (nccl-tests' comparison size), measured, not only asked for
    result["busbw"] = [{"bytes": 1 << 20, **row}, *([{"bytes": 1 << 30, **row}] if backend == "nccl" else [])]
    fields = {"returncode": 0, "output": "", "timed_out": False, "nproc": world, "backend": backend, "note": "",
              "seconds": 1.0, "device": "cuda" if backend == "nccl" else "cpu", **launch}
    return run_ddp.Launch(**fields), result, str(tmp_path)


def _gloo_smoke() -> Any:
    return lib.SmokeConfig(require_gpu=False, nproc=None, out="/tmp", expect={}, ddp_timeout=60.0)


def test_every_in_image_check_passes_a_good_job(tmp_path: Path) -> None:
    for check in job_tests.CHECKS.values():
        check(_good_job(tmp_path), _smoke(require_multi=True))
        check(_good_job(tmp_path, 2, "gloo"), _gloo_smoke())  # gloo: small sizes, any GPU count, name


def _worse(job: Any, launch: dict[str, Any] | None = None, **result: Any) -> Any:
    bench = {**job[1]["bench"], **result.pop("bench", {})}
    return job[0]._replace(**(launch or {})), {**job[1], **result, "bench": bench}, job[2]


@pytest.mark.parametrize(("check", "change", "says"), [
    ("exit-code", {"launch": {"timed_out": True}}, "hit the hard timeout"),
    ("exit-code", {"launch": {"returncode": 1}}, "torchrun exited 1"),
    ("world-size", {"launch": {"nproc": 4}}, None),
    ("world-size", {"world_size": 4, "launch": {"nproc": 4}}, None),  # 4 of 8 GPUs, and nobody asked for fewer
    ("backend", {"device": "cpu"}, "--require-gpu, but the job ran nccl on cpu"),
    ("loss-decreases", {"loss_decreased": False}, "did not decrease"),
    ("params-identical", {"params_identical": False}, "parameters differ"),
    ("allreduce-exact", {"allreduce_exact": False}, "gave a wrong result"),
    ("busbw-table", {"bench": {"warmup": 0}}, "warmup"),
    ("busbw-table", {"bench": {"iters": 5}}, "iters"),
    ("busbw-table", {"busbw": []}, "no all-reduce bandwidth measured"),
    ("busbw-table", {"busbw": [{"time_us": 0.0, "busbw_GBps": 1.0, "time_us_max": 1.0}]}, "time_us"),
    ("busbw-table", {"busbw": [{"time_us": 1.0, "busbw_GBps": 0.0, "time_us_max": 1.0}]}, "busbw_GBps"),
    ("busbw-table", {"busbw": [{"time_us": 2.0, "busbw_GBps": 1.0, "time_us_max": 1.0}]}, "time_us_max"),
    ("busbw-table", {"busbw": [{"bytes": 1 << 29, "time_us": 1.0, "busbw_GBps": 1.0, "time_us_max": 1.0}]},
     "the largest size measured is 512 MiB"),
    ("verdict", {"verdict": "failed"}, "the job's checks"),
])
def test_each_in_image_check_refuses_what_it_guards(tmp_path: Path, check: str, change: dict[str, Any],
                                                    says: str | None) -> None:
    job = _worse(_good_job(tmp_path), **change)
    with pytest.raises(AssertionError, match=says):
        job_tests.CHECKS[check](job, _smoke(require_multi=True))


def test_tensorboard_events_must_exist_and_hold_something(tmp_path: Path) -> None:
    job = _good_job(tmp_path)
    (tmp_path / "tb" / "events.out.tfevents.1.host").write_bytes(b"")
    with pytest.raises(AssertionError, match="no TensorBoard events written"):
        job_tests.CHECKS["tensorboard-events"](job, _smoke())
    (tmp_path / "tb" / "events.out.tfevents.1.host").unlink()
    with pytest.raises(AssertionError, match="no TensorBoard events written"):
        job_tests.CHECKS["tensorboard-events"](job, _smoke())


def test_a_job_without_a_result_fails_every_check_but_the_exit_code(tmp_path: Path) -> None:
    launch, _, out = _good_job(tmp_path)
    for name, check in job_tests.CHECKS.items():
        if name != "exit-code":
            with pytest.raises(pytest.fail.Exception, match="the DDP job printed no result"):
                check((launch, None, out), _smoke())


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    argvs: list[list[str]] = []

    def fake_run(argv: Sequence[str], timeout: float, echo: bool = False,
                 env: dict[str, str] | None = None) -> tuple[int, str, bool]:
        argvs.append(list(argv))
        return 0, "", False

    monkeypatch.setattr(run_ddp, "run_bounded", fake_run)
    yield argvs


@pytest.mark.parametrize(("n", "nproc", "backend"), [(0, 2, "gloo"), (1, 1, "nccl"), (2, 2, "nccl"), (8, 8, "nccl")])
def test_the_selftest_asks_for_every_gpu(launched: list[list[str]], monkeypatch: pytest.MonkeyPatch,
                                         n: int, nproc: int, backend: str) -> None:
    monkeypatch.setattr(run_ddp, "visible_gpus", lambda: n)
    launch = run_ddp.launch(None, script_args=["--out", "/tmp/x"])  # what test_ddp's ddp_job fixture does
    argv = launched[-1]
    assert argv[argv.index("--nproc_per_node") + 1] == str(nproc) and launch.nproc == nproc
    assert argv[argv.index("--backend") + 1] == backend
    assert argv[argv.index("--device") + 1] == ("cuda" if n else "cpu")


def test_selftest_flag_require_multi_gpu_needs_require_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    selftest = support.smoke_module("selftest")
    assert selftest.parse_args(["--require-gpu", "--require-multi-gpu"]).require_multi_gpu
    with pytest.raises(SystemExit):
        selftest.parse_args(["--require-multi-gpu"])
    assert selftest.parse_args([]).nproc is None  # no --nproc: one rank per visible GPU




# --- the log tail a failure shows ---------------------------------------------------------------------------
RANK_ERROR = "PTMG_DDP rank 0 failed in setup: ModuleNotFoundError: No module named 'tensorboard'"
TRACEBACK = [f'  File "/usr/lib/python3/site-packages/torch/distributed/run.py", line {n}, in main' for n in range(45)]


def _tail(lines: Sequence[str]) -> str:
    return str(job_tests.tail(run_ddp.Launch(1, "\n".join(lines) + "\n", False, 2, "gloo", "", 3.0)))


def test_the_log_tail_keeps_the_ranks_own_error_above_torchruns_traceback() -> None:
    """On failure the DDP checks show the output's last 40 lines; torchrun's ChildFailedError
    traceback alone fills them, so the rank's own line ("failed in setup: ...") goes first."""
    output = ["PTMG_DDP rank 0: world_size=2 backend=gloo", RANK_ERROR, "Traceback (most recent call last):",
              *TRACEBACK, "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"]
    assert _tail(output).splitlines() == ["the ranks' own errors:", RANK_ERROR, "... the last 40 lines:",
                                          *output[-40:]]


def test_a_log_tail_without_a_ranks_error_above_it_is_the_last_lines_alone() -> None:
    inside = [*TRACEBACK[:10], RANK_ERROR, *TRACEBACK[10:]]  # 46 lines, the rank's error among the last 40
    assert _tail(inside).splitlines() == inside[-40:]
    assert _tail(TRACEBACK).splitlines() == TRACEBACK[-40:]
    assert _tail([RANK_ERROR, "boom"]) == RANK_ERROR + "\nboom"  # a short output is shown whole, once
    assert _tail(TRACEBACK[:40]).splitlines() == TRACEBACK[:40]
