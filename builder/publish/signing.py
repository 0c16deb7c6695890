"""`publish --sign-key`: sign every manifest digest the run published (each platform image, and the index of
a tag of several platforms) with in-toto statements stored as cosign stores them (builder/attest).

The facts come from the image (its labels: revision, Debian snapshot and suites, builder), the checkout
(images.yaml's cell, the lock's sha256), the engine (its version, the base image's id) and the run (the
smoke record, the OS freshness and vulnerability gates, the SBOM copied beside the report). Nothing is
added to the image or its index: the pushed digests stay the local images' (and repro's).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any, Protocol, cast

import requests
from cryptography.hazmat.primitives.asymmetric import ec

import ptmg_contract as contract
from builder.attest import statements
from builder.attest.cosign_store import StoreError
from builder.attest.keys import key_id
from builder.attest.signer import sign_digest
from builder.audit.report import SectionResult
from builder.common.log import log
from builder.imaging import repro
from builder.lock import model
from builder.matrix import ImageSpec, Matrix
from builder.publish.client import RegistryClient
from builder.publish.faults import Fault
from builder.publish.report import OK_STATUSES, Report
from builder.publish.zstdpush import CHUNK, ChunkStream


class ClientStore:
    """builder.attest's registry port over the publish stage's HTTP client (faults become StoreError)."""

    def __init__(self, client: RegistryClient) -> None:
        self.client = client

    def get_manifest(self, reference: str) -> bytes | None:
        got = self.client.raw_manifest(reference)
        if isinstance(got, Fault):
            raise StoreError(str(got))
        return got

    def get_blob(self, digest: str) -> bytes:
        got = self.client.blob(digest)
        if isinstance(got, Fault):
            raise StoreError(str(got))
        return got

    @contextmanager
    def open_blob(self, digest: str) -> Iterator[IO[bytes]]:
        """A blob streamed (``build.py verify --rebuild`` reads layers of gigabytes so); faults, a broken
        connection included, become StoreError."""
        got = self.client.open_blob(digest)
        if isinstance(got, Fault):
            raise StoreError(str(got))
        with got:
            try:
                yield cast(IO[bytes], ChunkStream(got.iter_content(CHUNK)))
            except requests.exceptions.RequestException as exc:
                raise StoreError(f"reading {digest} from {self.client.registry.host}: {exc}") from None

    def put_blob(self, data: bytes, digest: str) -> None:
        held = self.client.blob_exists(digest)
        if isinstance(held, Fault):
            raise StoreError(str(held))
        if not held:
            got = self.client.upload_blob(data, digest)
            if isinstance(got, Fault):
                raise StoreError(str(got))

    def put_manifest(self, reference: str, media_type: str, body: bytes) -> str:
        got = self.client.put_manifest(reference, media_type, body)
        if isinstance(got, Fault):
            raise StoreError(str(got))
        return got


class EnginePort(Protocol):
    def image_attrs(self, ref: str) -> dict[str, Any] | None: ...
    def version(self) -> dict[str, Any]: ...


def lock_sha256(root: Path, cell: str) -> str:
    path = model.lock_path(root, cell)
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def source_date_epoch(suites: str) -> int | None:
    """The newest Release date of ``bookworm@2026-07-11T10:16:37Z ...`` as seconds (None: none)."""
    import datetime as dt

    stamps = []
    for item in suites.split():
        try:
            when = dt.datetime.strptime(item.partition("@")[2], "%Y-%m-%dT%H:%M:%SZ")
        except ValueError:
            continue
        stamps.append(int(when.replace(tzinfo=dt.timezone.utc).timestamp()))
    return max(stamps) if stamps else None


def vuln_record(result: SectionResult | None) -> dict[str, Any]:
    if result is None:
        return {"status": "not run"}
    return {"status": result.status, "findings": sorted((dict(f) for f in result.findings), key=json.dumps),
            "audited": result.facts.get("audited", ""), "source": result.facts.get("source", ""),
            "unknown": result.facts.get("unknown", "") == "yes", "error": result.error.splitlines()[0] if result.error
            else ""}


class Signing:
    """Gathers each published image's facts and signs each digest once."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, client: RegistryClient, engine: EnginePort, matrix: Matrix,
                 root: Path, *, audited: Mapping[str, SectionResult], sbom_dir: Path, allow_stale_os: bool,
                 repro_dir: Path | None = None) -> None:
        self.key, self.client, self.engine, self.matrix, self.root = key, client, engine, matrix, root
        self.store = ClientStore(client)
        self.audited, self.sbom_dir, self.allow_stale_os = audited, sbom_dir, allow_stale_os
        self.repro_dir = repro_dir
        self.reference = client.registry.repository(matrix.repository)

    def _engine_facts(self) -> dict[str, str]:
        v = self.engine.version()
        return {"engine": f"Docker Engine {v.get('Version', '?')}", "api": str(v.get("ApiVersion", "?"))}

    def reproducible(self, spec: ImageSpec, labels: Mapping[str, str]) -> dict[str, Any] | None:
        """What `build.py repro` proved for the inputs this image was built from (its inputs-hash label), from
        its report in ``repro_dir``; None, and the reason logged, when there is nothing to sign."""
        if self.repro_dir is None:
            return None
        got = repro.proven_digest(self.repro_dir, spec.name, str(labels.get(contract.LABEL_INPUTS_HASH, "")))
        if isinstance(got, str):
            log.info("%s: no reproducible digest in its provenance: %s", spec.name, got)
            return None
        log.info("%s: its provenance names the reproducible digest %s (%s)", spec.name, got.manifest,
                 repro.report_path(self.repro_dir, spec.name))
        return asdict(got)

    def facts(self, spec: ImageSpec, image_id: str, digest: str, smoke: Mapping[str, Any],
              engine: Mapping[str, str]) -> statements.CellFacts:
        labels = ((self.engine.image_attrs(image_id) or {}).get("Config") or {}).get("Labels") or {}
        base = self.engine.image_attrs(spec.base) or {}
        sbom_path = self.sbom_dir / f"{spec.name}.cdx.json"
        sbom = json.loads(sbom_path.read_text(encoding="utf-8")) if sbom_path.is_file() else None
        suites = str(labels.get(contract.LABEL_OS_SUITES, ""))
        return statements.CellFacts(
            cell=spec.name, platform=spec.platform, digest=digest, image_id=image_id,
            entry=statements.cell_entry(spec), lock_sha256=lock_sha256(self.root, spec.name),
            revision=str(labels.get(contract.OCI_REVISION, "")),
            os_snapshot=str(labels.get(contract.LABEL_OS_SNAPSHOT, "")), os_suites=suites,
            source_date_epoch=source_date_epoch(suites), base=spec.base, base_id=str(base.get("Id", "")),
            engine={**engine, "builder": str(labels.get(contract.LABEL_BUILDER, ""))},
            source=str(labels.get("org.opencontainers.image.source", "")), smoke=dict(smoke),
            os_gate={"updated": str(labels.get(contract.LABEL_OS_UPDATED, "")), "suites": suites,
                     "maxPendingDays": self.matrix.audit.debian.max_pending_days,
                     "result": "passed" if not self.allow_stale_os else "passed or allowed (--allow-stale-os)"},
            vuln_gate=vuln_record(self.audited.get(spec.name)), sbom=sbom, reproducible=self.reproducible(spec, labels))

    def run(self, report: Report, selected: Sequence[ImageSpec]) -> None:
        """Sign what ``report`` says was published; the outcome goes into ``report.signed``."""
        specs = {s.name: s for s in selected}
        report.signing_key = key_id(self.key.public_key())
        by_digest: dict[str, list[str]] = {}
        for c in report.cells:
            for t in c.tags:
                if t.digest and t.status in OK_STATUSES and c.cell not in by_digest.setdefault(t.digest, []):
                    by_digest[t.digest].append(c.cell)
        engine = self._engine_facts() if by_digest else {}
        cells = {c.cell: c for c in report.cells}
        platform_of = {}  # cell -> its platform image's digest
        groups: dict[str, list[str]] = {}
        for digest, names in by_digest.items():
            remote = self.client.manifest(digest)
            if remote.fault is not None:
                report.signed.append({"digest": digest, "cells": names, "error": f"reading it failed: {remote.fault}"})
                continue
            if remote.children:
                groups[digest] = [d for _, d in remote.children]
            else:
                for n in names:
                    platform_of[n] = digest
        members = {d: [n for n, pd in platform_of.items() if pd == d] for d in set(platform_of.values())}
        members.update({d: [n for n, pd in platform_of.items() if pd in kids] for d, kids in groups.items()})
        facts = {n: self.facts(specs[n], str(cells[n].image_id), d, cells[n].smoke, engine)
                 for n, d in platform_of.items() if n in specs}
        for digest, names in members.items():
            try:
                got = sign_digest(self.store, self.key, self.reference, digest,
                                  statements.for_digest(self.reference, digest, [facts[n] for n in names]), names)
            except StoreError as exc:
                report.signed.append({"digest": digest, "cells": names, "error": str(exc)})
                log.error("signing %s (%s) failed: %s", digest, ", ".join(names), exc)
                continue
            report.signed.append({**asdict(got), "reproducible": {n: str(r["manifest"]) for n in names
                                                                   if (r := facts[n].reproducible)}})
            log.info("%s (%s): %s %s, %s %s (%.2f s)", digest[:19], ", ".join(names), got.attestations[:18] + "….att",
                     got.att_status, ".sig", got.sig_status, got.seconds)
        if any("error" in s for s in report.signed):
            report.ok = False
