"""A stand-in `torch` package for running the in-image smoke code without torch or a GPU.

It models only what the GPU path asks of torch: how many GPUs CUDA sees, their compute
capability, the build's CUDA version and arch list, and which process holds a CUDA context.
Tensor maths is not modelled: every tensor is a placeholder and every comparison is true, so a
test built on it checks where and whether the code runs, never a number.

Settings come from the environment, so a child process (a torchrun rank, a per-GPU check) gets
the same fake: FAKE_TORCH_GPUS (count, default 0), FAKE_TORCH_CUDA (the build's CUDA; "" for a
CPU-only torch), FAKE_TORCH_CAP ("9.0"), FAKE_TORCH_ARCHS ("sm_80 sm_90"), FAKE_TORCH_CONTEXTS (a
file: every process that creates a CUDA context appends its pid) and FAKE_TORCH_EXCLUSIVE=1 (the
GPUs are in EXCLUSIVE_PROCESS compute mode: a second live process gets "busy or unavailable");
FAKE_TORCH_IMPORTS (a file: every process that imports torch appends its pid).
"""

from __future__ import annotations

from pathlib import Path

INIT = '''
import os, sys, types, contextlib
__version__ = "2.11.0+cu130"

def _env(name, default=""):
    return os.environ.get(name, default)

if _env("FAKE_TORCH_IMPORTS"):  # which processes imported torch
    with open(_env("FAKE_TORCH_IMPORTS"), "a") as _fh:
        _fh.write(f"{os.getpid()}\\n")

class _Version:
    cuda = _env("FAKE_TORCH_CUDA", "13.0") or None
version = _Version()

def _context():
    """A CUDA context in this process (EXCLUSIVE_PROCESS: refused while another live process holds one)."""
    log = _env("FAKE_TORCH_CONTEXTS")
    if not log:
        return
    pids = [int(x) for x in open(log).read().split()] if os.path.exists(log) else []
    if os.getpid() in pids:
        return
    if _env("FAKE_TORCH_EXCLUSIVE") == "1":
        for pid in pids:
            try:
                os.kill(pid, 0)
            except OSError:
                continue
            raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable")
    with open(log, "a") as fh:
        fh.write(f"{os.getpid()}\\n")

class device:
    def __init__(self, kind, index=None):
        self.type, self.index = kind, index

class Tensor:
    def __init__(self, dev=None):
        self.dev = dev
    def to(self, dev):
        if getattr(dev, "type", dev) == "cuda":
            _context()
        return Tensor(dev)
    def cpu(self):
        return Tensor()
    def __add__(self, other): return Tensor(self.dev)
    __mul__ = __matmul__ = __add__

def _make(*args, device=None, **kw):
    if device is not None and getattr(device, "type", device) == "cuda":
        _context()
    return Tensor(device)
arange = randn = zeros = ones = _make
float32 = "float32"

def equal(a, b): return True
def allclose(a, b, **kw): return True

class Generator:
    def manual_seed(self, seed): return self

class _Cuda(types.ModuleType):
    def is_available(self): return int(_env("FAKE_TORCH_GPUS", "0")) > 0 and bool(version.cuda)
    def device_count(self): return int(_env("FAKE_TORCH_GPUS", "0")) if version.cuda else 0
    def get_device_capability(self, i=0):
        major, minor = _env("FAKE_TORCH_CAP", "9.0").split(".")
        return int(major), int(minor)
    def get_arch_list(self): return _env("FAKE_TORCH_ARCHS", "sm_80 sm_90").split()
    def get_device_name(self, i=0): return "Fake GPU"
    def synchronize(self, dev=None): _context()
    def set_device(self, i): _context()
cuda = _Cuda("torch.cuda")
sys.modules["torch.cuda"] = cuda

class _Flags:
    def is_available(self): return True
    @contextlib.contextmanager
    def flags(self, **kw):
        yield
backends = types.SimpleNamespace(cudnn=_Flags())

from . import nn  # noqa: E402 (real torch imports it too)
'''

SUBMODULES = {
    "nn/__init__.py": ("from torch import Tensor\n\n\nclass functional:\n    @staticmethod\n"
                       "    def conv2d(x, w, padding=0):\n        return Tensor(getattr(x, 'dev', None))\n"),
    "nn/parallel.py": "DistributedDataParallel = object\n",
    "distributed.py": "def init_process_group(*a, **k):\n    raise RuntimeError('fake torch: no process group')\n",
    "utils/__init__.py": "",
    "utils/data/__init__.py": "DataLoader = TensorDataset = object\n",
    "utils/data/distributed.py": "DistributedSampler = object\n",
}


def write_fake_torch(directory: Path) -> Path:
    """Write the package under ``directory`` (put it first on PYTHONPATH) and return ``directory``."""
    pkg = directory / "torch"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(INIT)
    for rel, text in SUBMODULES.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return directory
