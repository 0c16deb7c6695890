"""What a publish did, per cell and tag; JSON and Markdown reports (secrets redacted)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from builder.common.log import human_size
from builder.publish.credentials import redact

# Tag statuses in the report.
PUSHED, UNCHANGED, REFUSED, FAILED, HELD, PLANNED = "pushed", "unchanged", "refused", "failed", "held", "planned"
OK_STATUSES = frozenset({PUSHED, UNCHANGED})


@dataclass
class TagResult:
    tag: str
    ref: str
    kind: str  # immutable | floating
    status: str  # pushed | unchanged | refused | failed | held | planned
    digest: str | None = None
    compressed_size: int | None = None
    message: str = ""
    attempts: int = 0
    seconds: float = 0.0
    layers_uploaded: list[str] = field(default_factory=list)
    layers_existing: list[str] = field(default_factory=list)
    compression: str = ""  # of the layers the registry serves under this tag: gzip | zstd | none | mixed


@dataclass
class CellReport:
    cell: str
    image: str
    image_id: str | None = None
    digest: str | None = None
    compressed_size: int | None = None
    uncompressed_size: int | None = None
    versions: dict[str, str] = field(default_factory=dict)
    smoke: dict[str, Any] = field(default_factory=dict)
    tags: list[TagResult] = field(default_factory=list)
    error: str = ""
    notes: list[str] = field(default_factory=list)
    unchanged_since: str = ""  # the registry already holds this image: nothing pushed, nothing moved

    def summarise(self) -> None:
        """The cell's digest and compressed size: its first published tag's."""
        digests = [t.digest for t in self.tags if t.digest and t.status in OK_STATUSES]
        if digests:
            self.digest = digests[0]
            self.compressed_size = next((t.compressed_size for t in self.tags if t.compressed_size), None)
        if len(set(digests)) > 1:
            self.notes.append("the tags of this image resolve to different manifests (same image, "
                              f"compressed differently): {', '.join(sorted(set(digests)))}")

    @property
    def immutable_ok(self) -> bool:
        if self.unchanged_since and not self.error:
            return True
        imm = [t for t in self.tags if t.kind == "immutable"]
        return not self.error and bool(imm) and all(t.status in OK_STATUSES for t in imm)


@dataclass
class Report:
    registry: str
    repository: str
    started: str
    finished: str = ""
    seconds: float = 0.0
    dry_run: bool = False
    allow_untested: bool = False
    compression: str = "gzip"  # of the layers of new pushes (a tag the registry holds keeps its own)
    credentials: str = "anonymous"  # where they came from, never what they are
    floating_gate: dict[str, Any] = field(default_factory=dict)
    cells: list[CellReport] = field(default_factory=list)
    ok: bool = False
    signing_key: str = ""  # --sign-key: the public key's sha256 (never the key)
    signed: list[dict[str, Any]] = field(default_factory=list)  # per digest: what was signed (builder/attest)



# --- reports ----------------------------------------------------------------------------
def report_json(report: Report, secrets: Iterable[str] = ()) -> str:
    return redact(json.dumps(asdict(report), indent=2, sort_keys=False), secrets) + "\n"


def short_digest(digest: str | None) -> str:
    return digest[:19] if digest else "-"


def report_markdown(report: Report, secrets: Iterable[str] = ()) -> str:
    lines = [f"# Publish report: {report.repository}", ""]
    verdict = "**ok**" if report.ok else "**FAILED**"
    if report.dry_run:
        verdict = "dry run (nothing pushed, registry not contacted)"
    lines += [f"- result: {verdict}", f"- registry: `{report.registry}`", f"- started: {report.started}",
              f"- took: {report.seconds:.1f} s", f"- credentials: {report.credentials}",
              f"- compression of new pushes: {report.compression} (a tag the registry already held keeps its own: "
              "see each tag's)"]
    gate = report.floating_gate
    if gate.get("open"):
        lines.append("- floating tags: moved (every cell published and smoke-tested)")
    else:
        lines.append("- floating tags: **held**")
        lines += [f"  - {r}" for r in gate.get("reasons", [])]
    if report.allow_untested:
        lines.append("- **WARNING: --allow-untested: floating tags may point at images without a smoke-test pass**")
    lines += ["", "| cell | digest | compressed | uncompressed | torch | CUDA | cuDNN | smoke |",
              "|---|---|---|---|---|---|---|---|"]
    for c in report.cells:
        v = c.versions
        lines.append(f"| {c.cell} | `{short_digest(c.digest)}` | {human_size(c.compressed_size)} | "
                     f"{human_size(c.uncompressed_size)} | {v.get('torch', '-')} | {v.get('cuda', '-')} | "
                     f"{v.get('cudnn', '-')} | {c.smoke.get('status', '-')} |")
    if report.signing_key:
        lines += ["", "## Signed", "", f"- key: `{report.signing_key}` (the public key's sha256)", "",
                  "| digest | cells | .att | .sig | statements | reproducible digest |", "|---|---|---|---|---|---|"]
        for s in report.signed:
            if "error" in s:
                lines.append(f"| `{s['digest']}` | {', '.join(s['cells'])} | **failed**: {s['error']} | - | - | - |")
            else:
                proven = ", ".join(f"`{d}`" for d in (s.get("reproducible") or {}).values()) or "none proven"
                lines.append(f"| `{s['digest']}` | {', '.join(s['cells'])} | {s['att_status']} | {s['sig_status']} | "
                             f"{', '.join(s['predicate_types'])} | {proven} |")
    for c in report.cells:
        lines += ["", f"## {c.cell}", "", f"- local image: `{c.image}` ({c.image_id or 'missing'})"]
        if c.digest:
            lines.append(f"- digest: `{c.digest}`")
        if c.error:
            lines.append(f"- error: {c.error}")
        if c.unchanged_since:
            lines.append(f"- {c.unchanged_since}: the registry already holds this image; nothing published")
        lines += [f"- note: {n}" for n in c.notes]
        if c.versions:
            lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in c.versions.items()
                                                   if k not in ("inputs-hash", "cuda-arch-list")))
        lines += ["", "| tag | kind | status | digest | compression | layers sent | message |",
                  "|---|---|---|---|---|---|---|"]
        for t in c.tags:
            msg = t.message.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{t.tag}` | {t.kind} | {t.status} | `{short_digest(t.digest)}` | {t.compression or '-'} | "
                         f"{len(t.layers_uploaded)}/{len(t.layers_uploaded) + len(t.layers_existing)} | {msg} |")
    return redact("\n".join(lines) + "\n", secrets)


def write_report(report: Report, directory: Path, secrets: Iterable[str] = ()) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    secrets = tuple(secrets)
    jpath, mpath = directory / "publish-report.json", directory / "publish-report.md"
    jpath.write_text(report_json(report, secrets), encoding="utf-8")
    mpath.write_text(report_markdown(report, secrets), encoding="utf-8")
    return jpath, mpath


