"""What a build needs from the host's network setup, carried as BuildKit secrets.

Corporate and air-gapped sites put a TLS-intercepting proxy, a private CA or a
pip mirror between the build and the internet. Builds need those settings;
the final image must not keep any of them. They travel as two build secrets
(mounted only for the RUN that uses them, never written to a layer, never in
the image history or labels):

- ``ca-bundle``: a PEM bundle of public roots plus every extra CA found;
- ``build-env``: a shell file of ``export`` lines (pip index settings, proxies)
  that each networked RUN sources.
"""

from __future__ import annotations

import os
import re
import shlex
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from builder.common.errors import InputError

# Where Debian (update-ca-certificates) keeps locally added CAs.
LOCAL_CA_DIRS = (Path("/usr/local/share/ca-certificates"),)
# Bundles that point at the CA a client is told to trust.
BUNDLE_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT")
PIP_ENV = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST")
PROXY_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")
SECRET_DIR = "/run/secrets"  # noqa: S105 - a path, not a password
PEM_RE = re.compile(rb"-----BEGIN CERTIFICATE-----\s+.*?-----END CERTIFICATE-----", re.S)


class BuildEnvError(InputError):
    pass


@dataclass(frozen=True)
class BuildEnv:
    """Host settings a build should see: CA files and environment values."""

    ca_files: tuple[Path, ...]
    env: tuple[tuple[str, str], ...]

    @property
    def has_ca(self) -> bool:
        return bool(self.ca_files)

    def describe(self) -> list[str]:
        """What will be carried, without values (they may hold credentials)."""
        out = [f"CA: {p}" for p in self.ca_files]
        out += [f"env: {k}" for k, _ in self.env]
        return out


def detect(environ: Mapping[str, str], extra_ca: Sequence[Path] = (),
           ca_dirs: Sequence[Path] = LOCAL_CA_DIRS) -> BuildEnv:
    """Collect extra CAs and pip/proxy settings from the host. Pure apart from listing ca_dirs."""
    cas: list[Path] = []
    for d in ca_dirs:
        if d.is_dir():
            cas += sorted(p for p in d.rglob("*.crt") if p.is_file())
    for name in BUNDLE_ENV:
        value = environ.get(name)
        if value and Path(value).is_file():
            cas.append(Path(value))
    for p in extra_ca:
        if not p.is_file():
            raise BuildEnvError(f"--ca-cert {p}: no such file; pass a PEM certificate file")
        if not PEM_RE.search(p.read_bytes()):
            raise BuildEnvError(f"--ca-cert {p}: no PEM certificate in it (expected -----BEGIN CERTIFICATE-----)")
        cas.append(p)
    env: dict[str, str] = {}
    for name in (*PIP_ENV, *PROXY_ENV):
        value = environ.get(name) or environ.get(name.lower())
        if value:
            env[name] = value
    unique: dict[Path, Path] = {}
    for p in cas:
        unique.setdefault(p.resolve(), p)
    return BuildEnv(tuple(unique.values()), tuple(sorted(env.items())))


def bundle(build_env: BuildEnv, public_roots: Sequence[Path]) -> bytes:
    """Public roots plus the extra CAs, each certificate once, in a stable order."""
    certs: dict[bytes, None] = {}
    for p in (*public_roots, *build_env.ca_files):
        try:
            data = p.read_bytes()
        except OSError:
            continue
        for m in PEM_RE.finditer(data):
            certs.setdefault(m.group(0).strip(), None)
    return b"\n".join(certs) + b"\n" if certs else b""


def env_script(build_env: BuildEnv) -> str:
    """The `build-env` secret: export lines, every value shell-quoted."""
    lines = ["# pt-multi-gpu build environment (a BuildKit secret; never stored in the image)"]
    if build_env.has_ca:
        ca = f"{SECRET_DIR}/ca-bundle"
        for name in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
            lines.append(f"export {name}={ca}")
    for name, value in build_env.env:
        lines.append(f"export {name}={shlex.quote(value)}")
        if name in PROXY_ENV and name != "HTTP_PROXY":
            # Most tools read the lower-case form. http_proxy is left to the user's own
            # HTTP_PROXY only, because apt reads it and ignores NO_PROXY.
            lines.append(f"export {name.lower()}={shlex.quote(value)}")
        elif name == "HTTP_PROXY":
            lines.append(f"export http_proxy={shlex.quote(value)}")
    return "\n".join(lines) + "\n"


def public_roots() -> list[Path]:
    """Public root bundles on this host: certifi's (what pip uses by default) and the system's."""
    roots: list[Path] = []
    try:
        import certifi

        roots.append(Path(certifi.where()))
    except ImportError:
        pass
    system = Path("/etc/ssl/certs/ca-certificates.crt")
    if system.is_file():
        roots.append(system)
    return roots


@contextmanager
def secret_files(build_env: BuildEnv) -> Iterator[dict[str, Path]]:
    """Write the two secrets to a private temp dir for one build; removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="ptmg-secrets-") as tmp:
        os.chmod(tmp, 0o700)
        out: dict[str, Path] = {}
        env_file = Path(tmp) / "build-env"
        env_file.write_text(env_script(build_env), encoding="utf-8")
        out["build-env"] = env_file
        if build_env.has_ca:
            ca_file = Path(tmp) / "ca-bundle"
            ca_file.write_bytes(bundle(build_env, public_roots()))
            out["ca-bundle"] = ca_file
        for p in out.values():
            p.chmod(0o600)
        yield out
