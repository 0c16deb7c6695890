"""Ready-to-submit job definitions for a cell: a Slurm batch script, a Kubeflow PyTorchJob,
a JobSet (+ its headless Service).

Everything here is pure except :func:`cmd_launch` (and the one engine call that reads the
image's digest): ``render_slurm(cfg)`` and ``render_pytorchjob(cfg)`` / ``render_jobset(cfg)``
take a frozen :class:`LaunchConfig` and return text, deterministically.

The Slurm script comes from a Jinja2 template (``builder/launch/templates/sbatch.sh.j2``, StrictUndefined: the
template only loops and guards). The Kubernetes manifests are built as plain data and dumped
with PyYAML: a YAML template would have to get indentation and quoting right by hand, data
can't, and the unit tests check the same data against the Kubernetes client's models.

Every node runs the same torchrun command (``builder.smoke.torchrun.torchrun_argv``) with a c10d
rendezvous on the first node, so ranks are assigned by the rendezvous; the default script is
the image's own DDP smoke job (``ptmg_contract.DDP_JOB`` with
``builder.smoke.torchrun.ddp_job_args``).
"""

from __future__ import annotations

from builder.launch.config import FILENAMES, LAUNCHERS, TARGETS, ImagePin, LaunchConfig, LaunchError, pin_image
from builder.launch.kubernetes import render_jobset, render_pytorchjob
from builder.launch.slurm import render_slurm

__all__ = ["FILENAMES", "LAUNCHERS", "TARGETS", "ImagePin", "LaunchConfig", "LaunchError", "pin_image", "render"]


def render(target: str, cfg: LaunchConfig) -> str:
    if target == "slurm":
        return render_slurm(cfg)
    if target == "pytorchjob":
        return render_pytorchjob(cfg)
    if target == "jobset":
        return render_jobset(cfg)
    raise LaunchError(f"--target {target!r}: one of {', '.join(TARGETS)}")


