"""busbw the nccl-tests way (smoke_tests/ddp_bench.py, builder/smoke/results.py): the bench's
settings, the row averaged over ranks with the slowest reported, and the markdown table."""

from __future__ import annotations

import pytest

from builder.smoke import results, torchrun
from tests import support
from tests.unit.smoke.test_gpus import ddp_bench
from tests.unit.smoke_tests.test_ddp_checks import job_result

# --- busbw, the nccl-tests way -----------------------------------------------------------------


def test_bench_settings_match_nccl_tests() -> None:
    job = support.smoke_module("ddp_job")
    ns = job.parse_args([])
    assert (ns.bench_warmup, ns.bench_iters, ns.bench_sizes) == (5, 20, "auto")
    assert max(ddp_bench.bench_sizes("auto", "nccl")) == 1 << 30
    assert max(ddp_bench.bench_sizes("auto", "gloo")) == 4 << 20
    assert ddp_bench.bench_sizes("", "nccl") == []
    assert "--bench-sizes" not in torchrun.ddp_job_args()  # the runner leaves the sizes to the job
    assert ddp_bench.bench_fits(0.01, 20, 1.0) and not ddp_bench.bench_fits(0.1, 20, 1.0)


def test_busbw_row_averages_over_ranks_and_reports_the_slowest() -> None:
    row = ddp_bench.busbw_row(1 << 30, [0.010, 0.010, 0.010, 0.014], 4)
    assert row["time_us"] == pytest.approx(11000) and row["time_us_max"] == pytest.approx(14000)
    alg = (1 << 30) / 0.011
    assert row["algbw_GBps"] == pytest.approx(alg / 1e9)
    assert row["busbw_GBps"] == pytest.approx(alg * 1.5 / 1e9)  # 2(n-1)/n at n = 4
    assert row["busbw_GBps_min"] == pytest.approx((1 << 30) / 0.014 * 1.5 / 1e9)


def test_busbw_markdown_lists_warmups_iterations_and_sizes() -> None:
    r = results.DDPResult.from_json(job_result(2, "nccl", gpus_visible=2))
    text = results.busbw_markdown(r)
    assert "5 warm-up + 20 timed iterations" in text and "1 KiB, 64 KiB, 1 MiB, 16 MiB, 256 MiB, 1 GiB" in text
    assert "| 1 GiB |" in text and "average over ranks" in text
