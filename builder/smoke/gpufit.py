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


def _emulated(cell: ImageSpec, host: str | None) -> bool:
    return cell.emulated_on(host) if host else cell.emulated


def cell_problems(cell: ImageSpec, gpus: Sequence[HostGpu], host: str | None = None) -> list[str]:
    """Why ``cell`` can't run on ``gpus`` ([] when it can, or when nothing is known). ``host``:
    the host's platform (default this machine's); a cell of another platform gets no GPU."""
    if cell.cpu_only or _emulated(cell, host) or not gpus:
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


def runnable(cells: Sequence[ImageSpec], gpus: Sequence[HostGpu], host: str | None = None) -> list[str]:
    """The names of the cells that run on ``gpus``."""
    return [c.name for c in cells
            if not c.cpu_only and not _emulated(c, host) and not cell_problems(c, gpus, host)]


def refusal(cell: ImageSpec, cells: Sequence[ImageSpec], gpus: Sequence[HostGpu], host: str | None = None) -> str:
    """The refusal of ``cell`` on ``gpus`` with the cells that would run ("" when it runs)."""
    problems = cell_problems(cell, gpus, host)
    if not problems:
        return ""
    others = [n for n in runnable(cells, gpus, host) if n != cell.name]
    would = f"cells that run here: {', '.join(others)}" if others else "no cell of the matrix runs on these GPUs"
    return f"{cell.name} can't run on this host's GPUs: {'; '.join(problems)} ({would})"


def _cubin_covers(arch_list: Sequence[str], capability: tuple[int, int]) -> bool:
    return contract.arch_covers([a for a in arch_list if not a.startswith("compute_")], capability)


def refusal_fix(cell: ImageSpec, gpus: Sequence[HostGpu], host: str | None = None,
                cells: Sequence[ImageSpec] = ()) -> str:
    """What fixes :func:`refusal`, for the reasons that hold: a driver upgrade only when the driver is
    too old, another cell only when the GPU has no code in this one."""
    fixes = []
    driver = next((g.driver for g in gpus if g.driver), "")
    if driver and cell.min_driver and Version.parse(driver) < Version.parse(cell.min_driver):
        fixes.append(f"upgrade the NVIDIA driver ({driver}) to >= {cell.min_driver}, or use a cell with an older "
                     "CUDA")
    missing = sorted({f"sm_{g.capability[0]}{g.capability[1]}" for g in gpus
                      if g.capability is not None and not contract.arch_covers(cell.arch_list, g.capability)})
    if missing:
        others = [n for n in runnable(cells, gpus, host) if n != cell.name]
        fixes.append(f"use a cell whose torch has code for {', '.join(missing)}"
                     + (f" ({', '.join(others)})" if others else " (a newer torch; none in this matrix)"))
    return "; ".join(fixes)


def ptx_warnings(cell: ImageSpec, gpus: Sequence[HostGpu]) -> list[tuple[str, str]]:
    """(warning, fix) per GPU model that ``cell`` runs only by PTX JIT (no cubin for it): the first
    start compiles every kernel, and a driver older than the build toolkit's (``min_driver_full``)
    can't JIT that PTX at all ("the provided PTX was compiled with an unsupported toolchain")."""
    out = []
    driver = next((g.driver for g in gpus if g.driver), "")
    seen: set[tuple[str, tuple[int, int]]] = set()
    for g in gpus:
        cap = g.capability
        if cell.cpu_only or cap is None or (g.name, cap) in seen:
            continue
        seen.add((g.name, cap))
        if not contract.arch_covers(cell.arch_list, cap) or _cubin_covers(cell.arch_list, cap):
            continue
        sm = f"sm_{cap[0]}{cap[1]}"
        ptx = " ".join(a for a in cell.arch_list if a.startswith("compute_"))
        what = (f"{cell.name}: {g.describe()}: torch {cell.torch} has no cubin for {sm}; only PTX JIT of {ptx} "
                "runs there (the first start compiles every kernel, minutes)")
        if driver and cell.min_driver_full and Version.parse(driver) < Version.parse(cell.min_driver_full):
            out.append((f"{what}, and driver {driver} is older than {cell.min_driver_full}, the driver of CUDA "
                        f"{cell.cuda_full} that built that PTX: the JIT will refuse it",
                        f"upgrade the NVIDIA driver to >= {cell.min_driver_full}, or use a cell with a cubin for "
                        f"{sm}"))
        else:
            out.append((what, f"use a cell with a cubin for {sm}, or keep the JIT cache (CUDA_CACHE_PATH on a "
                              "persistent disk, CUDA_CACHE_MAXSIZE=4294967296)"))
    return out


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
