"""The signing key pair: ECDSA P-256 (cosign's default), PEM PKCS#8 private key, PEM SubjectPublicKeyInfo public.

The private key is read from a file and nowhere else; no message here ever carries its bytes (only the
path). An encrypted cosign key (``ENCRYPTED SIGSTORE PRIVATE KEY``: scrypt + NaCl secretbox) is refused in
one line: ``cryptography`` has no XSalsa20-Poly1305, and a half-right decryption is worse than none.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from builder.common.errors import InputError

SIGSTORE_ENCRYPTED = b"ENCRYPTED SIGSTORE PRIVATE KEY"
PKCS8_ENCRYPTED = b"ENCRYPTED PRIVATE KEY"
MAX_KEY_BYTES = 64 * 1024
ALGORITHM = ec.ECDSA(hashes.SHA256())


def keygen(path: Path) -> tuple[Path, Path]:
    """Write ``PATH.key`` (0600, PEM PKCS#8, unencrypted) and ``PATH.pub``; never overwrite either."""
    priv_path, pub_path = path.with_name(path.name + ".key"), path.with_name(path.name + ".pub")
    for p in (priv_path, pub_path):
        if p.exists():
            raise InputError(f"{p}: exists; keygen never overwrites a key (move it away or pick another PATH)")
    if not path.parent.is_dir():
        raise InputError(f"{path.parent}: no such directory for the key pair")
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, pem)
    finally:
        os.close(fd)
    pub_path.write_bytes(public_pem(key.public_key()))
    return priv_path, pub_path


def public_pem(pub: ec.EllipticCurvePublicKey) -> bytes:
    return pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def key_id(pub: ec.EllipticCurvePublicKey) -> str:
    """sha256 of the public key's DER (what the report names the key by; never the private key)."""
    der = pub.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def _read(path: Path, what: str) -> bytes:
    try:
        if path.stat().st_size > MAX_KEY_BYTES:
            raise InputError(f"{what} {path}: {path.stat().st_size} bytes is not a key file")
        return path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{what} {path}: is a directory, not a key file") from None
    except PermissionError:
        raise InputError(f"{what} {path}: not readable (permission denied)") from None


def _p256(key: object, path: Path, what: str) -> None:
    curve = getattr(key, "curve", None)
    if not isinstance(curve, ec.SECP256R1):
        kind = f"an EC key on {curve.name}" if curve is not None else f"a {type(key).__name__.lstrip('_')}"
        raise InputError(f"{what} {path}: {kind}; the signing key must be ECDSA P-256 (`build.py keygen PATH` "
                         "writes one)")


def load_private(path: Path, what: str = "--sign-key") -> ec.EllipticCurvePrivateKey:
    """The signing key from ``path``: unencrypted PEM PKCS#8 (or SEC1) ECDSA P-256. Errors name the path only."""
    data = _read(path, what)
    if SIGSTORE_ENCRYPTED in data:
        raise InputError(f"{what} {path}: an encrypted cosign key (ENCRYPTED SIGSTORE PRIVATE KEY) is not "
                         "supported; give an unencrypted PEM PKCS#8 ECDSA P-256 key (`build.py keygen PATH`)")
    if PKCS8_ENCRYPTED in data:
        raise InputError(f"{what} {path}: an encrypted PKCS#8 key is not supported (no password is ever read); "
                         "give an unencrypted PEM PKCS#8 ECDSA P-256 key, kept in a 0600 file or a CI secret")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        # Never the parser's message: it may quote the file.
        raise InputError(f"{what} {path}: not a PEM private key (PKCS#8, as `build.py keygen` or "
                         "`openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256` writes it)") from None
    _p256(key, path, what)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key


def load_public(path: Path, what: str = "--key") -> ec.EllipticCurvePublicKey:
    """A PEM SubjectPublicKeyInfo ECDSA P-256 public key (``cosign.pub``, ``PATH.pub``)."""
    data = _read(path, what)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise InputError(f"{what} {path}: not a PEM public key (-----BEGIN PUBLIC KEY-----)") from None
    _p256(key, path, what)
    assert isinstance(key, ec.EllipticCurvePublicKey)
    return key
