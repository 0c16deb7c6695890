"""Two OS-freshness gates of publish: an unchanged cell is not published again; a stale OS is refused.

- **Unchanged.** The weekly CI run rebuilds every cell fresh (``--no-cache --force``), so image
  ids always differ. What matters is what is in the image: its recipe (Dockerfile and copied
  files: ``recipe-hash``) and what got installed (``os.packages``: every Debian package and
  version; ``venv.packages``: every distribution in the venv). When the image under the cell's
  floating tag in the registry carries the same three labels, the cell is skipped ("unchanged
  since <date>"): no new dated tags, no tag moves. An unchanged week publishes nothing.
- **OS freshness.** Every build applies all Debian updates, so a pending security update is at
  most as old as the image's OS layer (label ``os.updated``). An image with pending security
  updates whose OS layer is older than images.yaml's ``audit.debian.max_pending_days`` is
  refused, with the fix (rebuild) and the override (``--allow-stale-os``). An image whose OS
  layer is younger needs no audit at all.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import requests

import ptmg_contract as contract
from builder.imaging.os_snapshot import age_days
from builder.publish.client import RegistryClient

#: What must match for the registry's image to count as this one.
IDENTITY: tuple[str, ...] = (contract.LABEL_RECIPE_HASH, contract.LABEL_OS_PACKAGES, contract.LABEL_VENV_PACKAGES)
#: labels of the image under a tag: (labels, "") / (None, "absent") / (None, why it can't be told)
RemoteLabels = Callable[[str], tuple[dict[str, str] | None, str]]


def identity(labels: Mapping[str, str]) -> dict[str, str] | None:
    """The identity labels, or None when one is missing (an image without them is never 'the same')."""
    out = {k: labels.get(k, "") for k in IDENTITY}
    return out if all(out.values()) else None


def unchanged_since(local: Mapping[str, str], remote: Mapping[str, str] | None) -> str | None:
    """'unchanged since <date>' when the registry's image is this one by identity, else None."""
    mine = identity(local)
    if mine is None or remote is None or identity(remote) != mine:
        return None
    when = remote.get(contract.LABEL_OS_UPDATED) or remote.get(contract.OCI_CREATED) or "an earlier publish"
    return f"unchanged since {when[:10]}"


@dataclass(frozen=True)
class OsPending:
    """What the Debian audit found pending for one image: one 'package installed -> fixed' each."""

    packages: tuple[str, ...] = ()
    error: str = ""  # the audit could not run


def os_gate(labels: Mapping[str, str], max_days: int, now: dt.datetime,
            pending: Callable[[], OsPending]) -> str | None:
    """Why publish refuses the image for its OS patch level (None: it may go). `pending` runs the
    audit; it is called only when the OS layer is older than `max_days`."""
    updated = labels.get(contract.LABEL_OS_UPDATED, "")
    age = age_days(updated, now)
    if age is not None and age <= max_days:
        return None
    found = pending()
    since = f"last brought up to date {updated} ({age:.0f} days ago)" if age is not None \
        else f"of unknown age (no {contract.LABEL_OS_UPDATED} label: built before images recorded their OS patch level)"
    limit = f"audit.debian.max_pending_days is {max_days} (images.yaml)"
    fix = "fix: rebuild it (`make images` applies every Debian update), or publish anyway with --allow-stale-os"
    if found.error:
        return f"its OS layer is {since} and the Debian audit could not run ({found.error.splitlines()[0]}); " \
               f"{limit}. {fix}"
    if not found.packages:
        return None
    shown = ", ".join(found.packages[:5]) + (f" and {len(found.packages) - 5} more" if len(found.packages) > 5 else "")
    return (f"{len(found.packages)} Debian security update(s) pending ({shown}); its OS layer is {since}, "
            f"and {limit}. {fix}")


def registry_labels(client: RegistryClient) -> RemoteLabels:
    """Labels of the image a tag holds, read from the registry (manifest, then its config blob)."""

    def read(tag: str) -> tuple[dict[str, str] | None, str]:
        remote = client.manifest(tag)
        if remote.fault is not None:
            return None, str(remote.fault)
        if not remote.present:
            return None, "absent"
        if not remote.config_digest:
            return None, f"{tag} holds a {remote.media_type or 'manifest'} without one image config"
        url = f"{client.registry.api_base}/v2/{client.path}/blobs/{remote.config_digest}"
        try:
            r = client.session.get(url, headers=dict(client._auth), timeout=client.timeout, verify=client.verify)
        except requests.exceptions.RequestException as exc:
            return None, f"GET {url}: {type(exc).__name__}"
        if r.status_code != 200:
            return None, f"GET {url}: HTTP {r.status_code}"
        if "sha256:" + hashlib.sha256(r.content).hexdigest() != remote.config_digest:
            return None, f"the config blob of {tag} does not match its digest"
        try:
            config = json.loads(r.content).get("config") or {}
        except (ValueError, AttributeError):
            return None, f"the config blob of {tag} is not JSON"
        return {str(k): str(v) for k, v in (config.get("Labels") or {}).items()}, ""

    return read
