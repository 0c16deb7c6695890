"""Kubeflow PyTorchJob and JobSet manifests, built as data and dumped with PyYAML."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

import ptmg_contract as contract
from builder.launch.config import CONTAINER, FILENAMES, JOIN_TIMEOUT_S, LaunchConfig
from builder.smoke.torchrun import torchrun_argv

# --- Kubernetes ----------------------------------------------------------------------


def _meta(cfg: LaunchConfig, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if cfg.namespace:
        meta["namespace"] = cfg.namespace
    meta["labels"] = {**cfg.labels, contract.LABEL_CELL: cfg.cell}
    annotations = {contract.label("image"): cfg.image.tag_ref}
    if cfg.image.image_id:
        annotations[contract.label("image-id")] = cfg.image.image_id
    meta["annotations"] = annotations
    return meta


def _resources(cfg: LaunchConfig) -> dict[str, Any]:
    """What each pod asks for: its cores and memory (the memory-backed /dev/shm counted: its pages are
    charged to the pod), the GPUs and the RDMA devices. Limits equal requests, so the pod is of the
    Guaranteed QoS class: the last to be evicted when a node runs short of memory."""
    amounts: dict[str, Any] = {"cpu": str(cfg.node_cpus)}
    if cfg.node_mem_mib:
        amounts["memory"] = f"{cfg.node_mem_mib}Mi"
    if cfg.gpus_per_node:
        amounts["nvidia.com/gpu"] = cfg.gpus_per_node
    amounts.update({name: count for name, count in cfg.rdma_resources})
    return {"resources": {"requests": dict(amounts), "limits": dict(amounts)}}


def _rdma(cfg: LaunchConfig) -> dict[str, Any]:
    """RDMA for NCCL: the device plugin's resources (they bring /dev/infiniband into the pod) and
    IPC_LOCK, so buffer registration (ibv_reg_mr) is not capped by the locked-memory limit."""
    if not cfg.rdma_resources:
        return {}
    return {"securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}


def pod_spec(cfg: LaunchConfig, args: Sequence[str], extra_env: Sequence[Mapping[str, Any]] = (),
             ports: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The pod every node runs: the image's entrypoint (tini; the command runs as ``pt``) with
    torchrun as its arguments, its resources (:func:`_resources`), a memory-backed /dev/shm, the NCCL env."""
    env = [{"name": k, "value": v} for k, v in cfg.env_vars(default_ifname="eth0")] + [dict(e) for e in extra_env]
    shm_mount = [{"name": "dshm", "mountPath": "/dev/shm"}]
    main: dict[str, Any] = {
        "name": CONTAINER,
        "image": cfg.image.ref,
        "imagePullPolicy": "IfNotPresent",
        # `args`, not `command`: the image's ENTRYPOINT (tini + start.sh) stays, drops to `pt`
        # and passes the exit status through.
        "args": list(args),
        "env": env,
        **_resources(cfg),
        **_rdma(cfg),
        "volumeMounts": shm_mount,
    }
    if ports:
        main["ports"] = [dict(p) for p in ports]
    spec: dict[str, Any] = {"restartPolicy": "Never"}
    if cfg.arch:  # the cell's platform (arm64: Grace Hopper/Blackwell nodes); the digest pins one platform
        spec["nodeSelector"] = {"kubernetes.io/arch": cfg.arch}
    if cfg.selftest_init:
        selftest_args = ["selftest", "--nproc", str(cfg.nproc_per_node)]
        if cfg.gpus_per_node:
            selftest_args.append("--require-gpu")
        spec["initContainers"] = [{
            "name": "selftest",
            "image": cfg.image.ref,
            "imagePullPolicy": "IfNotPresent",
            "args": selftest_args,
            **_resources(cfg),  # the same as the main container's: the pod stays Guaranteed
            "volumeMounts": shm_mount,
        }]
    spec["containers"] = [main]
    # NCCL and DataLoader workers need more shared memory than the runtime's 64 MB default.
    spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": _k8s_quantity(cfg.shm_size)}}]
    return spec


def _k8s_quantity(size: str) -> str:
    """Docker-style 8g -> Kubernetes 8Gi (the size is checked by LaunchConfig)."""
    return size[:-1] + {"k": "Ki", "m": "Mi", "g": "Gi"}[size[-1].lower()] if size[-1].isalpha() else size


def _port(cfg: LaunchConfig) -> int:
    """The rendezvous port: every pod has its own network, so the fixed default serves."""
    return cfg.rdzv_port if cfg.rdzv_port is not None else contract.RDZV_PORT


def _torchrun(cfg: LaunchConfig, endpoint: str) -> tuple[str, ...]:
    return torchrun_argv(nnodes=cfg.nodes, nproc_per_node=cfg.nproc_per_node, script=cfg.script[0],
                         script_args=cfg.script[1:], rdzv_endpoint=endpoint, rdzv_id=cfg.name,
                         join_timeout_s=JOIN_TIMEOUT_S)


def pytorchjob(cfg: LaunchConfig) -> dict[str, Any]:
    """A Kubeflow PyTorchJob (kubeflow.org/v1): one Master, nodes-1 Workers.

    The training operator gives every replica PET_MASTER_ADDR/PET_MASTER_PORT (the Master's
    service) and creates that service. torchrun meets there with the c10d rendezvous; Kubernetes
    expands ``$(PET_MASTER_ADDR)`` in args from the container's env.
    """
    argv = _torchrun(cfg, "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)")
    ports = [{"name": "pytorchjob-port", "containerPort": _port(cfg), "protocol": "TCP"}]
    template = {"metadata": {"labels": {**cfg.labels, contract.LABEL_CELL: cfg.cell}},
                "spec": pod_spec(cfg, argv, ports=ports)}
    replicas: dict[str, Any] = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
    if cfg.nodes > 1:
        replicas["Worker"] = {"replicas": cfg.nodes - 1, "restartPolicy": "Never", "template": template}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _meta(cfg, cfg.name),
        "spec": {
            "nprocPerNode": str(cfg.nproc_per_node),
            # One failed rank fails the job; no restarts (torchrun --max_restarts 0 as well).
            "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": replicas,
        },
    }


JOBSET_REPLICATED_JOB = "node"


def jobset(cfg: LaunchConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """A headless Service and a JobSet (jobset.x-k8s.io/v1alpha2) of one Indexed Job with
    ``nodes`` pods. Pod ``i`` is ``NAME-node-0-i.NAME``; the rendezvous is pod 0."""
    port = _port(cfg)
    argv = _torchrun(cfg, f"{cfg.name}-{JOBSET_REPLICATED_JOB}-0-0.{cfg.name}:{port}")
    node_rank = {"name": "NODE_RANK", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}
    ports = [{"name": "rdzv", "containerPort": port, "protocol": "TCP"}]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(cfg, cfg.name),
        "spec": {
            "clusterIP": "None",  # headless: one DNS record per pod
            "publishNotReadyAddresses": True,  # pods resolve before they are Ready (the rendezvous needs it)
            "selector": {"jobset.sigs.k8s.io/jobset-name": cfg.name},
            "ports": [{"name": "rdzv", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }
    job_spec = {
        "parallelism": cfg.nodes,
        "completions": cfg.nodes,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "template": {"metadata": {"labels": {**cfg.labels, contract.LABEL_CELL: cfg.cell}},
                     "spec": pod_spec(cfg, argv, extra_env=[node_rank], ports=ports)},
    }
    js = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": _meta(cfg, cfg.name),
        "spec": {
            # The Service above is this subdomain; JobSet uses it instead of making its own.
            "network": {"enableDNSHostnames": True, "subdomain": cfg.name, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": 0},
            "successPolicy": {"operator": "All"},
            "replicatedJobs": [{"name": JOBSET_REPLICATED_JOB, "replicas": 1, "template": {"spec": job_spec}}],
        },
    }
    return service, js


def _yaml_header(cfg: LaunchConfig, target: str, submit: str) -> str:
    return (f"# GENERATED by `build.py launch --target {target}` from {cfg.source} (cell {cfg.cell}); "
            "edit the flags, not this file.\n"
            f"# Image: {cfg.image.note}\n"
            f"# {cfg.nodes} node(s) x {cfg.nproc_per_node} rank(s); submit: {submit}\n")


class _Dumper(yaml.SafeDumper):
    """No ``&id001`` anchors for values used twice: kubectl reads them, people shouldn't have to."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _dump(docs: Sequence[Mapping[str, Any]]) -> str:
    return "---\n".join(yaml.dump(dict(d), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
                        for d in docs)


def render_pytorchjob(cfg: LaunchConfig) -> str:
    return _yaml_header(cfg, "pytorchjob", f"kubectl apply -f {FILENAMES['pytorchjob']}") + _dump([pytorchjob(cfg)])


def render_jobset(cfg: LaunchConfig) -> str:
    return _yaml_header(cfg, "jobset", f"kubectl apply -f {FILENAMES['jobset']}") + _dump(list(jobset(cfg)))


