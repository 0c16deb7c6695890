"""torch.compile in this image: it works (CPU always, the GPU when one is visible), or the image
says why not and that is true.

- ``compile-claim``: the image's PTMG_TORCH_COMPILE ("yes" or "no: <why>") matches what torch
  does: where compile is unsupported (torch 2.0.1 on Python 3.11), torch.compile must refuse with
  the Python version in its message.
- ``compile-one-liner``: ``torch.compile(lambda x: x.sin() + 1)`` on the CPU equals eager.
- ``compile-model-cpu`` / ``compile-model-gpu``: conv + ReLU + linear + cross-entropy, forward and
  backward, compiled vs eager (allclose on the loss and every gradient). Inductor's CPU code is
  C++ with OpenMP (g++, the Python headers); on the GPU it is Triton kernels plus a C launcher.
- ``triton-build-helper``: Triton's own build helper compiles a C extension and it imports: the
  GPU-side toolchain (cc, Python.h) proven without a GPU.

Off the image (a host with torch and pytest), a missing PTMG_TORCH_COMPILE means "ask torch".
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import tempfile
from typing import Any, NamedTuple

import pytest

import smokelib

contract = smokelib.contract

class CompileState(NamedTuple):
    supported: bool
    reason: str  # why not ("" when supported)
    claimed: bool  # the image said it (PTMG_TORCH_COMPILE); False off the image


def _reset(torch: Any) -> None:
    """Forget earlier compiled code (torch < 2.1 imports torch._dynamo only on first use)."""
    importlib.import_module("torch._dynamo").reset()


def _refusal(torch: Any) -> str:
    """torch.compile's own refusal on this Python, or "" when it compiles."""
    try:
        torch.compile(lambda x: x + 1)(torch.ones(2))
    except RuntimeError as exc:
        if "not supported" in str(exc) or "not yet supported" in str(exc):
            return str(exc).strip().splitlines()[-1]
        raise
    return ""


@pytest.fixture(scope="session")
def compile_state(torch: Any) -> CompileState:
    claim = os.environ.get(contract.ENV_TORCH_COMPILE, "").strip()
    if claim:
        supported = claim == "yes"
        return CompileState(supported, "" if supported else claim.removeprefix("no:").strip(), True)
    reason = _refusal(torch)
    return CompileState(not reason, reason, False)


def _need_compile(state: CompileState) -> None:
    if not state.supported:
        pytest.skip(f"torch.compile is unavailable in this image: {state.reason}")


def test_compile_claim(compile_state: CompileState, torch: Any) -> None:
    if not compile_state.claimed:
        pytest.skip(f"not in a pt-multi-gpu image ({contract.ENV_TORCH_COMPILE} unset); "
                    f"torch.compile {'works' if compile_state.supported else 'refuses: ' + compile_state.reason}")
    if compile_state.supported:
        assert _refusal(torch) == "", "the image claims torch.compile works, but torch refuses it"
        return
    assert compile_state.reason, f"{contract.ENV_TORCH_COMPILE} says no, without saying why"
    refusal = _refusal(torch)
    assert refusal, f"the image says torch.compile is unavailable ({compile_state.reason}), but it compiled"
    assert "Python" in refusal, refusal
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert python in compile_state.reason, f"the image's reason does not name this Python {python}"


def test_compile_one_liner(compile_state: CompileState, torch: Any) -> None:
    _need_compile(compile_state)
    _reset(torch)

    def f(x: Any) -> Any:
        return x.sin() + 1

    torch.manual_seed(0)
    x = torch.randn(4)
    got = torch.compile(f)(x)
    # float32 tolerances: Inductor's vectorised sin may differ from eager's by an ulp, which near
    # sin(x) = -1 is a large *relative* error on a tiny result (seen: 2.0981e-05 vs 2.1040e-05).
    assert torch.allclose(got, f(x), rtol=1e-5, atol=1e-6), (got, f(x))


def _model(torch: Any) -> Any:
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))


def _compare(torch: Any, device: str, rtol: float, atol: float) -> None:
    """One forward+backward step, compiled vs eager, on the same parameters and batch."""
    _reset(torch)
    torch.manual_seed(0)
    model = _model(torch).to(device)
    x = torch.randn(4, 3, 16, 16, device=device)
    y = torch.tensor([0, 1, 2, 3], device=device)

    def step(m: Any) -> tuple[Any, list[Any]]:
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]

    eager_loss, eager_grads = step(model)
    compiled_loss, compiled_grads = step(torch.compile(model))
    assert torch.allclose(compiled_loss, eager_loss, rtol=rtol, atol=atol), (compiled_loss, eager_loss)
    for i, (c, e) in enumerate(zip(compiled_grads, eager_grads, strict=True)):
        diff = (c - e).abs().max().item()
        assert torch.allclose(c, e, rtol=rtol, atol=atol), f"gradient {i} differs by {diff}"


def test_compile_model_cpu(compile_state: CompileState, torch: Any) -> None:
    _need_compile(compile_state)
    _compare(torch, "cpu", rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.child  # a CUDA context in a child process only (gpu_child.py)
def test_compile_model_gpu(compile_state: CompileState, torch: Any, cuda_devices: int) -> None:
    _need_compile(compile_state)
    assert cuda_devices > 0
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        _compare(torch, "cuda:0", rtol=1e-3, atol=1e-4)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


EXT_SRC = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject *add(PyObject *self, PyObject *args) {
    long a, b;
    if (!PyArg_ParseTuple(args, "ll", &a, &b)) return NULL;
    return PyLong_FromLong(a + b);
}
static PyMethodDef methods[] = {{"add", add, METH_VARARGS, "a + b"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ptmg_triton_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_ptmg_triton_probe(void) { return PyModule_Create(&module); }
"""


def test_triton_build_helper(compile_state: CompileState, torch: Any) -> None:
    _need_compile(compile_state)
    if importlib.util.find_spec("triton") is None:
        if torch.version.cuda is not None:
            pytest.fail(f"torch {torch.__version__} is a CUDA build but triton is missing: "
                        "torch.compile cannot generate GPU kernels")
        pytest.skip(f"CPU-only torch {torch.__version__} has no triton (Inductor makes C++ only)")
    build: Any = importlib.import_module("triton.runtime.build")._build
    # No libraries: nothing links libcuda, so no driver and no GPU are needed. triton >= 3.4 adds ccflags.
    extra: dict[str, Any] = {"ccflags": []} if "ccflags" in build.__code__.co_varnames else {}
    with tempfile.TemporaryDirectory(prefix="ptmg-triton-") as tmp:
        src = os.path.join(tmp, "ptmg_triton_probe.c")
        with open(src, "w", encoding="utf-8") as fh:
            fh.write(EXT_SRC)
        so = build("ptmg_triton_probe", src, tmp, [], [], [], **extra)
        spec = importlib.util.spec_from_file_location("ptmg_triton_probe", so)
        assert spec is not None and spec.loader is not None, so
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.add(2, 40) == 42
