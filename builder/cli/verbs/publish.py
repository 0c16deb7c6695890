"""`build.py publish`: push smoke-tested images; immutable tags never overwritten; verify; report."""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import importlib.util
import os
from pathlib import Path

from builder.attest import keys
from builder.audit import python
from builder.audit.report import SectionResult
from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.errors import InputError
from builder.common.log import human_size, log, table
from builder.common.paths import project_root
from builder.engine.capabilities import CLASSIC, UNKNOWN, unknown_store_line
from builder.matrix import tags
from builder.publish.address import parse_registry
from builder.publish.client import RegistryClient
from builder.publish.credentials import load_credentials
from builder.publish.faults import RetryPolicy
from builder.publish.gates import freshness_gates
from builder.publish.publisher import PublishConfig, Publisher
from builder.publish.report import Report, report_json, short_digest, write_report
from builder.publish.signing import Signing
from builder.publish.vulns import annotate, combine, python_gate, write_extras
from builder.publish.zstdpush import ZstdPusher
from builder.smoke import passes


def add_arguments(p: argparse.ArgumentParser) -> None:
    types.add_platforms(p, "all", env=None)  # one registry tag carries every platform of a cell
    p.add_argument("--registry", default=os.environ.get("PTMG_REGISTRY", ""), metavar="HOST[:PORT][/NAMESPACE]",
                   type=types.text,
                   help="where to push, e.g. ghcr.io/my-org or 127.0.0.1:5000 (env PTMG_REGISTRY). Plain HTTP "
                        "for 127.0.0.1/localhost, HTTPS (system CA bundle) otherwise. Credentials: env "
                        "PTMG_REGISTRY_USER + PTMG_REGISTRY_PASSWORD or PTMG_REGISTRY_PASSWORD_FILE, else the "
                        "docker config (`docker login`)")
    p.add_argument("--report-dir", type=types.text,
                   default=os.environ.get("PTMG_PUBLISH_REPORT_DIR", "build-logs/publish"),
                   help="where publish-report.json and publish-report.md go (default build-logs/publish/)")
    p.add_argument("--allow-untested", action="store_true",
                   help="move floating tags even for images without a recorded smoke-test pass (reported loudly)")
    p.add_argument("--allow-stale-os", action="store_true",
                   help="publish even an image with Debian security updates pending for longer than images.yaml's "
                        "audit.debian.max_pending_days (reported)")
    p.add_argument("--allow-unknown-vulns", action="store_true",
                   help="publish even when the Python vulnerability audit could not run (no advisory source "
                        "answered, or nothing to audit); reported loudly. Known vulnerabilities still refuse a "
                        "cell unless images.yaml's audit.python.allow lists them")
    p.add_argument("--osv-dir", default=None, metavar="DIR", type=types.text,
                   help=f"Python advisories from this offline OSV snapshot only (env {python.OSV_DIR_ENV}); default: "
                        "OSV's API, then PyPI's JSON API")
    p.add_argument("--publish-unchanged", action="store_true",
                   help="publish new dated tags even for a cell whose floating tag already holds the same recipe "
                        "and packages (by default such a cell is skipped: an unchanged week publishes nothing)")
    p.add_argument("--compression", type=types.one_of("gzip", "zstd"), metavar="gzip|zstd",
                   default=os.environ.get("PTMG_PUBLISH_COMPRESSION") or "gzip",
                   help="how new pushes compress the layers (env PTMG_PUBLISH_COMPRESSION): gzip (default; `docker "
                        "push`, which every engine and cluster runtime pulls) or zstd (smaller, faster to unpack; "
                        "pulled by Docker >= 23, containerd >= 1.5, Podman/CRI-O, not by Docker 20.10: see "
                        "docs/supply-chain.md). A tag the registry already holds keeps its compression")
    p.add_argument("--sign-key", metavar="PATH", type=types.text, default=os.environ.get("PTMG_SIGN_KEY_FILE") or None,
                   help="sign every digest published with this ECDSA P-256 private key (a PEM PKCS#8 file, read "
                        "from the file only; env PTMG_SIGN_KEY_FILE names the file): SLSA provenance, the SBOM and "
                        "the gate results as in-toto attestations in the sha256-<hex>.att tag, and a .sig, as cosign "
                        "stores them (docs/supply-chain.md)")
    p.add_argument("--repro-dir", metavar="DIR", type=types.text, default=os.environ.get("PTMG_LOG_DIR", "build-logs"),
                   help="with --sign-key: where `build.py repro` wrote <cell>.repro.json (default: repro's log folder, "
                        "build-logs/ or env PTMG_LOG_DIR). A cell whose report proved a digest for the same inputs "
                        "as the pushed image has that reproducible digest in its signed provenance, which "
                        "`build.py verify --rebuild` then compares its rebuild's digest with")
    p.add_argument("--attempts", type=types.count(1, 20), default=os.environ.get("PTMG_PUSH_ATTEMPTS", "4"),
                   help="tries per tag for transient registry faults, 1-20 (default 4, env PTMG_PUSH_ATTEMPTS; "
                        "exponential backoff with jitter)")


def _print_summary(report: Report) -> None:
    rows = [[c.cell, t.tag, t.kind, t.status, f"{t.seconds:.1f}s", human_size(t.compressed_size),
             t.compression or "-", short_digest(t.digest)] for c in report.cells for t in c.tags]
    rows += [[c.cell, "-", "-", c.unchanged_since or ("would be refused" if "would be refused: " in c.error
                                                      else "failed"), "-", "-", "-", "-"]
             for c in report.cells if not c.tags]
    print(table(["cell", "tag", "kind", "status", "time", "size", "compression", "digest"], rows))


def _print_dry_run(report: Report) -> None:
    _print_summary(report)
    for c in report.cells:
        print(f"{c.cell}: {c.image} ({c.image_id or 'missing'}), smoke {c.smoke.get('status', '-')}"
              + (f"; {c.error}" if c.error else ""))
    gate = report.floating_gate
    print("floating tags would move" if gate["open"] else
          "floating tags would be held:\n  " + "\n  ".join(gate["reasons"]))


def _zstd_pusher(ctx: Context, client: RegistryClient, store: str) -> ZstdPusher | None:
    """The layer pusher of --compression zstd (None: gzip, `docker push`)."""
    if ctx.args.compression != "zstd":
        return None
    if store != CLASSIC:
        raise InputError(f"--compression zstd: this engine keeps its images in the {store} store, where an image ID "
                         "is its gzip manifest's digest, which a zstd manifest never has (publish could not tell "
                         "its own image in the registry); use --compression gzip with it, or the classic store")
    if importlib.util.find_spec("zstandard") is None:
        raise InputError("--compression zstd needs the zstandard module: pip install -e . (a dependency)")
    return ZstdPusher(ctx.engine(), client)


def run(ctx: Context) -> int:
    a = ctx.args
    registry = parse_registry(a.registry)
    sign_key = keys.load_private(Path(a.sign_key)) if a.sign_key else None  # a bad key: exit 2 before any push
    creds = load_credentials(registry, os.environ)
    tags.plan(ctx.matrix, dt.date.today(), "0" * tags.SHORT_SHA)  # ambiguous templates fail before anything
    log.info("publishing %d cell(s) to %s as %s", len(ctx.cells), registry,
             creds.source if creds else "anonymous (no credentials found)")
    client = RegistryClient(registry, ctx.matrix.repository, creds)
    cfg = PublishConfig(registry, allow_untested=a.allow_untested, dry_run=a.dry_run,
                        retry=RetryPolicy(attempts=a.attempts))
    gates = freshness_gates(ctx.engine(), client, ctx.matrix, a.allow_stale_os, a.publish_unchanged)
    # Known vulnerabilities in the Python distributions refuse a cell, like a stale OS
    vuln_settings = python.Settings(ctx.docker_dir.parent, ctx.matrix.audit.python, python.sources_from(a.osv_dir))
    audited: dict[str, SectionResult] = {}
    if a.allow_unknown_vulns:
        log.warning("WARNING: --allow-unknown-vulns: cells are published even where the Python vulnerability "
                    "audit could not run")
    vuln_gate = python_gate(ctx.engine(), vuln_settings, [ctx.docker_dir.parent, project_root()],
                            a.allow_unknown_vulns, audited)
    store = ctx.engine().store()
    if store.kind == UNKNOWN:  # what an image ID names decides every "unchanged" and every verification
        raise InputError(unknown_store_line(store))
    publisher = Publisher(ctx.engine(), client, cfg, repository=ctx.matrix.repository, creds=creds,
                          smoke=functools.partial(passes.smoke_pass, ctx.root), unchanged=gates.unchanged,
                          os_gate=combine(gates.os_gate, vuln_gate), store=store.kind,
                          zstd=_zstd_pusher(ctx, client, store.kind))
    report = publisher.run(ctx.matrix, ctx.cells)
    annotate(report, audited, vuln_settings)
    secrets = publisher.secrets
    if a.json:
        print(report_json(report, secrets), end="")
    if a.dry_run:
        if not a.json:
            _print_dry_run(report)
        return 0 if report.ok else 1
    for extra in write_extras(ctx.engine(), Path(a.report_dir), ctx.cells, audited, report):
        log.info("beside the report: %s", extra)
    if sign_key is not None:
        Signing(sign_key, client, ctx.engine(), ctx.matrix, ctx.docker_dir.parent, audited=audited,
                sbom_dir=Path(a.report_dir) / "sbom", allow_stale_os=a.allow_stale_os,
                repro_dir=Path(a.repro_dir)).run(report, ctx.cells)
    jpath, mpath = write_report(report, Path(a.report_dir), secrets)
    if not a.json:
        _print_summary(report)
    log.info("report: %s, %s", jpath, mpath)
    if not report.ok:
        log.error("publish FAILED; see %s", mpath)
    return 0 if report.ok else 1


VERB = Verb("publish", "push tags that are never overwritten, verify digests, write a JSON + Markdown report",
            "publish --registry HOST[:PORT][/NS]", run, add_arguments,
            "Push the selected cells to a registry: immutable tags first, never overwritten; floating tags "
            "(<tag>, <minor>-cuda<cuda>, latest) only after every cell is pushed and smoke-tested; verify and "
            "report.")
