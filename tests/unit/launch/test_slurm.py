"""`build.py launch`: the Slurm script, the PyTorchJob and the JobSet it writes; compose.yaml and
.devcontainer/devcontainer.json (no Docker, no cluster).

What is checked against what:
- Kubernetes core objects (PodTemplateSpec, JobTemplateSpec, Service) against the official
  `kubernetes` client's OpenAPI models: every field name must exist (at every depth), every value
  must have the model's type, and required fields must be there (the client's own deserializer
  raises on a missing one).
- The PyTorchJob against the Kubeflow training operator's own SDK models (`kubeflow-training`),
  the same way.
- The JobSet against a structural check written from the v1alpha2 Go types
  (kubernetes-sigs/jobset api/jobset/v1alpha2/jobset_types.go): there is no JobSet SDK on PyPI.
  Its Job template is checked against the Kubernetes models.
- The Slurm script by running it under bash with stand-in `scontrol`, `srun`, `docker`,
  `apptainer` and `torchrun` commands: each node must get the right rendezvous, its own node
  rank, and (docker) every variable it needs through `-e`; the stand-in srun drops the
  environment as Slurm does under `sbatch --export=NONE` unless srun says `--export=ALL`; the
  native launcher's preflight runs against a stand-in cell file and venv. Real Slurm runs are in
  tests/docker/test_slurm.py (one node, docker launcher) and tests/docker/test_slurm_multinode.py
  (a cluster of containers of the image, native launcher).
- compose.yaml against the Compose Specification's JSON schema (as vendored by check-jsonschema).
- devcontainer.json by a structural check (no devcontainer schema can be had from PyPI).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

import builder.cli.main as cli
import ptmg_contract as contract
from builder import launch
from builder.launch import ImagePin, LaunchConfig, LaunchError, config, kubernetes, slurm
from tests.support import LATEST, MID, OLD, vendored_schema, write_matrix

ROOT = Path(__file__).resolve().parents[3]
CELL = MID
DIGEST = "sha256:" + "ab" * 32


TORCH = "2.7.0"  # the torch of `cfg()`'s cell, as the verb passes it


#: Charliecloud runs an exported squashfs, CPU ranks only (ch-run injects no GPU driver).
CH_IMAGE = "/shared/images/pt.sqsh"


def cfg(**kw: Any) -> LaunchConfig:
    base: dict[str, Any] = {"cell": CELL, "image": ImagePin(ref=f"pt-multi-gpu:{CELL}", tag_ref=f"pt-multi-gpu:{CELL}"),
                            "nodes": 2, "gpus_per_node": 4, "nproc_per_node": 4, "torch": TORCH}
    if kw.get("launcher") == "charliecloud":
        base.update(image_file=CH_IMAGE, gpus_per_node=0)
    base.update(kw)
    return LaunchConfig(**base)


# --- a strict checker over the OpenAPI models of the Kubernetes/Kubeflow clients ----------------

try:  # a missing dev dependency is an error here, never a silent skip
    import kubeflow.training.models as kf_models
    import kubernetes.client.models as k8s_models
except ImportError as exc:
    raise ImportError(f"{exc}: the manifests are checked against the `kubernetes` and `kubeflow-training` "
                      "models; pip install -e '.[dev]'") from exc

#: Kubernetes resource quantities and int-or-string fields: the client types them `str`, the API
#: server accepts numbers too (`nvidia.com/gpu: 8` is the usual spelling).
INT_OR_STRING = {("V1ResourceRequirements", "limits"), ("V1ResourceRequirements", "requests")}


def _model(name: str) -> Any:
    for module in (kf_models, k8s_models):
        if hasattr(module, name):
            return getattr(module, name)
    raise AssertionError(f"no model {name}")


def strict_errors(data: Any, type_name: str, path: str = "$", owner: tuple[str, str] | None = None) -> list[str]:
    """Every field name unknown to the model, and every value of the wrong type, at every depth."""
    if type_name.startswith("list["):
        if not isinstance(data, list):
            return [f"{path}: expected a list, got {type(data).__name__}"]
        inner = type_name[5:-1]
        return [e for i, item in enumerate(data) for e in strict_errors(item, inner, f"{path}[{i}]", owner)]
    if type_name.startswith("dict("):
        if not isinstance(data, dict):
            return [f"{path}: expected a mapping, got {type(data).__name__}"]
        inner = type_name[type_name.index(",") + 1:-1].strip()
        return [e for k, v in data.items() for e in strict_errors(v, inner, f"{path}.{k}", owner)]
    primitives: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float)}
    if type_name in primitives:
        ok = isinstance(data, primitives[type_name]) and not (type_name == "int" and isinstance(data, bool))
        if type_name == "str" and owner in INT_OR_STRING and isinstance(data, int) and not isinstance(data, bool):
            ok = True
        return [] if ok else [f"{path}: expected {type_name}, got {data!r}"]
    if type_name == "object":
        return []
    model = _model(type_name)
    if not isinstance(data, dict):
        return [f"{path}: expected a {type_name} mapping, got {type(data).__name__}"]
    by_json = {json_name: attr for attr, json_name in model.attribute_map.items()}
    errors = []
    for key, value in data.items():
        if key not in by_json:
            errors.append(f"{path}.{key}: no such field in {type_name} (fields: {sorted(by_json)})")
            continue
        attr = by_json[key]
        errors += strict_errors(value, model.openapi_types[attr], f"{path}.{key}", (type_name, attr))
    return errors


def deserialize(data: Mapping[str, Any], type_name: str) -> Any:
    """The client's own deserializer: raises ValueError when a required field is missing."""
    from kubeflow.training import ApiClient

    return ApiClient()._ApiClient__deserialize(json.loads(json.dumps(data)), type_name)


def assert_valid(data: Mapping[str, Any], type_name: str) -> Any:
    errors = strict_errors(data, type_name)
    assert not errors, "\n".join(errors)
    return deserialize(data, type_name)


def test_the_strict_checker_rejects_what_it_should() -> None:
    """The checker itself can fail: misspelt fields, wrong types and missing required fields."""
    good = {"spec": {"containers": [{"name": "c", "image": "i", "args": ["x"]}]}}
    assert not strict_errors(good, "V1PodTemplateSpec")
    assert strict_errors({"spec": {"containers": [{"name": "c", "imagee": "i"}]}}, "V1PodTemplateSpec")
    assert strict_errors({"spec": {"containers": [{"name": "c", "args": "x"}]}}, "V1PodTemplateSpec")
    assert strict_errors({"spec": {"restartPolicy": 1, "containers": []}}, "V1PodTemplateSpec")
    with pytest.raises(ValueError, match="name"):
        deserialize({"spec": {"containers": [{"image": "i"}]}}, "V1PodTemplateSpec")


# --- image pinning -------------------------------------------------------------------------------


def test_pin_prefers_a_digest_of_the_same_repository() -> None:
    attrs = {"Id": "sha256:1111", "RepoDigests": [f"zz.io/other@{DIGEST}",
                                                  f"registry.example:5000/pt-multi-gpu@{'sha256:' + 'cd' * 32}"]}
    pin = config.pin_image("registry.example:5000/pt-multi-gpu:2.7.0", attrs)
    assert pin.ref == f"registry.example:5000/pt-multi-gpu@sha256:{'cd' * 32}"
    assert pin.pinned and pin.digest == "sha256:" + "cd" * 32 and pin.image_id == "sha256:1111"
    assert "pinned by digest" in pin.note


def test_pin_falls_back_to_another_repository_then_to_the_tag() -> None:
    pin = config.pin_image("pt-multi-gpu:x", {"Id": "sha256:1", "RepoDigests": [f"b.io/p@{DIGEST}", f"a.io/p@{DIGEST}"]})
    assert pin.ref == f"a.io/p@{DIGEST}"
    local = config.pin_image("pt-multi-gpu:x", {"Id": "sha256:1", "RepoDigests": []})
    assert local.ref == "pt-multi-gpu:x" and not local.pinned and "local image id sha256:1" in local.note
    absent = config.pin_image("pt-multi-gpu:x", None)
    assert absent.ref == "pt-multi-gpu:x" and absent.image_id is None and "not found locally" in absent.note


@pytest.mark.parametrize(("ref", "want"), [
    ("nvcr.io/nvidia/pytorch:24.01-py3", "nvcr.io#nvidia/pytorch:24.01-py3"),
    ("localhost:5000/pt-multi-gpu:x", "localhost:5000#pt-multi-gpu:x"),
    ("localhost/pt:x", "localhost#pt:x"),
    ("ghcr.io/org/pt-multi-gpu@" + DIGEST, "ghcr.io#org/pt-multi-gpu@" + DIGEST),
    ("pt-multi-gpu:x", "pt-multi-gpu:x"),
    ("library/ubuntu:22.04", "library/ubuntu:22.04"),
])
def test_pyxis_spells_the_registry_with_a_hash(ref: str, want: str) -> None:
    assert config.pyxis_image(ref) == want


# --- configuration checks ---------------------------------------------------------------------------


@pytest.mark.parametrize(("kw", "match"), [
    ({"name": "Bad_Name"}, "--name"),
    ({"name": "x" * 41}, "--name"),
    ({"nodes": 0}, "--nodes"),
    ({"nproc_per_node": 0}, "--nproc-per-node"),
    ({"launcher": "podman"}, "--launcher"),
    ({"mounts": ("/data:/data'",)}, "--mount"),
    ({"mounts": ("relative",)}, "--mount"),
    ({"env": (("1BAD", "x"),)}, "--env"),
    ({"shm_size": "lots"}, "--shm-size"),
    ({"launcher": "native", "mounts": ("/data:/data:ro",)}, "--mount '/data:/data:ro': --launcher native runs no container"),
])
def test_bad_flags_are_refused(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(LaunchError, match=match):
        cfg(**kw)


RENDER_ALL = """
import json, sys
from builder import launch
from builder.launch import ImagePin, LaunchConfig, config
cell = sys.argv[1]
c = LaunchConfig(cell=cell, image=ImagePin(ref=f"pt-multi-gpu:{cell}", tag_ref=f"pt-multi-gpu:{cell}"), nodes=2,
                 gpus_per_node=4, nproc_per_node=4, torch="2.7.0", env=(("B", "2"), ("A", "1")))
print(json.dumps({target: launch.render(target, c) for target in config.TARGETS}))
"""


def test_rendering_is_the_same_in_any_process(tmp_path: Path) -> None:
    """Byte-identical job files from fresh interpreters (other hash seeds, other working directories)
    and from this one."""

    def fresh(seed: str, cwd: Path) -> dict[str, str]:
        cwd.mkdir()
        r = subprocess.run([sys.executable, "-c", RENDER_ALL, CELL], cwd=cwd, capture_output=True, text=True,
                           timeout=120, check=True, env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)})
        return dict(json.loads(r.stdout))

    first = fresh("1", tmp_path / "a")
    assert sorted(first) == sorted(config.TARGETS)
    assert fresh("2", tmp_path / "b") == first
    here = cfg(env=(("B", "2"), ("A", "1")))
    assert {target: launch.render(target, here) for target in config.TARGETS} == first


# --- Kubernetes: PyTorchJob ------------------------------------------------------------------------------


def _main_container(pod: Mapping[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "pytorch"]
    return dict(container)


def _check_pod(pod: Mapping[str, Any], c: LaunchConfig) -> dict[str, Any]:
    assert_valid(pod, "V1PodTemplateSpec")
    main = _main_container(pod)
    assert main["image"] == c.image.ref
    assert "command" not in main, "args only: the image's ENTRYPOINT (tini, drop to pt) must stay"
    assert main["args"][0] == "torchrun"
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["NCCL_DEBUG"] == c.nccl_debug
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["GLOO_SOCKET_IFNAME"] == "eth0"
    limits = main["resources"]["limits"]
    assert main["resources"]["requests"] == limits  # Guaranteed QoS
    assert limits.get("nvidia.com/gpu") == (c.gpus_per_node or None)
    assert limits["cpu"] == str(c.node_cpus) and limits["memory"] == f"{c.node_mem_mib}Mi"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in main["volumeMounts"]
    (shm,) = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert pod["metadata"]["labels"]["project"] == "pt-multi-gpu"
    return main


@pytest.mark.parametrize("nodes", [1, 3])
def test_pytorchjob_matches_the_operator_models(nodes: int) -> None:
    c = cfg(nodes=nodes, gpus_per_node=8, nproc_per_node=8)
    doc = yaml.safe_load(kubernetes.render_pytorchjob(c))
    job = assert_valid(doc, "KubeflowOrgV1PyTorchJob")
    assert doc["apiVersion"] == "kubeflow.org/v1" and doc["kind"] == "PyTorchJob"
    assert job.spec.nproc_per_node == "8"
    replicas = doc["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    if nodes == 1:
        assert "Worker" not in replicas
    else:
        assert replicas["Worker"]["replicas"] == nodes - 1
    for spec in replicas.values():
        assert spec["restartPolicy"] == "Never"
        main = _check_pod(spec["template"], c)
        args = main["args"]
        assert args[args.index("--nnodes") + 1] == str(nodes)
        assert args[args.index("--nproc_per_node") + 1] == "8"
        # The operator names the Master's service in PET_MASTER_ADDR and the port of the
        # container port called pytorchjob-port in PET_MASTER_PORT; Kubernetes expands $(...).
        assert args[args.index("--rdzv_endpoint") + 1] == "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"
        assert main["ports"] == [{"name": "pytorchjob-port", "containerPort": 29400, "protocol": "TCP"}]
        assert args[args.index("--max_restarts") + 1] == "0"
        assert contract.DDP_JOB in args
    assert doc["spec"]["runPolicy"]["backoffLimit"] == 0


def test_pytorchjob_runs_the_users_command_and_the_selftest_first() -> None:
    c = cfg(command=("/workspace/train.py", "--epochs", "3"), selftest_init=True, namespace="ml")
    doc = yaml.safe_load(kubernetes.render_pytorchjob(c))
    assert_valid(doc, "KubeflowOrgV1PyTorchJob")
    pod = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    assert _main_container(pod)["args"][-3:] == ["/workspace/train.py", "--epochs", "3"]
    assert contract.DDP_JOB not in _main_container(pod)["args"]
    (init,) = pod["spec"]["initContainers"]
    assert init["args"] == ["selftest", "--nproc", "4", "--require-gpu"]
    assert init["resources"] == _main_container(pod)["resources"]  # the pod stays Guaranteed
    assert init["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert doc["metadata"]["namespace"] == "ml"


def test_cpu_jobs_ask_for_no_gpu() -> None:
    c = cfg(gpus_per_node=0, nproc_per_node=2, selftest_init=True)
    doc = yaml.safe_load(kubernetes.render_pytorchjob(c))
    pod = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    _check_pod(pod, c)
    assert pod["spec"]["initContainers"][0]["args"] == ["selftest", "--nproc", "2"]


# --- Kubernetes: JobSet + Service ---------------------------------------------------------------------------

#: JobSet v1alpha2 fields, from kubernetes-sigs/jobset api/jobset/v1alpha2/jobset_types.go.
JOBSET_SPEC = {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
               "coordinator", "managedBy", "ttlSecondsAfterFinished", "volumeClaimPolicies"}
JOBSET_REPLICATED_JOB = {"name", "groupName", "template", "replicas", "dependsOn"}
JOBSET_NETWORK = {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"}
JOBSET_FAILURE = {"maxRestarts", "restartStrategy", "rules"}
JOBSET_SUCCESS = {"operator", "targetReplicatedJobs"}


def jobset_errors(doc: Mapping[str, Any]) -> list[str]:
    errors = []
    if doc.get("apiVersion") != "jobset.x-k8s.io/v1alpha2" or doc.get("kind") != "JobSet":
        errors.append("not a jobset.x-k8s.io/v1alpha2 JobSet")
    errors += [f"$.{k}: unknown" for k in set(doc) - {"apiVersion", "kind", "metadata", "spec", "status"}]
    errors += strict_errors(doc.get("metadata", {}), "V1ObjectMeta", "$.metadata")
    spec = doc.get("spec", {})
    errors += [f"$.spec.{k}: unknown" for k in set(spec) - JOBSET_SPEC]
    errors += [f"$.spec.network.{k}: unknown" for k in set(spec.get("network", {})) - JOBSET_NETWORK]
    errors += [f"$.spec.failurePolicy.{k}: unknown" for k in set(spec.get("failurePolicy", {})) - JOBSET_FAILURE]
    success = spec.get("successPolicy", {})
    errors += [f"$.spec.successPolicy.{k}: unknown" for k in set(success) - JOBSET_SUCCESS]
    if success and success.get("operator") not in ("All", "Any"):
        errors.append("$.spec.successPolicy.operator: All or Any (required)")
    names = []
    for i, rj in enumerate(spec.get("replicatedJobs", [])):
        errors += [f"$.spec.replicatedJobs[{i}].{k}: unknown" for k in set(rj) - JOBSET_REPLICATED_JOB]
        if "name" not in rj or "template" not in rj:
            errors.append(f"$.spec.replicatedJobs[{i}]: name and template are required")
        names.append(rj.get("name"))
        if not isinstance(rj.get("replicas", 1), int):
            errors.append(f"$.spec.replicatedJobs[{i}].replicas: an integer")
        errors += strict_errors(rj.get("template", {}), "V1JobTemplateSpec", f"$.spec.replicatedJobs[{i}].template")
    if not names or len(set(names)) != len(names):
        errors.append("$.spec.replicatedJobs: at least one, names unique")
    return errors


def test_the_jobset_check_can_fail() -> None:
    assert jobset_errors({"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                          "spec": {"replicatedJob": []}})
    assert jobset_errors({"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                          "spec": {"replicatedJobs": [{"name": "a", "template": {"spec": {"paralelism": 1}}}]}})


@pytest.mark.parametrize("nodes", [1, 4])
def test_jobset_and_its_headless_service(nodes: int) -> None:
    c = cfg(nodes=nodes, name="llm-ddp")
    service, js = yaml.safe_load_all(kubernetes.render_jobset(c))
    assert_valid(service, "V1Service")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": "llm-ddp"}
    errors = jobset_errors(js)
    assert not errors, "\n".join(errors)
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": service["metadata"]["name"],
                                     "publishNotReadyAddresses": True}
    (rj,) = js["spec"]["replicatedJobs"]
    job = assert_valid(rj["template"], "V1JobTemplateSpec")
    assert job.spec.parallelism == job.spec.completions == nodes
    assert job.spec.completion_mode == "Indexed" and job.spec.backoff_limit == 0
    pod = rj["template"]["spec"]["template"]
    main = _check_pod(pod, c)
    assert pod["spec"]["restartPolicy"] == "Never"
    args = main["args"]
    # Pod i of Job 0 of replicated job `node` is <jobset>-node-0-i.<subdomain> (JobSet's naming).
    assert args[args.index("--rdzv_endpoint") + 1] == f"llm-ddp-{rj['name']}-0-0.llm-ddp:29400"
    node_rank = next(e for e in main["env"] if e["name"] == "NODE_RANK")
    assert "job-completion-index" in node_rank["valueFrom"]["fieldRef"]["fieldPath"]


def test_yaml_has_no_anchors_and_says_what_image() -> None:
    pinned = ImagePin(ref=f"r.io/pt-multi-gpu@{DIGEST}", tag_ref="r.io/pt-multi-gpu:x", digest=DIGEST, image_id="sha256:9")
    text = kubernetes.render_jobset(cfg(image=pinned, selftest_init=True))
    assert "&id" not in text and "*id" not in text
    assert f"pinned by digest {DIGEST}" in text.splitlines()[1]
    assert text.count(f"image: r.io/pt-multi-gpu@{DIGEST}") == 2  # the main container and the selftest


# --- Slurm: run the script with stand-ins for scontrol, srun and the launchers ------------------------------

FAKES = {
    "scontrol": """#!/bin/bash
[ "$1 $2" = "show hostnames" ] || { echo "scontrol: unexpected $*" >&2; exit 2; }
printf 'gpu-a01\\ngpu-a02\\ngpu-a03\\n' | head -n "$SLURM_NNODES"
""",
    # One task per node: run the command once per node with that node's SLURM_NODEID/PROCID;
    # fail like srun does when any task failed. The tasks' environment as Slurm makes it: srun's
    # --export, else SLURM_EXPORT_ENV (what `sbatch --export=NONE` leaves to the script), else ALL;
    # NONE keeps only Slurm's own variables (and the stand-ins' plumbing).
    "srun": """#!/bin/bash
echo "srun $*" >> "$FAKE_LOG"
export_env=${SLURM_EXPORT_ENV:-ALL}
while [[ "$1" == --* ]]; do
    case "$1" in --export=*) export_env=${1#--export=} ;; esac
    shift
done
rc=0
for ((i = 0; i < SLURM_NNODES; i++)); do
    if [ "$export_env" = NONE ]; then
        env -i PATH="$FAKE_BIN:/usr/bin:/bin" FAKE_LOG="$FAKE_LOG" FAKE_BIN="$FAKE_BIN" SLURM_JOB_ID="$SLURM_JOB_ID" \
            SLURM_NNODES="$SLURM_NNODES" SLURM_JOB_NODELIST="$SLURM_JOB_NODELIST" SLURM_NODEID=$i SLURM_PROCID=$i \
            "$@" || rc=$?
    else
        SLURM_NODEID=$i SLURM_PROCID=$i "$@" || rc=$?
    fi
done
exit $rc
""",
    # docker run ... IMAGE bash -c SCRIPT: run SCRIPT with ONLY the variables passed by -e (as Docker does).
    "docker": """#!/bin/bash
echo "docker $*" >> "$FAKE_LOG"
[ "$1" = run ] || exit 0
args=("$@"); n=${#args[@]}
keep=(PATH="$FAKE_BIN:/usr/bin:/bin" FAKE_LOG="$FAKE_LOG" FAKE_FAIL_NODE="${FAKE_FAIL_NODE-}")
for ((i = 0; i < n; i++)); do
    if [ "${args[i]}" = -e ]; then name=${args[i+1]}; keep+=("$name=${!name-}"); fi
done
exec env -i "${keep[@]}" bash -c "${args[n-1]}"
""",
    "apptainer": """#!/bin/bash
echo "apptainer $*" >> "$FAKE_LOG"
args=("$@"); n=${#args[@]}
exec bash -c "${args[n-1]}"
""",
    # ch-run [OPTIONS] IMAGE -- CMD...: the host's environment passes through.
    "ch-run": """#!/bin/bash
echo "ch-run $*" >> "$FAKE_LOG"
args=("$@"); n=${#args[@]}
[ "${args[n-4]}" = -- ] || { echo "ch-run: no -- before the command" >&2; exit 64; }
exec bash -c "${args[n-1]}"
""",
    "torchrun": """#!/bin/bash
echo "torchrun node=$NODE_RANK $*" >> "$FAKE_LOG"
[ -n "${FAKE_FAIL_NODE:-}" ] && [ "$NODE_RANK" = "$FAKE_FAIL_NODE" ] && exit 3
exit 0
""",
}


@pytest.fixture
def fake_bin(tmp_path: Path) -> Iterator[Path]:
    if not shutil.which("bash"):
        pytest.fail("bash is needed to run the generated Slurm script")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in FAKES.items():
        p = bindir / name
        p.write_text(text)
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    yield bindir


def native_node(script: str, tmp: Path, cell: str | None = CELL, torch: str | None = f"{TORCH}+cu126") -> str:
    """The script with the image's cell file and venv moved to a stand-in node under ``tmp``: the
    node has the cell file ``cell`` (None: none) and torch ``torch`` in its venv (None: none)."""
    node = tmp / "node"
    cell_file, venv = node / "cell", node / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True, exist_ok=True)
    if cell is not None:
        cell_file.write_text(cell + "\n")
    if torch is not None:
        (site / f"torch-{torch}.dist-info").mkdir()
    return script.replace(contract.CELL_FILE, str(cell_file)).replace(contract.VENV, str(venv))


def run_sbatch(script: str, bindir: Path, tmp: Path, nodes: int, **env: str) -> tuple[int, list[str], str]:
    path = tmp / "job.sbatch"
    path.write_text(script)
    log = tmp / "fake.log"
    full = {"PATH": f"{bindir}:/usr/bin:/bin", "FAKE_LOG": str(log), "FAKE_BIN": str(bindir),
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-a[01-03]", "SLURM_NNODES": str(nodes),
            "SLURM_SUBMIT_DIR": str(tmp), **env}
    r = subprocess.run(["bash", str(path)], env=full, cwd=tmp, capture_output=True, text=True, timeout=60,
                       check=False)
    return r.returncode, log.read_text().splitlines() if log.exists() else [], r.stderr


def for_launcher(launcher: str, script: str, tmp: Path) -> str:
    """The script, with a stand-in node for the native launcher (its preflight looks at the node)."""
    return native_node(script, tmp) if launcher == "native" else script


@pytest.mark.parametrize("launcher", config.LAUNCHERS)
def test_slurm_script_gives_each_node_its_rank_and_the_rendezvous(
        launcher: str, fake_bin: Path, tmp_path: Path) -> None:
    mounts = {"native": (), "charliecloud": ("/scratch/data:/data",)}.get(launcher, ("/scratch/data:/data:ro",))
    c = cfg(nodes=2, launcher=launcher, mounts=mounts, env=(("MY_FLAG", "a b'c"),))
    script = slurm.render_slurm(c)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    rc, lines, stderr = run_sbatch(for_launcher(launcher, script, tmp_path), fake_bin, tmp_path, nodes=2)
    assert rc == 0, stderr
    runs = [ln for ln in lines if ln.startswith("torchrun ")]
    assert [r.split()[1] for r in runs] == ["node=0", "node=1"], lines
    for r in runs:
        assert "--rdzv_endpoint gpu-a01:24242 --rdzv_id 4242" in r  # 20000 + the job id % 10000
        assert "--nnodes 2 --nproc_per_node 4" in r
        assert f"{contract.DDP_JOB} --out" in r
    srun = next(ln for ln in lines if ln.startswith("srun "))
    assert "--kill-on-bad-exit=1" in srun and "--ntasks-per-node=1" in srun and "--export=ALL" in srun
    if launcher == "native":
        assert srun.startswith("srun --kill-on-bad-exit=1 --export=ALL --label --nodes=2 --ntasks-per-node=1 "
                               "--cpus-per-task=16 --gpus-per-node=4 bash -c ")
        assert not any(ln.startswith(("docker ", "apptainer ")) for ln in lines) and "--container" not in srun
    elif launcher == "pyxis":
        assert f"--container-image=pt-multi-gpu:{CELL}" in srun
        assert f"--container-mounts={tmp_path}/ptmg-ddp-4242:{tmp_path}/ptmg-ddp-4242,/scratch/data:/data:ro" in srun
    elif launcher == "apptainer":
        app = next(ln for ln in lines if ln.startswith("apptainer "))
        assert app.startswith("apptainer exec --nv --env LIBRARY_PATH=/.singularity.d/libs "
                              f"--bind {tmp_path}/ptmg-ddp-4242 --bind /scratch/data:/data:ro docker://pt-multi-gpu:")
    elif launcher == "charliecloud":
        ch = [ln for ln in lines if ln.startswith("ch-run ")]
        assert len(ch) == 2 and ch[0].startswith(f"ch-run --home --set-env --bind=/scratch/data:/data {CH_IMAGE} -- ")
    else:
        docker = [ln for ln in lines if ln.startswith("docker run ")]
        assert len(docker) == 2
        assert "--name ptmg-4242-0 " in docker[0] and "--name ptmg-4242-1 " in docker[1]
        for d in docker:
            assert "--network host --shm-size 8g" in d
            assert "--label project=pt-multi-gpu" in d
            assert '--gpus "device=all"' in d  # SLURM_JOB_GPUS unset here: all of the host's
            assert "-v /scratch/data:/data:ro" in d


def test_slurm_docker_passes_slurms_gpus_and_the_env(fake_bin: Path, tmp_path: Path) -> None:
    c = cfg(nodes=1, launcher="docker", env=(("MY_FLAG", "a b'c"),))
    (fake_bin / "torchrun").write_text('#!/bin/bash\necho "torchrun node=$NODE_RANK flag=$MY_FLAG '
                                       'nccl=$NCCL_DEBUG" >> "$FAKE_LOG"\n')
    rc, lines, stderr = run_sbatch(slurm.render_slurm(c), fake_bin, tmp_path, nodes=1, SLURM_JOB_GPUS="2,3")
    assert rc == 0, stderr
    assert any('--gpus "device=2,3"' in ln for ln in lines), lines
    assert "torchrun node=0 flag=a b'c nccl=WARN" in lines


@pytest.mark.parametrize("launcher", config.LAUNCHERS)
def test_slurm_script_fails_when_a_node_fails(launcher: str, fake_bin: Path, tmp_path: Path) -> None:
    script = for_launcher(launcher, slurm.render_slurm(cfg(nodes=2, launcher=launcher)), tmp_path)
    rc, lines, _ = run_sbatch(script, fake_bin, tmp_path, nodes=2, FAKE_FAIL_NODE="1")
    assert rc != 0
    assert sum(ln.startswith("torchrun ") for ln in lines) == 2


@pytest.mark.parametrize("launcher", config.LAUNCHERS)
def test_every_srun_exports_the_scripts_environment(launcher: str, fake_bin: Path, tmp_path: Path) -> None:
    """Under `sbatch --export=NONE` (a site default at some centres) srun inherits SLURM_EXPORT_ENV=NONE
    and its tasks would get none of PTMG_*: every srun line says --export=ALL. Without it, the
    stand-in srun (like Slurm) starts the tasks without the script's environment and the job fails."""
    script = slurm.render_slurm(cfg(nodes=2, launcher=launcher))
    sruns = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    assert sruns and all(" --export=ALL " in ln for ln in sruns), sruns
    rc, lines, stderr = run_sbatch(for_launcher(launcher, script, tmp_path), fake_bin, tmp_path, nodes=2,
                                   SLURM_EXPORT_ENV="NONE")
    assert rc == 0, stderr
    assert [ln.split()[1] for ln in lines if ln.startswith("torchrun ")] == ["node=0", "node=1"], lines
    without = tmp_path / "without"
    without.mkdir()
    rc, lines, _ = run_sbatch(for_launcher(launcher, script.replace(" --export=ALL", ""), without), fake_bin,
                              without, nodes=2, SLURM_EXPORT_ENV="NONE")
    assert rc != 0 and not any(ln.startswith("torchrun ") for ln in lines), lines


@pytest.mark.parametrize(("cell", "torch", "runs"), [
    (CELL, f"{TORCH}+cu126", True),   # the image's cell file
    (CELL, None, True),               # the cell file decides, not the venv
    (None, f"{TORCH}+cu126", True),   # an image without the cell file: its torch (local version)
    (None, TORCH, True),              # ... or a torch without one
    ("2.0.1-cuda11.7-cudnn8-runtime", f"{TORCH}+cu126", False),  # another cell
    (None, "2.0.1", False),           # another torch
    (None, f"{TORCH}1", False),       # not a prefix match: 2.7.01 is not 2.7.0
    (None, None, False),              # no image at all
])
def test_native_preflight_refuses_a_node_that_does_not_run_the_image(
        cell: str | None, torch: str | None, runs: bool, fake_bin: Path, tmp_path: Path) -> None:
    script = native_node(slurm.render_slurm(cfg(nodes=2, launcher="native")), tmp_path, cell=cell, torch=torch)
    rc, lines, stderr = run_sbatch(script, fake_bin, tmp_path, nodes=2)
    torchruns = [ln for ln in lines if ln.startswith("torchrun ")]
    if runs:
        assert rc == 0 and len(torchruns) == 2, stderr
    else:
        assert rc == 127 and not torchruns, (rc, stderr)
        assert f"this node does not run pt-multi-gpu:{CELL}" in stderr
        assert (f"runs cell {cell} " if cell else f"no torch {TORCH} in ") in stderr


def test_slurm_header() -> None:
    text = slurm.render_slurm(cfg(nodes=3, gpus_per_node=8, nproc_per_node=8, partition="gpu", account="ml",
                                   time_limit="02:00:00"))
    sbatch = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert sbatch == ["#SBATCH --job-name=ptmg-ddp", "#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1",
                      "#SBATCH --no-requeue", "#SBATCH --time=02:00:00", "#SBATCH --gpus-per-node=8",
                      "#SBATCH --cpus-per-task=32", "#SBATCH --mem=139264M", "#SBATCH --partition=gpu",
                      "#SBATCH --account=ml", "#SBATCH --output=ptmg-ddp-%j.out"]
    cpu = slurm.render_slurm(cfg(gpus_per_node=0, nproc_per_node=2, launcher="docker"))
    assert "--gpus" not in cpu
    apptainer = slurm.render_slurm(cfg(gpus_per_node=0, nproc_per_node=2, launcher="apptainer"))
    assert re.search(r'^ +apptainer exec --bind "\$\{PTMG_JOB_DIR\}" \\$', apptainer, re.M), "no --nv without GPUs"


# --- the verb ------------------------------------------------------------------------------------------------


@pytest.fixture
def matrix_file(tmp_path: Path) -> Path:
    """The seed cells as a matrix file of this test's own (CELL among them)."""
    return write_matrix(tmp_path / "matrix")


def test_verb_writes_one_file_per_cell(tmp_path: Path, matrix_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = cli.main(["launch", "--config", str(matrix_file), "--target", "jobset", "--nodes", "2", "--gpus-per-node",
                   "8", "--no-pin", "--out", str(out), "--json"])
    assert rc == 0
    written = json.loads(capsys.readouterr().out)
    assert sorted(w["cell"] for w in written) == sorted([OLD, MID, LATEST])
    assert {w["target"] for w in written} == {"jobset"}
    for w in written:
        path = Path(w["path"])
        assert path == out / w["cell"] / "jobset.yaml"
        assert jobset_errors(list(yaml.safe_load_all(path.read_text()))[1]) == []


def test_verb_prints_one_cell_to_stdout(matrix_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["launch", "--config", str(matrix_file), "--target", "slurm", "--only", CELL, "--gpus-per-node", "0", "--nproc-per-node", "2",
                   "--launcher", "docker", "--no-pin", "--command", "train.py --lr '1e-3'"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n")
    assert re.search(r"^    train\.py --lr 1e-3$", out, re.M)


def test_verb_gives_the_native_preflight_the_cells_torch(matrix_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from builder.matrix import load_matrix

    (cell,) = [c for c in load_matrix(matrix_file).cells if c.name == CELL]
    assert cli.main(["launch", "--config", str(matrix_file), "--target", "slurm", "--only", CELL, "--launcher",
                     "native", "--nodes", "2", "--no-pin"]) == 0
    out = capsys.readouterr().out
    assert f"export PTMG_JOB_CELL={CELL}\n" in out
    assert f"/site-packages/torch-{cell.torch}+*.dist-info" in out and f"no torch {cell.torch} in" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--target", "slurm"], "cells selected"),
    (["--target", "slurm", "--only", CELL, "--gpus-per-node", "0"], "--nproc-per-node"),
    (["--target", "pytorchjob", "--only", CELL, "--name", "UPPER"], "--name"),
    (["--target", "slurm", "--only", CELL, "--command", "'unclosed"], "--command"),
    (["--target", "slurm", "--only", "no-such-cell"], "matches no cell"),
    (["--target", "slurm", "--only", CELL, "--launcher", "native", "--mount", "/data:/data"],
     "--mount '/data:/data': --launcher native runs no container"),
])
def test_verb_refuses_bad_input_with_exit_2(argv: list[str], message: str, matrix_file: Path,
                                            capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    assert cli.main(["launch", "--config", str(matrix_file), "--no-pin", *argv]) == 2
    err = capfd.readouterr().err + caplog.text
    assert message in err


# --- compose.yaml ----------------------------------------------------------------------------------------------


def load_compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "compose.yaml").read_text()))


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    validator = vendored_schema("compose-spec.json")
    errors = sorted(validator.iter_errors(load_compose()), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    broken = load_compose()
    broken["services"]["pt"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilitys"] = ["gpu"]
    assert list(validator.iter_errors(broken)), "the schema check must be able to fail"


def test_compose_file_wires_gpus_ports_volumes_and_secrets() -> None:
    doc = load_compose()
    svc = doc["services"]["pt"]
    assert svc["image"] == "${PTMG_IMAGE:-pt-multi-gpu:latest}"
    (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert dev == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    assert svc["shm_size"]
    assert "8888:8888" in svc["ports"] and "2222:22" in svc["ports"]
    mounts = {v["target"]: v for v in svc["volumes"]}
    assert mounts["/workspace"]["type"] == "volume"
    assert mounts["/var/lib/pt-multi-gpu/ssh-host-keys"]["type"] == "volume"
    assert {mounts[t]["source"] for t in mounts} <= set(doc["volumes"])
    assert svc["environment"]["JUPYTER_TOKEN_FILE"] == "/run/secrets/jupyter_token"
    secrets = {s["source"]: s.get("target", s["source"]) for s in svc["secrets"]}
    assert secrets == {"jupyter_token": "jupyter_token", "ssh_authorized_keys": "ssh_authorized_keys"}
    assert set(doc["secrets"]) == {"jupyter_token", "ssh_authorized_keys"}
    assert all("file" in s for s in doc["secrets"].values())
    assert svc["labels"]["project"] == "pt-multi-gpu"


# --- .devcontainer/devcontainer.json ---------------------------------------------------------------------------

#: Top-level devcontainer.json properties and their JSON types, from the Dev Container
#: specification's reference (containers.dev/implementors/json_reference). A structural check:
#: no devcontainer JSON schema is published on PyPI, and nothing may be fetched at test time.
DEVCONTAINER_TYPES: dict[str, type | tuple[type, ...]] = {
    "name": str, "image": str, "build": dict, "dockerComposeFile": (str, list), "service": str,
    "workspaceFolder": str, "workspaceMount": str, "runArgs": list, "remoteUser": str, "containerUser": str,
    "forwardPorts": list, "portsAttributes": dict, "otherPortsAttributes": dict, "containerEnv": dict,
    "remoteEnv": dict, "mounts": list, "features": dict, "overrideFeatureInstallOrder": list,
    "customizations": dict, "hostRequirements": dict, "shutdownAction": str, "overrideCommand": bool,
    "updateRemoteUserUID": bool, "userEnvProbe": str, "init": bool, "privileged": bool, "capAdd": list,
    "securityOpt": list, "appPort": (int, str, list), "initializeCommand": (str, list, dict),
    "onCreateCommand": (str, list, dict), "updateContentCommand": (str, list, dict),
    "postCreateCommand": (str, list, dict), "postStartCommand": (str, list, dict),
    "postAttachCommand": (str, list, dict), "waitFor": str, "$schema": str,
}


def devcontainer_errors(doc: Mapping[str, Any]) -> list[str]:
    errors = [f"{k}: not a devcontainer.json property" for k in doc if k not in DEVCONTAINER_TYPES]
    errors += [f"{k}: expected {DEVCONTAINER_TYPES[k]}, got {type(v).__name__}" for k, v in doc.items()
               if k in DEVCONTAINER_TYPES and not isinstance(v, DEVCONTAINER_TYPES[k])]
    # An image-, Dockerfile- or Compose-based container: exactly one way to get it.
    kinds = [k for k in ("image", "build", "dockerComposeFile") if k in doc]
    if len(kinds) != 1:
        errors.append(f"needs exactly one of image, build, dockerComposeFile (has {kinds})")
    if "workspaceMount" in doc and "workspaceFolder" not in doc:
        errors.append("workspaceMount needs workspaceFolder")
    errors += [f"runArgs[{i}]: not a string" for i, a in enumerate(doc.get("runArgs", [])) if not isinstance(a, str)]
    for p in doc.get("forwardPorts", []):
        if not (isinstance(p, int) and 0 < p < 65536) and not (isinstance(p, str) and re.match(r"^[^:]+:\d+$", p)):
            errors.append(f"forwardPorts: {p!r} is not a port or host:port")
    for key in doc.get("portsAttributes", {}):
        if not re.match(r"^(\d+(-\d+)?|[^:]+:\d+|.+)$", str(key)):
            errors.append(f"portsAttributes: {key!r}")
    return errors


def _strip_jsonc(text: str) -> str:
    """devcontainer.json is JSON with comments: drop // line comments outside strings."""
    out = []
    for line in text.splitlines():
        in_str = False
        for i, ch in enumerate(line):
            if ch == '"' and (i == 0 or line[i - 1] != "\\"):
                in_str = not in_str
            if not in_str and line[i:i + 2] == "//":
                line = line[:i]
                break
        out.append(line)
    return "\n".join(out)


def load_devcontainer() -> dict[str, Any]:
    return dict(json.loads(_strip_jsonc((ROOT / ".devcontainer" / "devcontainer.json").read_text())))


def test_devcontainer_has_the_spec_shape() -> None:
    doc = load_devcontainer()
    assert devcontainer_errors(doc) == []
    assert devcontainer_errors({**doc, "runArg": []}) != [], "the check must be able to fail"
    assert devcontainer_errors({**doc, "build": {"dockerfile": "x"}}) != []


def test_devcontainer_runs_the_image_as_pt_in_workspace_with_gpus() -> None:
    doc = load_devcontainer()
    assert doc["image"].startswith("pt-multi-gpu:")
    assert doc["remoteUser"] == "pt"
    assert doc["workspaceFolder"] == "/workspace"
    assert "target=/workspace" in doc["workspaceMount"]
    args = doc["runArgs"]
    assert args[args.index("--gpus") + 1] == "all"
    assert args[args.index("--shm-size") + 1] == "8g"
    assert 8888 in doc["forwardPorts"]


def test_the_devcontainer_and_compose_name_a_cell_of_the_real_images_yaml() -> None:
    """Both name `pt-multi-gpu:<tag>` of a cell in images.yaml (or latest)."""
    from builder.matrix import load_matrix

    tags = {c.tag for c in load_matrix(ROOT / "images.yaml").cells} | {"latest"}
    assert load_devcontainer()["image"].split(":", 1)[1] in tags
    default = re.search(r":-([^}]+)\}", load_compose()["services"]["pt"]["image"])
    assert default and default.group(1).split(":", 1)[1] in tags


# --- the DDP job's result from every node (--node-out), for multi-node jobs ------------------------------------


def _ddp_job() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ptmg_ddp_job_node_out", ROOT / "smoke_tests" / "ddp_job.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # parses no arguments and imports no torch at import time
    return module


def test_ddp_job_writes_a_result_from_every_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = _ddp_job()
    out = tmp_path / "shared"
    env = {"RANK": "2", "LOCAL_RANK": "0", "GROUP_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(job, "run", lambda *a, **k: 0)
    assert job.main(["--node-out", str(out), "--phase-timeout", "30"]) == 0
    assert json.loads((out / "node-1.json").read_text()) == {
        "schema": 1, "node_rank": 1, "host": socket.gethostname(), "rank": 2, "local_world_size": 2,
        "world_size": 4, "exit": 0, "ok": True}
    assert sorted(p.name for p in out.iterdir()) == ["node-1.json"]  # written whole (no .tmp left)

    def broken(*a: Any, **k: Any) -> int:
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(job, "run", broken)  # a failed collective: the node reports its exit status
    assert job.main(["--node-out", str(out), "--phase-timeout", "30"]) == 1
    failed = json.loads((out / "node-1.json").read_text())
    assert failed["exit"] == 1 and failed["ok"] is False

    monkeypatch.setenv("LOCAL_RANK", "1")  # only each node's local rank 0 writes
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.setattr(job, "run", lambda *a, **k: 0)
    assert job.main(["--node-out", str(out), "--phase-timeout", "30"]) == 0
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert job.main(["--phase-timeout", "30"]) == 0  # no --node-out: no file
    assert not (out / "node-0.json").exists()
