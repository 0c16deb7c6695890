"""`build.py keygen PATH`: an ECDSA P-256 key pair: PATH.key (0600) for `publish --sign-key`, PATH.pub for `verify`."""

from __future__ import annotations

import argparse
from pathlib import Path

from builder.attest import keys
from builder.cli import args as types
from builder.cli.context import Context
from builder.cli.registry import Verb
from builder.common.log import log


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", type=types.text,
                   help="writes PATH.key (PEM PKCS#8, mode 0600, unencrypted: keep it in a secret store) and PATH.pub")


def run(ctx: Context) -> int:
    priv, pub = keys.keygen(Path(ctx.args.path))
    log.info("wrote %s (private, 0600) and %s (public, %s)", priv, pub,
             keys.key_id(keys.load_public(pub)))
    return 0


VERB = Verb("keygen", "write an ECDSA P-256 signing key pair (PATH.key 0600, PATH.pub) for publish --sign-key",
            "keygen PATH", run, add_arguments,
            "Write PATH.key (PEM PKCS#8 ECDSA P-256, mode 0600) and PATH.pub, cosign's default key type: "
            "`publish --sign-key PATH.key` signs, `verify REF --key PATH.pub` (or cosign) checks. Never overwrites.")
