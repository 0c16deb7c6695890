"""arm64 cells on an x86 host, for real: the base and the cell built under qemu emulation,
torch's CUDA in the emulated container, the emulated selftest and 2-rank gloo DDP, the doctor's
emulation line, and a publish of one tag with two platforms (a manifest list) to a real registry.

The heavy emulated steps run once per session, in the background from the session's start
(background.py; this module runs after those that use the native cells, before the Docker 28
tests): the cell is built through `build.py build` (a no-op when
its inputs are unchanged) and tested once through `build.py test`. The publish test uses
small stand-in images (one per platform, FROM scratch, no RUN: no emulation), so it takes seconds;
what it checks is the list, not torch.

Needs: qemu-user-static >= 10 registered with binfmt_misc (`scripts/ensure-tools.sh emulation`),
Debian's docker-registry. Every emulated container runs with --init and a time cap.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

import ptmg_contract as contract
from builder.engine import emulation
from builder.lock import model as lock_model
from builder.lock import uvbin
from builder.lock.store import Store, default_store
from builder.matrix import load_matrix
from builder.smoke import passes
from tests.docker import cellimage
from tests.docker.background import Job, Step
from tests.docker.registry import LocalRegistry
from tests.support import build_py

ROOT = Path(__file__).resolve().parents[2]
MATRIX = load_matrix(ROOT / "images.yaml")
ARM = next(c for c in MATRIX.cells if c.platform == "linux/arm64")
AMD = next(c for c in MATRIX.cells if c.tag == ARM.tag and c.platform == "linux/amd64")
DOCKER = "/usr/bin/docker"  # the 20.10 CLI: BuildKit with DOCKER_BUILDKIT=1, `docker manifest`


def _emulation_or_fail() -> None:
    emu = emulation.probe(ARM.platform)
    if not emu.ok:
        pytest.fail(f"{emu.describe()}; fix: {emulation.FIX}", pytrace=False)


@dataclass
class ArmWork:
    """What the background job of this module knew when it started."""

    was_there: bool  # the arm64 cell image existed before this session
    stored_before: set[str]  # the wheel store's files before
    state_dir: Path  # PTMG_STATE_DIR of its `build.py test` (the smoke records)
    junit_dir: Path
    cleaned: bool = False


def background_job(docker_client: docker.DockerClient, build_py: tuple[str, ...],
                   tmp_path_factory: pytest.TempPathFactory, log: Path) -> Job:
    """The heavy part of this module, started by conftest.py at the session's start: the arm64 cell
    built through `build.py build --platforms all` (a no-op when its inputs are unchanged), then
    tested once through `build.py test` (the emulated selftest and the 2-rank gloo DDP job)."""
    try:
        docker_client.images.get(ARM.ref)
        was_there = True
    except docker.errors.ImageNotFound:
        was_there = False
    store = Store(default_store())
    work = ArmWork(was_there, {f.name for f in store.path.glob("*.whl")}, tmp_path_factory.mktemp("arm64-state"),
                   tmp_path_factory.mktemp("arm64-junit"))
    only = ("--only", ARM.name, "--platforms", "all")
    return Job(cellimage.ARM64, [
        Step("build", (*build_py, "build", *only, "--json"), timeout=5400),
        Step("test", (*build_py, "test", *only, "--junit-dir", str(work.junit_dir), "--json"), timeout=4200,
             env={"PTMG_STATE_DIR": str(work.state_dir)}, builds=False),
    ], log, data=work)


def _job() -> tuple[Job, ArmWork]:
    job = cellimage.JOBS.get(cellimage.ARM64)
    if job is None or not isinstance(job.data, ArmWork):
        pytest.fail("the arm64 background job was not started (tests/docker/conftest.py starts it)", pytrace=False)
    return job, job.data


@pytest.fixture(scope="module")
def arm_image(docker_client: docker.DockerClient) -> Iterator[str]:
    """The arm64 cell, built in the background from the session's start.

    `make images` builds no emulated cell unless asked (PLATFORMS=all), so when this session had
    to build it, it is removed again at the end: ~6 GB a newcomer never asked for, on machines
    where the docker tier's images already take most of the disk. One that was there before
    (built by `make images PLATFORMS=all`) stays."""
    _emulation_or_fail()
    job, _ = _job()
    done = job.step("build")
    try:
        if done is None or done.returncode != 0:
            why = done.stderr[-4000:] if done else "the job ended before the build"
            pytest.fail(f"building {ARM.name} failed (exit {done.returncode if done else '-'}):\n{why}",
                        pytrace=False)
        (result,) = json.loads(done.stdout)
        print(f"\n{ARM.name}: {result['status']} in {result['seconds']:.0f} s (background, from the session's start)")
        yield ARM.ref
    finally:
        clean_up(job, docker_client)  # before the module's build-cache prune, which then frees its layers


def clean_up(job: Job, docker_client: docker.DockerClient) -> None:
    """Stop the job (a step still running ends here) and, when this session built the arm64 cell,
    remove it and the aarch64-only wheels. Once; conftest calls it too, for a session that started
    the job and never reached this module (a failure with -x, Ctrl-C)."""
    job.stop()
    work = job.data
    if not isinstance(work, ArmWork) or work.cleaned:
        return
    work.cleaned = True
    if work.was_there:
        return
    with contextlib.suppress(docker.errors.APIError):
        docker_client.images.remove(ARM.ref)
        print(f"\nremoved {ARM.ref} (built by this session; `make images PLATFORMS=all` keeps one)")
    # ... and the aarch64 wheels its build downloaded that no other cell installs (~3 GB).
    files, size = Store(default_store()).prune(work.stored_before | _wheels_of_other_cells())
    print(f"wheel store: removed {files} wheel(s) only the arm64 cell uses, {size / 1e9:.1f} GB")


def _wheels_of_other_cells() -> set[str]:
    names = {w.filename for w in uvbin.read(ROOT)[1].values()}
    for c in MATRIX.cells:
        if c.name != ARM.name:
            names |= {p.wheel.filename for p in lock_model.read(lock_model.lock_path(ROOT, c.name)).packages}
    return names


@pytest.fixture(scope="module")
def tested(arm_image: str) -> dict[str, Any]:
    """The background job's `build.py test` of the arm64 cell: its JSON report, exit status and stderr."""
    job, _ = _job()
    done = job.step("test")
    assert done is not None, "the arm64 job ended before its test step"
    assert done.stdout.strip(), f"no report (exit {done.returncode}):\n{done.stderr[-4000:]}"
    (report,) = json.loads(done.stdout)
    report["rc"], report["stderr"] = done.returncode, done.stderr
    print(f"\n{ARM.name}: build.py test {done.seconds:.0f} s (selftest {report.get('selftest_s')} s, "
          f"DDP {report['ddp']['wall_s']} s)")
    return dict(report)


def test_the_base_is_an_arm64_image(arm_image: str, docker_client: docker.DockerClient,
                                    session_labels: dict[str, str]) -> None:
    base = docker_client.images.get(ARM.base_ref)
    assert base.attrs["Architecture"] == "arm64" and ARM.base_ref == f"arm64v8/{ARM.base}"
    out = docker_client.containers.run(ARM.base_ref, ["timeout", "120", "uname", "-m"], init=True,
                                       platform=ARM.platform, remove=True, labels=session_labels)
    assert out.decode().strip() == "aarch64"


def test_the_cell_is_arm64_and_its_torch_has_the_cells_cuda(arm_image: str, tested: dict[str, Any],
                                                            docker_client: docker.DockerClient) -> None:
    image = docker_client.images.get(arm_image)
    assert image.attrs["Architecture"] == "arm64"
    assert f"{contract.ENV_CUDA}={ARM.cuda}" in image.attrs["Config"]["Env"]
    # In the emulated container the selftest compared torch.version.cuda with that: passed, not skipped.
    cases = {str(c.get("name")): c for c in ET.parse(tested["junit"]).iter("testcase")}
    case = cases.get("test_env[cuda]")
    assert case is not None, f"no test_env[cuda] in {tested['junit']}: {sorted(cases)[:20]}"
    outcome = [child.tag for child in case if child.tag in ("skipped", "failure", "error")]
    assert not outcome, f"test_env[cuda] under emulation: {outcome} {[c.get('message') for c in case]}"


def test_emulated_selftest_and_two_rank_gloo_ddp_pass(tested: dict[str, Any], docker_client: docker.DockerClient,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    assert tested["rc"] == 0 and tested["ok"], tested["stderr"][-4000:]
    assert tested["platform"] == ARM.platform and tested["emulated"].startswith(ARM.platform)
    st = tested["selftest"]
    assert st["passed"] > 0 and st["failed"] == 0 and st["errors"] == 0
    ddp = tested["ddp"]
    assert (ddp["verdict"], ddp["world_size"], ddp["result"]["backend"]) == ("passed", 2, "gloo")
    junit = Path(tested["junit"]).read_text()
    assert "under emulation" in junit  # the torchrun and torch.compile checks say why they were skipped
    _, work = _job()
    monkeypatch.setenv("PTMG_STATE_DIR", str(work.state_dir))
    record = passes.smoke_pass(ROOT, docker_client.images.get(ARM.ref).id)
    assert record is not None and record.cell == ARM.name and record.backend == "gloo"


def test_doctor_names_the_qemu_in_use() -> None:
    r = build_py("doctor", "--json", timeout=300)
    findings = json.loads(r.stdout)
    line = next(f for f in findings if f["what"].startswith("emulation: linux/arm64"))
    assert line["level"] == "ok" and "qemu 1" in line["what"], line


# --- publish: one tag, two platforms ------------------------------------------------------
def _standin(ctx: Path, spec: Any, repo: str, labels: dict[str, str]) -> str:
    """A FROM-scratch image for ``spec``'s platform with its cell labels (BuildKit, no RUN)."""
    ctx.mkdir(parents=True)
    (ctx / "blob").write_bytes(os.urandom(64 * 1024))
    lines = ["FROM scratch", "COPY blob /blob"]
    lines += [f'LABEL {k}="{v}"' for k, v in {
        **labels, "io.pt-multi-gpu.cell": spec.name, "io.pt-multi-gpu.torch": spec.torch,
        "org.opencontainers.image.created": "2026-12-01T06:00:00Z",
        "org.opencontainers.image.revision": "0123456789abcdef0123456789abcdef01234567"}.items()]
    (ctx / "Dockerfile").write_text("\n".join(lines) + "\n")
    ref = f"{repo}:{spec.name}"
    subprocess.run([DOCKER, "build", "-q", "--platform", spec.platform, "-t", ref, str(ctx)], check=True,
                   capture_output=True, env={**os.environ, "DOCKER_BUILDKIT": "1"})
    return ref


@pytest.fixture
def standins(tmp_path: Path, docker_client: docker.DockerClient,
             session_labels: dict[str, str]) -> Iterator[tuple[str, Path, dict[str, str]]]:
    """Stand-ins for both platforms of the cell under a repository of this test, a matrix naming that
    repository, and a clean environment; every local ref of the repository is removed afterwards."""
    repo = f"ptmg-arm64pub-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "images.yaml"
    config.write_text((ROOT / "images.yaml").read_text().replace("\nrepository: pt-multi-gpu\n",
                                                                  f"\nrepository: {repo}\n"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PTMG_REGISTRY")}
    env |= {"PTMG_STATE_DIR": str(tmp_path / "state"), "DOCKER_CONFIG": str(tmp_path / "docker-config"),
            # publish's vulnerability gate: the tests' offline OSV snapshot (no live source here)
            "PTMG_OSV_DIR": str(ROOT / "tests" / "fixtures" / "osv")}
    try:
        for spec in (AMD, ARM):
            _standin(tmp_path / spec.arch, spec, repo, session_labels)
        yield repo, config, env
    finally:
        for image in docker_client.images.list():
            refs = [*(image.tags or []), *(image.attrs.get("RepoDigests") or [])]
            for ref in refs:
                if f"{repo}:" in ref or f"{repo}@" in ref:
                    with contextlib.suppress(docker.errors.APIError):
                        docker_client.images.remove(ref, force=True)


def test_publish_one_tag_with_two_platforms(standins: tuple[str, Path, dict[str, str]], tmp_path: Path,
                                            docker_client: docker.DockerClient,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    repo, config, env = standins
    reg = LocalRegistry(tmp_path / "registry").start()
    try:
        def publish(tag: str) -> dict[str, Any]:
            out = tmp_path / f"report-{tag}"
            r = subprocess.run([sys.executable, str(ROOT / "build.py"), "publish", "--config", str(config),
                                "--only", AMD.name, "--only", ARM.name, "--registry", f"{reg.host}/ns",
                                "--report-dir", str(out), "--json",
                                "--allow-stale-os"],  # stand-ins FROM scratch have no OS for the OS-freshness gate to audit
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
            report = json.loads((out / "publish-report.json").read_text())
            report["rc"], report["stderr"] = r.returncode, r.stderr
            return dict(report)

        amd_id = docker_client.images.get(f"{repo}:{AMD.name}").id
        arm_id = docker_client.images.get(f"{repo}:{ARM.name}").id
        monkeypatch.setenv("PTMG_STATE_DIR", env["PTMG_STATE_DIR"])  # the smoke records publish reads
        passes.record_pass(ROOT, amd_id, AMD.name, passed=1, skipped=0)
        held = publish("held")  # the arm64 image has no smoke pass yet: floating tags wait
        assert held["rc"] == 1 and not held["floating_gate"]["open"], held["stderr"][-2000:]
        assert any(ARM.name in r for r in held["floating_gate"]["reasons"])
        assert reg.manifest_digest(f"ns/{repo}", ARM.tag) is None
        passes.record_pass(ROOT, arm_id, ARM.name, passed=1, skipped=0)
        first = publish("first")
        assert first["rc"] == 0 and first["ok"], first["stderr"][-3000:]
        statuses = {t["tag"]: t["status"] for c in first["cells"] for t in c["tags"]}
        assert statuses[ARM.tag] == "pushed" and statuses["latest"] == "pushed"

        # The registry API: the tag is a list of both platforms, each naming our image.
        ref = f"{reg.host}/ns/{repo}:{ARM.tag}"
        inspect = subprocess.run([DOCKER, "manifest", "inspect", "--insecure", ref], capture_output=True, text=True,
                                 check=True, env={**os.environ, "DOCKER_CONFIG": env["DOCKER_CONFIG"]}).stdout
        listed = json.loads(inspect)
        print(f"\n`docker manifest inspect {ref}`:\n{inspect}")
        assert {(m["platform"]["os"], m["platform"]["architecture"]) for m in listed["manifests"]} == {
            ("linux", "amd64"), ("linux", "arm64")}
        assert listed["mediaType"] in ("application/vnd.docker.distribution.manifest.list.v2+json",
                                       "application/vnd.oci.image.index.v1+json")

        # Pulling the tag per platform gets that platform's image.
        for spec, image_id in ((ARM, arm_id), (AMD, amd_id)):
            pulled = docker_client.images.pull(f"{reg.host}/ns/{repo}", tag=ARM.tag, platform=spec.platform)
            assert pulled.attrs["Architecture"] == spec.arch and pulled.id == image_id

        before = reg.snapshot()
        again = publish("again")
        assert again["rc"] == 0 and {t["status"] for c in again["cells"] for t in c["tags"]} == {"unchanged"}
        assert reg.snapshot() == before, "a rerun with nothing new wrote to the registry"
    finally:
        reg.stop()
