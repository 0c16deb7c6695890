"""The multi-node Slurm cluster of slurm_cluster.py with pyxis: every container also has enroot 4.1.2
and pyxis 0.24.0 (the files `scripts/ensure-hpc-runtimes.sh` installed on this host, copied into the
test image), and slurmd loads pyxis through /etc/slurm/plugstack.conf.

    image = build_pyxis_image(client, cell, cell_ref, labels, log_dir)
    with SlurmCluster(client, image, labels, nodes=2, run_options=node_options(sqsh)) as cluster: ...

What enroot needs in a container that stands in for a compute node (a real node runs enroot on its
own kernel, with no container around it): user namespaces and mounts. Docker's default seccomp
profile refuses `unshare -U` (EPERM), so the nodes run with `seccomp=unconfined`; and /dev/fuse,
which squashfuse and fuse-overlayfs open: pyxis mounts the squashfs instead of unpacking it
(`use_squashfuse=1`, below). And for enroot's own pull (`--container-image=REGISTRY#IMAGE`), which
runs as the job's user: its two helpers get the file capabilities NVIDIA's enroot+caps package gives
them (`make setcap`: CAP_SYS_ADMIN and CAP_MKNOD for enroot-aufs2ovlfs, CAP_SYS_ADMIN for
enroot-mksquashovlfs: overlayfs's trusted.* xattrs and whiteout devices), and the nodes get
CAP_SYS_ADMIN added to their bounding set, without which no file capability can grant it (without
both: "enroot-aufs2ovlfs: failed to set capabilities: Operation not permitted"). No privileged mode.

The plugstack line, as a site writes it (pyxis's README lists the options):
- use_squashfuse=1: `--container-image=/abs/x.sqsh` (the launcher's `--image-file`) is mounted with
  squashfuse + fuse-overlayfs instead of unpacked (`enroot create`, 4 GB a node a job): seconds
  instead of a minute a job on this 2-core host.
- execute_entrypoint=1 (not pyxis's default: a site that runs images' entrypoints): the launch
  script's own --no-container-entrypoint is what keeps the image's ENTRYPOINT off; a plain
  `srun --container-image` runs it (the registry probe's control, test_pyxis).
- container_scope=job: a named container (--container-name) lives as long as the job.
enroot (enroot.conf): per-uid paths under /run and /tmp as pyxis's README suggests, the layer cache
per group under /var/lib/enroot-cache (kept for the node's life, shared by its jobs);
ENROOT_ALLOW_HTTP=yes for the test registry, which speaks plain HTTP (pyxis drops ENROOT_ALLOW_HTTP
from a job's environment, so only the site's config can set it; enroot then speaks http to every
registry, following a redirect to https); and enroot's PyTorch hook enabled (50-slurm-pytorch.sh,
copied from its extra hooks into hooks.d, as sites that run NGC images do).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import docker

from .slurm_cluster import HERE, build_slurm_image

PREFIX = Path("/usr/local")
PYXIS_SO = PREFIX / "lib/slurm/spank_pyxis.so"
#: What enroot's `make install` and pyxis's wrote under PREFIX (relative paths).
RUNTIME_FILES = ("bin/enroot", "bin/enroot-aufs2ovlfs", "bin/enroot-makeself", "bin/enroot-mksquashovlfs",
                 "bin/enroot-mount", "bin/enroot-nsenter", "bin/enroot-switchroot", "lib/enroot", "etc/enroot",
                 "share/enroot", "lib/slurm/spank_pyxis.so")
PLUGSTACK = f"required {PYXIS_SO} use_squashfuse=1 execute_entrypoint=1 container_scope=job\n"
PYTORCH_HOOK = "50-slurm-pytorch.sh"
ENROOT_CONF = "\n".join([
    "ENROOT_RUNTIME_PATH /run/enroot/user-$(id -u)",
    "ENROOT_CACHE_PATH /var/lib/enroot-cache/group-$(id -g)",
    "ENROOT_DATA_PATH /tmp/enroot-data/user-$(id -u)",
    "ENROOT_SQUASH_OPTIONS -comp lz4 -noD",
    "ENROOT_ALLOW_HTTP yes",
    "",
])
# enroot's runtime tools (Debian's packages: squashfuse and fuse-overlayfs for the mounted squashfs,
# bsdextrautils's `column` for `enroot list` (pyxis lists named containers), libcap2-bin's setcap,
# the rest for `enroot import`), then the host's build of enroot and pyxis.
TAIL = """
# --- pyxis nodes (tests/docker/pyxis_cluster.py): enroot 4.1.2 and pyxis 0.24.0 as built on the test
# host by scripts/ensure-hpc-runtimes.sh (Debian 12, the same glibc and Slurm 22.05 as this image).
RUN --mount=type=cache,id=ptmg-apt-@OS@,target=/var/cache/apt,sharing=locked \\
    --mount=type=cache,id=ptmg-apt-lists-@OS@,target=/var/lib/apt/lists,sharing=locked \\
    --mount=type=secret,id=build-env \\
    --mount=type=secret,id=ca-bundle \\
    if [ -f /run/secrets/build-env ]; then . /run/secrets/build-env; fi \\
 && @APT_BOUNDED@ \\
 && apt_bounded update \\
 && apt_bounded install -y --no-install-recommends \\
      bsdextrautils curl fuse-overlayfs gawk jq libbsd0 libcap2-bin parallel pigz squashfs-tools squashfuse zstd
COPY hpc/ /usr/local/
COPY plugstack.conf /etc/slurm/plugstack.conf
RUN install -d -m 1777 /run/enroot /var/lib/enroot-cache /tmp/enroot-data \\
 && setcap cap_sys_admin+pe /usr/local/bin/enroot-mksquashovlfs \\
 && setcap cap_sys_admin,cap_mknod+pe /usr/local/bin/enroot-aufs2ovlfs \\
 && enroot version
"""


def build_pyxis_image(client: docker.DockerClient, cell: str, base_ref: str, labels: Mapping[str, str],
                      log_dir: Path) -> str:
    """The Slurm test image FROM ``base_ref`` with enroot and pyxis; returns its tag."""
    missing = [f for f in RUNTIME_FILES if not (PREFIX / f).exists()]
    if missing:
        raise RuntimeError(f"not installed in {PREFIX}: {', '.join(missing)}. Fix: PTMG_THIRDPARTY_DIR=DIR "
                           "scripts/ensure-tools.sh test (DIR: the enroot and pyxis release tarballs; "
                           "`make test` uses ../shared/thirdparty)")
    with tempfile.TemporaryDirectory(prefix="ptmg-pyxis-ctx-") as tmp:
        ctx = Path(tmp)
        for f in HERE.iterdir():
            shutil.copy2(f, ctx / f.name)
        for rel in RUNTIME_FILES:
            src, dst = PREFIX / rel, ctx / "hpc" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, dst, symlinks=True)
            else:
                shutil.copy2(src, dst)
        (ctx / "hpc/etc/enroot/enroot.conf").write_text(ENROOT_CONF)
        shutil.copy2(ctx / "hpc/share/enroot/hooks.d" / PYTORCH_HOOK, ctx / "hpc/etc/enroot/hooks.d" / PYTORCH_HOOK)
        (ctx / "plugstack.conf").write_text(PLUGSTACK)
        return build_slurm_image(client, cell, base_ref, labels, log_dir, context=ctx, tail=TAIL)


def node_options(sqsh: Path) -> dict[str, Any]:
    """Every container's extra run options: what enroot needs (above), and the squashfs's folder,
    read-only, at its own path (the script names the file by its absolute path, as on a shared
    filesystem)."""
    return {"security_opt": ["seccomp=unconfined"], "devices": ["/dev/fuse:/dev/fuse:rwm"], "cap_add": ["SYS_ADMIN"],
            "volumes": {str(sqsh.parent): {"bind": str(sqsh.parent), "mode": "ro"}}}
