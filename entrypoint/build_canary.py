"""Build time only (a RUN in the Dockerfile): say whether the build secrets reached the
build, without a single secret value, so that tests/docker/test_build.py can prove the
secrets were there while it proves they are not in the image.

    ptmg-build-secret build-env: present (exports: HTTPS_PROXY NO_PROXY PIP_INDEX_URL ...)
    ptmg-build-secret ca-bundle: present (142 certificates; last: sha256:ab12...)

Certificates are public; their SHA-256 fingerprints identify the CA a build was given.
"""

from __future__ import annotations

import hashlib
import re
import ssl
import sys
from pathlib import Path

SECRETS = Path("/run/secrets")
PREFIX = "ptmg-build-secret"
_EXPORT = re.compile(r"^export ([A-Za-z_][A-Za-z0-9_]*)=", re.M)
_PEM = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def build_env(text: str) -> str:
    return "exports: " + " ".join(sorted(set(_EXPORT.findall(text))))


def ca_bundle(text: str, last: int = 3) -> str:
    fps = [hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest() for pem in _PEM.findall(text)]
    return f"{len(fps)} certificates; last: " + ", ".join(f"sha256:{fp}" for fp in fps[-last:])


def main() -> int:
    for name, describe in (("build-env", build_env), ("ca-bundle", ca_bundle)):
        path = SECRETS / name
        try:
            text = path.read_text()
        except OSError:
            print(f"{PREFIX} {name}: absent")
            continue
        try:
            print(f"{PREFIX} {name}: present ({describe(text)})")
        except ValueError as exc:
            print(f"{PREFIX} {name}: present (unparsable: {type(exc).__name__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
