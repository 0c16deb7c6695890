"""The host's GPUs before it meets a GPU, with fakes (builder/smoke/gpus.py and the in-image
smokelib): fake nvidia-smi hosts of 0, 1, 2 and 8 GPUs, CUDA_VISIBLE_DEVICES subsets, the
driver's version and why torch sees no GPU, and the rank rule (in the image:
ddp_plan.plan_ranks; on the host: builder.smoke.gpus), one rank per visible GPU, one node and two."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from builder.smoke import gpus
from tests import support

ROOT = Path(__file__).resolve().parents[3]
SMOKE_DIR = ROOT / "smoke_tests"


lib = support.smoke_module("smokelib")
ddp_plan = support.smoke_module("ddp_plan")
ddp_bench = support.smoke_module("ddp_bench")
ddp_watchdog = support.smoke_module("ddp_watchdog")
run_ddp = support.smoke_module("run_ddp")
job_tests = support.smoke_module("ddp_checks")


# --- fake hosts ----------------------------------------------------------------------


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}"


def smi_text(n: int) -> str:
    return "".join(f"{i}, {uuid(i)}\n" for i in range(n))


def fake_query(n: int) -> Any:
    def query() -> tuple[tuple[gpus.HostGpu, ...], str]:
        found = gpus.parse_smi(smi_text(n))
        return found, "" if found else "nvidia-smi lists no GPU"

    return query


def test_parse_smi_and_query_smi() -> None:
    assert gpus.parse_smi("0, GPU-a\n1, GPU-b\nNo devices were found\n") == (
        gpus.HostGpu("0", "GPU-a"), gpus.HostGpu("1", "GPU-b"))

    def run(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert list(argv[1:]) == list(gpus.SMI_ARGS)
        return subprocess.CompletedProcess(argv, 0, smi_text(2), "")

    found, why = gpus.query_smi(run=run, which=lambda _: "/usr/bin/nvidia-smi")
    assert [g.uuid for g in found] == [uuid(0), uuid(1)] and why == ""
    none, why = gpus.query_smi(which=lambda _: None)
    assert none == () and "nvidia-smi not found" in why


@pytest.mark.parametrize(("n", "cvd", "want", "note"), [
    (0, None, [], "no GPU"),
    (1, None, [0], ""),
    (2, None, [0, 1], ""),
    (8, None, list(range(8)), ""),
    (8, "2,3", [2, 3], ""),
    (8, "6, 7,0", [6, 7, 0], ""),  # CUDA's order is the list's order
    (8, uuid(5)[:12], [5], ""),  # a unique UUID prefix
    (8, f"{uuid(4)},1", [4, 1], ""),
    (8, "3,9,4", [3], "'9' names no single GPU"),  # CUDA stops the list at the first bad entry
    (8, "1,1", [1], "repeats a GPU"),
    (8, "", [], "hides every GPU"),
    (8, "-1", [], "names no single GPU"),
    (2, "MIG-1234", [], "names no single GPU"),
])
def test_host_gpus_honour_cuda_visible_devices(n: int, cvd: str | None, want: list[int], note: str) -> None:
    env = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    ids, why = gpus.host_gpus(env, query=fake_query(n))
    assert ids == tuple(uuid(i) for i in want)
    assert note in why


# --- why torch sees no GPU: the host's driver, and the reason the in-image checks give ---------------

#: /proc/driver/nvidia/version of the open kernel module (570) and of the proprietary one (535).
PROC_OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  "
             "(dvs-builder@U16-I3-B03-4-3)  Thu Jan 23 21:45:09 UTC 2025\nGCC version:  gcc version 12.2.0\n")
PROC_CLOSED = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"


def _driver_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smi: str | None,
                 proc: str | None = None) -> str:
    """A host whose PATH holds only a fake nvidia-smi (the shell script `smi`, or none), and whose
    /proc driver file (returned) holds `proc` (or does not exist)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    if smi is not None:
        (bindir / "nvidia-smi").write_text("#!/bin/sh\n" + smi)
        (bindir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", str(bindir))
    proc_file = tmp_path / "version"
    if proc is not None:
        proc_file.write_text(proc)
    return str(proc_file)


@pytest.mark.parametrize(("smi", "proc", "want"), [
    ("echo 570.86.15", None, "570.86.15"),                             # one GPU
    ("printf '570.86.15\\n570.86.15\\n'", None, "570.86.15"),         # one row per GPU
    ("echo 570.86.15", PROC_CLOSED, "570.86.15"),                      # nvidia-smi first
    (None, PROC_OPEN, "570.86.15"),                                    # no nvidia-smi: the kernel module's file
    (None, PROC_CLOSED, "535.104.05"),
    ("echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver\"; exit 9",
     PROC_CLOSED, "535.104.05"),
    ("echo 570.86.15; exit 15", PROC_CLOSED, "535.104.05"),            # a failed nvidia-smi's output is not used
    ("echo 'No devices were found'", PROC_CLOSED, "535.104.05"),       # not a version
    ("exit 0", PROC_CLOSED, "535.104.05"),                             # nothing printed
    (None, "NVRM version: unknown\n", None),
    (None, None, None),                                                # no driver at all
])
def test_driver_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smi: str | None, proc: str | None,
                        want: str | None) -> None:
    assert lib.driver_version(_driver_host(tmp_path, monkeypatch, smi, proc)) == want


def test_driver_version_survives_an_nvidia_smi_that_cannot_run(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    proc_file = _driver_host(tmp_path, monkeypatch, None, PROC_CLOSED)
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_bytes(b"\x7fELF not for this machine")  # executable, but exec() refuses it: OSError
    smi.chmod(0o755)
    assert lib.driver_version(proc_file) == "535.104.05"


def test_driver_version_does_not_wait_on_a_hung_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc_file = _driver_host(tmp_path, monkeypatch, "sleep 600", PROC_CLOSED)
    seen: dict[str, Any] = {}

    def hung(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen.update(kwargs)
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"])

    monkeypatch.setattr(subprocess, "run", hung)
    assert lib.driver_version(proc_file) == "535.104.05"
    assert 0 < seen["timeout"] <= 60


_CVD_UNSET: dict[str, str] = {}


@pytest.mark.parametrize(("cuda", "driver", "min_driver", "env", "says"), [
    (None, "570.86.15", "525.60.13", _CVD_UNSET, "CPU-only build of torch 2.7.0"),
    ("", None, "", _CVD_UNSET, "CPU-only build of torch 2.7.0"),
    ("12.6", "535.104.05", "560.28.03", _CVD_UNSET,
     "the NVIDIA driver 535.104.05 is older than 560.28.03, the minimum for CUDA 12.6"),
    # the driver at the minimum, or newer: the GPU was not passed in
    ("12.6", "560.28.03", "560.28.03", _CVD_UNSET, "the host's NVIDIA driver 560.28.03 is loaded, but no GPU"),
    ("12.6", "570.86.15", "560.28.03", _CVD_UNSET, "the host's NVIDIA driver 570.86.15 is loaded, but no GPU"),
    ("12.6", "570.86.15", "", _CVD_UNSET, "the host's NVIDIA driver 570.86.15 is loaded, but no GPU"),
    ("12.6", "570.86.15", "n/a", _CVD_UNSET, "the host's NVIDIA driver 570.86.15 is loaded, but no GPU"),
    ("12.6", "570.86.15", "560.28.03", {"CUDA_VISIBLE_DEVICES": ""}, "CUDA_VISIBLE_DEVICES='' hides every GPU"),
    ("12.6", "570.86.15", "560.28.03", {"CUDA_VISIBLE_DEVICES": "-1"}, "CUDA_VISIBLE_DEVICES='-1' hides every GPU"),
    ("12.6", None, "560.28.03", {"CUDA_VISIBLE_DEVICES": "NoDevFiles"},
     "CUDA_VISIBLE_DEVICES='NoDevFiles' hides every GPU"),
    ("12.6", "570.86.15", "560.28.03", {"CUDA_VISIBLE_DEVICES": "0,1"}, "is loaded, but no GPU"),
    ("12.6", None, "560.28.03", _CVD_UNSET, "no NVIDIA driver in this container"),
    ("12.6", None, "560.28.03", _CVD_UNSET, "(this image needs >= 560.28.03)"),
    ("12.6", None, "", _CVD_UNSET, "(this image needs >= the one its CUDA needs)"),
])
def test_no_gpu_reason_names_the_most_specific_cause(cuda: str | None, driver: str | None, min_driver: str,
                                                      env: dict[str, str], says: str) -> None:
    why = lib.no_gpu_reason("2.7.0+cu126" if cuda else "2.7.0+cpu", cuda, driver, min_driver, env)
    assert says in why, why
    causes = ("CPU-only", "is older than", "hides every GPU", "no NVIDIA driver in", "is loaded, but")
    assert sum(c in why for c in causes) == 1, why  # one cause, not a list of guesses


# --- the rank rule -------------------------------------------------------------------


@pytest.mark.parametrize(("n", "requested", "want"), [
    (0, None, (2, "gloo", "cpu")),
    (0, 3, (3, "gloo", "cpu")),
    (1, None, (1, "nccl", "cuda")),
    (2, None, (2, "nccl", "cuda")),
    (8, None, (8, "nccl", "cuda")),
    (8, 4, (4, "nccl", "cuda")),  # fewer when asked
    (8, 16, (8, "nccl", "cuda")),  # more is clamped: NCCL needs one GPU per rank
])
def test_in_image_plan_one_rank_per_visible_gpu(n: int, requested: int | None, want: tuple[int, str, str]) -> None:
    plan = ddp_plan.plan_ranks(requested, n)
    assert (plan.nproc, plan.backend, plan.device) == want
    assert ("clamped" in plan.note) == (requested is not None and n > 0 and requested > n)


def test_in_image_plan_gloo_on_cuda_and_refusals() -> None:
    plan = ddp_plan.plan_ranks(2, 1, backend="gloo", device="cuda")  # two gloo ranks on the one GPU
    assert (plan.nproc, plan.backend, plan.device) == (2, "gloo", "cuda")
    assert [ddp_plan.device_index(r, 1) for r in range(2)] == [0, 0]
    assert [ddp_plan.device_index(r, 8) for r in range(8)] == list(range(8))
    with pytest.raises(ValueError, match="GPU"):
        ddp_plan.plan_ranks(None, 0, backend="nccl")
    with pytest.raises(ValueError, match="cuda"):
        ddp_plan.plan_ranks(None, 2, backend="nccl", device="cpu")
    with pytest.raises(ValueError, match="GPU"):
        ddp_plan.plan_ranks(2, 0, backend="gloo", device="cuda")


@pytest.mark.parametrize(("n", "nodes", "requested", "per_node", "nproc", "note"), [
    (1, 1, None, [[0]], 1, ""),
    (2, 1, None, [[0, 1]], 2, ""),
    (8, 1, None, [list(range(8))], 8, ""),
    (8, 1, 2, [[0, 1]], 2, ""),
    (2, 1, 4, [[0, 1]], 2, "clamped to 2"),
    (2, 2, None, [[0], [1]], 1, ""),
    (8, 2, None, [[0, 1, 2, 3], [4, 5, 6, 7]], 4, ""),
    (8, 2, 1, [[0], [4]], 1, ""),
    (3, 2, None, [[0], [1]], 1, "1 GPU(s) idle"),
])
def test_host_plan_shares_the_gpus_between_nodes(n: int, nodes: int, requested: int | None,
                                                 per_node: list[list[int]], nproc: int, note: str) -> None:
    ids, _ = gpus.host_gpus({}, query=fake_query(n))
    plan = gpus.plan_run(ids, nodes, requested)
    assert plan.backend == "nccl" and plan.nproc_per_node == nproc and plan.world_size == nodes * nproc
    assert plan.node_gpus == tuple(tuple(uuid(i) for i in node) for node in per_node)
    assert note in plan.note


def test_host_plan_with_a_cuda_visible_devices_subset_on_two_nodes() -> None:
    ids, _ = gpus.host_gpus({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, query=fake_query(8))
    plan = gpus.plan_run(ids, 2, None)
    assert plan.node_gpus == ((uuid(4), uuid(5)), (uuid(6), uuid(7))) and plan.world_size == 4


def test_host_plan_cpu_and_impossible_requests() -> None:
    cpu = gpus.plan_run(None, 2, None)
    assert (cpu.backend, cpu.nproc_per_node, cpu.node_gpus, cpu.gpu_ids) == ("gloo", 2, None, None)
    with pytest.raises(gpus.GpuPlanError, match="--nodes 2"):
        gpus.plan_run((uuid(0),), 2, None)


