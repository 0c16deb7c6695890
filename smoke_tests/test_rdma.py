"""NCCL's InfiniBand/RoCE path: the rdma-core libraries it opens load, and the verbs API answers.

- ``rdma-ibverbs``: libibverbs.so.1 (NCCL dlopens libibverbs.so, then libibverbs.so.1) loads,
  and so does libmlx5.so.1 (NCCL >= 2.30 opens it for Mellanox/NVIDIA HCAs).
- ``rdma-rdmacm``: librdmacm.so.1 (UCX, MPI) loads.
- ``rdma-device-list``: ibv_get_device_list answers; with /dev/infiniband/uverbs* visible it
  lists at least one device.

Every pt-multi-gpu image carries these (PTMG_CELL is set); off the image a missing library skips.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import pytest

import smokelib

contract = smokelib.contract


def _load(name: str) -> Any:
    try:
        return ctypes.CDLL(name)
    except OSError as exc:
        if os.environ.get(contract.ENV_CELL):
            pytest.fail(f"{name} does not load in this image: {exc}", pytrace=False)
        pytest.skip(f"{name} is not installed on this host ({exc}); NCCL would use TCP sockets between nodes")


@pytest.mark.parametrize("name", [contract.IBVERBS_LIBRARY, "libmlx5.so.1"])
def test_rdma_ibverbs(name: str) -> None:
    _load(name)


def test_rdma_rdmacm() -> None:
    _load("librdmacm.so.1")


def test_rdma_device_list() -> None:
    ibv = _load(contract.IBVERBS_LIBRARY)
    ibv.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
    ibv.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
    count = ctypes.c_int(-1)
    devices = ibv.ibv_get_device_list(ctypes.byref(count))
    if devices:
        ibv.ibv_free_device_list.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        ibv.ibv_free_device_list(devices)
    assert count.value >= 0, "ibv_get_device_list failed"
    try:
        nodes = [n for n in os.listdir(contract.IB_DEVICE_DIR) if n.startswith("uverbs")]
    except OSError:
        nodes = []
    sysfs = os.path.isdir(contract.IB_SYSFS_DIR) and os.listdir(contract.IB_SYSFS_DIR)
    if nodes and sysfs:
        assert count.value > 0, f"{contract.IB_DEVICE_DIR} has {nodes} but libibverbs lists no device"
