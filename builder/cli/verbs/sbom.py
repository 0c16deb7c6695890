"""`build.py sbom [CELL|IMAGE]`: print or write the SBOM an image carries (CycloneDX JSON, made at build time)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import ptmg_contract as contract
from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.errors import StepFailed
from builder.common.log import log, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", nargs="?", metavar="CELL|IMAGE", type=types.text,
                   help="a cell of images.yaml or a local image reference (default: the one cell --only selects)")
    p.add_argument("--output", "-o", metavar="FILE", type=types.text, help="write the SBOM to FILE, not stdout")
    p.add_argument("--summary", action="store_true", help="print what it lists (counts, the image's facts) instead")


def run(ctx: Context) -> int:
    ref, _ = ctx.one_image("sbom", ctx.args.target)
    engine = ctx.engine()
    if not engine.image_exists(ref):
        raise StepFailed(f"no image {ref} here; build it first (`build.py build --only ...`)")
    r = engine.run(ref, [contract.SBOM_FILE], entrypoint=["/bin/cat"], timeout=300)
    if r.exit_code != 0:
        raise StepFailed(f"{ref} has no SBOM at {contract.SBOM_FILE} (built before images carried one?): rebuild it")
    text = r.output if r.output.endswith("\n") else r.output + "\n"
    try:
        bom = json.loads(text)
    except ValueError:
        raise StepFailed(f"{ref}: {contract.SBOM_FILE} is not JSON") from None
    if ctx.args.summary:
        comps = bom.get("components") or []
        kinds = {"pkg:deb/": "Debian packages", "pkg:pypi/": "Python distributions"}
        rows = [[label, str(sum(1 for c in comps if str(c.get("purl", "")).startswith(p)))]
                for p, label in kinds.items()]
        rows += [[str(x["name"]), str(x["value"])] for x in bom["metadata"]["component"].get("properties", [])]
        print(f"{ref}: CycloneDX {bom.get('specVersion')} ({contract.SBOM_FILE})")
        print(table(["what", "value"], rows))
    elif ctx.args.output:
        Path(ctx.args.output).write_text(text, encoding="utf-8")
        log.info("wrote %s (%d components)", ctx.args.output, len(bom.get("components") or []))
    else:
        print(text, end="")
    return 0


VERB = Verb("sbom", "print or write the SBOM of an image (CycloneDX JSON: every Debian and Python package)",
            "sbom CELL|IMAGE [--output FILE] [--summary]", run, add_arguments,
            f"Print (or --output FILE) the CycloneDX SBOM an image carries at {contract.SBOM_FILE} (label "
            f"{contract.LABEL_SBOM}), made from inside the image at build time: every Debian package and Python "
            "distribution with version, purl, license where known and, for Python, the sha256 of its wheel.")
