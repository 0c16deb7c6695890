"""smoke_tests/smokelib.py without Docker or torch, as every image ships it: expectations from the
environment then the image's labels, version matching and decoding, and the GPU architectures
an arch list covers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import smoke_module

ROOT = Path(__file__).resolve().parents[3]
SMOKE_DIR = ROOT / "smoke_tests"



lib = smoke_module("smokelib")


# --- expectations and versions ---------------------------------------------------


def test_expectations_from_env_then_labels() -> None:
    env = {"PTMG_TORCH": "2.7.0", "PTMG_NCCL": "", "PTMG_CUDA": "12.6", "HOME": "/x"}
    labels = {"io.pt-multi-gpu.cuda": "12.8", "io.pt-multi-gpu.cell": "c", "org.opencontainers.image.version": "1",
              "cudnn": "9.5.1.17", "PTMG_PYTHON": "3.11", "io.pt-multi-gpu.nccl": ""}
    got = lib.load_expectations(env, labels)
    assert got == {"torch": "2.7.0", "cuda": "12.8", "cudnn": "9.5.1.17", "python": "3.11"}
    assert "nccl" not in got  # empty means unknown: the check skips, it never passes


@pytest.mark.parametrize(("expected", "actual", "ok"), [
    ("2.7.0", "2.7.0+cu126", True),
    ("2.7.0", "2.7.1+cu126", False),
    ("2.7.0+cu126", "2.7.0+cu126", True),
    ("2.7.0+cu126", "2.7.0+cu128", False),
    ("0.22.0", "0.22.0", True),
    ("2.13.0", "2.13.0+cpu", True),
])
def test_pin_matches(expected: str, actual: str, ok: bool) -> None:
    assert lib.pin_matches(expected, actual) is ok


@pytest.mark.parametrize(("expected", "actual", "min_parts", "ok"), [
    ("12.6.3", "12.6", 2, True),
    ("12.6", "12.4", 2, False),
    ("12", "12.4", 2, False),   # too vague to pass
    ("9.5.1.17", "9.5.1", 1, True),
    ("9.5.1.17", "9.5.0", 1, False),
    ("9", "9.5.1", 1, True),
    ("2.26.2", "2.26.2.post1", 2, True),
    ("3.11", "3.11", 2, True),
    ("3.11", "3.13", 2, False),
])
def test_prefix_matches(expected: str, actual: str, min_parts: int, ok: bool) -> None:
    assert lib.prefix_matches(expected, actual, min_parts) is ok


def test_prefix_matches_needs_major_and_minor_unless_told() -> None:
    # the checks of Python, CUDA and NCCL versions call it with the default
    assert lib.prefix_matches("12.6", "12.6.3")
    assert not lib.prefix_matches("12", "12.4")


def test_smokelib_finds_the_contract_one_level_up_as_in_the_image() -> None:
    """In the image nothing puts the contract on sys.path: smokelib finds ptmg_contract.py beside
    its own folder. (-I -S: neither this checkout's PYTHONPATH nor the virtualenv's site-packages.)"""
    code = (f"import sys; sys.path.insert(0, {str(SMOKE_DIR)!r}); import smokelib; "
            "print(smokelib.contract.__file__)")
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=30,
                          check=False, cwd=SMOKE_DIR)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == ROOT / "ptmg_contract.py"


def test_version_tuple_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="not a version"):
        lib.version_tuple("cpu")


@pytest.mark.parametrize(("raw", "want"), [
    (90501, (9, 5, 1)), (92400, (9, 24, 0)), (91002, (9, 10, 2)), (8500, (8, 5, 0)), (8902, (8, 9, 2)),
    (7605, (7, 6, 5)),
    (90000, (9, 0, 0)),    # cuDNN 9.0.0: the first number of the major*10000 scheme
    (8005, (8, 0, 5)),     # cuDNN 8.0.5: the patch below the major
    (99999, (9, 99, 99)),  # each scheme's largest minor and patch
    (8999, (8, 9, 99)),
])
def test_decode_cudnn(raw: int, want: tuple[int, int, int]) -> None:
    assert lib.decode_cudnn(raw) == want


@pytest.mark.parametrize(("raw", "want"), [
    ((2, 26, 2), (2, 26, 2)), ([2, 14, 3], (2, 14, 3)), (21403, (2, 14, 3)), (2708, (2, 7, 8)), (23007, (2, 30, 7)),
    (2803, (2, 8, 3)),     # NCCL 2.8.3, the last minor of the major*1000 scheme: the patch below the minor
    (2000, (2, 0, 0)),     # the old scheme's first and last numbers for NCCL 2
    (2899, (2, 8, 99)),
    (20906, (2, 9, 6)),    # NCCL 2.9.6: from 2.9 on, the major*10000 scheme
    (29999, (2, 99, 99)),  # the new scheme's largest minor and patch
    (30000, (3, 0, 0)),    # a new major: NCCL's macro encodes 3.0.0 as 30000
])
def test_decode_nccl(raw: Any, want: tuple[int, ...]) -> None:
    assert lib.decode_nccl(raw) == want


@pytest.mark.parametrize(("raw", "want"), [
    ("13000", (13, 0)), (12060, (12, 6)), ("11070", (11, 7)), ("12.6", (12, 6)), (None, None), ("", None),
    (12090, (12, 9)),      # CUDA 12.9: the largest one-digit minor
    (12990, (12, 99)),     # CUDA_VERSION's largest minor
    (0, None), ("0", None),  # no CUDA
    ("12.", (12, 0)),      # a dotted text with the major alone
])
def test_decode_torchvision_cuda(raw: Any, want: tuple[int, int] | None) -> None:
    assert lib.decode_torchvision_cuda(raw) == want


# --- GPU architectures -----------------------------------------------------------


@pytest.mark.parametrize(("archs", "cap", "ok"), [
    (["sm_80"], (8, 6), True),          # same major, newer minor: the cubin runs
    (["sm_86"], (8, 0), False),         # a newer minor's cubin does not run on an older GPU
    (["sm_75", "sm_80"], (9, 0), False),  # no sm_9x cubin and no PTX
    (["sm_80", "compute_80"], (9, 0), True),  # PTX JIT-compiles forward
    (["compute_90"], (8, 6), False),    # PTX does not run backwards
    (["sm_90a"], (9, 0), True),
    (["sm_90a"], (10, 0), False),       # arch-specific: exactly 9.0 only
    (["sm_100f"], (10, 3), False),
    (["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"], (8, 9), True),
    (["sm_37", "sm_50"], (12, 0), False),
    ([], (8, 0), False),
    (["garbage"], (8, 0), False),
    (["sm_90"], (9, 0), True),          # the cubin's own capability
    (["sm_120"], (12, 0), True),        # a two-digit major
    (["sm_120"], (1, 2), False),
    (["compute_90"], (9, 0), True),     # PTX for exactly this capability
    (["garbage", "sm_80"], (8, 0), True),  # an entry it cannot read does not end the search
])
def test_arch_covers(archs: list[str], cap: tuple[int, int], ok: bool) -> None:
    assert lib.arch_covers(archs, cap) is ok


def test_split_arch_list() -> None:
    assert lib.split_arch_list(" sm_50 sm_60;sm_90,compute_90 ") == ["sm_50", "sm_60", "sm_90", "compute_90"]


