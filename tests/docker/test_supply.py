"""Locked installs with a real engine: the locked install refuses a tampered wheel (uv's hash check inside a RUN,
and the host store before any build), the SBOM in the image validates as CycloneDX and lists what it
must, `build.py lock --check` and `build.py diff` on the real images.

The tamper builds use a tiny lock (six) and the same install RUN text the cell Dockerfiles get
(dockerfile/_uv-install.j2), on top of the cell image: seconds, not the torch set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import ptmg_contract as contract
from builder.common.paths import template_dir
from builder.common.templates import environment
from builder.engine import Engine
from builder.lock import model, uvbin, wheelserver
from builder.lock.model import Package
from builder.lock.store import STORE_ENV, Store, default_store
from builder.matrix import load_matrix
from builder.render.dockerfile import SOURCE_DATE_EPOCH, stage_paths

from . import cellimage, sessions
from .cellimage import BuiltCell

ROOT = Path(__file__).resolve().parents[2]
DOCKER = "/usr/bin/docker"
RUNTIME_OLD, RUNTIME_NEW, DEVEL = ("2.7.0-cuda12.6-cudnn9-runtime", "2.14.1-cuda13.0-cudnn9-runtime",
                                   "2.14.1-cuda13.0-cudnn9-devel")


def _run(argv: list[str], timeout: float = 900, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout, cwd=ROOT,  # type: ignore[call-overload,no-any-return]
                          **kw)


def _six() -> Package:
    lock = model.read(model.lock_path(ROOT, RUNTIME_OLD))
    six = lock.package("six")
    assert six is not None, "the 2.7.0 lock has six (python-dateutil needs it)"
    return six


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A build context like a staged cell's, with a one-wheel tools layer (six) and the real static uv."""
    ctx = tmp_path_factory.mktemp("tiny-ctx")
    store = Store(default_store())
    six, uv = _six(), uvbin.host_wheel(ROOT)
    store.ensure([six.wheel, uv])
    (ctx / "wheelhouse" / "tools").mkdir(parents=True)
    shutil.copy(store.file(six.wheel), ctx / "wheelhouse" / "tools" / six.wheel.filename)
    (ctx / "wheelhouse" / "tools.txt").write_text(model.requirements_txt([six]))
    (ctx / "wheelhouse" / "uv").write_bytes(uvbin.binary(store.file(uv)))
    (ctx / "wheelhouse" / "uv").chmod(0o755)
    (ctx / "imagebuild").mkdir()
    shutil.copy(ROOT / "imagebuild" / "slim-venv.sh", ctx / "imagebuild" / "slim-venv.sh")
    return ctx


def tiny_dockerfile(base: str) -> str:
    """FROM the cell image, a fresh venv, then the cell Dockerfiles' own install RUN for the tools layer."""
    c = SimpleNamespace(**{k: getattr(contract, k) for k in dir(contract) if k.isupper()})
    c.VENV, c.VENV_PYTHON = "/tmp/v", "/tmp/v/bin/python"
    macros = environment(template_dir("render")).get_template("dockerfile/_uv-install.j2").make_module(
        {"c": c, "stage": stage_paths(), "source_date_epoch": SOURCE_DATE_EPOCH, "native_python": None})
    mounts, install = getattr(macros, "mounts"), getattr(macros, "install")  # noqa: B009 - Jinja macros
    return (f"FROM {base}\nRUN python3 -m venv --without-pip /tmp/v\n" + str(mounts("tools")) + str(install("tools"))
            + " \\\n && /tmp/v/bin/python -c 'import six; print(\"six\", six.__version__)'\n")


@pytest.fixture(scope="module")
def base_image() -> str:
    ref = f"pt-multi-gpu:{RUNTIME_OLD}"
    if _run([DOCKER, "image", "inspect", ref]).returncode != 0:
        pytest.fail(f"{ref} is not built here: `build.py build --only {RUNTIME_OLD}` first", pytrace=False)
    return ref


@pytest.fixture
def build_tiny(tiny: Path, base_image: str, session_labels: dict[str, str]) -> Iterator[object]:
    tags: list[str] = []

    def build(ctx: Path, server: Path | None = None) -> subprocess.CompletedProcess[str]:
        """``server``: the wheel server's secret file (its URL), passed as `build.py build` passes it."""
        tag = f"ptmg-supply-test:{uuid.uuid4().hex[:10]}"
        tags.append(tag)
        (ctx / "Dockerfile").write_text(tiny_dockerfile(base_image))
        labels = sessions.label_flags(session_labels)
        secret = ["--secret", f"id={wheelserver.SECRET_ID},src={server}"] if server else []
        return _run([DOCKER, "build", "--progress=plain", "--no-cache", "--pull=false", "-t", tag, *labels, *secret,
                     str(ctx)], env={**os.environ, "DOCKER_BUILDKIT": "1"})

    yield build
    for tag in tags:
        _run([DOCKER, "image", "rm", "-f", tag])


def tamper(wheel: Path) -> None:
    """Rewrite a wheel with one line added to its code: a valid zip, the same name, another hash."""
    with zipfile.ZipFile(wheel) as zf:
        members = {i.filename: zf.read(i) for i in zf.infolist()}
    members["six.py"] += b"\nprint('TAMPERED six')\n"
    wheel.unlink()
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def _copy(tiny: Path, dest: Path) -> Path:
    shutil.copytree(tiny, dest)
    return dest


def test_the_locked_install_works_and_refuses_a_planted_wheel(tiny: Path, build_tiny: object,
                                                              tmp_path: Path) -> None:
    build = build_tiny
    good = build(_copy(tiny, tmp_path / "good"))  # type: ignore[operator]
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
    assert "six 1.17.0" in good.stdout + good.stderr

    planted = _copy(tiny, tmp_path / "planted")
    wheel = next((planted / "wheelhouse" / "tools").glob("six-*.whl"))
    tamper(wheel)  # the same name, a valid wheel, another file
    bad = build(planted)  # type: ignore[operator]
    out = bad.stdout + bad.stderr
    assert bad.returncode != 0
    assert "Hash mismatch for `six==1.17.0`" in out and f"sha256:{_six().wheel.sha256}" in out, out[-3000:]
    assert "Computed:" in out


@pytest.mark.parametrize("planted", [False, True], ids=["locked", "planted"])
def test_from_the_wheel_server_the_install_works_and_refuses_a_planted_wheel(tiny: Path, build_tiny: object,
                                                                            tmp_path: Path, planted: bool,
                                                                            docker_client: Any) -> None:
    """The same RUN with the wheel-server secret and an empty wheel folder (what a buildx build gets):
    uv takes six from builder.lock.wheelserver on the engine's bridge address, where a build's RUNs
    reach the host without --network host, and still refuses a file that is not the locked one."""
    # The address a build uses, derived as the engine does: a fresh engine's bridge names only its subnet
    # ("Config": [{"Subnet": "172.17.0.0/16"}], no Gateway) while docker0 holds 172.17.0.1.
    gateway = Engine(docker_client).bridge_gateway()
    assert gateway, "the engine has no default bridge"
    assert wheelserver.bindable(gateway), f"the bridge address {gateway} is not one of this host's"
    ctx = _copy(tiny, tmp_path / "ctx")
    wheel = next((ctx / "wheelhouse" / "tools").glob("six-*.whl"))
    store = tmp_path / "store"
    store.mkdir()
    wheel.rename(store / wheel.name)  # the context keeps no wheel
    if planted:
        tamper(store / wheel.name)
    with wheelserver.serve(store, {"tools": [wheel.name]}, gateway) as server:
        server.ready(wheel.name)
        r = build_tiny(ctx, server.secret)  # type: ignore[operator]
        taken = server.served[0]
    out = r.stdout + r.stderr
    assert taken >= 1, f"the RUN did not take six from the server at {gateway}:\n{out[-3000:]}"
    if planted:
        assert r.returncode != 0 and "Hash mismatch for `six==1.17.0`" in out, out[-3000:]
    else:
        assert r.returncode == 0 and "six 1.17.0" in out, out[-3000:]


def test_a_changed_file_on_the_index_fails_the_install(tiny: Path, build_tiny: object, tmp_path: Path) -> None:
    """A lock whose hash no longer matches the file (what a re-upload on an index looks like)."""
    ctx = _copy(tiny, tmp_path / "index")
    req = ctx / "wheelhouse" / "tools.txt"
    sha = _six().wheel.sha256
    req.write_text(req.read_text().replace(sha, sha[:-1] + ("0" if sha[-1] != "0" else "1")))
    bad = build_tiny(ctx)  # type: ignore[operator]
    out = bad.stdout + bad.stderr
    assert bad.returncode != 0 and "Hash mismatch for `six==1.17.0`" in out, out[-3000:]
    assert "Building six" not in out  # --only-binary: no fall-back to the sdist


def test_a_planted_wheel_in_the_store_fails_build_py_and_tags_nothing(tmp_path: Path, base_image: str) -> None:
    before = _run([DOCKER, "image", "inspect", "-f", "{{.Id}}", base_image]).stdout.strip()
    store = tmp_path / "store"
    store.mkdir()
    six = _six()
    shutil.copy(Store(default_store()).file(six.wheel), store / six.wheel.filename)
    tamper(store / six.wheel.filename)
    r = _run([sys.executable, "build.py", "build", "--only", RUNTIME_OLD, "--force"],
             env={**os.environ, STORE_ENV: str(store)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "hash mismatch in the wheel store" in r.stderr and six.wheel.filename in r.stderr
    assert f"Expected: sha256:{six.wheel.sha256}" in r.stderr
    assert _run([DOCKER, "image", "inspect", "-f", "{{.Id}}", base_image]).stdout.strip() == before


def test_lock_check_passes_on_the_committed_locks() -> None:
    r = _run([sys.executable, "build.py", "lock", "--check"])
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_sbom_in_the_image_is_cyclonedx_and_lists_everything(built_cell: BuiltCell) -> None:
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    labels = json.loads(_run([DOCKER, "image", "inspect", "-f", "{{json .Config.Labels}}", built_cell.ref]).stdout)
    assert labels[contract.LABEL_SBOM] == contract.SBOM_FILE
    r = _run([DOCKER, "run", "--rm", "--label", "project=pt-multi-gpu", built_cell.ref, "cat", contract.SBOM_FILE])
    assert r.returncode == 0, r.stderr
    assert JsonStrictValidator(SchemaVersion.V1_5).validate_str(r.stdout) is None
    bom = json.loads(r.stdout)
    comps = {(c["purl"].split(":", 1)[1].split("/")[0], c["name"]): c for c in bom["components"]}
    lock = model.read(model.lock_path(ROOT, built_cell.cell))
    for p in lock.packages:  # every distribution, at the locked version, with the lock's hash
        c = comps[("pypi", p.name)]
        assert c["version"] == p.version and c["hashes"] == [{"alg": "SHA-256", "content": p.wheel.sha256}]
    assert {n for kind, n in comps if kind == "pypi"} == {p.name for p in lock.packages}  # nothing unlocked
    assert any(n.startswith("nvidia-") for kind, n in comps if kind == "pypi")
    ssh = comps[("deb", "openssh-server")]
    assert ssh["version"] and ssh["purl"].startswith("pkg:deb/debian/openssh-server@")
    props = {x["name"]: x["value"] for x in bom["metadata"]["component"]["properties"]}
    for key in ("torch", "cuda", "cudnn", "nccl"):
        assert props[contract.label(key)] == labels[contract.label(key)], key
    again = _run([sys.executable, "build.py", "sbom", built_cell.ref])
    assert again.returncode == 0 and json.loads(again.stdout) == bom


@pytest.fixture(scope="module")
def default_images() -> dict[str, str]:
    """The real default images diff is shown on (built here when missing or stale: skip-unchanged)."""
    cells = {c.name: c.ref for c in load_matrix(ROOT / "images.yaml").cells}
    wanted = [RUNTIME_OLD, RUNTIME_NEW, DEVEL]
    cellimage.wait_for_native_cells()
    r = _run([sys.executable, "build.py", "build", *[a for n in wanted for a in ("--only", n)]], timeout=7200)
    assert r.returncode == 0, r.stderr[-3000:]
    return {n: cells[n] for n in wanted}


def test_diff_names_the_torch_and_cuda_wheel_changes(default_images: dict[str, str]) -> None:
    r = _run([sys.executable, "build.py", "diff", RUNTIME_OLD, RUNTIME_NEW, "--json"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    changed = {x["name"]: (x["a"], x["b"]) for x in d["python"]["changed"]}
    assert changed["torch"] == ("2.7.0", "2.14.1") and changed["torchvision"] == ("0.22.0", "0.29.1")
    assert {"nvidia-cudnn-cu12", "nvidia-nccl-cu12"} <= {x["name"] for x in d["python"]["removed"]}
    assert {"nvidia-cudnn-cu13", "nvidia-nccl-cu13"} <= {x["name"] for x in d["python"]["added"]}
    assert d["labels"]["changed"][contract.label("cuda")] == ["12.6", "13.0"]
    assert d["directories"] and d["layers"]["a"] and d["layers"]["b"]
    text = _run([sys.executable, "build.py", "diff", RUNTIME_OLD, RUNTIME_NEW])
    assert "changed  torch" in text.stdout and "2.7.0 -> 2.14.1" in text.stdout


def test_diff_of_a_runtime_and_its_devel(default_images: dict[str, str]) -> None:
    r = _run([sys.executable, "build.py", "diff", RUNTIME_NEW, DEVEL, "--json"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["python"]["changed"] == [] and d["python"]["removed"] == []
    assert {"nvidia-cuda-nvcc", "ninja"} <= {x["name"] for x in d["python"]["added"]}
    assert {"build-essential", "git"} <= {x["name"] for x in d["debian"]["added"]}
    shared = 5  # base, OS, user, torch, tools: the devel cell builds on its runtime cell's layers
    assert [x["size"] for x in d["layers"]["a"][:shared]] == [x["size"] for x in d["layers"]["b"][:shared]]
