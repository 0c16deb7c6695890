"""The push stream and the per-tag decision (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from builder.engine.capabilities import CLASSIC, CONTAINERD, names_image
from builder.publish.client import Remote


# --- the push stream --------------------------------------------------------------------
@dataclass
class PushTracker:
    """Follows one `docker push` progress stream: which layers went up, the digest, the error."""

    uploaded: list[str] = field(default_factory=list)  # layer ids the engine sent ("Pushed")
    existing: list[str] = field(default_factory=list)  # already in the registry (or mounted)
    digest: str | None = None
    size: int | None = None
    error: str | None = None
    engine_retries: int = 0  # "Retrying in N seconds" episodes (dockerd's own per-layer retries)
    progressed: bool = False  # bytes were sent
    last: dict[str, str] = field(default_factory=dict)

    def feed(self, ev: Mapping[str, Any]) -> None:
        if ev.get("error") or ev.get("errorDetail"):
            detail = ev.get("errorDetail")
            msg = detail.get("message") if isinstance(detail, dict) else None
            self.error = str(msg or ev.get("error"))
        aux = ev.get("aux")
        if isinstance(aux, dict) and aux.get("Digest"):
            self.digest = str(aux["Digest"])
            self.size = int(aux.get("Size") or 0) or None
        elif isinstance(aux, dict) and aux.get("ManifestPushedInsteadOfIndex"):
            selected = aux.get("SelectedManifest")  # the containerd store sent one manifest, not the index
            if isinstance(selected, dict) and selected.get("digest"):
                self.digest = str(selected["digest"])
        status = str(ev.get("status") or "")
        lid = ev.get("id")
        if not lid:
            return
        lid = str(lid)
        prev = self.last.get(lid, "")
        if status == "Pushed" and lid not in self.uploaded:
            self.uploaded.append(lid)
        elif (status == "Layer already exists" or status.startswith("Mounted from")) and lid not in self.existing:
            self.existing.append(lid)
        elif status.startswith("Retrying in") and not prev.startswith("Retrying in"):
            self.engine_retries += 1
        elif status == "Pushing":
            detail = ev.get("progressDetail")
            if isinstance(detail, dict) and int(detail.get("current") or 0) > 0:
                self.progressed = True
        self.last[lid] = status

    def settle(self, store: str, image_id: str) -> str | None:
        """The digest this push sent, once the stream has ended. The classic store reports it (aux
        Digest); Docker 28's containerd store reports none on success: it pushes the image's own
        target, whose digest is the local image ID (:func:`names_image`), so that is what was sent
        (publish then reads the tag back and checks the registry serves it). None: nobody can tell."""
        if self.digest is None and not self.error and store == CONTAINERD and image_id.startswith("sha256:"):
            self.digest = image_id
        return self.digest


# --- decisions (pure) -------------------------------------------------------------------
def decide(kind: str, remote: Remote, image_id: str, store: str = CLASSIC) -> tuple[str, str]:
    """What to do with one tag: ("push" | "unchanged" | "refuse" | "fail", why). ``store``: the engine's
    image store, which says what the local image ID is (:func:`builder.engine.capabilities.names_image`)."""
    if remote.fault is not None:
        return "fail", str(remote.fault)
    if not remote.present:
        return "push", "not in the registry yet"
    if names_image(store, image_id, remote.digest, remote.config_digest):
        return "unchanged", f"the registry already holds this image ({remote.digest})"
    held = f"image {remote.config_digest}" if remote.config_digest else f"a {remote.media_type or 'manifest'}"
    if kind == "immutable":
        return "refuse", (f"the registry already holds {remote.digest} ({held}) under this immutable tag, and the "
                          f"local image is {image_id}; immutable tags are never overwritten. Nothing of this cell "
                          "was pushed. If the new image is right, rebuild so it gets a new date/sha tag.")
    return "push", f"moves from {remote.digest}"


