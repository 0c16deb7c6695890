"""Start diagnostics for NCCL between nodes: RDMA devices, the locked-memory limit, and what
NCCL will use. Warnings only, never failures; standard library only, no torch.

NCCL talks InfiniBand/RoCE through rdma-core: it dlopens libibverbs.so (then .so.1) and needs
the verbs device nodes (/dev/infiniband/uverbs*, `docker run --device /dev/infiniband`) and
enough locked memory to register its buffers (ibv_reg_mr; `--ulimit memlock=-1`). Without the
devices it uses TCP sockets. AWS EFA goes through the aws-ofi-nccl plugin (libnccl-net.so).
"""

from __future__ import annotations

import ctypes
import os
import resource
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import ptmg_contract as contract
from common import info, warn

#: CAP_IPC_LOCK: with it, mlock/ibv_reg_mr ignore RLIMIT_MEMLOCK.
CAP_IPC_LOCK = 14
MEMLOCK_FIX = ("NCCL registers its buffers with ibv_reg_mr and fails ('Cannot allocate memory') with a small "
               "limit: run with --ulimit memlock=-1 (docker), `ulimit -l unlimited` before srun (Slurm: or "
               "PropagateResourceLimitsExcept=MEMLOCK), or give the container IPC_LOCK (Kubernetes)")
DEVICE_FIX = "pass the devices in: docker run --device /dev/infiniband (Kubernetes: an RDMA device plugin)"
NET_PLUGIN = "libnccl-net.so"


@dataclass(frozen=True)
class Port:
    hca: str
    port: str
    state: str  # "ACTIVE", "DOWN", ... (from "4: ACTIVE")
    link_layer: str  # "InfiniBand" or "Ethernet" (RoCE)


def uverbs_nodes(dev_dir: str = contract.IB_DEVICE_DIR) -> list[str]:
    """The verbs device nodes the container can open (uverbs0, ...), sorted."""
    try:
        return sorted(n for n in os.listdir(dev_dir) if n.startswith("uverbs"))
    except OSError:
        return []


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def hca_ports(sys_dir: str = contract.IB_SYSFS_DIR) -> list[Port]:
    """Every port of every HCA the kernel lists (the host's, even without the device nodes)."""
    ports = []
    try:
        hcas = sorted(os.listdir(sys_dir))
    except OSError:
        return []
    for hca in hcas:
        try:
            numbers = sorted(os.listdir(os.path.join(sys_dir, hca, "ports")), key=lambda p: (len(p), p))
        except OSError:
            continue
        for number in numbers:
            base = os.path.join(sys_dir, hca, "ports", number)
            state = _read(os.path.join(base, "state")).split(":")[-1].strip() or "?"
            ports.append(Port(hca, number, state, _read(os.path.join(base, "link_layer")) or "?"))
    return ports


def memlock_limit() -> tuple[int, int]:
    """(soft, hard) RLIMIT_MEMLOCK in bytes; resource.RLIM_INFINITY for unlimited."""
    return resource.getrlimit(resource.RLIMIT_MEMLOCK)


def has_ipc_lock(status_path: str = "/proc/self/status") -> bool:
    """Whether this process holds CAP_IPC_LOCK in its effective set."""
    for line in _read(status_path).splitlines():
        if line.startswith("CapEff:"):
            try:
                return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
            except (IndexError, ValueError):
                return False
    return False


def can_load(name: str) -> bool:
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def human(limit: int) -> str:
    if limit == resource.RLIM_INFINITY:
        return "unlimited"
    if limit >= 1 << 30:
        return f"{limit / (1 << 30):.0f} GiB"
    if limit >= 1 << 20:
        return f"{limit / (1 << 20):.0f} MiB"
    return f"{limit // 1024} KiB"


@dataclass(frozen=True)
class Facts:
    nodes: Sequence[str]
    ports: Sequence[Port]
    memlock: tuple[int, int]
    ipc_lock: bool
    ibverbs: bool  # libibverbs.so.1 loads
    net_plugin: bool  # libnccl-net.so (e.g. aws-ofi-nccl) loads


def gather() -> Facts:
    return Facts(uverbs_nodes(), hca_ports(), memlock_limit(), has_ipc_lock(), can_load(contract.IBVERBS_LIBRARY),
                 can_load(NET_PLUGIN))


def transport(facts: Facts, env: Mapping[str, str]) -> str:
    """What NCCL will use between nodes, in words (its own choice, as NCCL makes it)."""
    forced = env.get("NCCL_NET", "").strip()
    efa = any(p.hca.startswith("efa") for p in facts.ports)
    if forced:
        return f"NCCL_NET={forced} (set by you)"
    if facts.net_plugin:
        return f"the network plugin {NET_PLUGIN} (e.g. aws-ofi-nccl for EFA)"
    if env.get("NCCL_IB_DISABLE", "").strip() not in ("", "0"):
        return "TCP sockets (NCCL_IB_DISABLE is set)"
    if not facts.ibverbs:
        return f"TCP sockets ({contract.IBVERBS_LIBRARY} is missing)"
    if not facts.nodes:
        return f"TCP sockets (no {contract.IB_DEVICE_DIR}/uverbs*)"
    if efa:
        return f"TCP sockets (EFA needs the aws-ofi-nccl plugin, {NET_PLUGIN}: see docs/launch.md)"
    active = [f"{p.hca}:{p.port} ({'RoCE' if p.link_layer == 'Ethernet' else p.link_layer})"
              for p in facts.ports if p.state == "ACTIVE"]
    hca = env.get("NCCL_IB_HCA", "").strip()
    chosen = f", NCCL_IB_HCA={hca}" if hca else ""
    if not active:
        return f"TCP sockets (no ACTIVE port on {len(facts.ports)} RDMA port(s))" if facts.ports else \
            "InfiniBand/RoCE if the verbs devices work (no HCA listed in sysfs)"
    return "InfiniBand/RoCE: " + ", ".join(active) + chosen


def memlock_too_small(facts: Facts, env: Mapping[str, str]) -> bool:
    """RDMA is in play (devices visible, or asked for) and buffer registration would be capped."""
    wanted = bool(facts.nodes) or bool(env.get("NCCL_IB_HCA", "").strip())
    soft = facts.memlock[0]
    return wanted and soft != resource.RLIM_INFINITY and not facts.ipc_lock


def report(env: Mapping[str, str], facts: Facts | None = None, *,
           say: Callable[[str], None] = info, warning: Callable[[str], None] = warn) -> None:
    """Print the RDMA part of the start diagnostics."""
    facts = facts or gather()
    soft, hard = facts.memlock
    limit = f"locked memory {human(soft)}" + ("" if soft == hard else f" (hard {human(hard)})")
    if facts.nodes:
        hcas = sorted({p.hca for p in facts.ports})
        say(f"RDMA: {len(facts.nodes)} verbs device(s) in {contract.IB_DEVICE_DIR}"
            + (f", HCAs {', '.join(hcas)}" if hcas else "") + f"; {limit}")
    elif facts.ports:
        say(f"RDMA: the host has HCAs ({', '.join(sorted({p.hca for p in facts.ports}))}) but this container "
            f"sees no {contract.IB_DEVICE_DIR}/uverbs*: {DEVICE_FIX}")
    else:
        say(f"RDMA: no InfiniBand/RoCE devices; {limit}")
    if memlock_too_small(facts, env):
        why = "RDMA devices are visible" if facts.nodes else "NCCL_IB_HCA is set"
        warning(f"locked memory is limited to {human(soft)} and {why}: {MEMLOCK_FIX}")
    shown = [f"{k}={env[k]}" for k in contract.NCCL_NET_ENV if env.get(k, "").strip()]
    say("NCCL between nodes: " + transport(facts, env) + (f" [{' '.join(shown)}]" if shown else ""))
