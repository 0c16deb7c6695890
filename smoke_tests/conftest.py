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
    g.addoption("--require-multi-gpu", action="store_true",
                help="with --require-gpu: one visible GPU fails the checks that need two (instead of skipping)")
    g.addoption("--nproc", type=int, default=None,
                help="DDP ranks per node: default one per visible GPU (NCCL; more are clamped), "
                     "else 2 CPU ranks (gloo)")
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
        require_multi_gpu=bool(opt("--require-multi-gpu")),
    )


@pytest.fixture
def cuda_devices(smoke: SmokeConfig, torch: Any) -> int:
    """For GPU checks in other files (test_compile.py, test_devel.py): the visible GPU count;
    skipped with the reason when there is none, failed with --require-gpu (test_gpu's rule)."""
    import test_gpu

    test_gpu.need_gpu(smoke, torch)
    return int(torch.cuda.device_count())


@pytest.fixture(scope="session")
def gpu_count() -> int:
    """The GPUs this container sees (CUDA_VISIBLE_DEVICES already applied by CUDA)."""
    ids = _gpu_ids()
    return 0 if ids == ["no-gpu"] else len(ids)


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


#: Run order: the quick version checks first, the torchrun launches last. test_compile and
#: test_devel (torch.compile on the GPU, the devel flavour's kernel build) are hooks for
#: their own files: they run after the GPU checks and before the DDP launches when present.
ORDER = ("test_versions", "test_gpu", "test_compile", "test_extensions", "test_devel", "test_ddp", "test_seeds")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: Any) -> Any:
    """A test marked ``child`` runs in a fresh process (gpu_child.py): no CUDA context in this one."""
    import gpu_child

    if pyfuncitem.get_closest_marker("child") is None or os.environ.get(gpu_child.IN_CHILD) == "1":
        return None
    if _gpu_ids() == ["no-gpu"]:  # no GPU, no context: the check skips (or fails) right here, without a child
        return None
    state, message = gpu_child.run(f"{pyfuncitem.path}::{pyfuncitem.name}", gpu_child.suite_options(pyfuncitem.config))
    if state == "skipped":
        pytest.skip(message)
    if state == "failed":
        pytest.fail(f"in a child process: {message}", pytrace=False)
    return True


def pytest_collection_modifyitems(items: list[Any]) -> None:
    def rank(item: Any) -> int:
        name = item.module.__name__.rsplit(".", 1)[-1]
        return ORDER.index(name) if name in ORDER else len(ORDER)

    items.sort(key=rank)  # stable: the order inside a module is kept
    where = os.environ.get(smokelib.contract.ENV_SMOKE_EMULATED, "")
    for item in items:
        why = emulation_skip(item, where)
        if why:
            item.add_marker(pytest.mark.skip(reason=why))


def emulation_skip(item: Any, where: str) -> str:
    """Why a check is skipped under emulation ("" when it runs): `build.py test` of another
    architecture's cell (linux/arm64 on x86, qemu-user) sets PTMG_SMOKE_EMULATED. There `import
    torch` alone takes one to three minutes, so every torchrun launch (two more imports per rank)
    and every torch.compile (g++ under qemu) would take many minutes; `build.py test` runs the
    2-rank gloo DDP job once instead, and real arm64 hardware runs everything."""
    if not where:
        return ""
    if item.get_closest_marker("ddp") or item.get_closest_marker("seed"):
        return (f"under emulation ({where}): torchrun launches take minutes each; `build.py test` runs the "
                "2-rank gloo DDP job once instead")
    if item.module.__name__.rsplit(".", 1)[-1] in ("test_compile", "test_extensions"):
        return f"under emulation ({where}): torch.compile and C++ extensions run g++ under qemu (minutes each)"
    return ""


def pytest_generate_tests(metafunc: Any) -> None:
    # One test id per visible GPU, so one bad GPU never hides the others.
    if "gpu_id" in metafunc.fixturenames:
        metafunc.parametrize("gpu_id", _gpu_ids())
