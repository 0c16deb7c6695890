"""Which container runtime this process runs in, named for the selftest's first line.

Read from what each runtime leaves behind (environment variables and marker files), most
specific first: an Apptainer or Charliecloud container of an image exported from Docker still
has the image's files, so the runtime's own variables win over files like /.dockerenv.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping


def runtime(environ: Mapping[str, str] | None = None, exists: Callable[[str], bool] = os.path.exists,
            read: Callable[[str], str] | None = None) -> str:
    """A short description: 'docker', 'apptainer (SIF /x.sif)', 'charliecloud', ... plus the
    scheduler ('under Slurm job 12') and the uid when it has no passwd entry."""
    env = os.environ if environ is None else environ
    read = read or _read
    if env.get("APPTAINER_CONTAINER") or env.get("SINGULARITY_CONTAINER"):
        name = f"apptainer ({env.get('APPTAINER_CONTAINER') or env.get('SINGULARITY_CONTAINER')})"
    elif env.get("CH_RUNNING"):
        name = "charliecloud (ch-run)"
    elif exists("/run/.containerenv"):
        name = "podman"
    elif exists("/.dockerenv"):
        name = "docker"
    elif env.get("KUBERNETES_SERVICE_HOST"):
        name = "kubernetes"
    elif _enroot_rc(read("/etc/rc")):
        name = "enroot/pyxis (or another runtime of the enroot export)"
    else:
        name = "no container runtime recognised (a bare host or an unknown runtime)"
    extra = []
    if env.get("SLURM_JOB_ID"):
        extra.append(f"under Slurm job {env['SLURM_JOB_ID']}")
    if env.get("KUBERNETES_SERVICE_HOST") and name != "kubernetes":
        extra.append("in a Kubernetes pod")
    return ", ".join([name, *extra])


def _enroot_rc(rc: str) -> bool:
    """enroot's command script: the export's names enroot; what `enroot import` writes does not
    (labels as comments, then a cd and `. /etc/rc.local`, which only enroot's scripts source)."""
    return "enroot" in rc or ". /etc/rc.local" in rc


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(65536)
    except OSError:
        return ""
