"""`build.py launch`: ready-to-submit job definitions for a cell (Slurm, PyTorchJob, JobSet)."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

import ptmg_contract as contract
from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.errors import InputError, StepFailed
from builder.common.log import log
from builder.launch import FILENAMES, LAUNCHERS, TARGETS, ImagePin, LaunchConfig, pin_image, render
from builder.launch.config import (
    CPUS_PER_GPU_RANK,
    MEM_PER_CPU_RANK_G,
    MEM_PER_GPU_RANK_G,
    RDZV_PORT_BASE,
    RDZV_PORT_SPAN,
    resolve_image_file,
)


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = types.text(text).partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, value


def _resource(text: str) -> tuple[str, int]:
    name, sep, count = types.text(text).partition("=")
    if not sep or not count.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=COUNT, e.g. rdma/rdma_shared_device_a=1")
    return name, int(count)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, choices=TARGETS,
                   help="slurm: an sbatch script; pytorchjob: a Kubeflow PyTorchJob; "
                        "jobset: a JobSet + its headless Service")
    p.add_argument("--nodes", type=types.count(1, 4096), default=1, help="nodes (Slurm nodes, pods) (default 1)")
    p.add_argument("--gpus-per-node", type=types.count(0, 64), default=8,
                   help="GPUs per node (default 8; 0: CPU ranks over gloo)")
    p.add_argument("--nproc-per-node", type=types.count(1, 256), default=None,
                   help="ranks per node (default: --gpus-per-node; required with --gpus-per-node 0)")
    p.add_argument("--command", default=None, type=types.text, metavar="'SCRIPT ARGS'",
                   help="what torchrun runs on every rank, in shell words (default: the image's DDP smoke job, "
                        f"{contract.DDP_JOB})")
    p.add_argument("--launcher", choices=LAUNCHERS, default="pyxis",
                   help="Slurm: how each node runs the image: pyxis (srun --container-image), apptainer "
                        "(apptainer exec docker://... or a .sif), docker (docker run --network host), native (nodes "
                        "whose OS is the image, e.g. Slurm in containers of it: srun runs the script directly) or "
                        "charliecloud (ch-run of an exported .sqsh; CPU ranks only) (default pyxis)")
    p.add_argument("--image-file", default=None, type=types.text, metavar="PATH",
                   help="Slurm: run this exported image file instead of the registry image (pyxis, charliecloud: "
                        "a .sqsh; apptainer: a .sif; from `build.py export`); every node opens it by its absolute "
                        "path, so put it on a shared filesystem")
    p.add_argument("--name", default="ptmg-ddp", type=types.text,
                   help="job name (DNS-1035, at most 40 characters; default ptmg-ddp)")
    p.add_argument("--image", default=None, type=types.text, metavar="REF",
                   help="the image to run (default: the cell's tag; pinned by its registry digest when the "
                        "local engine knows one)")
    p.add_argument("--no-pin", action="store_true", help="don't ask the Docker engine for a digest; name the tag")
    p.add_argument("--rdzv-port", type=types.count(1, 65535), default=None,
                   help=f"c10d rendezvous port (default: Slurm {RDZV_PORT_BASE} + the job id %% {RDZV_PORT_SPAN}, as "
                        f"jobs may share a node; Kubernetes {contract.RDZV_PORT})")
    p.add_argument("--shm-size", default=contract.SHM_SIZE, type=types.text,
                   help=f"/dev/shm per node (docker --shm-size; k8s emptyDir) (default {contract.SHM_SIZE})")
    p.add_argument("--nccl-debug", default="WARN", type=types.text,
                   help="NCCL_DEBUG (default WARN; INFO to debug a hang)")
    p.add_argument("--socket-ifname", default=None, type=types.text,
                   help="NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME (default: eth0 on Kubernetes, unset on Slurm)")
    p.add_argument("--env", action="append", default=[], type=_env_pair, metavar="KEY=VALUE",
                   help="extra environment for every node (repeatable)")
    p.add_argument("--mount", action="append", default=[], metavar="SRC:DST[:ro]", type=types.text,
                   help="Slurm: bind-mount a host path into the container (repeatable; not with --launcher native)")
    p.add_argument("--time", default="01:00:00", type=types.text, help="Slurm: --time limit (default 01:00:00)")
    p.add_argument("--cpus-per-task", type=types.count(1, 4096), default=None, metavar="N",
                   help=f"cores per node for its ranks (Slurm --cpus-per-task, the pod's cpu request; default "
                        f"{CPUS_PER_GPU_RANK} per GPU rank, 1 per CPU rank)")
    p.add_argument("--mem", default=None, type=types.text, metavar="SIZE",
                   help=f"memory per node (Slurm --mem, e.g. 512G; 0: all of it; the pod's memory request; default "
                        f"{MEM_PER_GPU_RANK_G}G per GPU rank, {MEM_PER_CPU_RANK_G}G per CPU rank, plus --shm-size)")
    p.add_argument("--exclusive", action="store_true",
                   help="Slurm: whole nodes (sbatch --exclusive): every core and, unless --mem says, all memory")
    p.add_argument("--rdma", action="store_true",
                   help="Slurm: NCCL over the nodes' InfiniBand/RoCE (pyxis: sets MELLANOX_VISIBLE_DEVICES=all for "
                        "enroot's Mellanox hook; the docker launcher adds the devices of a node that has them)")
    p.add_argument("--partition", default=None, type=types.text, help="Slurm: --partition")
    p.add_argument("--account", default=None, type=types.text, help="Slurm: --account")
    p.add_argument("--namespace", default=None, type=types.text, help="Kubernetes: metadata.namespace")
    p.add_argument("--selftest-init", action="store_true",
                   help="Kubernetes: run the image's selftest as an initContainer first")
    p.add_argument("--rdma-resource", action="append", default=[], type=_resource, metavar="NAME=COUNT",
                   help="Kubernetes: an RDMA device plugin's resource per pod, e.g. rdma/rdma_shared_device_a=1 or "
                        "vpc.amazonaws.com/efa=4 (repeatable); also adds the IPC_LOCK capability")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="write DIR/<cell>/<file> (needed when several cells are selected); default: stdout")


def _pin(ctx: Context, ref: str, no_pin: bool, local: str | None = None) -> ImagePin:
    """``ref`` pinned by the digest the local image ``local`` (default ``ref``) has in a registry."""
    if no_pin:
        return ImagePin(ref=ref, tag_ref=ref)
    try:
        attrs = ctx.engine().image_attrs(local or ref)
    except StepFailed as exc:  # no engine here: still render, by tag
        log.warning("can't ask the Docker engine for %s's digest (%s); naming the tag", ref, exc)
        return ImagePin(ref=ref, tag_ref=ref)
    return pin_image(ref, attrs)


def run(ctx: Context) -> int:
    a = ctx.args
    if not ctx.cells:
        raise InputError("--only/--exclude: no cell selected; `build.py matrix` lists them")
    if a.out is None and len(ctx.cells) > 1:
        raise InputError(f"--only: {len(ctx.cells)} cells selected; choose one with --only CELL, or give --out DIR")
    nproc = a.nproc_per_node if a.nproc_per_node is not None else a.gpus_per_node
    image_file = ""
    if a.image_file is not None:
        if a.target != "slurm":
            raise InputError(f"--image-file {a.image_file}: for --target slurm only (Kubernetes pulls images from "
                             "a registry)")
        image_file = resolve_image_file(a.image_file)
    if a.target != "slurm" and (a.exclusive or a.rdma or a.mem == "0"):
        flag = "--exclusive" if a.exclusive else "--rdma" if a.rdma else "--mem 0"
        raise InputError(f"{flag}: for --target slurm only (a pod asks for a size; RDMA on Kubernetes: "
                         "--rdma-resource)")
    if a.target == "slurm" and a.launcher == "apptainer" and not image_file:
        log.warning("--launcher apptainer without --image-file: every node converts docker://IMAGE to a SIF itself "
                    "(minutes each, and they add to the nodes' start-up skew); export one SIF once, to a shared "
                    "filesystem: `build.py export CELL --format sif -o PATH.sif`, then --image-file PATH.sif")
    try:
        command = tuple(shlex.split(a.command)) if a.command else ()
    except ValueError as exc:
        raise InputError(f"--command {a.command!r}: {exc}; give shell words, e.g. 'train.py --epochs 3'") from None
    written: list[dict[str, Any]] = []
    for cell in ctx.cells:
        # Another platform's cell is <tag>-<arch> here, but its registry tag is the cell's tag (both platforms).
        ref = a.image or f"{cell.repository}:{cell.tag}"
        cfg = LaunchConfig(
            cell=cell.name,
            image=_pin(ctx, ref, a.no_pin or a.dry_run or bool(image_file), None if a.image else cell.ref),
            image_file=image_file, nodes=a.nodes,
            gpus_per_node=a.gpus_per_node, nproc_per_node=nproc, name=a.name, command=command, launcher=a.launcher,
            torch=cell.torch,
            rdzv_port=a.rdzv_port, shm_size=a.shm_size, nccl_debug=a.nccl_debug, socket_ifname=a.socket_ifname,
            env=tuple(a.env), mounts=tuple(a.mount), time_limit=a.time, partition=a.partition, account=a.account,
            selftest_init=a.selftest_init, namespace=a.namespace, source=ctx.config_display,
            rdma_resources=tuple(a.rdma_resource), arch=cell.arch, cpus_per_task=a.cpus_per_task, mem=a.mem,
            exclusive=a.exclusive, rdma=a.rdma,
        )
        text = render(a.target, cfg)
        if not cfg.image.pinned and not image_file:
            log.warning("%s: %s", cell.name, cfg.image.note)
        entry = {"cell": cell.name, "target": a.target, "image": cfg.image.ref, "digest": cfg.image.digest,
                 "image_id": cfg.image.image_id, "path": None}
        if a.out is None or a.dry_run:
            if a.out is not None:
                log.info("would write %s", a.out / cell.name / FILENAMES[a.target])
            elif not a.json:
                print(text, end="")
        else:
            path = a.out / cell.name / FILENAMES[a.target]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            if a.target == "slurm":
                path.chmod(0o755)
            log.info("wrote %s", path)
            entry["path"] = str(path)
        written.append(entry)
    if a.json:
        print(json.dumps(written, indent=2))
    return 0


VERB = Verb("launch", "ready-to-submit multi-node jobs for Slurm (pyxis, apptainer, docker, native, charliecloud) "
            "and Kubernetes; "
            "see [docs/launch.md](docs/launch.md)", "launch --target slurm|pytorchjob|jobset", run, add_arguments,
            "Write ready-to-submit job definitions for the selected cell(s): a Slurm sbatch script, a Kubeflow "
            "PyTorchJob or a JobSet, pinned to the image's digest when one is known.")
