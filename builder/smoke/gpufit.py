"""Whether a cell can run on this host's GPUs, before any container starts (pure).

- its torch must carry a cubin or PTX for each GPU's compute capability (the contract's
  ``arch_covers``, the rule the in-image ``test_arch_covered`` applies);
- the driver must be at least the cell's minimum for its CUDA;
- NCCL does not talk between MIG instances, so a multi-rank NCCL run on MIG GPUs is refused;
- on a host with mixed GPU models, CUDA numbers GPUs fastest first unless
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, while nvidia-smi numbers them by PCI bus: an index then names
  different GPUs to each, so the host is warned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import ptmg_contract as contract
from builder.common.versions import Version
from builder.matrix import ImageSpec
from builder.smoke.gpus import HostGpu, RunPlan


def cell_problems(cell: ImageSpec, gpus: Sequence[HostGpu]) -> list[str]:
    """Why ``cell`` can't run on ``gpus`` ([] when it can, or when nothing is known)."""
    if cell.cpu_only or cell.emulated or not gpus:
        return []
    problems = []
    driver = next((g.driver for g in gpus if g.driver), "")
    if driver and cell.min_driver and Version.parse(driver) < Version.parse(cell.min_driver):
        problems.append(f"driver {driver} is older than {cell.min_driver}, the minimum for CUDA {cell.cuda}: CUDA "
                        f"will not initialise in this image; upgrade the NVIDIA driver to >= {cell.min_driver}, or "
                        "use a cell with an older CUDA")
    seen: set[tuple[str, tuple[int, int]]] = set()
    for g in gpus:
        if g.capability is None or (g.name, g.capability) in seen:
            continue
        seen.add((g.name, g.capability))
        if not contract.arch_covers(cell.arch_list, g.capability):
            sm = f"sm_{g.capability[0]}{g.capability[1]}"
            problems.append(f"{g.describe()}: torch {cell.torch} (CUDA {cell.cuda}) is built for "
                            f"{' '.join(cell.arch_list)}: no cubin or PTX runs on {sm}")
    return problems


def runnable(cells: Sequence[ImageSpec], gpus: Sequence[HostGpu]) -> list[str]:
    """The names of the cells that run on ``gpus``."""
    return [c.name for c in cells if not c.cpu_only and not c.emulated and not cell_problems(c, gpus)]


def refusal(cell: ImageSpec, cells: Sequence[ImageSpec], gpus: Sequence[HostGpu]) -> str:
    """The refusal of ``cell`` on ``gpus`` with the cells that would run ("" when it runs)."""
    problems = cell_problems(cell, gpus)
    if not problems:
        return ""
    others = [n for n in runnable(cells, gpus) if n != cell.name]
    would = f"cells that run here: {', '.join(others)}" if others else "no cell of the matrix runs on these GPUs"
    return f"{cell.name} can't run on this host's GPUs: {'; '.join(problems)} ({would})"


def mig_problem(gpus: Sequence[HostGpu], plan: RunPlan) -> str:
    """Why ``plan`` can't run on MIG GPUs ("" when it can): NCCL has no transport between MIG instances."""
    mig = [g for g in gpus if g.mig]
    if not mig or plan.backend != "nccl" or plan.world_size < 2:
        return ""
    names = ", ".join(g.describe() for g in mig)
    return (f"MIG mode is enabled on {names}: NCCL does not communicate between MIG instances, so a "
            f"{plan.world_size}-rank NCCL run across MIG slices is refused; run one rank (--nproc 1 --nodes 1), or "
            "disable MIG on these GPUs (nvidia-smi -i INDEX -mig 0, as root, with the GPU idle)")


def device_order_warning(gpus: Sequence[HostGpu], env: Mapping[str, str]) -> str:
    """A warning for mixed GPU models unless CUDA_DEVICE_ORDER=PCI_BUS_ID ("" when none is due)."""
    models = sorted({g.name for g in gpus if g.name})
    order = env.get("CUDA_DEVICE_ORDER", "")
    if len(models) < 2 or order == "PCI_BUS_ID":
        return ""
    return (f"mixed GPU models ({', '.join(models)}) and CUDA_DEVICE_ORDER={order or 'unset (FASTEST_FIRST)'}: CUDA "
            "numbers the fastest GPU 0 while nvidia-smi numbers them by PCI bus, so an index (CUDA_VISIBLE_DEVICES=0, "
            "cuda:0) names different GPUs to each; export CUDA_DEVICE_ORDER=PCI_BUS_ID")
