"""The files HPC runtimes read from an image's root filesystem, made from its Docker config (pure).

- enroot/pyxis (NVIDIA/enroot doc/image-format.md, as `enroot import` writes them):
  ``/etc/environment`` (the config's Env, one KEY=value per line), ``/etc/rc`` (provenance and
  labels as comments, then: cd to WorkingDir, source /etc/rc.local, exec Entrypoint with the
  arguments or with Cmd), ``/etc/rc.local`` (a comment), ``/etc/fstab`` (Volumes as binds);
- Charliecloud: ``/ch/environment`` (what ``ch-run --set-env`` reads), the same lines;
- Apptainer/Singularity: ``/.singularity.d/`` with ``env/10-docker2singularity.sh`` (each
  variable exported unless the caller set it; PATH always), ``runscript``, ``labels.json`` and
  minimal ``actions/``: what `apptainer build` writes for a docker image.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from typing import Any


def config_of(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """The image config (``docker inspect``'s .Config) with absent fields as empty values."""
    cfg = attrs.get("Config") or {}
    return {"Env": list(cfg.get("Env") or []), "Entrypoint": list(cfg.get("Entrypoint") or []),
            "Cmd": list(cfg.get("Cmd") or []), "WorkingDir": str(cfg.get("WorkingDir") or "/"),
            "Labels": dict(cfg.get("Labels") or {}), "Volumes": sorted((cfg.get("Volumes") or {}).keys())}


def _q(words: Sequence[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)


def enroot_rc(cfg: Mapping[str, Any], uri: str) -> str:
    entrypoint, cmd = list(cfg["Entrypoint"]), list(cfg["Cmd"])
    if not entrypoint and not cmd:
        cmd = ["/bin/sh"]
    labels = "".join(f"# {k} {str(v).replace(chr(10), ' ')}\n" for k, v in sorted(cfg["Labels"].items()))
    workdir = cfg["WorkingDir"] or "/"
    ep = _q(entrypoint) + " " if entrypoint else ""
    return (f"# enroot-provenance: {uri}\n{labels}\n"
            f'mkdir -p "{workdir}" 2> /dev/null\n'
            f'cd "{workdir}" && unset OLDPWD || exit 1\n\n'
            "if [ -s /etc/rc.local ]; then\n    . /etc/rc.local\nfi\n\n"
            f'if [ $# -gt 0 ]; then\n    exec {ep}"$@"\nelse\n    exec {(ep + _q(cmd)).strip()}\nfi\n')


def apptainer_env(env: Sequence[str]) -> str:
    lines = ["#!/bin/sh"]
    for item in env:
        key, _, value = item.partition("=")
        v = value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace("`", "\\`")
        lines.append(f'export {key}="{v}"' if key == "PATH" else f'export {key}="${{{key}:-"{v}"}}"')
    return "\n".join(lines) + "\n"


def apptainer_runscript(cfg: Mapping[str, Any]) -> str:
    return ("#!/bin/sh\n"
            f"OCI_ENTRYPOINT={shlex.quote(_q(cfg['Entrypoint']))}\nOCI_CMD={shlex.quote(_q(cfg['Cmd']))}\n"
            'if [ $# -gt 0 ]; then set -- $OCI_ENTRYPOINT "$@"; else eval "set -- $OCI_ENTRYPOINT $OCI_CMD"; fi\n'
            'exec "$@"\n')


ACTIONS = {
    "exec": '#!/bin/sh\nfor script in /.singularity.d/env/*.sh; do [ -f "$script" ] && . "$script"; done\nexec "$@"\n',
    "run": '#!/bin/sh\nfor script in /.singularity.d/env/*.sh; do [ -f "$script" ] && . "$script"; done\n'
           'exec /.singularity.d/runscript "$@"\n',
    "shell": '#!/bin/sh\nfor script in /.singularity.d/env/*.sh; do [ -f "$script" ] && . "$script"; done\n'
             'exec /bin/bash "$@"\n',
}


def files(cfg: Mapping[str, Any], uri: str) -> dict[str, tuple[str, int]]:
    """Path inside the rootfs -> (text, mode) of every runtime file the export adds."""
    env = "".join(f"{e}\n" for e in cfg["Env"])
    out: dict[str, tuple[str, int]] = {
        "etc/environment": (env, 0o644),
        "etc/rc": (enroot_rc(cfg, uri), 0o644),
        "etc/rc.local": ("# This file is sourced by /etc/rc when the container starts.\n"
                         "# It can be used to manipulate the entrypoint or the command of the container.\n", 0o644),
        "etc/fstab": ("".join(f"${{ENROOT_ROOTFS}}{v} {v} none x-create=dir,bind,rw,nosuid,nodev\n"
                              for v in cfg["Volumes"]), 0o644),
        "ch/environment": (env, 0o644),
        ".singularity.d/env/10-docker2singularity.sh": (apptainer_env(cfg["Env"]), 0o755),
        ".singularity.d/runscript": (apptainer_runscript(cfg), 0o755),
        ".singularity.d/labels.json": (json.dumps(cfg["Labels"], indent=1, sort_keys=True) + "\n", 0o644),
    }
    for name, text in ACTIONS.items():
        out[f".singularity.d/actions/{name}"] = (text, 0o755)
    return out
