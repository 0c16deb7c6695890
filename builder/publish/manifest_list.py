"""One registry tag, several platforms: a manifest list (an OCI image index for OCI manifests).

Cells that share a tag in images.yaml (a cell on linux/amd64 and linux/arm64, named ``<tag>``
and ``<tag>-arm64`` locally) are published together, all or nothing:

1. Every platform's image goes up through the engine under an immutable tag of its own,
   ``<tag>-<short sha>-<arch>`` (a registry keeps only what a tag or a list holds, and `docker
   push` pushes tags), checked, pushed and read back like any immutable tag (the publisher's
   ``_publish_tag``: never overwritten, retried, verified).
2. The list is made from what the registry serves for those tags (digest, size, media type) and
   each image's platform, as canonical JSON: the same images give the same bytes, so the same
   digest, and a rerun finds every tag "unchanged".
3. It is PUT (registry HTTP API) under the cell's immutable tags ``<tag>-<YYYYMMDD>`` and
   ``<tag>-<sha>`` (date and sha of the most recently built platform image), and later, once the
   floating gate opens (every platform published and smoke-tested), under its floating tags.
   Each PUT is read back: the registry must answer the list's digest.

An immutable tag that already holds a list of exactly these images (per platform, the image id
its manifest's config names) is "unchanged"; one that holds anything else is refused, and then
nothing of the cell is pushed. A selection with only some platforms of a tag is refused: moving
``<tag>`` to a one-platform image would drop the others.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import ptmg_contract as contract
from builder.common.digests import digest_of
from builder.engine.capabilities import CONTAINERD
from builder.matrix import ImageSpec, Matrix, tags
from builder.matrix.model import PLATFORMS
from builder.publish.client import MANIFEST_LIST, MANIFEST_V2, OCI_INDEX, OCI_MANIFEST, Remote
from builder.publish.faults import Fault
from builder.publish.policy import image_date, image_revision
from builder.publish.push import decide
from builder.publish.report import FAILED, HELD, OK_STATUSES, PUSHED, REFUSED, UNCHANGED, CellReport, TagResult

#: The list's media type follows its entries': Docker's list for Docker v2 manifests (what dockerd
#: pushes), the OCI index for OCI manifests.
LIST_TYPE = {MANIFEST_V2: MANIFEST_LIST, OCI_MANIFEST: OCI_INDEX}


class CellLike(Protocol):
    spec: ImageSpec
    report: CellReport
    image_id: str
    tags: tags.CellTags | None


class PublisherPort(Protocol):
    """What this module uses of :class:`builder.publish.publisher.Publisher` (no import: no cycle)."""

    engine: Any  # image_attrs(ref)
    registry: Any  # manifest(ref) -> Remote, put_manifest(ref, media_type, body) -> digest | Fault
    cfg: Any  # .retry.attempts
    store: str  # the engine's image store (capabilities.CLASSIC or CONTAINERD)

    def _publish_tag(self, cell: Any, tag: str, kind: str, remote: Remote | None) -> TagResult: ...
    def _result(self, tag: str, kind: str, status: str, message: str = "", **kw: Any) -> TagResult: ...
    def _log_result(self, res: TagResult) -> None: ...
    def _read(self, tag: str) -> tuple[Remote, int]: ...
    def _wait(self, attempt: int, why: str) -> None: ...


@dataclass(frozen=True)
class Entry:
    """One platform's image in the list."""

    platform: str  # linux/arm64
    digest: str
    size: int
    media_type: str


def normal_platform(text: str) -> str:
    """``linux/arm64/v8`` and ``linux/arm64`` name one platform (v8 is arm64's only variant)."""
    return text.removesuffix("/v8") if text.startswith("linux/arm64") else text


def list_body(entries: Sequence[Entry]) -> tuple[bytes, str]:
    """The list's canonical bytes and media type: entries in PLATFORMS order, fixed key order."""
    order = list(PLATFORMS)
    ordered = sorted(entries, key=lambda e: (order.index(e.platform) if e.platform in order else len(order),
                                            e.platform))
    types = {e.media_type for e in ordered}
    media = LIST_TYPE.get(types.pop(), OCI_INDEX) if len(types) == 1 else OCI_INDEX
    doc = {"schemaVersion": 2, "mediaType": media, "manifests": [
        {"mediaType": e.media_type, "size": e.size, "digest": e.digest,
         "platform": {"architecture": e.platform.split("/")[1], "os": e.platform.split("/")[0]}}
        for e in ordered]}
    return (json.dumps(doc, indent=3) + "\n").encode(), media


@dataclass
class Group:
    """The selected cells of one multi-platform tag."""

    tag: str
    cells: list[CellLike]  # in PLATFORMS order; cells[0] carries the list's tags in the report
    platform_tags: dict[str, str] = field(default_factory=dict)  # cell name -> <tag>-<sha>-<arch>
    immutable: tuple[str, ...] = ()
    floating: tuple[str, ...] = ()
    started: bool = False
    body: bytes | None = None
    media_type: str = ""
    entries: tuple[Entry, ...] = ()

    @property
    def lead(self) -> CellLike:
        return self.cells[0]

    @property
    def digest(self) -> str | None:
        return digest_of(self.body) if self.body is not None else None


class MultiPlatform:
    """Plans and publishes the multi-platform tags of one run (hooks in Publisher.run)."""

    def __init__(self, pub: PublisherPort, matrix: Matrix, cells: Sequence[CellLike]) -> None:
        self.pub = pub
        self.groups: dict[str, Group] = {}  # cell name -> its group
        siblings: dict[str, list[ImageSpec]] = {}
        for spec in matrix.cells:
            siblings.setdefault(spec.tag, []).append(spec)
        order = list(PLATFORMS)
        by_tag: dict[str, list[CellLike]] = {}
        for c in cells:
            if len(siblings.get(c.spec.tag, ())) > 1:
                by_tag.setdefault(c.spec.tag, []).append(c)
        for tag, members in by_tag.items():
            members.sort(key=lambda c: order.index(c.spec.platform))
            group = Group(tag, members)
            for c in members:
                self.groups[c.spec.name] = group
            self._plan(group, siblings[tag])

    def owns(self, cell: CellLike) -> bool:
        return cell.spec.name in self.groups

    # --- planning ------------------------------------------------------------------------
    def _fail_all(self, group: Group, why: str) -> None:
        for c in group.cells:
            c.report.error = c.report.error or why
            c.tags = None

    def _plan(self, group: Group, siblings: Sequence[ImageSpec]) -> None:
        chosen = {c.spec.name for c in group.cells}
        missing = [s for s in siblings if s.name not in chosen]
        if missing:
            names = ", ".join(f"{s.name} ({s.platform})" for s in missing)
            self._fail_all(group, f"tag {group.tag} carries every platform of this cell, and {names} is not "
                                  f"selected: publish them together (--only '{group.tag}*', --platforms all); "
                                  "moving the tag to fewer platforms would drop the others")
            return
        broken = [c for c in group.cells if c.tags is None]
        if broken:
            why = "; ".join(f"{c.spec.name} ({c.spec.platform}): {c.report.error or 'not ready'}" for c in broken)
            self._fail_all(group, f"tag {group.tag} is published with all its platforms, and one is not ready: {why}")
            return
        built: dict[str, tuple[str, str]] = {}  # cell name -> (YYYYMMDD, created timestamp)
        try:
            for c in group.cells:
                attrs = self.pub.engine.image_attrs(c.spec.ref) or {}
                labels = dict((attrs.get("Config") or {}).get("Labels") or {})
                built[c.spec.name] = (image_date(labels, attrs.get("Created")), labels.get(contract.OCI_CREATED, ""))
                group.platform_tags[c.spec.name] = tags.platform_tag(c.spec, image_revision(labels))
        except (tags.TagError, ValueError) as exc:
            self._fail_all(group, f"tag {group.tag}: {exc}")
            return
        newest = max(group.cells, key=lambda c: built[c.spec.name])  # its date and sha name the list
        assert newest.tags is not None
        group.immutable = newest.tags.immutable
        group.floating = tuple(dict.fromkeys(t for c in group.cells if c.tags for t in c.tags.floating))
        for c in group.cells:
            own = (group.platform_tags[c.spec.name],)
            lead = c is group.lead
            c.tags = tags.CellTags(c.spec.name, own + (group.immutable if lead else ()),
                                   group.floating if lead else (), group=group.tag)

    # --- publishing ----------------------------------------------------------------------
    def _same_images(self, remote: Remote, group: Group) -> bool:
        """Whether a list in the registry holds exactly this group's images, platform by platform."""
        if not remote.children:
            return False
        want = {c.spec.platform: c.image_id for c in group.cells}
        have: dict[str, str | None] = {}
        for plat, digest in remote.children:
            child = self.pub.registry.manifest(digest)
            names = child.digest if self.pub.store == CONTAINERD else child.config_digest
            have[normal_platform(plat)] = names if child.fault is None else None
        return have == want

    def _decide(self, kind: str, remote: Remote, group: Group) -> tuple[str, str]:
        if remote.fault is not None:
            return "fail", str(remote.fault)
        if not remote.present:
            return "push", "not in the registry yet"
        if (group.digest is not None and remote.digest == group.digest) or self._same_images(remote, group):
            return "unchanged", f"the registry already holds this list ({remote.digest})"
        if kind == "immutable":
            return "refuse", (f"the registry already holds {remote.digest} (a {remote.media_type or 'manifest'} of "
                              "other images) under this immutable tag; immutable tags are never overwritten. "
                              "Nothing of this cell was pushed. If the new images are right, rebuild so they get "
                              "a new date/sha tag.")
        return "push", f"moves from {remote.digest}"

    def immutable(self, cell: CellLike) -> None:
        """Publish the group of ``cell`` (once, whichever member comes first)."""
        group = self.groups[cell.spec.name]
        if group.started or cell.tags is None:
            return
        group.started = True
        pub = self.pub
        refused = [c for c in group.cells if c.tags is None and c.report.error]  # a gate after planning
        if refused:
            why = "; ".join(f"{c.spec.name}: {c.report.error}" for c in refused)
            for c in group.cells:
                for t in (group.platform_tags[c.spec.name], *(group.immutable if c is group.lead else ())):
                    c.report.tags.append(pub._result(t, "immutable", HELD, f"not pushed: tag {group.tag} is published "
                                                                           f"with all its platforms, and {why}"))
            return
        arch_reads = {c.spec.name: pub._read(group.platform_tags[c.spec.name])[0] for c in group.cells}
        list_reads = {t: pub._read(t)[0] for t in group.immutable}
        arch_plan = {c.spec.name: decide("immutable", arch_reads[c.spec.name], c.image_id, pub.store)
                     for c in group.cells}
        list_plan = {t: self._decide("immutable", r, group) for t, r in list_reads.items()}
        blocked = [t for t, (a, _) in [*((group.platform_tags[n], d) for n, d in arch_plan.items()),
                                       *list_plan.items()] if a in ("refuse", "fail")]
        if blocked:
            for c in group.cells:
                self._record(c, group.platform_tags[c.spec.name], arch_plan[c.spec.name], blocked)
            for t in group.immutable:
                self._record(group.lead, t, list_plan[t], blocked)
            return
        failed = ""
        for c in group.cells:
            t = group.platform_tags[c.spec.name]
            if failed:
                res = pub._result(t, "immutable", HELD, f"not pushed: {failed} failed before it")
            else:
                res = pub._publish_tag(c, t, "immutable", arch_reads[c.spec.name])
                failed = t if res.status not in OK_STATUSES else ""
            c.report.tags.append(res)
            pub._log_result(res)
        if not failed:
            failed = self._make_list(group)
        for t in group.immutable:
            if failed:
                res = pub._result(t, "immutable", HELD, f"not pushed: {failed} failed before it")
            elif list_plan[t][0] == "unchanged":
                res = pub._result(t, "immutable", UNCHANGED, list_plan[t][1], digest=list_reads[t].digest)
            else:
                res = self._put(group, t, "immutable")
                failed = t if res.status not in OK_STATUSES else ""
            group.lead.report.tags.append(res)
            pub._log_result(res)

    def _record(self, cell: CellLike, tag: str, plan: tuple[str, str], blocked: Sequence[str]) -> None:
        action, why = plan
        if action == "refuse":
            res = self.pub._result(tag, "immutable", REFUSED, why)
        elif action == "fail":
            res = self.pub._result(tag, "immutable", FAILED, f"{why} (nothing pushed)")
        else:
            res = self.pub._result(tag, "immutable", HELD, f"not pushed: {', '.join(blocked)} could not be "
                                                            "published, and a cell is published whole (every "
                                                            "platform) or not at all")
        cell.report.tags.append(res)
        self.pub._log_result(res)

    def _make_list(self, group: Group) -> str:
        """Read each platform's manifest back and make the list; "" or the tag that failed."""
        entries = []
        for c in group.cells:
            t = group.platform_tags[c.spec.name]
            remote, _ = self.pub._read(t)
            if remote.fault is not None or remote.digest is None or remote.size is None:
                res = self.pub._result(t, "immutable", FAILED, f"reading it back for the list failed: {remote.fault}")
                c.report.tags.append(res)
                return t
            entries.append(Entry(c.spec.platform, remote.digest, remote.size, remote.media_type or MANIFEST_V2))
        group.entries = tuple(entries)
        group.body, group.media_type = list_body(entries)
        return ""

    def _put(self, group: Group, tag: str, kind: str) -> TagResult:
        """PUT the list under ``tag``, retrying transient faults, then read it back."""
        assert group.body is not None and group.digest is not None
        start, attempt = time.monotonic(), 0
        listed = ", ".join(f"{e.platform} {e.digest}" for e in group.entries)
        while True:
            attempt += 1
            got = self.pub.registry.put_manifest(tag, group.media_type, group.body)
            extra: dict[str, Any] = {"attempts": attempt, "seconds": round(time.monotonic() - start, 2)}
            if isinstance(got, Fault):
                if got.transient and attempt < self.pub.cfg.retry.attempts:
                    self.pub._wait(attempt, f"PUT of the list under {tag} failed: {got}")
                    continue
                return self.pub._result(tag, kind, FAILED, f"PUT of the list failed after {attempt} attempt(s): "
                                                           f"{got}", **extra)
            back, _ = self.pub._read(tag)
            if back.fault is not None:
                return self.pub._result(tag, kind, FAILED, f"put, but reading it back failed: {back.fault}",
                                        digest=group.digest, **extra)
            if back.digest != group.digest:
                return self.pub._result(tag, kind, FAILED, f"put {group.digest}, but the registry answers "
                                                           f"{back.digest} for this tag", digest=group.digest, **extra)
            return self.pub._result(tag, kind, PUSHED, f"verified: the registry serves the list {group.digest} "
                                                       f"({listed})", digest=group.digest, **extra)

    def floating(self, cell: CellLike, tag: str) -> TagResult:
        group = self.groups[cell.spec.name]
        if group.digest is None:
            return self.pub._result(tag, "floating", HELD, "the list was not made (see the immutable tags)")
        attempt = 0
        while True:
            attempt += 1
            remote, _ = self.pub._read(tag)
            action, why = self._decide("floating", remote, group)
            if action == "unchanged":
                return self.pub._result(tag, "floating", UNCHANGED, why, digest=remote.digest, attempts=attempt)
            if action == "fail":
                return self.pub._result(tag, "floating", FAILED, why, attempts=attempt)
            return self._put(group, tag, "floating")

    def summarise(self, cell: CellLike) -> None:
        """The cell's digest in the report: the list's for the cell that carries it, else its own image's."""
        group = self.groups[cell.spec.name]
        own = next((t for t in cell.report.tags if t.tag == group.platform_tags.get(cell.spec.name)
                    and t.status in OK_STATUSES), None)
        if own is not None:
            cell.report.compressed_size = own.compressed_size
            cell.report.digest = own.digest
        if cell is group.lead and group.digest is not None and any(
                t.digest == group.digest and t.status in OK_STATUSES for t in cell.report.tags):
            cell.report.digest = group.digest
            cell.report.notes.append(f"tag {group.tag}: a {group.media_type} of "
                                     + ", ".join(f"{e.platform} {e.digest}" for e in group.entries))
        elif cell is not group.lead and own is not None:
            cell.report.notes.append(f"its image is {own.digest} in the list of tag {group.tag} (see cell "
                                     f"{group.lead.spec.name})")


def platforms_of(remote: Remote) -> Mapping[str, str]:
    """platform -> manifest digest of a list in the registry (for tests and reports)."""
    return {normal_platform(p): d for p, d in remote.children}
