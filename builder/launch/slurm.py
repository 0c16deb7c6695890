"""A Slurm batch script (``templates/sbatch.sh.j2``: the template only loops and guards)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

import ptmg_contract as contract
from builder.common.paths import template_dir
from builder.common.templates import environment
from builder.launch.config import (
    APPTAINER_LIBS,
    ENROOT_GPU_ENV,
    ENROOT_RDMA_ENV,
    FILENAMES,
    JOIN_TIMEOUT_S,
    RDZV_ENDPOINT_VAR,
    RDZV_ID_VAR,
    RDZV_PORT_BASE,
    RDZV_PORT_SPAN,
    RESULT_TMP_VAR,
    SLURM_VARS,
    LaunchConfig,
    pyxis_image,
)
from builder.smoke.torchrun import torchrun_argv

# --- shell helpers -------------------------------------------------------------------


def shell_word(word: str, expand: Sequence[str] = ()) -> str:
    """One POSIX shell word. Words listed in ``expand`` are double-quoted so their ``${VAR}``
    expands where the line runs; everything else is quoted literally."""
    if word in expand:
        return '"' + re.sub(r'(["\\`])', r"\\\1", word) + '"'
    return shlex.quote(word)


def shell_join(argv: Sequence[str], expand: Sequence[str] = ()) -> str:
    return " ".join(shell_word(w, expand) for w in argv)


# --- Slurm ---------------------------------------------------------------------------


def slurm_torchrun(cfg: LaunchConfig) -> str:
    """The torchrun line each node runs (its rendezvous endpoint and id, and the image's DDP job's
    record folder, expand on the node)."""
    script = cfg.command or cfg.ddp_job(out=RESULT_TMP_VAR)
    argv = torchrun_argv(nnodes=cfg.nodes, nproc_per_node=cfg.nproc_per_node, script=script[0],
                         script_args=script[1:], rdzv_endpoint=RDZV_ENDPOINT_VAR, rdzv_id=RDZV_ID_VAR,
                         join_timeout_s=JOIN_TIMEOUT_S)
    launcher, job = argv[: len(argv) - len(script)], argv[len(argv) - len(script):]
    expand = (RDZV_ENDPOINT_VAR, RDZV_ID_VAR)
    return f"{shell_join(launcher, expand)} \\\n    {shell_join(job, (RESULT_TMP_VAR,))}"


def native_torch_globs(cfg: LaunchConfig) -> tuple[str, ...]:
    """Where a node without the cell file must have the cell's torch (``torch-2.7.0+cu126.dist-info``)."""
    site = f"{contract.VENV}/lib/python3*/site-packages"
    if not cfg.torch:
        return (f"{site}/torch-*.dist-info",)
    return (f"{site}/torch-{cfg.torch}.dist-info", f"{site}/torch-{cfg.torch}+*.dist-info")


def sbatch_lines(cfg: LaunchConfig) -> list[str]:
    """The job's #SBATCH requests past the node count: time, GPUs, cores and memory per node."""
    extra = [f"--time={cfg.time_limit}"]
    if cfg.gpus_per_node:
        extra.append(f"--gpus-per-node={cfg.gpus_per_node}")
    if cfg.exclusive:
        extra.append("--exclusive")
    if not (cfg.exclusive and cfg.cpus_per_task is None):  # --exclusive alone: every core (SLURM_CPUS_ON_NODE)
        extra.append(f"--cpus-per-task={cfg.node_cpus}")
    extra.append(f"--mem={cfg.node_mem_mib}M" if cfg.node_mem_mib else "--mem=0")
    if cfg.partition:
        extra.append(f"--partition={cfg.partition}")
    if cfg.account:
        extra.append(f"--account={cfg.account}")
    return extra


def srun_line(cfg: LaunchConfig) -> str:
    """One task per node, its output lines prefixed by its task number (--label), the cores the job
    asked for (srun 22.05-23.02 does not take --cpus-per-task from sbatch) and the node's GPUs (the
    step then has them: SLURM_STEP_GPUS, CUDA_VISIBLE_DEVICES)."""
    srun = ["srun", "--kill-on-bad-exit=1", "--export=ALL", "--label", f"--nodes={cfg.nodes}", "--ntasks-per-node=1"]
    srun.append('--cpus-per-task="${SLURM_CPUS_ON_NODE}"' if cfg.exclusive and cfg.cpus_per_task is None
                else f"--cpus-per-task={cfg.node_cpus}")
    if cfg.gpus_per_node:
        srun.append(f"--gpus-per-node={cfg.gpus_per_node}")
    return " ".join(srun)


def render_slurm(cfg: LaunchConfig) -> str:
    """An sbatch script for ``cfg`` (see builder/launch/templates/sbatch.sh.j2)."""
    env = cfg.env_vars(default_ifname=None)
    if cfg.launcher == "pyxis":  # enroot's hooks: set by the job, never by the image
        hooks = (ENROOT_GPU_ENV if cfg.gpus_per_node else ()) + (ENROOT_RDMA_ENV if cfg.rdma else ())
        env = (*env, *((k, v) for k, v in hooks if k not in dict(env)))
    image = cfg.image_file or (pyxis_image(cfg.image.ref) if cfg.launcher == "pyxis" else cfg.image.ref)
    rdzv_port = str(cfg.rdzv_port) if cfg.rdzv_port is not None else \
        f"$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % {RDZV_PORT_SPAN} ))"
    # docker passes only what -e names; NCCL's network settings (NCCL_IB_HCA, ...) pass through by
    # name from the job's environment when set there (`-e NAME` with NAME unset sets nothing).
    record = () if cfg.command else ("PTMG_RESULT_TMP",)
    passed = tuple(dict.fromkeys((*SLURM_VARS, "PTMG_RDZV_ENDPOINT", "PTMG_RDZV_ID", "PTMG_NODE_SCRIPT", *record,
                                  *(k for k, _ in env), *contract.NCCL_NET_ENV)))
    return environment(template_dir("launch")).get_template("sbatch.sh.j2").render(
        source=cfg.source,
        cell=cfg.cell,
        pin=cfg.image,
        filename=FILENAMES["slurm"],
        name=cfg.name,
        nodes=cfg.nodes,
        nproc_per_node=cfg.nproc_per_node,
        gpus_per_node=cfg.gpus_per_node,
        sbatch_extra=sbatch_lines(cfg),
        image_q=shlex.quote(image),
        image_file=bool(cfg.image_file),
        srun=srun_line(cfg),
        apptainer_libs=APPTAINER_LIBS,
        ch_binds="".join(f" --bind={m}" for m in cfg.mounts),
        rdzv_port=rdzv_port,
        ddp_record=not cfg.command,  # the image's DDP job: its record is copied to the job's directory
        env=[(k, shlex.quote(v)) for k, v in env],
        torchrun=slurm_torchrun(cfg),
        launcher=cfg.launcher,
        mounts=list(cfg.mounts),
        # the job's directory first (the DDP job's record is copied there), then --mount's
        pyxis_mounts=",".join((['"${PTMG_JOB_DIR}:${PTMG_JOB_DIR}"'] if not cfg.command else []) + list(cfg.mounts)),
        shm_size=cfg.shm_size,
        docker_env=" ".join(f"-e {k}" for k in passed),
        cell_file=contract.CELL_FILE,
        job_label=contract.LABEL_SLURM_JOB,
        cell_q=shlex.quote(cfg.cell),
        torch=cfg.torch or "(any version)",
        torch_test=" || ".join(f'compgen -G "{g}"' for g in native_torch_globs(cfg)),
        venv=contract.VENV,
        ib_dir=contract.IB_DEVICE_DIR,
        rdma=cfg.rdma,
    )


