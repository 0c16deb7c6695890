"""The Kubernetes jobs `build.py launch` writes (builder/launch/kubernetes.py): the PyTorchJob and
the JobSet with its headless Service (no cluster).

What is checked against what:
- Kubernetes core objects (PodTemplateSpec, JobTemplateSpec, Service) against the official
  `kubernetes` client's OpenAPI models: every field name must exist (at every depth), every value
  must have the model's type, and required fields must be there (the client's own deserializer
  raises on a missing one).
- The PyTorchJob against the Kubeflow training operator's own SDK models (`kubeflow-training`),
  the same way.
- The JobSet against a structural check written from the v1alpha2 Go types
  (kubernetes-sigs/jobset api/jobset/v1alpha2/jobset_types.go): there is no JobSet SDK on PyPI.
  Its Job template is checked against the Kubernetes models."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
import yaml

import ptmg_contract as contract
from builder.launch import ImagePin, LaunchConfig, kubernetes
from tests.unit.launch.test_config import DIGEST, cfg

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


