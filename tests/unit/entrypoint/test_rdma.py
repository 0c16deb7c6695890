"""entrypoint/rdma.py: RDMA devices from a fake /dev and /sys, the memlock rule, what NCCL will use.
Warnings only: report() never raises, so the tests read what it prints."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

import ptmg_contract as contract
import rdma
from rdma import Facts, Port

UNLIMITED = resource.RLIM_INFINITY
KIB64 = 65536


def _sysfs(root: Path, hca: str, port: str, state: str, link: str) -> None:
    d = root / hca / "ports" / port
    d.mkdir(parents=True)
    (d / "state").write_text(f"{state}\n")
    (d / "link_layer").write_text(f"{link}\n")


def test_hca_ports_and_uverbs_nodes_from_a_fake_tree(tmp_path: Path) -> None:
    sys_dir, dev_dir = tmp_path / "sys", tmp_path / "dev"
    _sysfs(sys_dir, "mlx5_0", "1", "4: ACTIVE", "InfiniBand")
    _sysfs(sys_dir, "mlx5_1", "1", "1: DOWN", "Ethernet")
    (sys_dir / "broken_hca").mkdir()  # no ports/ folder: skipped, no exception
    dev_dir.mkdir()
    for name in ("uverbs1", "uverbs0", "rdma_cm", "issm0"):
        (dev_dir / name).touch()
    assert rdma.hca_ports(str(sys_dir)) == [Port("mlx5_0", "1", "ACTIVE", "InfiniBand"),
                                            Port("mlx5_1", "1", "DOWN", "Ethernet")]
    assert rdma.uverbs_nodes(str(dev_dir)) == ["uverbs0", "uverbs1"]
    assert rdma.uverbs_nodes(str(tmp_path / "absent")) == []
    assert rdma.hca_ports(str(tmp_path / "absent")) == []


def test_ipc_lock_from_proc_status(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython3\nCapEff:\t00000000a80425fb\n")  # Docker's default set: no IPC_LOCK
    assert not rdma.has_ipc_lock(str(status))
    status.write_text(f"CapEff:\t{0xa80425fb | 1 << rdma.CAP_IPC_LOCK:016x}\n")
    assert rdma.has_ipc_lock(str(status))
    assert not rdma.has_ipc_lock(str(tmp_path / "missing"))


def _facts(nodes: tuple[str, ...] = (), ports: tuple[Port, ...] = (), soft: int = UNLIMITED, *,
           ipc_lock: bool = False, ibverbs: bool = True, plugin: bool = False) -> Facts:
    return Facts(nodes, ports, (soft, soft), ipc_lock, ibverbs, plugin)


IB = Port("mlx5_0", "1", "ACTIVE", "InfiniBand")
ROCE = Port("mlx5_1", "1", "ACTIVE", "Ethernet")


@pytest.mark.parametrize(("facts", "env", "want"), [
    (_facts(), {}, "TCP sockets (no /dev/infiniband/uverbs*)"),
    (_facts(ibverbs=False, nodes=("uverbs0",)), {}, "TCP sockets (libibverbs.so.1 is missing)"),
    (_facts(("uverbs0",), (IB,)), {"NCCL_IB_DISABLE": "1"}, "TCP sockets (NCCL_IB_DISABLE is set)"),
    (_facts(("uverbs0", "uverbs1"), (IB, ROCE)), {}, "InfiniBand/RoCE: mlx5_0:1 (InfiniBand), mlx5_1:1 (RoCE)"),
    (_facts(("uverbs0",), (IB,)), {"NCCL_IB_HCA": "mlx5_0"}, "InfiniBand/RoCE: mlx5_0:1 (InfiniBand), "
                                                               "NCCL_IB_HCA=mlx5_0"),
    (_facts(("uverbs0",), (Port("mlx5_0", "1", "DOWN", "InfiniBand"),)), {},
     "TCP sockets (no ACTIVE port on 1 RDMA port(s))"),
    (_facts(("uverbs0",), (Port("efa_0", "1", "ACTIVE", "Unspecified"),)), {},
     "TCP sockets (EFA needs the aws-ofi-nccl plugin, libnccl-net.so: see docs/launch.md)"),
    (_facts(("uverbs0",), (Port("efa_0", "1", "ACTIVE", "Unspecified"),), plugin=True), {},
     "the network plugin libnccl-net.so (e.g. aws-ofi-nccl for EFA)"),
    (_facts(), {"NCCL_NET": "Socket"}, "NCCL_NET=Socket (set by you)"),
])
def test_what_nccl_will_use(facts: Facts, env: dict[str, str], want: str) -> None:
    assert rdma.transport(facts, env) == want


def test_small_memlock_with_devices_warns(capsys: pytest.CaptureFixture[str]) -> None:
    rdma.report({}, _facts(("uverbs0",), (IB,), soft=KIB64))
    err = capsys.readouterr().err
    assert "[ptmg] RDMA: 1 verbs device(s) in /dev/infiniband, HCAs mlx5_0; locked memory 64 KiB" in err
    assert "WARNING: locked memory is limited to 64 KiB and RDMA devices are visible" in err
    assert "--ulimit memlock=-1" in err
    assert "[ptmg] NCCL between nodes: InfiniBand/RoCE: mlx5_0:1 (InfiniBand)" in err


@pytest.mark.parametrize("facts", [
    _facts(("uverbs0",), (IB,), soft=UNLIMITED),  # unlimited: fine
    _facts(("uverbs0",), (IB,), soft=KIB64, ipc_lock=True),  # IPC_LOCK ignores the limit
    _facts(soft=KIB64),  # no RDMA in play: sockets don't lock memory
])
def test_no_memlock_warning_when_it_does_not_matter(facts: Facts, capsys: pytest.CaptureFixture[str]) -> None:
    rdma.report({}, facts)
    assert "WARNING" not in capsys.readouterr().err


def test_nccl_ib_hca_without_devices_warns_and_env_is_shown(capsys: pytest.CaptureFixture[str]) -> None:
    rdma.report({"NCCL_IB_HCA": "mlx5", "NCCL_SOCKET_IFNAME": "eth0", "UNRELATED": "x"}, _facts(soft=8 << 20))
    err = capsys.readouterr().err
    assert "WARNING: locked memory is limited to 8 MiB and NCCL_IB_HCA is set" in err
    assert "[NCCL_IB_HCA=mlx5 NCCL_SOCKET_IFNAME=eth0]" in err and "UNRELATED" not in err


def test_host_hcas_without_device_nodes_say_how_to_pass_them(capsys: pytest.CaptureFixture[str]) -> None:
    rdma.report({}, _facts((), (IB,)))
    err = capsys.readouterr().err
    assert "the host has HCAs (mlx5_0) but this container sees no /dev/infiniband/uverbs*" in err
    assert "--device /dev/infiniband" in err


def test_gather_on_this_host_never_raises(capsys: pytest.CaptureFixture[str]) -> None:
    facts = rdma.gather()
    assert facts.memlock == resource.getrlimit(resource.RLIMIT_MEMLOCK)
    rdma.report({}, facts)
    assert "NCCL between nodes:" in capsys.readouterr().err
    assert contract.IBVERBS_LIBRARY == "libibverbs.so.1"


def test_human_sizes() -> None:
    assert [rdma.human(v) for v in (UNLIMITED, KIB64, 8 << 20, 64 << 30)] == ["unlimited", "64 KiB", "8 MiB",
                                                                              "64 GiB"]
