"""Unit tests for builder/matrix/compat*.py and builder/matrix/compat_data.yaml (no Docker, no network)."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from builder.matrix.compat import DATA_FILE, Compat, CompatDataError, CudaVariant, TorchRelease
from builder.matrix.compat_load import load_compat

ALL_RELEASES = [
    "2.0.0", "2.0.1",
    "2.1.0", "2.1.1", "2.1.2",
    "2.2.0", "2.2.1", "2.2.2",
    "2.3.0", "2.3.1",
    "2.4.0", "2.4.1",
    "2.5.0", "2.5.1",
    "2.6.0",
    "2.7.0", "2.7.1",
    "2.8.0",
    "2.9.0", "2.9.1",
    "2.10.0",
    "2.11.0",
    "2.12.0", "2.12.1",
    "2.13.0",
    "2.14.0", "2.14.1",
    "2.15.0",
]  # fmt: skip


@pytest.fixture(scope="module")
def compat() -> Compat:
    return load_compat()


def _vt(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


# --- coverage -------------------------------------------------------------------


def test_every_patch_release_present_in_order(compat: Compat) -> None:
    assert list(compat.releases) == ALL_RELEASES


def test_load_is_cached() -> None:
    assert load_compat() is load_compat()
    assert load_compat(DATA_FILE) is load_compat()


# --- the three reference cells -----------------------------------------------------

# (torch, expected PyPI-default variant); cuDNN/NCCL verified against the PyPI wheels' Requires-Dist.
ARCH_KEPLER_TO_AMPERE = ("sm_37", "sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86")
ARCH_MAXWELL_TO_HOPPER = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
ARCH_TURING_TO_BLACKWELL = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
ARCH_AARCH64_2_14 = ("sm_80", "sm_90", "sm_100", "sm_110", "sm_120")
CELLS = [
    ("2.0.1", CudaVariant("11.7", "11.7.0", "8.5.0.96", 8, "2.14.3", "pypi",
                          ARCH_KEPLER_TO_AMPERE, (), "450.80.02", "515.43.04")),
    ("2.7.0", CudaVariant("12.6", "12.6.3", "9.5.1.17", 9, "2.26.2", "pypi",
                          ARCH_MAXWELL_TO_HOPPER, (), "525.60.13", "560.35.05")),
    ("2.14.1", CudaVariant("13.0", "13.0.2", "9.24.0.43", 9, "2.30.7", "pypi",
                           ARCH_TURING_TO_BLACKWELL, ARCH_AARCH64_2_14, "580", "580.95.05")),
]  # fmt: skip


@pytest.mark.parametrize(("torch", "expected"), CELLS, ids=[f"{t}-cu{v.cuda}" for t, v in CELLS])
def test_reference_cells(compat: Compat, torch: str, expected: CudaVariant) -> None:
    rel = compat.release(torch)
    assert rel is not None
    assert rel.default_cuda == expected.cuda
    v = rel.variants[expected.cuda]
    assert v == expected
    assert v.from_pypi
    assert v.index_url is None
    assert rel.default_variant is v


def test_2_0_1(compat: Compat) -> None:
    rel = compat.release("2.0.1")
    assert rel is not None
    assert rel.python == ("3.8", "3.9", "3.10", "3.11")
    assert (rel.torchvision, rel.torchaudio) == ("0.15.2", "2.0.2")
    assert rel.neighbours == ("numpy<2", "setuptools<82")
    assert list(rel.variants) == ["11.7", "11.8"]
    assert "12.6" not in rel.variants
    assert rel.variants.get("12.6") is None
    cu118 = rel.variants["11.8"]
    assert cu118.source == "https://download.pytorch.org/whl/cu118"
    assert cu118.index_url == cu118.source
    assert not cu118.from_pypi
    assert (cu118.cudnn, cu118.nccl, cu118.cuda_full) == ("8.7.0.84", "2.15.5", "11.8.0")
    assert rel.variants["11.7"].arch_list == ARCH_KEPLER_TO_AMPERE
    assert cu118.arch_list[-1] == "sm_90"


def test_2_0_0_pairs_with_pip_torchvision(compat: Compat) -> None:
    rel = compat.release("2.0.0")
    assert rel is not None
    # torchvision 0.15.0 pins torch==2.0.0+cu117 on PyPI; 0.15.1 is the pip pairing.
    assert (rel.torchvision, rel.torchaudio) == ("0.15.1", "2.0.1")


def test_2_7_0(compat: Compat) -> None:
    rel = compat.release("2.7.0")
    assert rel is not None
    assert rel.python == ("3.9", "3.10", "3.11", "3.12", "3.13")
    assert (rel.torchvision, rel.torchaudio, rel.neighbours) == ("0.22.0", "2.7.0", ())
    assert list(rel.variants) == ["11.8", "12.6", "12.8"]
    assert rel.variants["12.6"].arch_list == ARCH_MAXWELL_TO_HOPPER
    cu128 = rel.variants["12.8"]
    assert cu128.arch_list == (*ARCH_TURING_TO_BLACKWELL, "compute_120")
    assert cu128.nccl is None  # unconfirmed
    assert cu128.min_driver_full == "570.26"


def test_2_14_1_and_2_15_0(compat: Compat) -> None:
    rel = compat.release("2.14.1")
    assert rel is not None
    assert rel.python == ("3.10", "3.11", "3.12", "3.13", "3.14")
    assert (rel.torchvision, rel.torchaudio) == ("0.29.1", None)
    assert list(rel.variants) == ["12.6", "13.0", "13.2"]
    assert rel.variants["13.2"].min_driver_full == "595.58.03"
    new = compat.release("2.15.0")
    assert new is not None
    assert new.python[0] == "3.11"
    assert new.torchvision is None
    assert new.default_cuda == "13.2"
    assert new.default_variant.cudnn == "9.26.0.51"
    assert new.default_variant.cuda_full == "13.2.2"


def test_2_11_uses_pypi_cudnn_not_release_md(compat: Compat) -> None:
    rel = compat.release("2.11.0")
    assert rel is not None
    assert rel.default_cuda == "13.0"
    assert rel.variants["13.0"].cudnn == "9.19.0.56"  # RELEASE.md says 9.17.1.4
    assert rel.variants["12.8"].cudnn == "9.17.1.4"


# --- min driver --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("torch", "cuda", "floor"),
    [("2.0.1", "11.7", "450.80.02"), ("2.7.0", "12.6", "525.60.13"), ("2.14.1", "13.0", "580")],
)
def test_min_driver_is_minor_compat_floor(compat: Compat, torch: str, cuda: str, floor: str) -> None:
    rel = compat.release(torch)
    assert rel is not None
    v = rel.variants[cuda]
    assert v.min_driver == floor
    assert _vt(v.min_driver_full) >= _vt(v.min_driver)


def test_min_driver_consistent_per_cuda_major(compat: Compat) -> None:
    floors = {"11": "450.80.02", "12": "525.60.13", "13": "580"}
    for rel in compat.releases.values():
        for v in rel.variants.values():
            assert v.min_driver == floors[v.cuda.split(".")[0]], (rel.version, v.cuda)


# --- whole-data invariants ------------------------------------------------------------


def test_invariants(compat: Compat) -> None:
    for version, rel in compat.releases.items():
        assert rel.version == version
        assert rel.default_cuda in rel.variants
        assert [c for c, v in rel.variants.items() if v.from_pypi] == [rel.default_cuda]
        assert list(rel.variants) == sorted(rel.variants, key=_vt)
        assert rel.python == tuple(sorted(rel.python, key=_vt))
        for cuda, v in rel.variants.items():
            assert v.cuda == cuda
            assert v.cuda_full.startswith(cuda + ".")
            assert v.cudnn_major == int(v.cudnn.split(".")[0])
            assert v.from_pypi or v.source == f"https://download.pytorch.org/whl/cu{cuda.replace('.', '')}"
            assert all(re.fullmatch(r"(sm|compute)_\d+", a) for a in v.arch_list)


def test_neighbour_limits(compat: Compat) -> None:
    """NumPy 1.x before 2.3; setuptools with pkg_resources where cpp_extension imports it (< 2.2)."""
    for version, rel in compat.releases.items():
        want = {"numpy<2"} if _vt(version) < (2, 3) else set()
        if _vt(version) < (2, 2):
            want.add("setuptools<82")
        assert set(rel.neighbours) == want, version


def test_cudnn_major_switches_at_2_4(compat: Compat) -> None:
    for version, rel in compat.releases.items():
        majors = {v.cudnn_major for v in rel.variants.values()}
        assert majors == ({8} if _vt(version) < (2, 4) else {9}), version


# --- lookups ---------------------------------------------------------------------


def test_unknown_release_and_suggestions(compat: Compat) -> None:
    assert compat.release("1.13.1") is None
    assert compat.release("2.7") is None
    assert compat.closest_torch("2.7") == ["2.7.1", "2.7.0"]
    assert compat.closest_torch("2.7.0+cu126")[0] == "2.7.0"
    near = compat.closest_torch("2.7.5")
    assert near and near[0] in {"2.7.0", "2.7.1"}
    assert "2.10.0" not in compat.closest_torch("2.1")
    assert compat.closest_torch("zzz") == []


def test_torch_for_torchvision(compat: Compat) -> None:
    assert compat.torch_for_torchvision("0.15.2") == "2.0.1"
    assert compat.torch_for_torchvision("0.22.0") == "2.7.0"
    assert compat.torch_for_torchvision("0.29.1") == "2.14.1"
    assert compat.torch_for_torchvision("9.9.9") is None
    for version, rel in compat.releases.items():
        if rel.torchvision is not None:
            assert compat.torch_for_torchvision(rel.torchvision) == version


# --- immutability ------------------------------------------------------------------


def test_immutability(compat: Compat) -> None:
    rel = compat.release("2.7.0")
    assert rel is not None
    v = rel.variants["12.6"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        rel.version = "9.9.9"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.cudnn = "1.2.3.4"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        compat.releases = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        rel.variants["12.6"] = v  # type: ignore[index]
    with pytest.raises(TypeError):
        compat.releases["2.7.0"] = rel  # type: ignore[index]
    with pytest.raises(AttributeError):
        rel.variants.clear()  # type: ignore[attr-defined]
    assert isinstance(rel.python, tuple)
    assert isinstance(v.arch_list, tuple)
    # Frozen all the way down, so everything is hashable and usable in sets.
    assert len({hash(compat), hash(rel), hash(v)}) == 3
    assert isinstance(rel, TorchRelease)


# --- data-file validation ---------------------------------------------------------


def _raw() -> dict[str, Any]:
    data = yaml.safe_load(DATA_FILE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return copy.deepcopy(data)  # deepcopy also unshares anchored blocks


def _write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "compat.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _errors(path: Path) -> str:
    with pytest.raises(CompatDataError) as info:
        load_compat(path)
    assert info.value.errors
    for e in info.value.errors:
        assert e.startswith(str(path.resolve())), e
    return "\n".join(info.value.errors)


def test_valid_copy_loads(tmp_path: Path) -> None:
    assert list(load_compat(_write(tmp_path, _raw())).releases) == ALL_RELEASES


def test_default_cuda_not_among_variants(tmp_path: Path) -> None:
    data = _raw()
    data["releases"]["2.7.0"]["default_cuda"] = "12.9"
    msg = _errors(_write(tmp_path, data))
    assert re.search(r"compat\.yaml:\d+: releases\['2\.7\.0'\]\.default_cuda: '12\.9' is not among its variants", msg)


def test_missing_cudnn(tmp_path: Path) -> None:
    data = _raw()
    del data["releases"]["2.7.0"]["variants"]["12.6"]["cudnn"]
    msg = _errors(_write(tmp_path, data))
    assert "releases['2.7.0'].variants['12.6']: missing key 'cudnn'" in msg


def test_unknown_key_gets_suggestion(tmp_path: Path) -> None:
    data = _raw()
    data["releases"]["2.6.0"]["torchvison"] = "0.21.0"
    msg = _errors(_write(tmp_path, data))
    assert "releases['2.6.0']: unknown key 'torchvison' (did you mean 'torchvision'?)" in msg


def test_unquoted_float_version(tmp_path: Path) -> None:
    data = _raw()
    data["releases"]["2.6.0"]["default_cuda"] = 12.4
    msg = _errors(_write(tmp_path, data))
    assert "releases['2.6.0'].default_cuda: must be a quoted string, got float 12.4 (quote it: '12.4')" in msg


def test_wrong_index_url_and_two_pypi_variants(tmp_path: Path) -> None:
    data = _raw()
    variants = data["releases"]["2.4.0"]["variants"]
    variants["11.8"]["source"] = "https://download.pytorch.org/whl/cu121"
    variants["12.4"]["source"] = "pypi"
    with pytest.raises(CompatDataError) as info:
        load_compat(_write(tmp_path, data))
    msg = "\n".join(info.value.errors)
    want_url = "'https://download.pytorch.org/whl/cu118'"
    assert f"releases['2.4.0'].variants['11.8'].source: must be 'pypi' or {want_url}" in msg
    assert "releases['2.4.0'].variants['12.4'].source: only the default_cuda variant ('12.1') comes from PyPI" in msg
    assert len(info.value.errors) >= 2  # every problem at once


def test_toolkit_without_driver_entry(tmp_path: Path) -> None:
    data = _raw()
    data["releases"]["2.8.0"]["variants"]["12.9"]["cuda_full"] = "12.9.7"
    del data["min_driver"]["cuda"]["13.2"]
    msg = _errors(_write(tmp_path, data))
    assert "releases['2.8.0'].variants['12.9'].cuda_full: toolkit 12.9.7 has no entry" in msg
    assert "releases['2.15.0'].variants['13.2']: CUDA 13.2 has no entry in min_driver.cuda" in msg


def test_bad_values(tmp_path: Path) -> None:
    data = _raw()
    rel = data["releases"]["2.9.0"]
    rel["python"] = ["3.11", "3.10"]
    rel["neighbours"] = {"numpy": "two"}
    rel["variants"]["12.6"]["cudnn"] = "9"
    rel["variants"]["12.6"]["arch_list"] = []
    rel["variants"]["12.8"]["cuda_full"] = "12.6.3"
    msg = _errors(_write(tmp_path, data))
    assert "releases['2.9.0'].python: must be ascending without duplicates" in msg
    assert "releases['2.9.0'].neighbours['numpy']: malformed value 'two'" in msg
    assert "releases['2.9.0'].variants['12.6'].cudnn: malformed value '9' (expected like '9.5.1.17')" in msg
    assert "releases['2.9.0'].variants['12.6'].arch_list: must be a non-empty list" in msg
    assert "releases['2.9.0'].variants['12.8'].cuda_full: 12.6.3 is not a CUDA 12.8 toolkit" in msg


def test_torchvision_paired_twice(tmp_path: Path) -> None:
    data = _raw()
    data["releases"]["2.7.1"]["torchvision"] = "0.22.0"
    msg = _errors(_write(tmp_path, data))
    assert "releases['2.7.1'].torchvision: 0.22.0 is already paired with torch 2.7.0" in msg


def test_error_line_points_at_the_key(tmp_path: Path) -> None:
    text = DATA_FILE.read_text(encoding="utf-8")
    lines = text.splitlines()
    # The cudnn line of 2.6.0's 12.6 variant, found from the text itself.
    start = lines.index("  '2.6.0':")
    idx = next(i for i in range(start, len(lines)) if lines[i].strip() == "cudnn: '9.5.1.17'")
    lines[idx] = lines[idx].replace("'9.5.1.17'", "'9.5'")
    path = tmp_path / "compat.yaml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    msg = _errors(path)
    assert f"compat.yaml:{idx + 1}: releases['2.6.0'].variants['12.6'].cudnn: malformed value '9.5'" in msg


def test_duplicate_key_in_text(tmp_path: Path) -> None:
    text = DATA_FILE.read_text(encoding="utf-8")
    dup = "\n".join(
        [
            "  '2.15.0':",
            "    python: ['3.11']",
            "    torchvision: null",
            "    torchaudio: null",
            "    default_cuda: '13.2'",
            "    neighbours: {}",
            "    variants: {}",
            "",
        ]
    )
    path = tmp_path / "compat.yaml"
    path.write_text(text.rstrip("\n") + "\n" + dup, encoding="utf-8")
    n_lines = len(text.rstrip("\n").splitlines())
    msg = _errors(path)
    assert f"compat.yaml:{n_lines + 1}:3: duplicate key '2.15.0'" in msg


def test_merge_override_is_not_a_duplicate() -> None:
    # 2.0.1 overrides torchvision inherited from the 2.0.0 anchor: allowed.
    assert "<<: *torch_2_0" in DATA_FILE.read_text(encoding="utf-8")
    rel = load_compat().release("2.0.1")
    assert rel is not None
    assert rel.torchvision == "0.15.2"


def test_malformed_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("releases: [unclosed\n", encoding="utf-8")
    with pytest.raises(CompatDataError, match="malformed YAML"):
        load_compat(bad)
    with pytest.raises(CompatDataError, match="file not found"):
        load_compat(tmp_path / "missing.yaml")


def test_wrong_top_level(tmp_path: Path) -> None:
    path = tmp_path / "compat.yaml"
    path.write_text("- 1\n", encoding="utf-8")
    assert "top level: must be a mapping" in _errors(path)
    path2 = tmp_path / "compat2.yaml"
    path2.write_text("releases: {}\nmin_drivers: {}\n", encoding="utf-8")
    msg = _errors(path2)
    assert "unknown key 'min_drivers' (did you mean 'min_driver'?)" in msg
    assert "missing key 'min_driver'" in msg
