"""The registry's HTTP API (v2): read and put manifests, check and upload blobs, with token or basic auth."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode, urljoin, urlsplit

import requests

from builder.publish.address import Registry
from builder.publish.credentials import Credentials
from builder.publish.faults import Fault, exception_fault, http_fault, registry_errors

MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
# Docker's v2 manifest first. The other types are accepted too: a registry asked only for
# v2 answers 404 MANIFEST_UNKNOWN for a tag that holds an OCI manifest, and that must
# never read as "absent" (it would let a push overwrite an immutable tag).
ACCEPT = ", ".join((MANIFEST_V2, OCI_MANIFEST, MANIFEST_LIST, OCI_INDEX))
ABSENT_CODES = frozenset({"MANIFEST_UNKNOWN", "NAME_UNKNOWN"})


# --- the registry's HTTP API ------------------------------------------------------------
@dataclass(frozen=True)
class Remote:
    """What the registry holds under one reference."""

    digest: str | None = None  # None: absent (or unknown, when fault is set)
    config_digest: str | None = None  # the image id the manifest describes (schema 2 / OCI)
    media_type: str = ""
    compressed_size: int | None = None  # sum of the layer sizes
    fault: Fault | None = None
    size: int | None = None  # bytes of the manifest itself (an index entry's size)
    #: a manifest list / OCI index: (platform "os/arch[/variant]", manifest digest) per entry
    children: tuple[tuple[str, str], ...] = ()
    compression: str = ""  # of the layers: gzip | zstd | none | mixed ("" for a list)

    @property
    def present(self) -> bool:
        return self.digest is not None


def manifest_remote(status: int, headers: Mapping[str, str], body: bytes, what: str) -> Remote:
    """Classify the answer to GET /v2/<name>/manifests/<ref> (pure)."""
    if status == 200:
        computed = "sha256:" + hashlib.sha256(body).hexdigest()
        digest = headers.get("Docker-Content-Digest") or computed
        if digest != computed:
            return Remote(fault=Fault("protocol", f"{what}: Docker-Content-Digest {digest} is not the sha256 of "
                                                  f"the manifest ({computed})", False))
        try:
            data = json.loads(body)
        except ValueError:
            return Remote(fault=Fault("protocol", f"{what}: the manifest is not JSON", False))
        if not isinstance(data, dict):
            return Remote(fault=Fault("protocol", f"{what}: the manifest is not a JSON object", False))
        media = str(data.get("mediaType") or headers.get("Content-Type", "")).split(";")[0]
        config = data.get("config")
        layers = data.get("layers")
        config_digest = str(config["digest"]) if isinstance(config, dict) and "digest" in config else None
        size = sum(int(x.get("size", 0)) for x in layers if isinstance(x, dict)) if isinstance(layers, list) else None
        return Remote(digest, config_digest, media, size, size=len(body), children=_children(data),
                      compression=layer_compression(layers))
    if status == 404 and {c for c, _ in registry_errors(body)} & ABSENT_CODES:
        return Remote()
    return Remote(fault=http_fault(status, headers, body, what))


def layer_compression(layers: object) -> str:
    """How a manifest's layers are compressed, by their media types: gzip, zstd, none or mixed ("" without layers)."""
    if not isinstance(layers, list) or not layers:
        return ""
    kinds = set()
    for x in layers:
        media = str(x.get("mediaType", "")) if isinstance(x, dict) else ""
        kinds.add("zstd" if media.endswith("zstd") else "gzip" if media.endswith("gzip") else "none")
    return kinds.pop() if len(kinds) == 1 else "mixed"


def _children(data: Mapping[str, object]) -> tuple[tuple[str, str], ...]:
    """The entries of a manifest list / OCI index: (os/arch[/variant], digest)."""
    entries = data.get("manifests")
    if not isinstance(entries, list):
        return ()
    out = []
    for e in entries:
        if isinstance(e, dict) and isinstance(e.get("platform"), dict) and "digest" in e:
            p = e["platform"]
            plat = "/".join(str(x) for x in (p.get("os"), p.get("architecture"), p.get("variant")) if x)
            out.append((plat, str(e["digest"])))
    return tuple(out)


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="https://auth/token",service="reg",scope="repository:x:pull"`` -> ("bearer", {...})."""
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'([A-Za-z_]+)\s*=\s*"([^"]*)"', rest)}
    for k, v in re.findall(r'([A-Za-z_]+)\s*=\s*([^",\s]+)', rest):
        params.setdefault(k.lower(), v)
    return scheme.lower(), params


def ca_bundle(env: Mapping[str, str]) -> str | bool:
    """The system CA bundle (what dockerd trusts too), unless REQUESTS_CA_BUNDLE/SSL_CERT_FILE say otherwise."""
    for var in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        if env.get(var) and Path(env[var]).is_file():
            return env[var]
    for path in ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt"):
        if Path(path).is_file():
            return path
    return True


class RegistryClient:
    """Reads manifests over the registry HTTP API v2, answering Basic and Bearer token challenges."""

    def __init__(self, registry: Registry, name: str, creds: Credentials | None, *,
                 session: requests.Session | None = None, timeout: float = 30.0,
                 verify: str | bool | None = None) -> None:
        self.registry = registry
        self.path = registry.api_path(name)
        self.creds = creds
        self.timeout = timeout
        self.verify = ca_bundle(os.environ) if verify is None else verify
        self.session = session or requests.Session()
        if registry.is_loopback:
            self.session.trust_env = False  # no proxy (or ~/.netrc) between us and a loopback registry
        self._auth: dict[str, str] = {}

    def _basic(self) -> dict[str, str]:
        assert self.creds is not None
        token = base64.b64encode(f"{self.creds.username}:{self.creds.password.reveal()}".encode()).decode()
        return {"Authorization": f"Basic {token}"}

    def _token(self, params: Mapping[str, str], what: str) -> dict[str, str] | Fault:
        realm = params.get("realm")
        if not realm:
            return Fault("auth", f"{what}: the registry asked for a token without a realm", False)
        query = {"service": params.get("service", ""),
                 "scope": params.get("scope") or f"repository:{self.path}:pull"}
        headers = self._basic() if self.creds else {}
        try:
            r = self.session.get(realm, params=query, headers=headers, timeout=self.timeout, verify=self.verify)
        except requests.exceptions.RequestException as exc:
            return exception_fault(exc, f"{what} (token from {realm})")
        if r.status_code != 200:
            return http_fault(r.status_code, r.headers, r.content, f"{what} (token from {realm})")
        try:
            data = r.json()
            token = str(data.get("token") or data.get("access_token") or "")
        except (ValueError, AttributeError):
            token = ""
        if not token:
            return Fault("auth", f"{what}: the token endpoint {realm} gave no token", False)
        return {"Authorization": f"Bearer {token}"}

    def manifest(self, reference: str) -> Remote:
        """What the registry holds under a tag (or digest). Never raises for registry/network faults."""
        url = f"{self.registry.api_base}/v2/{self.path}/manifests/{reference}"
        what = f"GET {self.registry.host}/{self.path}:{reference} manifest"
        got = self._send("GET", url, {"Accept": ACCEPT}, None, what)
        if isinstance(got, Fault):
            return Remote(fault=got)
        return manifest_remote(got.status_code, got.headers, got.content, what)

    def raw_manifest(self, reference: str) -> bytes | Fault | None:
        """The bytes the registry serves under a tag or digest (None: absent), checked against its digest."""
        url = f"{self.registry.api_base}/v2/{self.path}/manifests/{reference}"
        what = f"GET {self.registry.host}/{self.path}:{reference} manifest"
        got = self._send("GET", url, {"Accept": ACCEPT}, None, what)
        if isinstance(got, Fault):
            return got
        remote = manifest_remote(got.status_code, got.headers, got.content, what)
        if remote.fault is not None:
            return remote.fault
        return got.content if remote.present else None

    def blob(self, digest: str) -> bytes | Fault:
        """A blob's bytes, as served (the caller checks them against ``digest``: a mismatch is its finding)."""
        what = f"GET {self.registry.host}/{self.path}@{digest}"
        got = self._send("GET", f"{self.registry.api_base}/v2/{self.path}/blobs/{digest}", {}, None, what)
        if isinstance(got, Fault):
            return got
        if got.status_code != 200:
            return http_fault(got.status_code, got.headers, got.content, what)
        return got.content

    def open_blob(self, digest: str) -> requests.Response | Fault:
        """A blob as a streamed response (read ``.raw`` or ``iter_content``; the caller closes it and checks
        the bytes against ``digest``): a layer of gigabytes is never held in memory."""
        what = f"GET {self.registry.host}/{self.path}@{digest}"
        got = self._send("GET", f"{self.registry.api_base}/v2/{self.path}/blobs/{digest}", {}, None, what,
                         stream=True)
        if isinstance(got, Fault) or got.status_code == 200:
            return got
        fault = http_fault(got.status_code, got.headers, got.content, what)
        got.close()
        return fault

    def put_manifest(self, reference: str, media_type: str, body: bytes) -> str | Fault:
        """PUT a manifest (a manifest list / OCI index) under a tag: the digest the registry answers, or
        the fault. The caller reads the tag back to verify it."""
        url = f"{self.registry.api_base}/v2/{self.path}/manifests/{reference}"
        what = f"PUT {self.registry.host}/{self.path}:{reference} manifest"
        got = self._send("PUT", url, {"Content-Type": media_type}, body, what)
        if isinstance(got, Fault):
            return got
        if got.status_code not in (200, 201):
            return http_fault(got.status_code, got.headers, got.content, what)
        return got.headers.get("Docker-Content-Digest") or "sha256:" + hashlib.sha256(body).hexdigest()

    def blob_exists(self, digest: str) -> bool | Fault:
        """Whether the repository holds the blob ``digest`` (HEAD: 200, or a redirect to its storage; a HEAD's
        404 carries no body to read)."""
        what = f"HEAD {self.registry.host}/{self.path}@{digest}"
        got = self._send("HEAD", f"{self.registry.api_base}/v2/{self.path}/blobs/{digest}", {}, None, what)
        if isinstance(got, Fault) or got.status_code in (200, 404, 307, 302, 303, 308, 301):
            return got if isinstance(got, Fault) else got.status_code != 404
        return http_fault(got.status_code, got.headers, b"", what)

    def upload_blob(self, body: bytes | Iterator[bytes], digest: str | Callable[[], str]) -> str | Fault:
        """Upload one blob: POST a session, PATCH the bytes (an iterator is streamed, read once: no copy
        of the blob anywhere), PUT ``?digest=``. ``digest`` may be a callable, asked once the bytes are
        sent (a blob compressed on the way). The digest the registry answers, or the fault."""
        what = f"upload to {self.registry.host}/{self.path}"
        url = f"{self.registry.api_base}/v2/{self.path}/blobs/uploads/"
        got = self._send("POST", url, {}, b"", what)
        if isinstance(got, Fault) or got.status_code != 202:
            return got if isinstance(got, Fault) else http_fault(got.status_code, got.headers, got.content, what)
        url = urljoin(url, got.headers.get("Location", ""))
        got = self._send("PATCH", url, {"Content-Type": "application/octet-stream"}, body, what,
                         auth=self._own(url))
        if isinstance(got, Fault) or got.status_code != 202:
            return got if isinstance(got, Fault) else http_fault(got.status_code, got.headers, got.content, what)
        url = urljoin(url, got.headers.get("Location", ""))
        want = digest() if callable(digest) else digest
        got = self._send("PUT", url + ("&" if "?" in url else "?") + urlencode({"digest": want}), {}, b"", what,
                         auth=self._own(url))
        if isinstance(got, Fault) or got.status_code != 201:
            return got if isinstance(got, Fault) else http_fault(got.status_code, got.headers, got.content, what)
        answered = got.headers.get("Docker-Content-Digest") or want
        if answered != want:
            return Fault("protocol", f"{what}: sent {want}, the registry stored {answered}", False)
        return want

    def _own(self, url: str) -> bool:
        """Whether ``url`` is on the registry's own origin (scheme, host and port): an upload's Location
        may name another (a storage backend), which gets the request but never the credentials."""
        here, there = urlsplit(self.registry.api_base), urlsplit(url)
        return (here.scheme, here.netloc) == (there.scheme, there.netloc)

    def _send(self, method: str, url: str, headers: Mapping[str, str], body: bytes | Iterator[bytes] | None,
              what: str, auth: bool = True, stream: bool = False) -> requests.Response | Fault:
        """One request, answering a Basic or Bearer challenge once each (a PUT's token asks for push). A
        streamed body can't be sent twice: a challenge to it is a fault (the POST before it answered them).
        ``auth=False`` (another origin): no credentials are sent, and a challenge is a fault."""
        tried: set[str] = set()
        while True:
            try:
                call: Callable[..., requests.Response] = getattr(self.session, method.lower())
                r = call(url, headers={**headers, **(self._auth if auth else {})}, data=body, timeout=self.timeout,
                         verify=self.verify, **({"stream": True} if stream else {}))
            except requests.exceptions.RequestException as exc:
                return exception_fault(exc, what)
            if r.status_code != 401:
                return r
            if not auth or (body is not None and not isinstance(body, bytes)):
                return http_fault(r.status_code, r.headers, r.content, what)
            scheme, params = parse_challenge(r.headers.get("WWW-Authenticate", ""))
            if scheme in tried or scheme not in ("basic", "bearer"):
                return http_fault(r.status_code, r.headers, r.content, what)
            tried.add(scheme)
            if scheme == "basic":
                if self.creds is None:
                    return Fault("auth", f"{what}: the registry wants credentials and none are set "
                                         "(PTMG_REGISTRY_USER + PTMG_REGISTRY_PASSWORD(_FILE), or "
                                         "`docker login`)", False)
                self._auth = self._basic()
            else:
                got = self._token(params, what)
                if isinstance(got, Fault):
                    return got
                self._auth = got


