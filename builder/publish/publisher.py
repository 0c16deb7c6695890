"""Publish the built cells to a registry: push, never lose or overwrite, verify, report.

The order, for the selected cells:

1. Resolve each cell's local image (by id, once: a rebuild during the run can't
   slip in) and its tags (builder/matrix/tags.py; date and sha from the image's labels,
   so a rerun next week names the same tags for the same image).
2. Immutable tags: read each one's manifest from the registry first.
   - absent (HTTP 404 with MANIFEST_UNKNOWN/NAME_UNKNOWN, nothing else) -> push;
   - present with the same image (the manifest names the local image id: capabilities.names_image) -> "unchanged";
   - present with another image -> "refused", and NOTHING of that cell is pushed;
   - anything else (401/403, 429, 5xx, network, a 404 that is not a registry's) -> the cell fails;
     transient faults are retried with exponential backoff and jitter first.
   After each push the manifest is read back; its Docker-Content-Digest must be the push's digest.
   Before that, two OS-freshness gates (builder/publish/freshness.py): a cell whose image is the one its
   floating tag already holds (same recipe, Debian and venv packages) is skipped ("unchanged since
   <date>"; --publish-unchanged pushes it anyway), and one with Debian security updates pending longer
   than images.yaml's audit.debian.max_pending_days is refused (--allow-stale-os).
3. The floating-tag gate: only when EVERY selected cell has all its immutable
   tags published and a smoke-test pass recorded for its exact image id
   (builder.smoke.passes; `--allow-untested` waives the latter, loudly).
4. Floating tags (``<tag>``, ``2.7-cuda12.6``, ``latest``) move.
5. A JSON and a Markdown report go to --report-dir. Exit 1 if anything failed.

Credentials come from the environment (PTMG_REGISTRY_USER with PTMG_REGISTRY_PASSWORD or
PTMG_REGISTRY_PASSWORD_FILE) or the docker config (auths, credHelpers, credsStore). They go to the
engine as the push's auth_config and to the registry client as HTTP auth; never to argv, logs, reports.

Layers are pushed gzip-compressed by the engine (`docker push`, the default), or with ``zstd`` by
builder/publish/zstdpush.py through the registry client; every check above is the same for both.

Limitation: registry API v2 has no conditional PUT, so a second publisher racing between our read
and our push can't be excluded here; CI serialises publishing (a concurrency group) for that reason.
"""


from __future__ import annotations

import datetime as dt
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import ptmg_contract as contract
from builder.common.log import log
from builder.engine import EngineError
from builder.engine.capabilities import CLASSIC, CONTAINERD, names_image
from builder.matrix import ImageSpec, Matrix, tags
from builder.publish import manifest_list
from builder.publish.address import Registry
from builder.publish.client import Remote
from builder.publish.credentials import Credentials, redact
from builder.publish.faults import Fault, RetryPolicy, backoff, push_fault
from builder.publish.policy import floating_gate, image_date, image_revision, versions_from_labels
from builder.publish.push import PushTracker, decide
from builder.publish.report import (
    FAILED,
    HELD,
    OK_STATUSES,
    PLANNED,
    PUSHED,
    REFUSED,
    UNCHANGED,
    CellReport,
    Report,
    TagResult,
    short_digest,
)
from builder.publish.zstdpush import ZstdPusher
from builder.smoke import passes


# --- orchestration ----------------------------------------------------------------------
class EnginePort(Protocol):
    def image_attrs(self, ref: str) -> dict[str, Any] | None: ...
    def tag(self, image_id: str, ref: str) -> None: ...
    def untag(self, ref: str) -> None: ...
    def push(self, ref: str, auth_config: Mapping[str, str] | None,
             on_event: Callable[[Mapping[str, Any]], None]) -> None: ...


class RegistryPort(Protocol):
    def manifest(self, reference: str) -> Remote: ...
    def put_manifest(self, reference: str, media_type: str, body: bytes) -> str | Fault: ...  # manifest lists


@dataclass(frozen=True)
class PublishConfig:
    registry: Registry
    allow_untested: bool = False
    dry_run: bool = False
    retry: RetryPolicy = field(default_factory=RetryPolicy)


@dataclass
class _Cell:
    spec: ImageSpec
    report: CellReport
    image_id: str = ""
    tags: tags.CellTags | None = None
    labels: dict[str, str] = field(default_factory=dict)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Publisher:
    """Runs one publish. Engine, registry client, smoke records, sleep and randomness are
    injected, so the whole decision logic runs in unit tests without a daemon."""

    def __init__(self, engine: EnginePort, registry: RegistryPort, cfg: PublishConfig, *,
                 repository: str, creds: Credentials | None = None,
                 smoke: Callable[[str], passes.SmokePass | None],
                 sleep: Callable[[float], None] = time.sleep, rng: Callable[[], float] = random.random,
                 on_event: Callable[[str, Mapping[str, Any]], None] | None = None,
                 unchanged: Callable[[ImageSpec, Mapping[str, str]], str | None] | None = None,
                 os_gate: Callable[[ImageSpec, str, Mapping[str, str]], str | None] | None = None,
                 store: str = CLASSIC, zstd: ZstdPusher | None = None) -> None:
        self.engine = engine
        self.zstd = zstd  # --compression zstd: layers go up through the registry API, not `docker push`
        self.store = store  # the engine's image store: what its image IDs name (capabilities.names_image)
        self.registry = registry
        self.cfg = cfg
        self.repo = cfg.registry.repository(repository)
        self.creds = creds
        self.secrets = creds.secrets() if creds else ()
        self.smoke = smoke
        self.sleep = sleep
        self.rng = rng
        self.on_event = on_event
        self.unchanged = unchanged  # "unchanged since <date>" when the registry holds this image
        self.os_gate = os_gate  # why the image's OS patch level is refused, or None

    def _r(self, text: str) -> str:
        return redact(text, self.secrets)

    # -- one cell's local facts --
    def _prepare(self, spec: ImageSpec, matrix: Matrix) -> _Cell:
        cell = _Cell(spec, CellReport(spec.name, spec.ref))
        attrs = self.engine.image_attrs(spec.ref)
        if attrs is None:
            cell.report.error = (f"{spec.ref} is not built here; run `python build.py build --only {spec.name}` "
                                 "(and `python build.py test --only` it) first")
            return cell
        labels = dict((attrs.get("Config") or {}).get("Labels") or {})
        cell.labels = labels
        cell.image_id = str(attrs["Id"])
        cell.report.image_id = cell.image_id
        cell.report.uncompressed_size = int(attrs.get("Size") or 0) or None
        cell.report.versions = versions_from_labels(labels)
        passed = self.smoke(cell.image_id)
        if passed is not None:
            cell.report.smoke = {"status": "passed", "at": passed.at, "passed": passed.passed,
                                 "skipped": passed.skipped, "nodes": passed.nodes}
        else:
            cell.report.smoke = {"status": "untested (--allow-untested)" if self.cfg.allow_untested else "missing"}
        if labels.get(contract.LABEL_CELL) != spec.name:
            cell.report.error = (f"{spec.ref} is not an image of cell {spec.name} (its {contract.LABEL_CELL} label is "
                                 f"{labels.get(contract.LABEL_CELL)!r}); rebuild it with `python build.py build --only "
                                 f"{spec.name}`")
            return cell
        try:
            revision = image_revision(labels)
            cell.tags = tags.cell_tags(spec, matrix.cells, image_date(labels, attrs.get("Created")), revision)
        except (tags.TagError, ValueError) as exc:
            cell.report.error = f"{spec.ref}: {exc}"
            return cell
        if revision.endswith("-dirty"):
            cell.report.notes.append(f"built from an uncommitted tree ({revision}); its sha tag says -dirty")
        return cell

    def _result(self, tag: str, kind: str, status: str, message: str = "", **kw: Any) -> TagResult:
        return TagResult(tag, f"{self.repo}:{tag}", kind, status, message=self._r(message), **kw)

    def _wait(self, attempt: int, why: str) -> None:
        delay = backoff(self.cfg.retry, attempt, self.rng)
        log.warning("  %s; retrying in %.1f s (attempt %d of %d)", self._r(why), delay, attempt + 1,
                    self.cfg.retry.attempts)
        self.sleep(delay)

    def _read(self, tag: str) -> tuple[Remote, int]:
        """The registry's state for a tag, retrying transient faults. (remote, tries used)."""
        attempt = 0
        while True:
            attempt += 1
            remote = self.registry.manifest(tag)
            if remote.fault is None or not remote.fault.transient or attempt >= self.cfg.retry.attempts:
                return remote, attempt
            self._wait(attempt, str(remote.fault))

    def _push_once(self, cell: _Cell, ref: str, tracker: PushTracker) -> Fault | None:
        auth = self.creds.auth_config(self.cfg.registry) if self.creds else None

        def feed(ev: Mapping[str, Any]) -> None:
            retries = tracker.engine_retries
            tracker.feed(ev)
            status, lid = str(ev.get("status") or ""), ev.get("id")
            if lid and (status in ("Pushed", "Layer already exists") or tracker.engine_retries > retries):
                log.info("  %s layer %s: %s", ref.rpartition(":")[2], lid, status)
            if self.on_event is not None:
                self.on_event(ref, ev)

        self.engine.tag(cell.image_id, ref)
        try:
            self.engine.push(ref, auth, feed)
        except EngineError as exc:
            return push_fault(self._r(str(exc)))
        finally:
            self.engine.untag(ref)
        if tracker.error:
            return push_fault(self._r(tracker.error))
        if not tracker.settle(self.store, cell.image_id):
            return Fault("engine", "the push ended without reporting a digest", False)
        return None

    def _verify(self, tag: str, digest: str, image_id: str) -> tuple[Remote, str | None]:
        remote, _ = self._read(tag)
        if remote.fault is not None:
            return remote, f"pushed, but reading it back failed: {remote.fault}"
        if remote.digest != digest:
            return remote, f"pushed {digest}, but the registry answers {remote.digest} for this tag"
        if not names_image(self.store, image_id, remote.digest, remote.config_digest):
            what = remote.digest if self.store == CONTAINERD else remote.config_digest
            return remote, f"the registry's manifest describes image {what}, not {image_id} ({self.store} store)"
        return remote, None

    def _publish_tag(self, cell: _Cell, tag: str, kind: str, remote: Remote | None) -> TagResult:
        """Check, push, verify one tag, retrying transient faults (re-checking before each push)."""
        ref = f"{self.repo}:{tag}"
        start = time.monotonic()
        uploaded: list[str] = []
        existing: list[str] = []
        attempt = 0
        while True:
            attempt += 1
            if remote is None:
                remote = self.registry.manifest(tag)
            action, why = decide(kind, remote, cell.image_id, self.store)
            extra = {"attempts": attempt, "layers_uploaded": uploaded, "layers_existing": existing,
                     "seconds": round(time.monotonic() - start, 2)}
            if action == "fail":
                assert remote.fault is not None
                if remote.fault.transient and attempt < self.cfg.retry.attempts:
                    self._wait(attempt, why)
                    remote = None
                    continue
                outcome = "the push did not complete" if uploaded or existing or attempt > 1 else "nothing pushed"
                return self._result(tag, kind, FAILED, f"{why} (after {attempt} attempt(s); {outcome})", **extra)
            if action == "unchanged":
                return self._result(tag, kind, UNCHANGED, why, digest=remote.digest, compression=remote.compression,
                                    compressed_size=remote.compressed_size, **extra)
            if action == "refuse":
                return self._result(tag, kind, REFUSED, why, **extra)
            log.info("push %s (%s)", ref, why)
            tracker = PushTracker()
            fault = self.zstd.push(cell.image_id, tag, tracker) if self.zstd else self._push_once(cell, ref, tracker)
            uploaded += [x for x in tracker.uploaded if x not in uploaded]
            existing += [x for x in tracker.existing if x not in existing and x not in uploaded]
            if fault is not None:
                if fault.transient and attempt < self.cfg.retry.attempts:
                    self._wait(attempt, f"push of {ref} failed: {fault}")
                    remote = None  # read the tag again: the push may have landed after all
                    continue
                extra["seconds"] = round(time.monotonic() - start, 2)
                return self._result(tag, kind, FAILED, f"push failed after {attempt} attempt(s): {fault}", **extra)
            assert tracker.digest is not None
            checked, problem = self._verify(tag, tracker.digest, cell.image_id)
            extra["seconds"] = round(time.monotonic() - start, 2)
            if problem:
                return self._result(tag, kind, FAILED, problem, digest=tracker.digest, **extra)
            return self._result(tag, kind, PUSHED, f"verified: the registry serves {tracker.digest}",
                                digest=tracker.digest, compressed_size=checked.compressed_size,
                                compression=checked.compression, **extra)

    def _immutable(self, cell: _Cell) -> None:
        assert cell.tags is not None
        reads = {t: self._read(t)[0] for t in cell.tags.immutable}
        decisions = {t: decide("immutable", r, cell.image_id, self.store) for t, r in reads.items()}
        blocked = [t for t, (action, _) in decisions.items() if action in ("refuse", "fail")]
        if blocked:
            # All or nothing: one refused or unreadable immutable tag stops the whole cell.
            for t in cell.tags.immutable:
                action, why = decisions[t]
                if action == "refuse":
                    res = self._result(t, "immutable", REFUSED, why)
                elif action == "fail":
                    res = self._result(t, "immutable", FAILED, f"{why} (nothing pushed)")
                else:
                    res = self._result(t, "immutable", HELD, f"not pushed: {', '.join(blocked)} could not be "
                                                             "published, and a cell is published whole or not at all")
                cell.report.tags.append(res)
                if res.status != HELD:
                    log.error("%s: %s: %s", res.ref, res.status, res.message)
            return
        failed = ""
        for t in cell.tags.immutable:
            if failed:
                res = self._result(t, "immutable", HELD, f"not pushed: {failed} failed before it")
            else:
                res = self._publish_tag(cell, t, "immutable", reads[t])
                failed = t if res.status not in OK_STATUSES else ""
            cell.report.tags.append(res)
            self._log_result(res)

    def _gates(self, cells: Sequence[_Cell], dry: bool = False) -> None:
        """Skip cells the registry already holds (by recipe and packages; a dry run asks no registry); refuse
        a stale OS or known vulnerabilities (the gates that need no registry: a dry run runs them too)."""
        for c in cells:
            if c.tags is None:
                continue
            note = self.unchanged(c.spec, c.labels) if self.unchanged is not None and not dry else None
            if note:
                log.info("%s: %s; nothing of it is published", c.spec.name, note)
                c.report.unchanged_since, c.tags = note, None
                continue
            why = self.os_gate(c.spec, c.image_id, c.labels) if self.os_gate is not None else None
            if why:
                c.report.error, c.tags = f"{c.spec.ref}: {'would be ' * dry}refused: {why}", None

    def _log_result(self, res: TagResult) -> None:
        if res.status in OK_STATUSES:
            sent = f"; {len(res.layers_uploaded)} layer(s) sent, {len(res.layers_existing)} already there" \
                if res.status == PUSHED else ""
            log.info("%s: %s %s (%.1f s%s)", res.ref, res.status, short_digest(res.digest), res.seconds, sent)
        elif res.status == HELD:
            log.warning("%s: %s: %s", res.ref, res.status, res.message)
        else:
            log.error("%s: %s: %s", res.ref, res.status, res.message)

    def run(self, matrix: Matrix, selected: Sequence[ImageSpec]) -> Report:
        started = time.monotonic()
        report = Report(str(self.cfg.registry), self.repo, _now(), dry_run=self.cfg.dry_run,
                        allow_untested=self.cfg.allow_untested, compression="zstd" if self.zstd else "gzip",
                        credentials=self.creds.source if self.creds else "anonymous")
        cells = [self._prepare(spec, matrix) for spec in selected]
        multi = manifest_list.MultiPlatform(self, matrix, cells)  # a tag of several platforms: one list
        report.cells = [c.report for c in cells]
        if self.cfg.allow_untested:
            untested = [c.spec.name for c in cells if c.report.smoke.get("status") != "passed"]
            log.warning("WARNING: --allow-untested: floating tags may move to images without a smoke-test pass%s",
                        f" ({', '.join(untested)})" if untested else "")
        if self.cfg.dry_run:
            self._gates(cells, dry=True)
            for c in cells:
                if c.tags is not None:
                    c.report.tags = [self._result(t, "immutable", PLANNED) for t in c.tags.immutable]
                    c.report.tags += [self._result(t, "floating", PLANNED, "if the gate opens")
                                      for t in c.tags.floating]
            ready = [CellReport(c.report.cell, c.report.image, c.report.image_id, smoke=c.report.smoke,
                                error=c.report.error,
                                tags=[TagResult(t.tag, t.ref, t.kind, PUSHED) for t in c.report.tags])
                     for c in cells]
            is_open, reasons = floating_gate(ready, self.cfg.allow_untested)
            report.floating_gate = {"open": is_open, "reasons": reasons}
            report.ok = is_open
            return self._finish(report, started)

        self._gates(cells)
        for c in cells:
            if c.tags is not None:
                log.info("%s (%s): immutable tags %s", c.spec.name, c.image_id[:19], ", ".join(c.tags.immutable))
                multi.immutable(c) if multi.owns(c) else self._immutable(c)
            else:
                log.error("%s: %s", c.spec.name, c.report.error)

        is_open, reasons = floating_gate(report.cells, self.cfg.allow_untested)
        report.floating_gate = {"open": is_open, "reasons": [self._r(r) for r in reasons]}
        for c in cells:
            if c.tags is None:
                continue
            if not is_open:
                c.report.tags += [self._result(t, "floating", HELD, "held: floating tags move only when every "
                                               "selected cell published its immutable tags and passed its smoke "
                                               "test (see floating_gate)") for t in c.tags.floating]
                continue
            for t in c.tags.floating:
                res = multi.floating(c, t) if multi.owns(c) else self._publish_tag(c, t, "floating", None)
                c.report.tags.append(res)
                self._log_result(res)
        if not is_open:
            log.error("floating tags held:\n  %s", "\n  ".join(report.floating_gate["reasons"]))
        for c in cells:
            multi.summarise(c) if multi.owns(c) else c.report.summarise()
        report.ok = is_open and all(c.immutable_ok and all(t.status in OK_STATUSES for t in c.tags)
                                    for c in report.cells)
        return self._finish(report, started)

    @staticmethod
    def _finish(report: Report, started: float) -> Report:
        report.finished = _now()
        report.seconds = round(time.monotonic() - started, 2)
        return report


