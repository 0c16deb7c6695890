"""`build.py test`: each selected image's selftest, then the DDP job (`--nodes N` across containers)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.errors import StepFailed
from builder.common.log import log, table
from builder.engine import emulation
from builder.matrix import platforms
from builder.smoke import gpufit, gpus, passes, results, runner

#: Time caps for a cell of another architecture (qemu-user: `import torch` alone takes 1-3 min on a
#: busy 2-core host; the DDP job imports it once per rank, in parallel).
EMULATED_SELFTEST_S = 1800.0
EMULATED_DDP_S = 1800.0
#: ... and the DDP job's own limits (after its defaults, so they win): its watchdog's first phase
#: includes `import torch`, and each rank waits in init_process_group for the slower one's import.
EMULATED_JOB = ("--timeout", "900", "--phase-timeout", "1200")


def add_arguments(p: argparse.ArgumentParser) -> None:
    types.add_platforms(p, "native")
    p.add_argument("--nodes", type=types.count(1, 16), default=1,
                   help="DDP across N containers on a private network, 1-16 (default 1); with --require-gpu "
                        "the GPUs are shared evenly between them")
    p.add_argument("--nproc", type=types.count(1, 64), default=None,
                   help="ranks per node (default: with --require-gpu one per visible GPU, else 2 CPU ranks over "
                        "gloo); fewer than the GPUs uses that many GPUs, more is clamped to them")
    p.add_argument("--require-gpu", action="store_true",
                   help="give the containers every visible GPU (nvidia-smi, narrowed by CUDA_VISIBLE_DEVICES) and "
                        "fail when there is none or when the job fell back to gloo (GPU runners)")
    p.add_argument("--require-multi-gpu", action="store_true",
                   default=os.environ.get("PTMG_REQUIRE_MULTI_GPU", "") in ("1", "true", "yes"),
                   help="with --require-gpu: a run with one GPU per world fails instead of reporting the "
                        "checks that need two ranks as skipped (env PTMG_REQUIRE_MULTI_GPU=1)")
    p.add_argument("--junit-dir", default=os.environ.get("PTMG_JUNIT_DIR", "build-logs/junit"), type=types.text,
                   help="where the JUnit XML of each image goes (default build-logs/junit/)")


def plan_for(a: argparse.Namespace, env: Any = os.environ) -> tuple[gpus.RunPlan, tuple[gpus.HostGpu, ...]]:
    """The rank/GPU plan of this run (the one rule, see builder/smoke/gpus.py) and the GPUs it uses."""
    visible: tuple[gpus.HostGpu, ...] = ()
    if a.require_gpu:
        visible, note = gpus.visible_gpus(env)
        if not visible:
            raise StepFailed(f"--require-gpu: no GPU visible on this host ({note})")
        for warning in (note, gpufit.device_order_warning(visible, env)):
            if warning:
                log.warning("%s", warning)
    plan = gpus.plan_run(tuple(g.uuid for g in visible) if a.require_gpu else None, a.nodes, a.nproc)
    mig = gpufit.mig_problem(visible, plan)
    if mig:
        raise gpus.GpuPlanError(mig)
    return plan, visible


def run(ctx: Context) -> int:
    a = ctx.args
    require_multi = bool(a.require_gpu and a.require_multi_gpu)
    plan, visible = plan_for(a)
    log.info("DDP plan: %s", plan.describe())
    engine = ctx.engine()
    junit_dir = Path(a.junit_dir)
    junit_dir.mkdir(parents=True, exist_ok=True)
    rows: list[list[str]] = []
    report: list[dict[str, Any]] = []
    failed = False
    for cell in ctx.cells:
        if not engine.image_exists(cell.ref):
            log.error("%s: image %s is not built; run `python build.py build --only %s`", cell.name, cell.ref,
                      cell.name)
            rows.append([cell.name, "not built", "-", "-", "-", "-"])
            failed = True
            continue
        image_id = engine.image_id(cell.ref)
        emulated, cell_plan, use_gpus = "", plan, bool(a.require_gpu)
        emu = emulation.probe(cell.platform) if cell.emulated else None  # native on an arm64 host
        if emu is not None and not emu.native:  # another architecture: qemu-user runs it, on the CPU only
            if not emu.ok:
                log.error("%s: %s runs under emulation here, and %s\n  fix: %s", cell.name, cell.platform,
                          emu.describe(), emulation.FIX)
                rows.append([cell.name, "FAIL (no emulation)", "-", "-", "-", "-"])
                failed = True
                continue
            emulated = f"{cell.platform} on {platforms.host_platform()}, qemu {emu.version}"
            if use_gpus:
                log.warning("%s: runs under emulation (%s): no GPU in it, so its GPU checks are skipped and its "
                            "DDP job runs on CPU ranks (gloo)", cell.name, emulated)
                cell_plan, use_gpus = gpus.plan_run(None, a.nodes, a.nproc), False
        refused = gpufit.refusal(cell, ctx.matrix.cells, visible) if use_gpus else ""
        if refused:  # a driver too old or an arch list without these GPUs: no container would pass
            log.error("%s", refused)
            rows.append([cell.name, "FAIL (GPUs)", "-", "-", "-", "-"])
            report.append({"cell": cell.name, "image_id": image_id, "ok": False, "problems": [refused]})
            failed = True
            continue
        log.info("%s: selftest%s", cell.name, f" under emulation ({emulated})" if emulated else "")
        st = runner.run_selftest(engine, cell.ref, gpus=use_gpus, gpu_ids=cell_plan.gpu_ids,
                                 require_multi_gpu=require_multi and use_gpus,
                                 args=["--nproc", str(a.nproc)] if a.nproc is not None else [],
                                 timeout=EMULATED_SELFTEST_S if emulated else 900.0, emulated=emulated)
        if st.junit_xml:
            (junit_dir / f"{cell.name}.xml").write_text(st.junit_xml, encoding="utf-8")
        log.info("%s", st.summary())
        log.info("%s: DDP, %s", cell.name, cell_plan.describe())
        ddp = runner.run_plan(engine, cell.ref, cell_plan, require_multi=require_multi and use_gpus,
                              timeout=EMULATED_DDP_S if emulated else 300.0, job_extra=EMULATED_JOB if emulated else ())
        log.info("%s", ddp.summary())
        if ddp.result is not None and ddp.result.busbw:
            log.info("%s: all-reduce bus bandwidth\n%s", cell.name,
                     results.busbw_markdown(ddp.result, same_host_nodes=cell_plan.nodes))
        ok = st.ok and ddp.ok
        failed |= not ok
        c = st.counts
        backend = ddp.result.backend if ddp.result else "-"
        if ok:
            passes.record_pass(ctx.root, image_id, cell.name, c.passed, c.skipped, a.nodes, ddp=ddp.verdict,
                               backend=backend, world_size=ddp.world_size)
        status = "FAIL" if not ok else "PASS" if ddp.passed else f"PASS, DDP {ddp.verdict}"
        rows.append([cell.name, status, str(c.passed), str(c.failed + c.errors), str(c.skipped),
                     f"{ddp.verdict}: world {ddp.world_size}, {backend}, {ddp.wall_s:.1f}s"])
        report.append({"cell": cell.name, "image_id": image_id, "ok": ok, "platform": cell.platform,
                       "emulated": emulated, "selftest_s": round(st.wall_s, 1), "selftest": c.__dict__,
                       "selftest_failures": list(st.failures), "junit": str(junit_dir / f"{cell.name}.xml"),
                       "plan": {"nodes": cell_plan.nodes, "nproc_per_node": cell_plan.nproc_per_node,
                                "backend": cell_plan.backend, "gpus": cell_plan.node_gpus, "note": cell_plan.note},
                       "ddp": {"ok": ddp.ok, "verdict": ddp.verdict, "problems": list(ddp.problems),
                               "wall_s": round(ddp.wall_s, 1), "world_size": ddp.world_size,
                               "result": ddp.result.__dict__ if ddp.result else None,
                               "nodes": [n.describe() for n in ddp.nodes]}})
    if a.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(table(["cell", "status", "passed", "failed", "skipped", "DDP"], rows))
    return 1 if failed else 0


VERB = Verb("test", "run each image's selftest and the DDP job in containers (`--nodes 2` across containers), "
            "JUnit XML per image", "test", run, add_arguments)
