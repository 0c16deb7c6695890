"""Options and fixtures of the in-image smoke suite (run it with ``selftest``)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import smokelib  # noqa: E402

SmokeConfig = smokelib.SmokeConfig


def pytest_addoption(parser: Any) -> None:
    g = parser.getgroup("pt-multi-gpu smoke")
    g.addoption("--require-gpu", action="store_true",
                help="a missing GPU fails the GPU checks instead of skipping them")
    g.addoption("--nproc", type=int, default=None,
                help="DDP ranks per node: CPU ranks for gloo (default 2); NCCL is clamped to the GPUs")
    g.addoption("--smoke-out", default=None, help="results folder (DDP result, TensorBoard events)")
    g.addoption("--expect-json", default=None,
                help="expected versions as JSON (image labels or names); overrides PTMG_*")
    g.addoption("--ddp-timeout", type=float, default=300.0, help="hard limit per torchrun launch")


@pytest.fixture(scope="session")
def smoke(request: Any) -> SmokeConfig:
    opt = request.config.getoption
    overrides = json.loads(opt("--expect-json")) if opt("--expect-json") else {}
    out = opt("--smoke-out") or tempfile.mkdtemp(prefix="ptmg-smoke-")
    os.makedirs(out, exist_ok=True)
    return SmokeConfig(
        require_gpu=bool(opt("--require-gpu")),
        nproc=opt("--nproc"),
        out=out,
        expect=smokelib.load_expectations(os.environ, overrides),
        ddp_timeout=float(opt("--ddp-timeout")),
    )


@pytest.fixture(scope="session")
def torch() -> Any:
    import torch as _torch

    return _torch


def _gpu_ids() -> list[str]:
    try:
        import torch as _torch

        n = _torch.cuda.device_count() if _torch.cuda.is_available() else 0
    except Exception:
        n = 0
    return [f"gpu{i}" for i in range(n)] or ["no-gpu"]


#: Run order: the quick version checks first, the torchrun launches last.
ORDER = ("test_versions", "test_gpu", "test_ddp", "test_seeds")


def pytest_collection_modifyitems(items: list[Any]) -> None:
    def rank(item: Any) -> int:
        name = item.module.__name__.rsplit(".", 1)[-1]
        return ORDER.index(name) if name in ORDER else len(ORDER)

    items.sort(key=rank)  # stable: the order inside a module is kept


def pytest_generate_tests(metafunc: Any) -> None:
    # One test id per visible GPU, so one bad GPU never hides the others.
    if "gpu_id" in metafunc.fixturenames:
        metafunc.parametrize("gpu_id", _gpu_ids())
