"""Pure parts of building: secrets, the classic-builder transform, inputs hash, probe checks, doctor."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from builder.engine import to_classic
from builder.host import doctor
from builder.imaging import buildenv, inputs, probe
from builder.matrix import ImageSpec
from builder.render import dockerfile
from tests.support import MID, small_matrix
from tests.support import cell as cell_named

PEM = b"-----BEGIN CERTIFICATE-----\nTUFSS0VS\n-----END CERTIFICATE-----\n"


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory) -> ImageSpec:
    return cell_named(small_matrix(tmp_path_factory.mktemp("matrix")), MID)


def test_detect_ca_and_env(tmp_path: Path) -> None:
    d = tmp_path / "cas"
    d.mkdir()
    (d / "corp.crt").write_bytes(PEM)
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(PEM)
    env = buildenv.detect({"SSL_CERT_FILE": str(bundle), "PIP_INDEX_URL": "https://u:p@mirror/simple",
                           "https_proxy": "http://proxy:3128", "UNRELATED": "x"}, ca_dirs=[d])
    assert env.ca_files == (d / "corp.crt", bundle)
    assert dict(env.env) == {"PIP_INDEX_URL": "https://u:p@mirror/simple", "HTTPS_PROXY": "http://proxy:3128"}
    assert all("u:p" not in line for line in env.describe())


def test_ca_cert_flag_validated(tmp_path: Path) -> None:
    with pytest.raises(buildenv.BuildEnvError, match="no such file"):
        buildenv.detect({}, [tmp_path / "missing.pem"], ca_dirs=[])
    bad = tmp_path / "bad.pem"
    bad.write_text("hello")
    with pytest.raises(buildenv.BuildEnvError, match="no PEM certificate"):
        buildenv.detect({}, [bad], ca_dirs=[])


def test_env_script_quotes_values() -> None:
    env = buildenv.BuildEnv((), (("PIP_INDEX_URL", "https://u:p'x@h/simple"), ("HTTPS_PROXY", "http://p:1")))
    script = buildenv.env_script(env)
    assert "export PIP_INDEX_URL='https://u:p'\"'\"'x@h/simple'" in script
    assert "export https_proxy=http://p:1" in script
    assert "PIP_CERT" not in script


def test_bundle_dedupes(tmp_path: Path) -> None:
    a = tmp_path / "a.pem"
    a.write_bytes(PEM + PEM)
    env = buildenv.BuildEnv((a,), ())
    assert buildenv.bundle(env, [a]).count(b"BEGIN CERTIFICATE") == 1


def test_secret_files_are_private_and_removed() -> None:
    env = buildenv.BuildEnv((), (("PIP_TRUSTED_HOST", "h"),))
    with buildenv.secret_files(env) as files:
        assert set(files) == {"build-env"}
        assert oct(files["build-env"].stat().st_mode & 0o777) == "0o600"
        kept = files["build-env"]
    assert not kept.exists()


def test_to_classic_strips_mounts_and_empties_caches(cell: ImageSpec) -> None:
    text = to_classic(dockerfile.render(cell))
    assert "--mount" not in text
    assert "rm -rf /var/cache/apt/* /var/lib/apt/lists/*" in text
    # Every RUN line still continues properly.
    for line in text.splitlines():
        assert not line.startswith("    if [ -f")


def test_inputs_hash_tracks_every_input(cell: ImageSpec, tmp_path: Path) -> None:
    (tmp_path / "entrypoint").mkdir()
    (tmp_path / "smoke_tests").mkdir()
    f = tmp_path / "entrypoint" / "start.sh"
    f.write_text("echo hi\n")
    files = inputs.context_files(tmp_path)
    h = inputs.inputs_hash("FROM x", files, "sha256:base", tmp_path)
    # The same tree elsewhere (another checkout) hashes the same: only relative paths count.
    elsewhere = tmp_path / "elsewhere" / "checkout"
    shutil.copytree(tmp_path / "entrypoint", elsewhere / "entrypoint")
    shutil.copytree(tmp_path / "smoke_tests", elsewhere / "smoke_tests")
    assert inputs.inputs_hash("FROM x", inputs.context_files(elsewhere), "sha256:base", elsewhere) == h
    assert h != inputs.inputs_hash("FROM y", files, "sha256:base", tmp_path)
    assert h != inputs.inputs_hash("FROM x", files, "sha256:other", tmp_path)
    f.write_text("echo bye\n")
    assert h != inputs.inputs_hash("FROM x", files, "sha256:base", tmp_path)
    f.write_text("echo hi\n")
    os.chmod(f, 0o755)
    assert h != inputs.inputs_hash("FROM x", files, "sha256:base", tmp_path)
    (tmp_path / "smoke_tests" / "__pycache__").mkdir()
    (tmp_path / "smoke_tests" / "__pycache__" / "x.pyc").write_bytes(b"junk")
    assert inputs.context_files(tmp_path) == files


def test_check_probe(cell: ImageSpec) -> None:
    good: dict[str, object] = {"torch": "2.7.0", "torchvision": "0.22.0", "cuda": "12.6", "cudnn": "9.5.1.17", "nccl": "2.26.2",
            "python": "3.11"}
    assert probe.check_probe(cell, good) == []
    bad = {**good, "torchvision": "0.21.0"}
    (msg,) = probe.check_probe(cell, bad)
    assert "torchvision" in msg and "0.21.0" in msg


def test_doctor_cells_without_gpu(cell: ImageSpec) -> None:
    (f,) = doctor.cell_findings([cell], [], "nvidia-smi not found")
    assert f.level == "warn" and "no GPU here" in f.what and "525.60.13" in f.fix


def test_doctor_old_driver(cell: ImageSpec) -> None:
    (f,) = doctor.cell_findings([cell], [doctor.Gpu("H100", "470.82.01")], "")
    assert f.level == "fail" and "older than 525.60.13" in f.what
    (g,) = doctor.cell_findings([cell], [doctor.Gpu("H100", "550.54.15")], "")
    assert g.level == "ok"


def test_doctor_disk() -> None:
    assert doctor.disk_finding(100 * doctor.GB, 3).level == "ok"
    assert doctor.disk_finding(5 * doctor.GB, 3).level == "fail"


def test_check_probe_fails_on_an_arch_list_the_compat_data_does_not_match(cell: ImageSpec) -> None:
    """The image's ENV (PTMG_CUDA_ARCH_LIST) and its selftest expect the compat data's list: a
    wheel with another list must fail the build, not the user's selftest."""
    good: dict[str, object] = {"torch": "2.7.0", "torchvision": "0.22.0", "cuda": "12.6", "cudnn": "9.5.1.17",
                               "nccl": "2.26.2", "python": "3.11", "arch_list": list(cell.arch_list)}
    assert probe.check_probe(cell, good) == []
    (msg,) = probe.check_probe(cell, {**good, "arch_list": [*cell.arch_list, "compute_90"]})
    assert "cuda arch list" in msg and "extra ['compute_90']" in msg and "compat_data.yaml" in msg
    (msg,) = probe.check_probe(cell, {**good, "arch_list": list(cell.arch_list[1:])})
    assert f"missing [{cell.arch_list[0]!r}]" in msg
