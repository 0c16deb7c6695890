"""The in-toto statements publish signs for one manifest digest (pure).

Each digest gets three Statement v1 (https://in-toto.io/Statement/v1), signed separately:

- SLSA Provenance v1: the builder; each cell of images.yaml it carries (the entry and its sha256); the git
  commit the image was built from and whether the tree was clean; the lock's sha256; the Debian snapshot
  and SOURCE_DATE_EPOCH; the base image; the engine and builder; the external parameters a rebuild needs;
  and, where ``build.py repro`` proved one for the image's inputs, the reproducible OCI manifest digest a
  cold rebuild must give (a byproduct: the published image itself keeps its build's file times);
- the CycloneDX SBOM the image carries (one per platform: an index gets its platforms' SBOMs);
- the gate results: the smoke record, the OS freshness and the vulnerability gate.

A statement holds nothing that changes between two runs for the same image (no clock, no run id): the
same image and inputs give the same bytes, which is how a rerun knows it has nothing to sign.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

STATEMENT_V1 = "https://in-toto.io/Statement/v1"
SLSA_PROVENANCE_V1 = "https://slsa.dev/provenance/v1"
CYCLONEDX = "https://cyclonedx.org/bom"
GATES_V1 = "https://github.com/pt-multi-gpu/pt-multi-gpu/attestation/gates/v1"
BUILD_TYPE = "https://github.com/pt-multi-gpu/pt-multi-gpu/build/v1"
BUILDER_ID = "https://github.com/pt-multi-gpu/pt-multi-gpu/build.py"
#: cosign's names for --type (what `cosign verify-attestation --type` takes) of each predicate
COSIGN_TYPES = {SLSA_PROVENANCE_V1: "slsaprovenance1", CYCLONEDX: "cyclonedx", GATES_V1: GATES_V1}


def canonical(data: Any) -> bytes:
    """Sorted keys, no spaces, UTF-8: one value, one byte string."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class CellFacts:
    """What publish knows of one platform image it pushed (every field from the image, the checkout or the run)."""

    cell: str
    platform: str
    digest: str  # the platform manifest's digest in the registry
    image_id: str
    entry: Mapping[str, Any]  # the images.yaml cell, as the validated ImageSpec has it
    lock_sha256: str  # of locks/<cell>/pylock.toml; "" when the cell has none
    revision: str  # the git commit the image was built from (its revision label; "-dirty" when not clean)
    os_snapshot: str  # the Debian snapshot key the OS layer was built from
    os_suites: str  # the suites apt read, with their Release dates
    source_date_epoch: int | None  # the snapshot's newest Release date
    base: str  # the base image reference
    base_id: str  # its image id ("" when not here)
    engine: Mapping[str, str]  # engine version, API, builder (BuildKit)
    source: str  # the repository URL (the image's source label)
    smoke: Mapping[str, Any] = field(default_factory=dict)
    os_gate: Mapping[str, Any] = field(default_factory=dict)
    vuln_gate: Mapping[str, Any] = field(default_factory=dict)
    sbom: Mapping[str, Any] | None = None  # the CycloneDX document, or None when the image carries none
    #: what `build.py repro` proved for this image's inputs (its report: manifest, config, SOURCE_DATE_EPOCH,
    #: Debian snapshot, inputs hash), or None when no such report was at hand
    reproducible: Mapping[str, Any] | None = None


def cell_entry(spec: Any) -> dict[str, Any]:
    """A validated images.yaml cell (an ImageSpec) as plain JSON, without where it was written (``loc``) or
    whether it is the newest release (``latest``: a later release flips it without changing the image)."""
    data = dataclasses.asdict(spec)
    for k in ("loc", "latest"):
        data.pop(k, None)
    parsed: dict[str, Any] = json.loads(canonical(data))
    return parsed


def entry_sha256(entry: Mapping[str, Any]) -> str:
    return sha256_hex(canonical(entry))


def statement(name: str, digest: str, predicate_type: str, predicate: Mapping[str, Any]) -> bytes:
    algo, _, hexdigest = digest.partition(":")
    return canonical({"_type": STATEMENT_V1, "subject": [{"name": name, "digest": {algo: hexdigest}}],
                      "predicateType": predicate_type, "predicate": predicate})


def _cell_parameters(c: CellFacts) -> dict[str, Any]:
    return {"cell": c.cell, "platform": c.platform, "imagesYamlCell": dict(c.entry),
            "imagesYamlCellSha256": entry_sha256(c.entry), "lockSha256": c.lock_sha256,
            "osSnapshot": c.os_snapshot, "osSuites": c.os_suites, "sourceDateEpoch": c.source_date_epoch,
            "revision": c.revision.removesuffix("-dirty"), "treeClean": not c.revision.endswith("-dirty"),
            "base": c.base}


#: The name of the byproduct that carries a cell's reproducible OCI manifest digest (``<this>/<cell>``).
REPRODUCIBLE = "reproducible-oci-image"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _byproducts(cells: Sequence[CellFacts]) -> list[dict[str, Any]]:
    """Each cell's reproducible OCI manifest: the digest a cold rebuild of the same inputs must give."""
    out = []
    for c in cells:
        r = c.reproducible
        if not r:
            continue
        algo, _, hexdigest = str(r["manifest"]).partition(":")
        out.append({"name": f"{REPRODUCIBLE}/{c.cell}", "digest": {algo: hexdigest}, "mediaType": OCI_MANIFEST,
                    "annotations": {"cell": c.cell, "platform": c.platform, "config": str(r["config"]),
                                    "sourceDateEpoch": int(r["source_date_epoch"]),
                                    "osSnapshot": str(r["os_snapshot"]), "inputsHash": str(r["inputs"]),
                                    "buildx": str(r.get("buildx") or ""), "buildkit": str(r.get("buildkit") or ""),
                                    "how": "a separate build.py repro run of the same inputs (the image's inputs "
                                           "hash): uncached builds exported as OCI layouts with rewrite-timestamp, "
                                           "two with one digest, or one with the digest --against named"}})
    return out


def reproducible_digests(predicate: Mapping[str, Any]) -> dict[str, str]:
    """cell -> the reproducible manifest digest a provenance predicate records (empty when none)."""
    found: dict[str, str] = {}
    try:
        items = predicate["runDetails"].get("byproducts") or []
    except (KeyError, TypeError, AttributeError):
        return found
    for b in items if isinstance(items, list) else []:
        if not isinstance(b, dict) or not isinstance(b.get("annotations"), dict):
            continue
        digest, cell = b.get("digest"), b["annotations"].get("cell")
        if b.get("name") == f"{REPRODUCIBLE}/{cell}" and isinstance(digest, dict) and len(digest) == 1:
            ((algo, value),) = digest.items()
            found[cell] = f"{algo}:{value}"
    return found


def provenance(cells: Sequence[CellFacts]) -> dict[str, Any]:
    """SLSA Provenance v1 for the images of ``cells`` (one, or an index's platforms)."""
    deps: list[dict[str, Any]] = []
    for c in cells:
        rev = c.revision.removesuffix("-dirty")
        dep = {"uri": f"git+{c.source}@{rev}", "digest": {"gitCommit": rev}}
        if dep not in deps:
            deps.append(dep)
        if c.lock_sha256:
            deps.append({"uri": f"locks/{c.cell}/pylock.toml", "digest": {"sha256": c.lock_sha256}})
        if c.base_id:
            algo, _, hexdigest = c.base_id.partition(":")
            deps.append({"uri": c.base, "digest": {algo: hexdigest}, "annotations": {"what": "base image id"}})
        if c.os_snapshot:
            deps.append({"uri": "debian-snapshot", "digest": {"sha256": c.os_snapshot.removeprefix("sha256:")},
                         "annotations": {"suites": c.os_suites}})
    run_details: dict[str, Any] = {"builder": {"id": BUILDER_ID}, "metadata": {}}
    byproducts = _byproducts(cells)
    if byproducts:
        run_details["byproducts"] = byproducts
    return {
        "buildDefinition": {
            "buildType": BUILD_TYPE,
            "externalParameters": {"cells": [_cell_parameters(c) for c in cells],
                                   "rebuild": "python build.py repro --only CELL (the commit checked out)"},
            "internalParameters": {"images": {c.cell: {"imageId": c.image_id, "digest": c.digest,
                                                       "engine": dict(c.engine)} for c in cells}},
            "resolvedDependencies": deps,
        },
        "runDetails": run_details,
    }


def gates(cells: Sequence[CellFacts]) -> dict[str, Any]:
    return {"cells": [{"cell": c.cell, "platform": c.platform, "smoke": dict(c.smoke), "osFreshness": dict(c.os_gate),
                       "vulnerabilities": dict(c.vuln_gate)} for c in cells]}


def for_digest(name: str, digest: str, cells: Sequence[CellFacts]) -> list[tuple[str, bytes]]:
    """(predicateType, statement) for one digest: a platform image (one cell) or an index (its platforms)."""
    out = [(SLSA_PROVENANCE_V1, statement(name, digest, SLSA_PROVENANCE_V1, provenance(cells)))]
    out += [(CYCLONEDX, statement(name, digest, CYCLONEDX, c.sbom)) for c in cells if c.sbom is not None]
    out.append((GATES_V1, statement(name, digest, GATES_V1, gates(cells))))
    return out


def subject_digests(statement_bytes: bytes) -> list[str]:
    """``algo:hex`` of every subject of a statement (empty when it is not one)."""
    try:
        data = json.loads(statement_bytes)
    except ValueError:
        return []
    found = []
    for s in data.get("subject") or [] if isinstance(data, dict) else []:
        for algo, value in (s.get("digest") or {}).items() if isinstance(s, dict) else ():
            found.append(f"{algo}:{value}")
    return found
