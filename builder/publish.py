"""Publish the built cells to a registry: push, never lose or overwrite, verify, report.

The order, for the selected cells:

1. Resolve each cell's local image (by id, once: a rebuild during the run can't
   slip in) and its tags (builder/tags.py; date and sha from the image's labels,
   so a rerun next week names the same tags for the same image).
2. Immutable tags: read each one's manifest from the registry first.
   - absent (HTTP 404 with MANIFEST_UNKNOWN/NAME_UNKNOWN, nothing else) -> push;
   - present with the same image (the manifest's config digest is the local image id) -> "unchanged";
   - present with another image -> "refused", and NOTHING of that cell is pushed;
   - anything else (401/403, 429, 5xx, network, a 404 that is not a registry's) -> the cell fails;
     transient faults are retried with exponential backoff and jitter first.
   After each push the manifest is read back; its Docker-Content-Digest must be the push's digest.
3. The floating-tag gate: only when EVERY selected cell has all its immutable
   tags published and a smoke-test pass recorded for its exact image id
   (builder.records; `--allow-untested` waives the latter, loudly).
4. Floating tags (``<tag>``, ``2.7-cuda12.6``, ``latest``) move.
5. A JSON and a Markdown report go to --report-dir. Exit 1 if anything failed.

Credentials come from the environment (PTMG_REGISTRY_USER with PTMG_REGISTRY_PASSWORD
or PTMG_REGISTRY_PASSWORD_FILE) or the docker config (auths, credHelpers,
credsStore). They go to the engine as the push's auth_config and to the registry
client as HTTP auth; they never appear in argv, logs or reports.

Limitation: registry API v2 has no conditional PUT, so a second publisher racing
between our read and our push can't be excluded here; CI serialises publishing
(a concurrency group) for that reason.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import requests

from builder import records, tags
from builder.engine import EngineError
from builder.log import human_size, log, table
from builder.spec import ImageSpec, Matrix

if TYPE_CHECKING:
    from builder.cli import Context

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
LABEL_NS = "io.pt-multi-gpu"
CELL_LABEL = f"{LABEL_NS}.cell"
CREATED_LABEL = "org.opencontainers.image.created"
REVISION_LABEL = "org.opencontainers.image.revision"

MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
# Docker's v2 manifest first. The other types are accepted too: a registry asked only for
# v2 answers 404 MANIFEST_UNKNOWN for a tag that holds an OCI manifest, and that must
# never read as "absent" (it would let a push overwrite an immutable tag).
ACCEPT = ", ".join((MANIFEST_V2, OCI_MANIFEST, MANIFEST_LIST, OCI_INDEX))
ABSENT_CODES = frozenset({"MANIFEST_UNKNOWN", "NAME_UNKNOWN"})

# Tag statuses in the report.
PUSHED, UNCHANGED, REFUSED, FAILED, HELD, PLANNED = "pushed", "unchanged", "refused", "failed", "held", "planned"
OK_STATUSES = frozenset({PUSHED, UNCHANGED})


class PublishInputError(ValueError):
    """Bad --registry, unusable credentials settings: exit 2, nothing contacted."""


# --- the registry address --------------------------------------------------------------
HOST_RE = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
                     r"|\[[0-9A-Fa-f:]+\])(?::[0-9]{1,5})?$")
PATH_COMPONENT_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
DOCKER_HUB = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})


@dataclass(frozen=True)
class Registry:
    host: str  # as image references name it: "127.0.0.1:5000", "ghcr.io", "docker.io"
    namespace: str = ""  # "" or "org" or "org/team"

    def repository(self, name: str) -> str:
        """The full image repository for `name`: what `docker push` is given."""
        return "/".join(p for p in (self.host, self.namespace, name) if p)

    def api_path(self, name: str) -> str:
        """The repository name in registry API URLs (Docker Hub puts bare names under library/)."""
        path = "/".join(p for p in (self.namespace, name) if p)
        return f"library/{path}" if self.is_docker_hub and "/" not in path else path

    @property
    def hostname(self) -> str:
        host = self.host
        if host.startswith("["):
            return host[1:host.index("]")]
        return host.rsplit(":", 1)[0] if ":" in host else host

    @property
    def is_docker_hub(self) -> bool:
        return self.hostname in DOCKER_HUB

    @property
    def is_loopback(self) -> bool:
        """dockerd talks plain HTTP to these without configuration (127.0.0.0/8); so do we."""
        h = self.hostname
        return h in {"localhost", "::1"} or h.startswith("127.")

    @property
    def api_base(self) -> str:
        if self.is_docker_hub:
            return "https://registry-1.docker.io"
        return f"{'http' if self.is_loopback else 'https'}://{self.host}"

    @property
    def auth_keys(self) -> tuple[str, ...]:
        """Keys the docker config may file this registry's credentials under, best first."""
        if self.is_docker_hub:
            return ("https://index.docker.io/v1/", "index.docker.io", "docker.io", "registry-1.docker.io")
        return (self.host, f"https://{self.host}", f"http://{self.host}", f"https://{self.host}/v1/",
                f"https://{self.host}/v2/")

    @property
    def server_address(self) -> str:
        return "https://index.docker.io/v1/" if self.is_docker_hub else self.host

    def __str__(self) -> str:
        return "/".join(p for p in (self.host, self.namespace) if p)


def parse_registry(text: str) -> Registry:
    """``HOST[:PORT][/NAMESPACE]`` -> Registry, with a located explanation when it is not one."""
    raw = (text or "").strip()
    if "://" in raw:
        raise PublishInputError(f"--registry {text!r}: give HOST[:PORT][/NAMESPACE] without a scheme "
                                "(plain HTTP is used for 127.0.0.1/localhost, HTTPS for everything else)")
    if not raw:
        raise PublishInputError("--registry is empty; give HOST[:PORT][/NAMESPACE], e.g. ghcr.io/my-org or "
                                "127.0.0.1:5000 (or set PTMG_REGISTRY)")
    host, _, namespace = raw.rstrip("/").partition("/")
    if not HOST_RE.match(host):
        raise PublishInputError(f"--registry {text!r}: {host!r} is not a host[:port]")
    if "." not in host and ":" not in host and host != "localhost":
        # Docker reads a first component without '.' or ':' as a Docker Hub namespace.
        raise PublishInputError(f"--registry {text!r}: {host!r} is not a registry host (no '.' or ':'); "
                                f"for a Docker Hub namespace write docker.io/{host}")
    port = host.rsplit("]", 1)[-1].rpartition(":")[2] if ":" in host.rsplit("]", 1)[-1] else ""
    if port and not 0 < int(port) < 65536:
        raise PublishInputError(f"--registry {text!r}: port {port} is out of range")
    for comp in namespace.split("/") if namespace else ():
        if not PATH_COMPONENT_RE.match(comp):
            raise PublishInputError(f"--registry {text!r}: namespace component {comp!r} is not valid "
                                    "(lowercase letters, digits, '.', '_', '-')")
    if host in DOCKER_HUB:
        host = "docker.io"
    return Registry(host, namespace)


# --- credentials ------------------------------------------------------------------------
class Secret:
    """A string that does not print: repr, str and f-strings show *** (reveal() gives it)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


@dataclass(frozen=True)
class Credentials:
    username: str
    password: Secret
    source: str  # where they came from, for the log (never the values)

    def auth_config(self, registry: Registry) -> dict[str, str]:
        """For the SDK's push(auth_config=...): sent to dockerd in a header, never in argv."""
        return {"username": self.username, "password": self.password.reveal(),
                "serveraddress": registry.server_address}

    def secrets(self) -> tuple[str, ...]:
        pw = self.password.reveal()
        basic = base64.b64encode(f"{self.username}:{pw}".encode()).decode()
        return tuple(s for s in (pw, basic) if s)


class CredentialsError(PublishInputError):
    pass


def redact(text: str, secrets: Iterable[str]) -> str:
    """`text` with every secret (longest first, so no fragment survives) replaced by ***."""
    for s in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(s, "***")
    return text


def docker_config_path(env: Mapping[str, str]) -> Path:
    base = env.get("DOCKER_CONFIG")
    return Path(base) / "config.json" if base else Path(env.get("HOME", str(Path.home()))) / ".docker" / "config.json"


def _read_secret_file(path_text: str, var: str) -> str:
    path = Path(path_text)
    try:
        value = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CredentialsError(f"{var}={path_text}: can't read it ({exc.strerror or exc})") from None
    value = value.rstrip("\r\n")
    if not value:
        raise CredentialsError(f"{var}={path_text}: the file is empty")
    return value


def load_credentials(registry: Registry, env: Mapping[str, str],
                     helper: Callable[[str, str], tuple[str, str] | None] | None = None) -> Credentials | None:
    """Credentials for `registry`: the environment first, then the docker config; None for anonymous.

    Env: PTMG_REGISTRY_USER with PTMG_REGISTRY_PASSWORD or PTMG_REGISTRY_PASSWORD_FILE (a
    password or token file; for CI secrets mounted as files). The docker config is read the
    way the docker CLI reads it: credHelpers[host], else credsStore, else auths[host].
    """
    user = env.get("PTMG_REGISTRY_USER", "")
    pw_env = env.get("PTMG_REGISTRY_PASSWORD")
    pw_file = env.get("PTMG_REGISTRY_PASSWORD_FILE")
    if pw_env and pw_file:
        raise CredentialsError("set PTMG_REGISTRY_PASSWORD or PTMG_REGISTRY_PASSWORD_FILE, not both")
    if user or pw_env or pw_file:
        if not user:
            raise CredentialsError("PTMG_REGISTRY_PASSWORD(_FILE) is set but PTMG_REGISTRY_USER is not; "
                                   "set the user name too (for token registries, any name the registry accepts)")
        if pw_file:
            return Credentials(user, Secret(_read_secret_file(pw_file, "PTMG_REGISTRY_PASSWORD_FILE")),
                               "env PTMG_REGISTRY_USER + PTMG_REGISTRY_PASSWORD_FILE")
        if not pw_env:
            raise CredentialsError("PTMG_REGISTRY_USER is set but neither PTMG_REGISTRY_PASSWORD nor "
                                   "PTMG_REGISTRY_PASSWORD_FILE is")
        return Credentials(user, Secret(pw_env), "env PTMG_REGISTRY_USER + PTMG_REGISTRY_PASSWORD")

    path = docker_config_path(env)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CredentialsError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CredentialsError(f"{path}: not a JSON object")
    run_helper = helper or credential_helper
    helpers = config.get("credHelpers") or {}
    for key in registry.auth_keys:
        if isinstance(helpers, dict) and key in helpers:
            got = run_helper(str(helpers[key]), key)
            return Credentials(got[0], Secret(got[1]), f"docker-credential-{helpers[key]}") if got else None
    if config.get("credsStore"):
        store = str(config["credsStore"])
        for key in registry.auth_keys:
            got = run_helper(store, key)
            if got:
                return Credentials(got[0], Secret(got[1]), f"docker-credential-{store}")
    auths = config.get("auths") or {}
    for key in registry.auth_keys:
        entry = auths.get(key) if isinstance(auths, dict) else None
        if not isinstance(entry, dict):
            continue
        if entry.get("identitytoken"):
            raise CredentialsError(f"{path} holds an identity token for {key}, which publishing can't use; "
                                   "set PTMG_REGISTRY_USER and PTMG_REGISTRY_PASSWORD(_FILE) instead")
        if entry.get("auth"):
            try:
                decoded = base64.b64decode(str(entry["auth"]), validate=True).decode()
            except ValueError:
                raise CredentialsError(f"{path}: auths[{key!r}].auth is not base64 of user:password") from None
            name, sep, pw = decoded.partition(":")
            if not sep:
                raise CredentialsError(f"{path}: auths[{key!r}].auth is not base64 of user:password")
            return Credentials(name, Secret(pw), f"docker config {path}")
        if entry.get("username") and entry.get("password"):
            return Credentials(str(entry["username"]), Secret(str(entry["password"])), f"docker config {path}")
    return None


def credential_helper(name: str, server: str) -> tuple[str, str] | None:
    """`docker-credential-<name> get` with the server on stdin (never argv) -> (user, secret)."""
    exe = shutil.which(f"docker-credential-{name}")
    if exe is None:
        raise CredentialsError(f"the docker config names credential helper {name!r}, but "
                               f"docker-credential-{name} is not on PATH")
    r = subprocess.run([exe, "get"], input=server, capture_output=True, text=True, timeout=30, check=False)
    if r.returncode != 0:
        if "credentials not found" in (r.stdout + r.stderr).lower():
            return None
        raise CredentialsError(f"docker-credential-{name} get failed for {server} (exit {r.returncode})")
    try:
        data = json.loads(r.stdout)
        user, secret = str(data["Username"]), str(data["Secret"])
    except (ValueError, KeyError, TypeError):
        raise CredentialsError(f"docker-credential-{name} gave no Username/Secret for {server}") from None
    if user == "<token>":
        raise CredentialsError(f"docker-credential-{name} holds an identity token for {server}, which publishing "
                               "can't use; set PTMG_REGISTRY_USER and PTMG_REGISTRY_PASSWORD(_FILE) instead")
    return user, secret


# --- retries ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4  # tries in all, the first included
    base: float = 1.0  # seconds before the 2nd try
    factor: float = 2.0
    cap: float = 30.0


def backoff(policy: RetryPolicy, failed_attempt: int, rng: Callable[[], float] = random.random) -> float:
    """Seconds to wait after try number `failed_attempt` (1-based): exponential, capped, with
    "equal jitter" (half fixed, half random) so parallel publishers don't retry in lockstep."""
    d = min(policy.cap, policy.base * policy.factor ** (failed_attempt - 1))
    return d / 2 + rng() * d / 2


# --- faults -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    kind: str  # auth | rate-limit | server | network | tls | protocol | local | engine
    message: str
    transient: bool

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


def _registry_errors(body: bytes) -> list[tuple[str, str]]:
    """(code, message) of a registry error body ({"errors": [...]}); [] when it is not one."""
    try:
        data = json.loads(body)
    except ValueError:
        return []
    errs = data.get("errors") if isinstance(data, dict) else None
    if not isinstance(errs, list):
        return []
    return [(str(e.get("code", "")), str(e.get("message", ""))) for e in errs if isinstance(e, dict)]


def http_fault(status: int, headers: Mapping[str, str], body: bytes, what: str) -> Fault:
    """Classify a non-2xx answer that is not "absent". Only transient faults are retried."""
    errs = _registry_errors(body)
    detail = "; ".join(f"{c}: {m}" if m else c for c, m in errs) or body[:200].decode("utf-8", "replace").strip()
    detail = f" ({detail})" if detail else ""
    if status in (401, 403):
        return Fault("auth", f"{what}: HTTP {status}{detail}: the registry refused these credentials "
                             "(check PTMG_REGISTRY_USER / PTMG_REGISTRY_PASSWORD or `docker login`)", False)
    if status == 429:
        after = headers.get("Retry-After")
        return Fault("rate-limit", f"{what}: HTTP 429 rate limited{detail}"
                                   + (f"; Retry-After {after}" if after else ""), True)
    if status >= 500:
        return Fault("server", f"{what}: HTTP {status} from the registry{detail}", True)
    if status == 404:
        return Fault("protocol", f"{what}: HTTP 404 without a registry MANIFEST_UNKNOWN/NAME_UNKNOWN error"
                                 f"{detail}: is this a registry (a proxy or a wrong path in the way)?", False)
    return Fault("protocol", f"{what}: unexpected HTTP {status}{detail}", False)


def exception_fault(exc: BaseException, what: str) -> Fault:
    if isinstance(exc, requests.exceptions.SSLError):
        return Fault("tls", f"{what}: TLS failed ({exc}); is the registry's CA in the system bundle "
                            "(/usr/local/share/ca-certificates + update-ca-certificates, or REQUESTS_CA_BUNDLE)?",
                     False)
    if isinstance(exc, requests.exceptions.RequestException):
        # urllib3's text nests the cause deep inside; the errno line is what a person needs.
        m = re.search(r"\[Errno -?\d+\] [^'\")]+", str(exc))
        return Fault("network", f"{what}: {type(exc).__name__}: {m.group(0) if m else exc}", True)
    return Fault("protocol", f"{what}: {type(exc).__name__}: {exc}", False)


_PUSH_RULES: tuple[tuple[re.Pattern[str], str, bool], ...] = (
    (re.compile(r"unauthorized|authentication required|no basic auth credentials|denied|forbidden"
                r"|\b40[13]\b", re.I), "auth", False),
    (re.compile(r"toomanyrequests|too many requests|\b429\b", re.I), "rate-limit", True),
    (re.compile(r"server gave HTTP response to HTTPS client", re.I), "tls", False),
    (re.compile(r"x509|certificate", re.I), "tls", False),
    (re.compile(r"does not exist locally|tag does not exist|no such image|invalid reference", re.I), "local", False),
    (re.compile(r"\b5\d\d\b|internal server error|bad gateway|service unavailable|gateway time-?out", re.I),
     "server", True),
    (re.compile(r"connection refused|connection reset|broken pipe|i/o timeout|timeout|\bEOF\b|no such host"
                r"|network is unreachable|closed network connection|temporary failure|dial tcp", re.I),
     "network", True),
)


def push_fault(text: str) -> Fault:
    """Classify the error dockerd reports for a push. Unknown errors are not retried."""
    for rx, kind, transient in _PUSH_RULES:
        if rx.search(text):
            msg = text
            if kind == "tls" and "HTTP response to HTTPS" in text:
                msg += " (dockerd talks HTTPS to this registry: add it to insecure-registries in daemon.json)"
            return Fault(kind, msg, transient)
    return Fault("engine", text, False)


# --- the registry's HTTP API ------------------------------------------------------------
@dataclass(frozen=True)
class Remote:
    """What the registry holds under one reference."""

    digest: str | None = None  # None: absent (or unknown, when fault is set)
    config_digest: str | None = None  # the image id the manifest describes (schema 2 / OCI)
    media_type: str = ""
    compressed_size: int | None = None  # sum of the layer sizes
    fault: Fault | None = None

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
        return Remote(digest, config_digest, media, size)
    if status == 404 and {c for c, _ in _registry_errors(body)} & ABSENT_CODES:
        return Remote()
    return Remote(fault=http_fault(status, headers, body, what))


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
        tried: set[str] = set()
        while True:
            try:
                r = self.session.get(url, headers={"Accept": ACCEPT, **self._auth}, timeout=self.timeout,
                                     verify=self.verify)
            except requests.exceptions.RequestException as exc:
                return Remote(fault=exception_fault(exc, what))
            if r.status_code != 401:
                return manifest_remote(r.status_code, r.headers, r.content, what)
            scheme, params = parse_challenge(r.headers.get("WWW-Authenticate", ""))
            if scheme in tried or scheme not in ("basic", "bearer"):
                return Remote(fault=http_fault(r.status_code, r.headers, r.content, what))
            tried.add(scheme)
            if scheme == "basic":
                if self.creds is None:
                    return Remote(fault=Fault("auth", f"{what}: the registry wants credentials and none are set "
                                                      "(PTMG_REGISTRY_USER + PTMG_REGISTRY_PASSWORD(_FILE), or "
                                                      "`docker login`)", False))
                self._auth = self._basic()
            else:
                got = self._token(params, what)
                if isinstance(got, Fault):
                    return Remote(fault=got)
                self._auth = got


# --- the push stream --------------------------------------------------------------------
@dataclass
class PushTracker:
    """Follows one `docker push` progress stream: which layers went up, the digest, the error."""

    uploaded: list[str] = field(default_factory=list)  # layer ids the engine sent ("Pushed")
    existing: list[str] = field(default_factory=list)  # already in the registry (or mounted)
    digest: str | None = None
    size: int | None = None
    error: str | None = None
    engine_retries: int = 0  # "Retrying in N seconds" episodes (dockerd's own per-layer retries)
    progressed: bool = False  # bytes were sent
    last: dict[str, str] = field(default_factory=dict)

    def feed(self, ev: Mapping[str, Any]) -> None:
        if ev.get("error") or ev.get("errorDetail"):
            detail = ev.get("errorDetail")
            msg = detail.get("message") if isinstance(detail, dict) else None
            self.error = str(msg or ev.get("error"))
        aux = ev.get("aux")
        if isinstance(aux, dict) and aux.get("Digest"):
            self.digest = str(aux["Digest"])
            self.size = int(aux.get("Size") or 0) or None
        status = str(ev.get("status") or "")
        lid = ev.get("id")
        if not lid:
            return
        lid = str(lid)
        prev = self.last.get(lid, "")
        if status == "Pushed" and lid not in self.uploaded:
            self.uploaded.append(lid)
        elif (status == "Layer already exists" or status.startswith("Mounted from")) and lid not in self.existing:
            self.existing.append(lid)
        elif status.startswith("Retrying in") and not prev.startswith("Retrying in"):
            self.engine_retries += 1
        elif status == "Pushing":
            detail = ev.get("progressDetail")
            if isinstance(detail, dict) and int(detail.get("current") or 0) > 0:
                self.progressed = True
        self.last[lid] = status


# --- decisions (pure) -------------------------------------------------------------------
def decide(kind: str, remote: Remote, image_id: str) -> tuple[str, str]:
    """What to do with one tag: ("push" | "unchanged" | "refuse" | "fail", why)."""
    if remote.fault is not None:
        return "fail", str(remote.fault)
    if not remote.present:
        return "push", "not in the registry yet"
    if remote.config_digest == image_id:
        return "unchanged", f"the registry already holds this image ({remote.digest})"
    held = f"image {remote.config_digest}" if remote.config_digest else f"a {remote.media_type or 'manifest'}"
    if kind == "immutable":
        return "refuse", (f"the registry already holds {remote.digest} ({held}) under this immutable tag, and the "
                          f"local image is {image_id}; immutable tags are never overwritten. Nothing of this cell "
                          "was pushed. If the new image is right, rebuild so it gets a new date/sha tag.")
    return "push", f"moves from {remote.digest}"


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

    @property
    def immutable_ok(self) -> bool:
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
    credentials: str = "anonymous"  # where they came from, never what they are
    floating_gate: dict[str, Any] = field(default_factory=dict)
    cells: list[CellReport] = field(default_factory=list)
    ok: bool = False


def floating_gate(cells: Sequence[CellReport], allow_untested: bool) -> tuple[bool, list[str]]:
    """Floating tags move only when EVERY selected cell published its immutable tags and has a
    smoke-test pass recorded for its exact image id (the latter waived by --allow-untested)."""
    reasons: list[str] = []
    for c in cells:
        if not c.immutable_ok:
            bad = [f"{t.tag} {t.status}" for t in c.tags if t.kind == "immutable" and t.status not in OK_STATUSES]
            reasons.append(f"{c.cell}: immutable tags not published ({'; '.join(bad) or c.error or 'none'})")
        if c.image_id and c.smoke.get("status") != "passed" and not allow_untested:
            reasons.append(f"{c.cell}: no smoke-test pass recorded for image {c.image_id}; "
                           f"run `python build.py test --only {c.cell}`")
    if not cells:
        reasons.append("no cells selected")
    return not reasons, reasons


def versions_from_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """io.pt-multi-gpu.* labels without the prefix (torch, cuda, cudnn, nccl, python, ...)."""
    prefix = LABEL_NS + "."
    return {k[len(prefix):]: v for k, v in sorted(labels.items()) if k.startswith(prefix)}


def image_date(labels: Mapping[str, str], created: str | None) -> str:
    """YYYYMMDD of the image's build (its created label, else the engine's Created)."""
    for text in (labels.get(CREATED_LABEL), created):
        if text and re.match(r"^\d{4}-\d{2}-\d{2}", text):
            return text[:10].replace("-", "")
    raise tags.TagError("the image has no creation date (label org.opencontainers.image.created)")


def image_revision(labels: Mapping[str, str]) -> str:
    rev = labels.get(REVISION_LABEL, "")
    if not rev or rev == "unknown":
        raise tags.TagError("the image has no git revision label (org.opencontainers.image.revision); rebuild it "
                            "with `python build.py build` from a git checkout")
    return rev


# --- reports ----------------------------------------------------------------------------
def report_json(report: Report, secrets: Iterable[str] = ()) -> str:
    return redact(json.dumps(asdict(report), indent=2, sort_keys=False), secrets) + "\n"


def _short(digest: str | None) -> str:
    return digest[:19] if digest else "-"


def report_markdown(report: Report, secrets: Iterable[str] = ()) -> str:
    lines = [f"# Publish report: {report.repository}", ""]
    verdict = "**ok**" if report.ok else "**FAILED**"
    if report.dry_run:
        verdict = "dry run (nothing pushed, registry not contacted)"
    lines += [f"- result: {verdict}", f"- registry: `{report.registry}`", f"- started: {report.started}",
              f"- took: {report.seconds:.1f} s", f"- credentials: {report.credentials}"]
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
        lines.append(f"| {c.cell} | `{_short(c.digest)}` | {human_size(c.compressed_size)} | "
                     f"{human_size(c.uncompressed_size)} | {v.get('torch', '-')} | {v.get('cuda', '-')} | "
                     f"{v.get('cudnn', '-')} | {c.smoke.get('status', '-')} |")
    for c in report.cells:
        lines += ["", f"## {c.cell}", "", f"- local image: `{c.image}` ({c.image_id or 'missing'})"]
        if c.digest:
            lines.append(f"- digest: `{c.digest}`")
        if c.error:
            lines.append(f"- error: {c.error}")
        lines += [f"- note: {n}" for n in c.notes]
        if c.versions:
            lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in c.versions.items()
                                                   if k not in ("inputs-hash", "cuda-arch-list")))
        lines += ["", "| tag | kind | status | digest | layers sent | message |", "|---|---|---|---|---|---|"]
        for t in c.tags:
            msg = t.message.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{t.tag}` | {t.kind} | {t.status} | `{_short(t.digest)}` | "
                         f"{len(t.layers_uploaded)}/{len(t.layers_uploaded) + len(t.layers_existing)} | {msg} |")
    return redact("\n".join(lines) + "\n", secrets)


def write_report(report: Report, directory: Path, secrets: Iterable[str] = ()) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    secrets = tuple(secrets)
    jpath, mpath = directory / "publish-report.json", directory / "publish-report.md"
    jpath.write_text(report_json(report, secrets), encoding="utf-8")
    mpath.write_text(report_markdown(report, secrets), encoding="utf-8")
    return jpath, mpath


# --- orchestration ----------------------------------------------------------------------
class EnginePort(Protocol):
    def image_attrs(self, ref: str) -> dict[str, Any] | None: ...
    def tag(self, image_id: str, ref: str) -> None: ...
    def untag(self, ref: str) -> None: ...
    def push(self, ref: str, auth_config: Mapping[str, str] | None,
             on_event: Callable[[Mapping[str, Any]], None]) -> None: ...


class RegistryPort(Protocol):
    def manifest(self, reference: str) -> Remote: ...


@dataclass(frozen=True)
class PublishConfig:
    registry: Registry
    allow_untested: bool = False
    dry_run: bool = False
    retry: RetryPolicy = RetryPolicy()


@dataclass
class _Cell:
    spec: ImageSpec
    report: CellReport
    image_id: str = ""
    tags: tags.CellTags | None = None


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Publisher:
    """Runs one publish. Engine, registry client, smoke records, sleep and randomness are
    injected, so the whole decision logic runs in unit tests without a daemon."""

    def __init__(self, engine: EnginePort, registry: RegistryPort, cfg: PublishConfig, *,
                 repository: str, creds: Credentials | None = None,
                 smoke: Callable[[str], records.SmokePass | None] = records.smoke_pass,
                 sleep: Callable[[float], None] = time.sleep, rng: Callable[[], float] = random.random,
                 on_event: Callable[[str, Mapping[str, Any]], None] | None = None) -> None:
        self.engine = engine
        self.registry = registry
        self.cfg = cfg
        self.repo = cfg.registry.repository(repository)
        self.creds = creds
        self.secrets = creds.secrets() if creds else ()
        self.smoke = smoke
        self.sleep = sleep
        self.rng = rng
        self.on_event = on_event

    def _r(self, text: str) -> str:
        return redact(text, self.secrets)

    # -- one cell's local facts --
    def _prepare(self, spec: ImageSpec, matrix: Matrix) -> _Cell:
        cell = _Cell(spec, CellReport(spec.name, spec.ref))
        attrs = self.engine.image_attrs(spec.ref)
        if attrs is None:
            cell.report.error = (f"{spec.ref} is not built here; run `python build.py build --only {spec.name}` "
                                 "(and `python build.py test --only` it) first")
            return cell
        labels = dict((attrs.get("Config") or {}).get("Labels") or {})
        cell.image_id = str(attrs["Id"])
        cell.report.image_id = cell.image_id
        cell.report.uncompressed_size = int(attrs.get("Size") or 0) or None
        cell.report.versions = versions_from_labels(labels)
        passed = self.smoke(cell.image_id)
        if passed is not None:
            cell.report.smoke = {"status": "passed", "at": passed.at, "passed": passed.passed,
                                 "skipped": passed.skipped, "nodes": passed.nodes}
        else:
            cell.report.smoke = {"status": "untested (--allow-untested)" if self.cfg.allow_untested else "missing"}
        if labels.get(CELL_LABEL) != spec.name:
            cell.report.error = (f"{spec.ref} is not an image of cell {spec.name} (its {CELL_LABEL} label is "
                                 f"{labels.get(CELL_LABEL)!r}); rebuild it with `python build.py build --only "
                                 f"{spec.name}`")
            return cell
        try:
            revision = image_revision(labels)
            cell.tags = tags.cell_tags(spec, matrix.cells, image_date(labels, attrs.get("Created")), revision)
        except (tags.TagError, ValueError) as exc:
            cell.report.error = f"{spec.ref}: {exc}"
            return cell
        if revision.endswith("-dirty"):
            cell.report.notes.append(f"built from an uncommitted tree ({revision}); its sha tag says -dirty")
        return cell

    def _result(self, tag: str, kind: str, status: str, message: str = "", **kw: Any) -> TagResult:
        return TagResult(tag, f"{self.repo}:{tag}", kind, status, message=self._r(message), **kw)

    def _wait(self, attempt: int, why: str) -> None:
        delay = backoff(self.cfg.retry, attempt, self.rng)
        log.warning("  %s; retrying in %.1f s (attempt %d of %d)", self._r(why), delay, attempt + 1,
                    self.cfg.retry.attempts)
        self.sleep(delay)

    def _read(self, tag: str) -> tuple[Remote, int]:
        """The registry's state for a tag, retrying transient faults. (remote, tries used)."""
        attempt = 0
        while True:
            attempt += 1
            remote = self.registry.manifest(tag)
            if remote.fault is None or not remote.fault.transient or attempt >= self.cfg.retry.attempts:
                return remote, attempt
            self._wait(attempt, str(remote.fault))

    def _push_once(self, cell: _Cell, ref: str, tracker: PushTracker) -> Fault | None:
        auth = self.creds.auth_config(self.cfg.registry) if self.creds else None

        def feed(ev: Mapping[str, Any]) -> None:
            retries = tracker.engine_retries
            tracker.feed(ev)
            status, lid = str(ev.get("status") or ""), ev.get("id")
            if lid and (status in ("Pushed", "Layer already exists") or tracker.engine_retries > retries):
                log.info("  %s layer %s: %s", ref.rpartition(":")[2], lid, status)
            if self.on_event is not None:
                self.on_event(ref, ev)

        self.engine.tag(cell.image_id, ref)
        try:
            self.engine.push(ref, auth, feed)
        except EngineError as exc:
            return push_fault(self._r(str(exc)))
        finally:
            self.engine.untag(ref)
        if tracker.error:
            return push_fault(self._r(tracker.error))
        if not tracker.digest:
            return Fault("engine", "the push ended without reporting a digest", False)
        return None

    def _verify(self, tag: str, digest: str, image_id: str) -> tuple[Remote, str | None]:
        remote, _ = self._read(tag)
        if remote.fault is not None:
            return remote, f"pushed, but reading it back failed: {remote.fault}"
        if remote.digest != digest:
            return remote, f"pushed {digest}, but the registry answers {remote.digest} for this tag"
        if remote.config_digest != image_id:
            return remote, f"the registry's manifest describes image {remote.config_digest}, not {image_id}"
        return remote, None

    def _publish_tag(self, cell: _Cell, tag: str, kind: str, remote: Remote | None) -> TagResult:
        """Check, push, verify one tag, retrying transient faults (re-checking before each push)."""
        ref = f"{self.repo}:{tag}"
        start = time.monotonic()
        uploaded: list[str] = []
        existing: list[str] = []
        attempt = 0
        while True:
            attempt += 1
            if remote is None:
                remote = self.registry.manifest(tag)
            action, why = decide(kind, remote, cell.image_id)
            extra = {"attempts": attempt, "layers_uploaded": uploaded, "layers_existing": existing,
                     "seconds": round(time.monotonic() - start, 2)}
            if action == "fail":
                assert remote.fault is not None
                if remote.fault.transient and attempt < self.cfg.retry.attempts:
                    self._wait(attempt, why)
                    remote = None
                    continue
                outcome = "the push did not complete" if uploaded or existing or attempt > 1 else "nothing pushed"
                return self._result(tag, kind, FAILED, f"{why} (after {attempt} attempt(s); {outcome})", **extra)
            if action == "unchanged":
                return self._result(tag, kind, UNCHANGED, why, digest=remote.digest,
                                    compressed_size=remote.compressed_size, **extra)
            if action == "refuse":
                return self._result(tag, kind, REFUSED, why, **extra)
            log.info("push %s (%s)", ref, why)
            tracker = PushTracker()
            fault = self._push_once(cell, ref, tracker)
            uploaded += [x for x in tracker.uploaded if x not in uploaded]
            existing += [x for x in tracker.existing if x not in existing and x not in uploaded]
            if fault is not None:
                if fault.transient and attempt < self.cfg.retry.attempts:
                    self._wait(attempt, f"push of {ref} failed: {fault}")
                    remote = None  # read the tag again: the push may have landed after all
                    continue
                extra["seconds"] = round(time.monotonic() - start, 2)
                return self._result(tag, kind, FAILED, f"push failed after {attempt} attempt(s): {fault}", **extra)
            assert tracker.digest is not None
            checked, problem = self._verify(tag, tracker.digest, cell.image_id)
            extra["seconds"] = round(time.monotonic() - start, 2)
            if problem:
                return self._result(tag, kind, FAILED, problem, digest=tracker.digest, **extra)
            return self._result(tag, kind, PUSHED, f"verified: the registry serves {tracker.digest}",
                                digest=tracker.digest, compressed_size=checked.compressed_size, **extra)

    def _immutable(self, cell: _Cell) -> None:
        assert cell.tags is not None
        reads = {t: self._read(t)[0] for t in cell.tags.immutable}
        decisions = {t: decide("immutable", r, cell.image_id) for t, r in reads.items()}
        blocked = [t for t, (action, _) in decisions.items() if action in ("refuse", "fail")]
        if blocked:
            # All or nothing: one refused or unreadable immutable tag stops the whole cell.
            for t in cell.tags.immutable:
                action, why = decisions[t]
                if action == "refuse":
                    res = self._result(t, "immutable", REFUSED, why)
                elif action == "fail":
                    res = self._result(t, "immutable", FAILED, f"{why} (nothing pushed)")
                else:
                    res = self._result(t, "immutable", HELD, f"not pushed: {', '.join(blocked)} could not be "
                                                             "published, and a cell is published whole or not at all")
                cell.report.tags.append(res)
                if res.status != HELD:
                    log.error("%s: %s: %s", res.ref, res.status, res.message)
            return
        failed = ""
        for t in cell.tags.immutable:
            if failed:
                res = self._result(t, "immutable", HELD, f"not pushed: {failed} failed before it")
            else:
                res = self._publish_tag(cell, t, "immutable", reads[t])
                failed = t if res.status not in OK_STATUSES else ""
            cell.report.tags.append(res)
            self._log_result(res)

    def _log_result(self, res: TagResult) -> None:
        if res.status in OK_STATUSES:
            sent = f"; {len(res.layers_uploaded)} layer(s) sent, {len(res.layers_existing)} already there" \
                if res.status == PUSHED else ""
            log.info("%s: %s %s (%.1f s%s)", res.ref, res.status, _short(res.digest), res.seconds, sent)
        elif res.status == HELD:
            log.warning("%s: %s: %s", res.ref, res.status, res.message)
        else:
            log.error("%s: %s: %s", res.ref, res.status, res.message)

    def _summarise(self, cell: _Cell) -> None:
        digests = [t.digest for t in cell.report.tags if t.digest and t.status in OK_STATUSES]
        if digests:
            cell.report.digest = digests[0]
            cell.report.compressed_size = next((t.compressed_size for t in cell.report.tags
                                                if t.compressed_size), None)
        if len(set(digests)) > 1:
            cell.report.notes.append("the tags of this image resolve to different manifests (same image, "
                                     f"compressed differently): {', '.join(sorted(set(digests)))}")

    def run(self, matrix: Matrix, selected: Sequence[ImageSpec]) -> Report:
        started = time.monotonic()
        report = Report(str(self.cfg.registry), self.repo, _now(), dry_run=self.cfg.dry_run,
                        allow_untested=self.cfg.allow_untested,
                        credentials=self.creds.source if self.creds else "anonymous")
        cells = [self._prepare(spec, matrix) for spec in selected]
        report.cells = [c.report for c in cells]
        if self.cfg.allow_untested:
            untested = [c.spec.name for c in cells if c.report.smoke.get("status") != "passed"]
            log.warning("WARNING: --allow-untested: floating tags may move to images without a smoke-test pass%s",
                        f" ({', '.join(untested)})" if untested else "")
        if self.cfg.dry_run:
            for c in cells:
                if c.tags is not None:
                    c.report.tags = [self._result(t, "immutable", PLANNED) for t in c.tags.immutable]
                    c.report.tags += [self._result(t, "floating", PLANNED, "if the gate opens")
                                      for t in c.tags.floating]
            ready = [CellReport(c.report.cell, c.report.image, c.report.image_id, smoke=c.report.smoke,
                                error=c.report.error,
                                tags=[TagResult(t.tag, t.ref, t.kind, PUSHED) for t in c.report.tags])
                     for c in cells]
            is_open, reasons = floating_gate(ready, self.cfg.allow_untested)
            report.floating_gate = {"open": is_open, "reasons": reasons}
            report.ok = is_open
            return self._finish(report, started)

        for c in cells:
            if c.tags is not None:
                log.info("%s (%s): immutable tags %s", c.spec.name, c.image_id[:19], ", ".join(c.tags.immutable))
                self._immutable(c)
            else:
                log.error("%s: %s", c.spec.name, c.report.error)

        is_open, reasons = floating_gate(report.cells, self.cfg.allow_untested)
        report.floating_gate = {"open": is_open, "reasons": [self._r(r) for r in reasons]}
        for c in cells:
            if c.tags is None:
                continue
            if not is_open:
                c.report.tags += [self._result(t, "floating", HELD, "held: floating tags move only when every "
                                               "selected cell published its immutable tags and passed its smoke "
                                               "test (see floating_gate)") for t in c.tags.floating]
                continue
            for t in c.tags.floating:
                res = self._publish_tag(c, t, "floating", None)
                c.report.tags.append(res)
                self._log_result(res)
        if not is_open:
            log.error("floating tags held:\n  %s", "\n  ".join(report.floating_gate["reasons"]))
        for c in cells:
            self._summarise(c)
        report.ok = is_open and all(c.immutable_ok and all(t.status in OK_STATUSES for t in c.tags)
                                    for c in report.cells)
        return self._finish(report, started)

    @staticmethod
    def _finish(report: Report, started: float) -> Report:
        report.finished = _now()
        report.seconds = round(time.monotonic() - started, 2)
        return report


# --- the verb ---------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--registry", default=os.environ.get("PTMG_REGISTRY", ""), metavar="HOST[:PORT][/NAMESPACE]",
                   help="where to push, e.g. ghcr.io/my-org or 127.0.0.1:5000 (env PTMG_REGISTRY). Plain HTTP "
                        "for 127.0.0.1/localhost, HTTPS (system CA bundle) otherwise. Credentials: env "
                        "PTMG_REGISTRY_USER + PTMG_REGISTRY_PASSWORD or PTMG_REGISTRY_PASSWORD_FILE, else the "
                        "docker config (`docker login`)")
    p.add_argument("--report-dir", type=Path,
                   default=Path(os.environ.get("PTMG_PUBLISH_REPORT_DIR", "build-logs/publish")),
                   help="where publish-report.json and publish-report.md go (default build-logs/publish/)")
    p.add_argument("--allow-untested", action="store_true",
                   help="move floating tags even for images without a recorded smoke-test pass (reported loudly)")
    p.add_argument("--attempts", type=int, default=os.environ.get("PTMG_PUSH_ATTEMPTS", "4"),
                   help="tries per tag for transient registry faults (default 4, env PTMG_PUSH_ATTEMPTS; "
                        "exponential backoff with jitter)")


def _print_summary(report: Report) -> None:
    rows = [[c.cell, t.tag, t.kind, t.status, f"{t.seconds:.1f}s", human_size(t.compressed_size), _short(t.digest)]
            for c in report.cells for t in c.tags]
    rows += [[c.cell, "-", "-", "failed", "-", "-", "-"] for c in report.cells if not c.tags]
    print(table(["cell", "tag", "kind", "status", "time", "size", "digest"], rows))


def cmd_publish(ctx: Context) -> int:
    """Push the selected cells to a registry: immutable tags first, never overwritten; floating tags
    (<tag>, <minor>-cuda<cuda>, latest) only after every cell is pushed and smoke-tested; verify and report."""
    from builder.engine import Engine

    a = ctx.args
    try:
        registry = parse_registry(a.registry)
        creds = load_credentials(registry, os.environ)
        tags.plan(ctx.matrix, dt.date.today(), "0" * tags.SHORT_SHA)  # ambiguous templates fail before anything
        if a.attempts < 1:
            raise PublishInputError("--attempts must be at least 1")
    except (PublishInputError, tags.TagError) as exc:
        log.error("%s", exc)
        return EXIT_INVALID
    log.info("publishing %d cell(s) to %s as %s", len(ctx.cells), registry,
             creds.source if creds else "anonymous (no credentials found)")
    try:
        engine = Engine()
    except EngineError as exc:
        log.error("%s", exc)
        return EXIT_FAILED
    client = RegistryClient(registry, ctx.matrix.repository, creds)
    cfg = PublishConfig(registry, allow_untested=a.allow_untested, dry_run=a.dry_run,
                        retry=RetryPolicy(attempts=a.attempts))
    publisher = Publisher(engine, client, cfg, repository=ctx.matrix.repository, creds=creds)
    report = publisher.run(ctx.matrix, ctx.cells)
    secrets = publisher.secrets
    if a.dry_run:
        if a.json:
            print(report_json(report, secrets), end="")
        else:
            _print_summary(report)
            for c in report.cells:
                print(f"{c.cell}: {c.image} ({c.image_id or 'missing'}), smoke {c.smoke.get('status', '-')}"
                      + (f"; {c.error}" if c.error else ""))
            gate = report.floating_gate
            print("floating tags would move" if gate["open"] else
                  "floating tags would be held:\n  " + "\n  ".join(gate["reasons"]))
        return EXIT_OK if report.ok else EXIT_FAILED
    jpath, mpath = write_report(report, Path(a.report_dir), secrets)
    if a.json:
        print(report_json(report, secrets), end="")
    else:
        _print_summary(report)
    log.info("report: %s, %s", jpath, mpath)
    if not report.ok:
        log.error("publish FAILED; see %s", mpath)
    return EXIT_OK if report.ok else EXIT_FAILED
