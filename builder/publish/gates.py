"""The OS-freshness gates wired to the real world: the registry's labels and the Debian audit of an image.

builder/publish/freshness.py decides (pure); this module gives the Publisher the two callables
(`unchanged`, `os_gate`) that fetch what those decisions need.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from builder.audit import debian
from builder.audit.report import FAILED, Target
from builder.common.log import log
from builder.engine import Engine
from builder.matrix import ImageSpec, Matrix
from builder.publish.client import RegistryClient
from builder.publish.freshness import OsPending, os_gate, registry_labels, unchanged_since


@dataclass(frozen=True)
class Gates:
    unchanged: Callable[[ImageSpec, Mapping[str, str]], str | None] | None
    os_gate: Callable[[ImageSpec, str, Mapping[str, str]], str | None] | None


def debian_pending(engine: Engine, image_id: str, cell: str) -> OsPending:
    """The Debian audit of one image, as the OS gate needs it."""
    r = debian.audit(engine, Target(image_id, cell))
    if r.status == FAILED:
        return OsPending(error=r.error or "the audit failed")
    return OsPending(tuple(f"{f['package']} {f['installed']} -> {f['fixed']}" for f in r.findings))


def freshness_gates(engine: Engine, client: RegistryClient, matrix: Matrix, allow_stale_os: bool,
                    publish_unchanged: bool) -> Gates:
    read = registry_labels(client)
    max_days = matrix.audit.debian.max_pending_days

    def unchanged(spec: ImageSpec, labels: Mapping[str, str]) -> str | None:
        remote, why = read(spec.tag)  # the cell's own floating tag: what users of <tag> get now
        if remote is None:
            if why != "absent":
                log.warning("%s: can't compare with the registry's %s (%s); publishing it", spec.name, spec.tag, why)
            return None
        return unchanged_since(labels, remote)

    def gate(spec: ImageSpec, image_id: str, labels: Mapping[str, str]) -> str | None:
        return os_gate(labels, max_days, dt.datetime.now(dt.timezone.utc),
                       lambda: debian_pending(engine, image_id, spec.name))

    if allow_stale_os:
        log.warning("--allow-stale-os: images are published whatever Debian security updates they lack")
    return Gates(None if publish_unchanged else unchanged, None if allow_stale_os else gate)
