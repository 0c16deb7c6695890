"""pyxis 0.24.0 on the multi-node Slurm 22.05 cluster (slurm_cluster.py, nodes from pyxis_cluster.py:
enroot 4.1.2 and pyxis built from their release sources, loaded through plugstack.conf).

`sbatch` runs the script of `build.py launch --target slurm --launcher pyxis --image-file X.sqsh`
as written (the session's export, conftest.exported_sqsh), as the user `pt`: 2 nodes x 2 CPU ranks
(gloo), world size 4, each node's torchrun in an enroot container of the squashfs.

- The image's DDP job passes across the nodes; its record reaches the job's directory through the
  script's --container-mounts. While it trains, each node holds the squashfs mounted (squashfuse).
- `selftest --require-gpu` on CPU fails the job, and the job log says why; the selftest names
  enroot/pyxis as its runtime (it runs in the squashfs's root, not the node's) and the image's
  environment reached it (the cell from PTMG_CELL: the job is submitted with --export=NONE, so it
  comes from the squashfs's /etc/environment, not from the submitting shell).
- A node killed mid-run ends the job NODE_FAIL or FAILED, never COMPLETED, and it is not requeued.

Runs last in the docker tier (conftest.RUN_LAST: it holds exported_sqsh, 4 GB). Every container,
network, volume and the test image carry the session's labels and are removed at the module's end.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import pytest

import ptmg_contract as contract
from builder.smoke.results import find_ddp_result
from builder.smoke.torchrun import ddp_job_args
from tests.support import wait_until

from .cellimage import BuiltCell
from .pyxis_cluster import build_pyxis_image, node_options
from .pyxis_probe import Probe, base_of, build_and_push
from .slurm_cluster import FINAL_STATES, JOBS, SHARED, SlurmCluster, SlurmClusterError, finish

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NODES, NPROC = 2, 2
HOSTS = {f"node{i}" for i in range(1, NODES + 1)}
JOB_S = 600  # submit -> COMPLETED: both nodes mount the squashfs and import torch from it on a busy 2-core host
NODE_FAIL_S = 90  # docker kill -> the job ended (SlurmdTimeout=10, MessageTimeout=5)
PROBE_S = 180  # submit -> the end of a job of the probe image (two nodes pull 75 MB and unpack it)
HOOK_LIKE = ("MASTER_ADDR=node2", "MASTER_PORT=61999", "WORLD_SIZE=2", "RANK=1", "LOCAL_RANK=1")


@pytest.fixture(scope="module")
def cluster(built_cell: BuiltCell, exported_sqsh: Path, docker_client: docker.DockerClient,
            session_labels: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    t0 = time.monotonic()
    try:
        image = build_pyxis_image(docker_client, built_cell.cell, built_cell.ref, session_labels,
                                  tmp_path_factory.mktemp("pyxis-image"))
    except (SlurmClusterError, RuntimeError) as exc:
        pytest.fail(str(exc), pytrace=False)
    print(f"Slurm + pyxis layer {image} built in {time.monotonic() - t0:.1f} s")
    c = SlurmCluster(docker_client, image, session_labels, nodes=NODES, run_options=node_options(exported_sqsh))
    try:
        try:
            c.start(timeout=120)
        except SlurmClusterError as exc:
            pytest.fail(str(exc), pytrace=False)
        print(f"Slurm cluster {c.id} (pyxis) up in {c.up_seconds:.1f} s")
        yield c
    finally:
        c.stop()
        with contextlib.suppress(docker.errors.ImageNotFound):
            docker_client.images.remove(image, force=True)
        left = c.leftovers()
        assert not left, f"left behind by Slurm cluster {c.id}: {left}"


def generate(tmp: Path, cell: str, image: Path | str, *extra: str) -> str:
    """`build.py launch` itself, as a user runs it: ``image`` an export (--image-file) or a registry
    reference (--image, named by its tag: the engine has no digest of the probe)."""
    source = ["--image-file", str(image)] if isinstance(image, Path) else ["--image", image, "--no-pin"]
    argv = [sys.executable, str(ROOT / "build.py"), "launch", "--target", "slurm", "--launcher", "pyxis",
            "--only", cell, *source, "--nodes", str(NODES), "--gpus-per-node", "0",
            "--nproc-per-node", str(NPROC), "--time", "00:15:00", "--mem", "512M", "--out", str(tmp), *extra]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return (tmp / cell / "slurm.sbatch").read_text()


def test_pyxis_runs_the_ddp_job_across_two_nodes(cluster: SlurmCluster, built_cell: BuiltCell,
                                                 exported_sqsh: Path, tmp_path: Path) -> None:
    # What enroot's PyTorch hook writes for an image that sets PYTORCH_VERSION (this one does not), given
    # by the job with values no rank may keep: torchrun's rendezvous gives every rank its own.
    script = generate(tmp_path, built_cell.cell, exported_sqsh, *(a for kv in HOOK_LIKE for a in ("--env", kv)))
    assert '--container-image="${PTMG_IMAGE}"' in script and str(exported_sqsh) in script, script
    job = cluster.sbatch(script, "ddp.sbatch")
    mounted: set[str] = set()
    entrypoint: set[str] = set()

    def trained_or_ended() -> bool:  # meanwhile: which nodes hold the squashfs mounted, or run the ENTRYPOINT
        mounted.update(n for n in sorted(HOSTS) if str(exported_sqsh) in cluster.processes(n, "squashfuse"))
        entrypoint.update(n for n in sorted(HOSTS) if cluster.processes(n, contract.START_SCRIPT))
        return contract.DDP_KILL_TRIGGER in cluster.output(job) or cluster.job(job).get("JobState") in FINAL_STATES

    wait_until(trained_or_ended, JOB_S, interval=1, what=f"job {job} training")
    info, text = finish(cluster, job, JOB_S)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-4000:]}"
    assert info["UserId"].startswith(f"{contract.USER}({contract.UID})"), info
    result = find_ddp_result([text])
    assert result is not None, text[-4000:]
    assert result.ok and result.backend == "gloo" and result.world_size == NODES * NPROC, result
    assert sorted(result.hosts) == sorted(sorted(HOSTS) * NPROC) and result.nodes == NODES, result
    assert result.loss_decreased and result.params_identical and result.allreduce_exact, result
    # The record, copied by the node that ran rank 0 into the job's directory (--container-mounts).
    record = json.loads(cluster.read(f"{JOBS}/ptmg-ddp-{job}/result.json") or "{}")
    assert record.get("ok") is True and record.get("world_size") == NODES * NPROC, record
    assert mounted == HOSTS, f"squashfuse of {exported_sqsh} seen on {sorted(mounted)}"
    # The nodes' pyxis runs entrypoints (execute_entrypoint=1): the script's --no-container-entrypoint kept
    # the image's tini + start.sh off, and the job did not need them.
    assert not entrypoint, f"{contract.START_SCRIPT} ran on {sorted(entrypoint)}"


def test_require_gpu_on_cpu_fails_the_pyxis_job_and_says_why(cluster: SlurmCluster, built_cell: BuiltCell,
                                                             exported_sqsh: Path, tmp_path: Path) -> None:
    command = shlex.join([f"{contract.SMOKE_DIR}/selftest.py", "--require-gpu", "-k", "test_cuda_available"])
    # Submitted with --export=NONE: no PTMG_CELL from the submitting shell, only from the image (enroot's
    # /etc/environment of the squashfs).
    job = cluster.sbatch(generate(tmp_path, built_cell.cell, exported_sqsh, "--nproc-per-node", "1",
                                  "--command", command), "gpu.sbatch", "--export=NONE")
    info, text = finish(cluster, job, JOB_S)
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", f"{info}\n{text[-4000:]}"
    assert "--require-gpu: " in text and "FAIL " in text, text[-4000:]
    # In the squashfs's root (no /.dockerenv: not the node's own), with the image's environment.
    assert f"pt-multi-gpu selftest: {built_cell.cell} in enroot/pyxis" in text, text[-4000:]
    assert f"under Slurm job {job}, as uid {contract.UID}" in text, text[-4000:]


@pytest.fixture(scope="module")
def probe(cluster: SlurmCluster, built_cell: BuiltCell, docker_client: docker.DockerClient,
          session_labels: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Probe]:
    """The small image (pyxis_probe.py) in a registry with a login, on the cluster network's gateway."""
    t0 = time.monotonic()
    try:
        p = build_and_push(docker_client, base_of(ROOT / "docker" / built_cell.cell / "Dockerfile"), session_labels,
                           tmp_path_factory.mktemp("probe-registry"), cluster.gateway)
    except (RuntimeError, docker.errors.DockerException) as exc:
        pytest.fail(f"the pyxis probe image: {exc}", pytrace=False)
    print(f"probe {p.docker_ref} built and pushed in {time.monotonic() - t0:.1f} s: {len(p.layers)} blobs")
    try:
        yield p
    finally:
        p.registry.stop()


def set_credentials(cluster: SlurmCluster, netrc: str | None) -> None:
    """Each node's ~/.config/enroot/.credentials (netrc: what enroot reads), or none."""
    write = "" if netrc is None else ' && (umask 077 && printf "%s\\n" "$1" > "$0/.credentials")'
    for node in sorted(HOSTS):
        rc, out = cluster.exec(["sh", "-c", f'mkdir -p "$0" && rm -f "$0/.credentials"{write}',
                                f"{contract.HOME}/.config/enroot", netrc or ""], user=contract.USER, node=node)
        assert rc == 0, out


def cached(cluster: SlurmCluster, node: str) -> set[str]:
    """The digests in the node's enroot layer cache (per group: pt's gid is its uid; enroot.conf)."""
    rc, out = cluster.exec(["ls", f"/var/lib/enroot-cache/group-{contract.UID}"], node=node)
    return set(out.split()) if rc == 0 else set()


def node_ip(cluster: SlurmCluster, node: str) -> str:
    return f"{cluster.gateway.rsplit('.', 1)[0]}.{10 + int(node.removeprefix('node'))}"


def report(text: str) -> dict[str, dict[str, str]]:
    """The probe torchrun's `[probe NODE] KEY=VALUE` lines, by node."""
    seen: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        m = re.search(r"\[probe (\S+)\] ([^=]+)=(.*)$", line)
        if m:
            seen.setdefault(m[1], {})[m[2]] = m[3]
    return seen


def probe_job(cluster: SlurmCluster, name: str, nodes: int, steps: str) -> tuple[dict[str, str], str]:
    """A hand-written batch script of srun steps (what a user types), run to its end."""
    script = "\n".join(["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={nodes}",
                        "#SBATCH --ntasks-per-node=1", "#SBATCH --no-requeue", f"#SBATCH --output={name}-%j.out",
                        "set -euo pipefail", steps, ""])
    job = cluster.sbatch(script, f"{name}.sbatch")
    info = cluster.wait(job, PROBE_S)
    text = cluster.output(job, name)
    print(f"job {job} ({name}): {info.get('JobState')} {info.get('ExitCode')} RunTime={info.get('RunTime')}\n{text}")
    return info, text


def test_pyxis_pulls_the_launch_scripts_registry_image_with_its_login(cluster: SlurmCluster, built_cell: BuiltCell,
                                                                     probe: Probe, tmp_path: Path) -> None:
    """The script of `build.py launch --image HOST:PORT/ptmg-pyxis-probe:TAG` as written, run by the probe's
    stand-in torchrun: enroot's own pull on both nodes with the user's .credentials, and what the job sees."""
    set_credentials(cluster, probe.netrc)
    cluster.exec(["install", "-d", "-o", str(contract.UID), f"{SHARED}/data"])
    cluster.write(f"{SHARED}/data/sample.txt", "a dataset\n")
    script = generate(tmp_path, built_cell.cell, probe.docker_ref, "--mount", f"{SHARED}/data:/data:ro",
                      "--env", "PTMG_PROBE_JOB=from-job", "--env", "PTMG_PROBE_IMAGE=from-job")
    assert probe.enroot_ref in script, script  # HOST:PORT#REPO:TAG, enroot's spelling
    since = probe.log_size()
    job = cluster.sbatch(script, "probe.sbatch")
    info, text = finish(cluster, job, PROBE_S)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-4000:]}"
    seen = report(text)
    assert set(seen) == HOSTS, text[-4000:]
    for node, r in sorted(seen.items()):
        assert r["marker"] == probe.marker, r  # the pulled image's root
        assert r["env.PTMG_PROBE_IMAGE"] == "from-image" and r["env.PTMG_PROBE_JOB"] == "from-job", r
        assert r["env.PTMG_PROBE_ENTRYPOINT"] == "<unset>", r  # --no-container-entrypoint, on a site that runs them
        assert r["pwd"] == "/workspace" and r["dataset"] == "a dataset" and r["jobdir-write"] == "ok", r
        assert r["home"] == contract.HOME and r["home-mounted"] == "yes" and r["home-write"] == "ok", r
        # the node's own HOME, bound: the file is on the node
        assert cluster.exec(["cat", f"{contract.HOME}/.ptmg-probe-{job}"], node=node)[1].strip() == node
        assert cluster.read(f"{JOBS}/ptmg-ddp-{job}/probe-{node}").strip() == node
        # enroot's PyTorch hook (the image sets PYTORCH_VERSION), beside torchrun's own rendezvous; one task
        # a node: RANK is the node's, WORLD_SIZE the nodes'
        assert r["env.MASTER_ADDR"] == "node1" and r["env.MASTER_PORT"] == str(int(job) % 4536 + 61000), r
        rank = str(sorted(HOSTS).index(node))
        assert (r["env.RANK"], r["env.LOCAL_RANK"], r["env.WORLD_SIZE"]) == (rank, "0", str(NODES)), r
        assert "--rdzv_backend c10d --rdzv_endpoint node1:" in r["argv"], r
    # enroot's own pull: every node fetched every blob of the image from the registry, once
    got = Counter((ip, path.rsplit("/", 1)[1]) for ip, method, path, status in probe.requests(since)
                  if method == "GET" and "/blobs/" in path and status == 200)
    want = Counter({(node_ip(cluster, n), d): 1 for n in HOSTS for d in probe.layers})
    assert got == want, f"blob fetches {dict(got)}, expected {dict(want)}"


def test_pyxis_steps_reuse_enroots_layer_cache_and_a_named_container(cluster: SlurmCluster, probe: Probe) -> None:
    """Three steps: the image into a named container (no --no-container-entrypoint: the site's
    execute_entrypoint=1 runs the image's), that container again, the image again unnamed."""
    set_credentials(cluster, probe.netrc)
    image, host = shlex.quote(probe.enroot_ref), "$(cat /proc/sys/kernel/hostname)"
    steps = "\n".join([
        f"srun --container-image={image} --container-name=probe --container-writable "
        f"bash -c 'echo \"{host} ${{PTMG_PROBE_ENTRYPOINT:-no-entrypoint}}\" > /etc/ptmg-step0'",
        f"srun --container-name=probe bash -c 'echo \"[step1 {host}] $(cat /etc/ptmg-step0)\"'",
        f"srun --container-image={image} bash -c 'echo \"[step2 {host}] $(cat /etc/ptmg-step0 2>&1)\"'",
    ])
    before = {n: cached(cluster, n) for n in HOSTS}
    since = probe.log_size()
    info, text = probe_job(cluster, "ptmg-probe-steps", NODES, steps)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-4000:]}"
    for node in sorted(HOSTS):
        assert f"[step1 {node}] {node} ran" in text, text[-4000:]  # step 0's file: the same container; ENTRYPOINT ran
        assert f"[step2 {node}] cat: /etc/ptmg-step0: No such file or directory" in text, text[-4000:]  # a new one
    reqs = probe.requests(since)
    pulls = Counter(ip for ip, method, path, _status in reqs if method == "HEAD" and "/manifests/" in path)
    assert pulls == {node_ip(cluster, n): 2 for n in HOSTS}, f"imports by node: {pulls}"  # steps 0 and 2, not 1
    # Two pulls, and each node fetched only what its cache lacked before the job, once: step 2 took the
    # layers from the cache (warm from the launch script's job when that ran first: then nothing at all)
    got = Counter((ip, path.rsplit("/", 1)[1]) for ip, method, path, status in reqs
                  if method == "GET" and "/blobs/" in path and status == 200)
    want = Counter({(node_ip(cluster, n), d): 1 for n in HOSTS for d in probe.layers
                    if d.removeprefix("sha256:") not in before[n]})
    assert got == want, f"blob fetches {dict(got)}, expected {dict(want)}"
    for node in sorted(HOSTS):
        assert {d.removeprefix("sha256:") for d in probe.layers} <= cached(cluster, node), node


def test_pyxis_registry_pull_without_the_right_login_fails_and_says_so(cluster: SlurmCluster, probe: Probe) -> None:
    step = f"srun --container-image={shlex.quote(probe.enroot_ref)} true"
    user = probe.netrc.split()[3]
    wrong = probe.netrc.rsplit(" ", 1)[0] + " not-the-password"
    try:
        for netrc, who in ((wrong, user), (None, "<anonymous>")):
            set_credentials(cluster, netrc)
            since = probe.log_size()
            info, text = probe_job(cluster, "ptmg-probe-login", 1, step)
            assert info["JobState"] == "FAILED", f"{info}\n{text[-4000:]}"
            assert f"pyxis: failed to import docker image: {probe.enroot_ref}" in text, text[-4000:]
            # enroot 4.1.2's own log, which pyxis prints: whom it tried; its 401 never reaches the log
            assert f"Authenticating with user: {who}\n" in text and "Authentication succeeded" not in text, text
            assert ("Using credentials from file" in text) is (netrc is not None), text
            blobs = [(method, status) for _ip, method, path, status in probe.requests(since) if "/blobs/" in path]
            assert not blobs, f"blobs requested without a login: {blobs}"
    finally:
        set_credentials(cluster, probe.netrc)


def test_a_killed_node_ends_the_pyxis_job_without_a_requeue(cluster: SlurmCluster, built_cell: BuiltCell,
                                                            exported_sqsh: Path, tmp_path: Path) -> None:
    """Last: node2's container is killed while the job trains (its results on /shared, a --mount)."""
    run = uuid.uuid4().hex[:8]
    out = f"/shared/runs/{run}"
    command = shlex.join([contract.DDP_JOB, *ddp_job_args(out=out, steps=600, step_sleep_s=0.5, timeout_s=30,
                                                          phase_timeout_s=60, extra=("--node-out", out))])
    job = cluster.sbatch(generate(tmp_path, built_cell.cell, exported_sqsh, "--mount", "/shared:/shared",
                                  "--command", command), f"{run}.sbatch")
    try:
        wait_until(lambda: contract.DDP_KILL_TRIGGER in cluster.output(job) or cluster.job(job).get("JobState")
                   in FINAL_STATES, JOB_S, interval=1, what=f"job {job} training")
        assert contract.DDP_KILL_TRIGGER in cluster.output(job), f"{cluster.job(job)}\n{cluster.output(job)[-4000:]}"
        killed = time.monotonic()
        cluster.kill("node2")
        info, text = finish(cluster, job, NODE_FAIL_S)
        took = time.monotonic() - killed
        cluster.restart("node2")
        after = cluster.job(job)
    finally:
        cluster.cancel(job)
    print(f"job {job}: {info['JobState']} (Reason={info.get('Reason')}) {took:.1f} s after docker kill node2")
    assert info["JobState"] in ("NODE_FAIL", "FAILED"), f"{info}\n{text[-4000:]}"
    assert info["Requeue"] == "0" and info["Restarts"] == "0", info
    assert after["JobState"] == info["JobState"] and after["Restarts"] == "0", after
