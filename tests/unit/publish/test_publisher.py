"""Publishing without a daemon or a registry: address parsing, credentials and their redaction,
fault classification, retries, the overwrite decision, the floating-tag gate, the push stream,
the registry client's auth handshake, reports, and the whole run against fakes."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import requests
from requests.structures import CaseInsensitiveDict

from builder.engine import EngineError, capabilities
from builder.matrix import Matrix, tags
from builder.publish import address, client, credentials, faults, policy, publisher, push
from builder.publish import report as publish_report
from builder.smoke import passes
from tests.support import LATEST, MID, small_matrix, write_matrix

ROOT = Path(__file__).resolve().parents[3]
PASSWORD = "s3cr3t-Pa55word-xyz"


# --- registry address -----------------------------------------------------------------
@pytest.mark.parametrize(("text", "repo", "api", "path"), [
    ("127.0.0.1:5000", "127.0.0.1:5000/pt-multi-gpu", "http://127.0.0.1:5000", "pt-multi-gpu"),
    ("localhost:5000/team", "localhost:5000/team/pt-multi-gpu", "http://localhost:5000", "team/pt-multi-gpu"),
    ("ghcr.io/my-org/ml", "ghcr.io/my-org/ml/pt-multi-gpu", "https://ghcr.io", "my-org/ml/pt-multi-gpu"),
    ("registry.example.com:8443/x/", "registry.example.com:8443/x/pt-multi-gpu", "https://registry.example.com:8443",
     "x/pt-multi-gpu"),
    ("docker.io/me", "docker.io/me/pt-multi-gpu", "https://registry-1.docker.io", "me/pt-multi-gpu"),
    ("index.docker.io", "docker.io/pt-multi-gpu", "https://registry-1.docker.io", "library/pt-multi-gpu"),
    ("[::1]:5000", "[::1]:5000/pt-multi-gpu", "http://[::1]:5000", "pt-multi-gpu"),
])
def test_parse_registry(text: str, repo: str, api: str, path: str) -> None:
    r = address.parse_registry(text)
    assert r.repository("pt-multi-gpu") == repo
    assert r.api_base == api
    assert r.api_path("pt-multi-gpu") == path


@pytest.mark.parametrize(("text", "why"), [
    ("myorg", "write docker.io/myorg"),
    ("https://ghcr.io/x", "without a scheme"),
    ("", "is empty"),
    ("ghcr.io/My-Org", "namespace component 'My-Org'"),
    ("127.0.0.1:99999", "out of range"),
    ("bad_host!:5000", "not a host"),
])
def test_parse_registry_rejects(text: str, why: str) -> None:
    with pytest.raises(address.PublishInputError, match=why):
        address.parse_registry(text)


# --- credentials ------------------------------------------------------------------------
REG = address.parse_registry("registry.example.com:5000/ns")


def _config(tmp_path: Path, data: dict[str, Any]) -> dict[str, str]:
    (tmp_path / "config.json").write_text(json.dumps(data))
    return {"DOCKER_CONFIG": str(tmp_path)}


def test_env_credentials_and_password_file(tmp_path: Path) -> None:
    c = credentials.load_credentials(REG, {"PTMG_REGISTRY_USER": "ci", "PTMG_REGISTRY_PASSWORD": PASSWORD})
    assert c is not None and c.username == "ci" and c.password.reveal() == PASSWORD
    f = tmp_path / "token"
    f.write_text(PASSWORD + "\n")
    c = credentials.load_credentials(REG, {"PTMG_REGISTRY_USER": "ci", "PTMG_REGISTRY_PASSWORD_FILE": str(f)})
    assert c is not None and c.password.reveal() == PASSWORD
    assert c.auth_config(REG) == {"username": "ci", "password": PASSWORD, "serveraddress": REG.host}
    assert PASSWORD not in c.source and PASSWORD not in repr(c) and PASSWORD not in str(c.password)
    assert PASSWORD not in f"{c}"


@pytest.mark.parametrize(("env", "why"), [
    ({"PTMG_REGISTRY_PASSWORD": "x"}, "PTMG_REGISTRY_USER is not"),
    ({"PTMG_REGISTRY_USER": "u"}, "neither PTMG_REGISTRY_PASSWORD nor"),
    ({"PTMG_REGISTRY_USER": "u", "PTMG_REGISTRY_PASSWORD": "x", "PTMG_REGISTRY_PASSWORD_FILE": "/x"}, "not both"),
    ({"PTMG_REGISTRY_USER": "u", "PTMG_REGISTRY_PASSWORD_FILE": "/nonexistent/pw"}, "can't read it"),
])
def test_env_credentials_misconfigured(env: dict[str, str], why: str) -> None:
    with pytest.raises(credentials.CredentialsError, match=why):
        credentials.load_credentials(REG, env)


def test_docker_config_auths(tmp_path: Path) -> None:
    auth = base64.b64encode(f"bob:{PASSWORD}".encode()).decode()
    env = _config(tmp_path, {"auths": {"https://registry.example.com:5000": {"auth": auth},
                                       "other.io": {"auth": base64.b64encode(b"x:y").decode()}}})
    c = credentials.load_credentials(REG, env)
    assert c is not None and (c.username, c.password.reveal()) == ("bob", PASSWORD)
    assert credentials.load_credentials(address.parse_registry("third.io"), env) is None
    env = _config(tmp_path, {"auths": {"registry.example.com:5000": {"username": "al", "password": "pw"}}})
    c = credentials.load_credentials(REG, env)
    assert c is not None and (c.username, c.password.reveal()) == ("al", "pw")


def test_env_wins_over_docker_config(tmp_path: Path) -> None:
    env = _config(tmp_path, {"auths": {"registry.example.com:5000": {"username": "al", "password": "pw"}}})
    c = credentials.load_credentials(REG, {**env, "PTMG_REGISTRY_USER": "ci", "PTMG_REGISTRY_PASSWORD": PASSWORD})
    assert c is not None and c.username == "ci"


def test_docker_config_helpers_and_tokens(tmp_path: Path) -> None:
    calls: list[tuple[str, str]] = []

    def helper(name: str, server: str) -> tuple[str, str] | None:
        calls.append((name, server))
        return ("hub-user", PASSWORD) if server == "https://index.docker.io/v1/" else None

    hub = address.parse_registry("docker.io/me")
    env = _config(tmp_path, {"credsStore": "desktop"})
    c = credentials.load_credentials(hub, env, helper=helper)
    assert c is not None and c.username == "hub-user" and c.source == "docker-credential-desktop"
    env = _config(tmp_path, {"credHelpers": {"registry.example.com:5000": "ecr-login"}, "credsStore": "desktop"})
    calls.clear()
    assert credentials.load_credentials(REG, env, helper=helper) is None
    assert calls == [("ecr-login", "registry.example.com:5000")]
    env = _config(tmp_path, {"auths": {"registry.example.com:5000": {"identitytoken": "tok"}}})
    with pytest.raises(credentials.CredentialsError, match="identity token"):
        credentials.load_credentials(REG, env)
    env = _config(tmp_path, {"auths": {"registry.example.com:5000": {"auth": "not-base64!"}}})
    with pytest.raises(credentials.CredentialsError, match="not base64"):
        credentials.load_credentials(REG, env)


def test_no_docker_config_is_anonymous(tmp_path: Path) -> None:
    assert credentials.load_credentials(REG, {"DOCKER_CONFIG": str(tmp_path / "none")}) is None


def test_redact() -> None:
    c = credentials.Credentials("bob", credentials.Secret(PASSWORD), "test")
    basic = base64.b64encode(f"bob:{PASSWORD}".encode()).decode()
    text = f"error: auth {PASSWORD} failed; header Basic {basic}; again {PASSWORD}"
    out = credentials.redact(text, c.secrets())
    assert PASSWORD not in out and basic not in out
    assert out == "error: auth *** failed; header Basic ***; again ***"
    assert credentials.redact("nothing here", ()) == "nothing here"


# --- classification -----------------------------------------------------------------------
def _manifest(config: str = "sha256:" + "c" * 64, sizes: tuple[int, ...] = (100, 250)) -> bytes:
    return json.dumps({"schemaVersion": 2, "mediaType": client.MANIFEST_V2,
                       "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 1,
                                  "digest": config},
                       "layers": [{"size": s, "digest": f"sha256:{i:064x}"} for i, s in enumerate(sizes)]}).encode()


def _digest(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def _err(code: str, msg: str = "") -> bytes:
    return json.dumps({"errors": [{"code": code, "message": msg}]}).encode()


def test_manifest_present() -> None:
    body = _manifest()
    r = client.manifest_remote(200, {"Docker-Content-Digest": _digest(body)}, body, "GET")
    assert (r.digest, r.config_digest, r.compressed_size, r.fault) == (_digest(body), "sha256:" + "c" * 64, 350, None)
    r = client.manifest_remote(200, {"Docker-Content-Digest": "sha256:" + "0" * 64}, body, "GET")
    assert r.fault is not None and r.fault.kind == "protocol" and not r.present


@pytest.mark.parametrize("code", ["MANIFEST_UNKNOWN", "NAME_UNKNOWN"])
def test_only_registry_404s_mean_absent(code: str) -> None:
    r = client.manifest_remote(404, {}, _err(code, "unknown"), "GET")
    assert not r.present and r.fault is None


@pytest.mark.parametrize(("status", "body", "kind", "transient"), [
    (404, b"<html>Not Found</html>", "protocol", False),  # a proxy or a wrong path: never "absent"
    (404, _err("BLOB_UNKNOWN"), "protocol", False),
    (401, _err("UNAUTHORIZED", "authentication required"), "auth", False),
    (403, _err("DENIED"), "auth", False),
    (429, _err("TOOMANYREQUESTS"), "rate-limit", True),
    (500, b"oops", "server", True),
    (503, b"", "server", True),
    (400, _err("MANIFEST_INVALID"), "protocol", False),
])
def test_manifest_faults(status: int, body: bytes, kind: str, transient: bool) -> None:
    r = client.manifest_remote(status, {}, body, "GET x")
    assert r.fault is not None and (r.fault.kind, r.fault.transient) == (kind, transient)
    assert push.decide("immutable", r, "sha256:x")[0] == "fail"  # never falls through to a push


def test_exception_faults() -> None:
    assert faults.exception_fault(requests.exceptions.ConnectionError("refused"), "GET").transient
    nested = requests.exceptions.ConnectionError(
        "HTTPConnectionPool(host='127.0.0.1', port=5999): Max retries exceeded with url: /v2/x/manifests/t "
        "(Caused by NewConnectionError(\"HTTPConnection(host='127.0.0.1', port=5999): Failed to establish a new "
        "connection: [Errno 111] Connection refused\"))")
    assert faults.exception_fault(nested, "GET t").message == "GET t: ConnectionError: [Errno 111] Connection refused"
    assert faults.exception_fault(requests.exceptions.ReadTimeout("slow"), "GET").transient
    tls = faults.exception_fault(requests.exceptions.SSLError("bad cert"), "GET")
    assert (tls.kind, tls.transient) == ("tls", False)


@pytest.mark.parametrize(("text", "kind", "transient"), [
    ("unauthorized: authentication required", "auth", False),
    ("denied: requested access to the resource is denied", "auth", False),
    ("no basic auth credentials", "auth", False),
    ("toomanyrequests: You have reached your pull rate limit", "rate-limit", True),
    ("received unexpected HTTP status: 503 Service Unavailable", "server", True),
    ("received unexpected HTTP status: 500 Internal Server Error", "server", True),
    ("dial tcp 127.0.0.1:5999: connect: connection refused", "network", True),
    ("Patch \"http://127.0.0.1:5999/v2/x/blobs/uploads/1\": EOF", "network", True),
    ("net/http: TLS handshake timeout", "network", True),
    ("http: server gave HTTP response to HTTPS client", "tls", False),
    ("x509: certificate signed by unknown authority", "tls", False),
    ("An image does not exist locally with the tag: r/x", "local", False),
    ("something nobody has seen", "engine", False),
])
def test_push_fault(text: str, kind: str, transient: bool) -> None:
    f = faults.push_fault(text)
    assert (f.kind, f.transient) == (kind, transient)


def test_backoff_exponential_capped_jittered() -> None:
    pol = faults.RetryPolicy(attempts=6, base=1.0, factor=2.0, cap=5.0)
    lows = [faults.backoff(pol, n, rng=lambda: 0.0) for n in range(1, 6)]
    highs = [faults.backoff(pol, n, rng=lambda: 1.0) for n in range(1, 6)]
    assert lows == [0.5, 1.0, 2.0, 2.5, 2.5]
    assert highs == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_parse_challenge() -> None:
    s, p = client.parse_challenge('Bearer realm="https://auth.example/token",service="reg.example",'
                               'scope="repository:ns/x:pull"')
    assert s == "bearer" and p == {"realm": "https://auth.example/token", "service": "reg.example",
                                   "scope": "repository:ns/x:pull"}
    assert client.parse_challenge('Basic realm="Registry Realm"') == ("basic", {"realm": "Registry Realm"})


# --- decisions --------------------------------------------------------------------------
IMG = "sha256:" + "a" * 64
OTHER = "sha256:" + "b" * 64


def test_decide() -> None:
    same = client.Remote("sha256:d1", IMG, client.MANIFEST_V2, 10)
    other = client.Remote("sha256:d2", OTHER, client.MANIFEST_V2, 10)
    index = client.Remote("sha256:d3", None, client.OCI_INDEX)
    assert push.decide("immutable", client.Remote(), IMG)[0] == "push"
    assert push.decide("immutable", same, IMG)[0] == "unchanged"
    action, why = push.decide("immutable", other, IMG)
    assert action == "refuse" and "never overwritten" in why and "sha256:d2" in why and IMG in why
    assert push.decide("immutable", index, IMG)[0] == "refuse"  # a multi-arch index is not ours either
    assert push.decide("floating", other, IMG) == ("push", "moves from sha256:d2")
    assert push.decide("floating", same, IMG)[0] == "unchanged"


def _cell_report(name: str, statuses: tuple[str, ...], smoke: str = "passed", error: str = "") -> publish_report.CellReport:
    return publish_report.CellReport(name, f"r:{name}", IMG, smoke={"status": smoke}, error=error,
                          tags=[publish_report.TagResult(f"{name}-{i}", "x", "immutable", s) for i, s in enumerate(statuses)])


def test_floating_gate() -> None:
    good = _cell_report("a", ("pushed", "unchanged"))
    assert policy.floating_gate([good, _cell_report("b", ("unchanged", "unchanged"))], False) == (True, [])
    is_open, why = policy.floating_gate([good, _cell_report("b", ("pushed", "failed"))], False)
    assert not is_open and why == ["b: immutable tags not published (b-1 failed)"]
    is_open, why = policy.floating_gate([good, _cell_report("b", ("refused", "held"))], True)
    assert not is_open and "b-0 refused" in why[0]
    untested = _cell_report("b", ("pushed", "pushed"), smoke="missing")
    is_open, why = policy.floating_gate([good, untested], False)
    assert not is_open and "no smoke-test pass recorded" in why[0] and "build.py test --only b" in why[0]
    assert policy.floating_gate([good, untested], True) == (True, [])
    assert not policy.floating_gate([_cell_report("c", (), error="not built")], True)[0]
    assert not policy.floating_gate([], False)[0]


# --- the push stream ------------------------------------------------------------------------
STREAM: list[dict[str, Any]] = [
    {"status": "The push refers to repository [127.0.0.1:5999/exp/x]"},
    {"status": "Preparing", "progressDetail": {}, "id": "d3eded9260c5"},
    {"status": "Preparing", "progressDetail": {}, "id": "0cf8aeda6a98"},
    {"status": "Pushing", "progressDetail": {"current": 512, "total": 9000}, "id": "0cf8aeda6a98"},
    {"status": "Layer already exists", "progressDetail": {}, "id": "d21d823cdbff"},
    {"status": "Mounted from other/repo", "progressDetail": {}, "id": "aaaaaaaaaaaa"},
    {"status": "Pushed", "progressDetail": {}, "id": "d3eded9260c5"},
    {"status": "Retrying in 5 seconds", "progressDetail": {}, "id": "0cf8aeda6a98"},
    {"status": "Retrying in 4 seconds", "progressDetail": {}, "id": "0cf8aeda6a98"},
    {"status": "Pushing", "progressDetail": {"current": 9000, "total": 9000}, "id": "0cf8aeda6a98"},
    {"status": "Retrying in 10 seconds", "progressDetail": {}, "id": "0cf8aeda6a98"},
    {"status": "Pushed", "progressDetail": {}, "id": "0cf8aeda6a98"},
    {"status": "t1: digest: sha256:d419 size: 948"},
    {"progressDetail": {}, "aux": {"Tag": "t1", "Digest": "sha256:d419", "Size": 948}},
]


def test_push_tracker() -> None:
    t = push.PushTracker()
    for ev in STREAM:
        t.feed(ev)
    assert t.uploaded == ["d3eded9260c5", "0cf8aeda6a98"]
    assert t.existing == ["d21d823cdbff", "aaaaaaaaaaaa"]
    assert (t.digest, t.size, t.error, t.engine_retries, t.progressed) == ("sha256:d419", 948, None, 2, True)
    t.feed({"errorDetail": {"message": "dial tcp: connection refused"}, "error": "dial tcp: connection refused"})
    assert t.error == "dial tcp: connection refused"


# --- the registry client's auth handshake --------------------------------------------------
class FakeResponse:
    def __init__(self, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None) -> None:
        self.status_code = status
        self.content = body
        self.headers = CaseInsensitiveDict(headers or {})

    def json(self) -> Any:
        return json.loads(self.content)


class FakeSession:
    def __init__(self, answer: Callable[[str, dict[str, str], dict[str, str]], FakeResponse]) -> None:
        self.answer = answer
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.trust_env = True

    def get(self, url: str, params: dict[str, str] | None = None, headers: dict[str, str] | None = None,
            **_: Any) -> FakeResponse:
        self.calls.append((url, dict(headers or {})))
        return self.answer(url, dict(params or {}), dict(headers or {}))


BODY = _manifest(IMG)
OK = FakeResponse(200, BODY, {"Docker-Content-Digest": _digest(BODY)})
CREDS = credentials.Credentials("bob", credentials.Secret(PASSWORD), "test")
BASIC = "Basic " + base64.b64encode(f"bob:{PASSWORD}".encode()).decode()


def _client(answer: Callable[..., FakeResponse], creds: credentials.Credentials | None = CREDS,
            registry: str = "127.0.0.1:5000/ns") -> tuple[client.RegistryClient, FakeSession]:
    s = FakeSession(answer)
    return client.RegistryClient(address.parse_registry(registry), "pt", creds, session=s, verify=True), s  # type: ignore[arg-type]


def test_client_basic_challenge() -> None:
    def answer(url: str, params: dict[str, str], headers: dict[str, str]) -> FakeResponse:
        if headers.get("Authorization") == BASIC:
            return OK
        return FakeResponse(401, _err("UNAUTHORIZED"), {"WWW-Authenticate": 'Basic realm="r"'})

    c, s = _client(answer)
    r = c.manifest("t1")
    assert r.config_digest == IMG and r.fault is None
    assert [u for u, _ in s.calls] == ["http://127.0.0.1:5000/v2/ns/pt/manifests/t1"] * 2
    assert s.calls[0][1]["Accept"].startswith(client.MANIFEST_V2) and client.OCI_MANIFEST in s.calls[0][1]["Accept"]
    assert s.trust_env is False  # loopback: no proxy in between
    c.manifest("t2")  # the header is kept: one request, no second challenge
    assert len(s.calls) == 3


def test_client_bearer_challenge_fetches_token_with_basic_auth() -> None:
    def answer(url: str, params: dict[str, str], headers: dict[str, str]) -> FakeResponse:
        if url == "https://auth.example/token":
            assert headers.get("Authorization") == BASIC and params["service"] == "reg"
            assert params["scope"] == "repository:ns/pt:pull"
            return FakeResponse(200, b'{"token": "TOKEN"}')
        if headers.get("Authorization") == "Bearer TOKEN":
            return OK
        return FakeResponse(401, b"", {"WWW-Authenticate": 'Bearer realm="https://auth.example/token",service="reg"'})

    c, s = _client(answer, registry="reg.example/ns")
    assert c.manifest("t1").config_digest == IMG
    assert s.calls[0][0] == "https://reg.example/v2/ns/pt/manifests/t1"


def test_client_wrong_credentials_is_an_auth_fault() -> None:
    def answer(url: str, params: dict[str, str], headers: dict[str, str]) -> FakeResponse:
        return FakeResponse(401, _err("UNAUTHORIZED", "authentication required"),
                            {"WWW-Authenticate": 'Basic realm="r"'})

    c, s = _client(answer)
    r = c.manifest("t1")
    assert r.fault is not None and (r.fault.kind, r.fault.transient) == ("auth", False)
    assert len(s.calls) == 2 and PASSWORD not in str(r.fault)
    c, s = _client(answer, creds=None)
    r = c.manifest("t1")
    assert r.fault is not None and "none are set" in r.fault.message and len(s.calls) == 1


def test_client_network_error_is_transient() -> None:
    def answer(url: str, params: dict[str, str], headers: dict[str, str]) -> FakeResponse:
        raise requests.exceptions.ConnectionError("connection refused")

    c, _ = _client(answer)
    r = c.manifest("t1")
    assert r.fault is not None and (r.fault.kind, r.fault.transient) == ("network", True)


# --- the whole run against fakes ------------------------------------------------------------
class FakeRegistry:
    """Tags -> (digest, image id); scripted faults per tag are served before the real answer."""

    def __init__(self) -> None:
        self.tags: dict[str, tuple[str, str]] = {}
        self.faults: dict[str, list[faults.Fault]] = {}
        self.reads: list[str] = []
        self.blobs: set[str] = set()
        self.lie: dict[str, str] = {}  # tag -> digest to answer instead of the truth

    def manifest(self, reference: str) -> client.Remote:
        self.reads.append(reference)
        queue = self.faults.get(reference)
        if queue:
            return client.Remote(fault=queue.pop(0))
        if reference not in self.tags:
            return client.Remote()
        digest, image_id = self.tags[reference]
        return client.Remote(self.lie.get(reference, digest), image_id, client.MANIFEST_V2, 1234)

    def put_manifest(self, reference: str, media_type: str, body: bytes) -> str | faults.Fault:
        """Manifest lists: tests/unit/publish/test_manifest_list.py's registry holds them; none here."""
        return faults.Fault("protocol", f"this fake holds no manifest lists ({reference})", False)


def manifest_digest(image_id: str) -> str:
    """The digest of the manifest a registry holds for `image_id` (the body _manifest() makes)."""
    return _digest(_manifest(image_id))


class FakeEngine:
    STORE = capabilities.CLASSIC  # what its image IDs name (the publisher is told, as the verb tells it)

    def __init__(self, registry: FakeRegistry) -> None:
        self.registry = registry
        self.images: dict[str, dict[str, Any]] = {}
        self.tagged: dict[str, str] = {}
        self.pushes: list[tuple[str, Mapping[str, str] | None]] = []
        self.push_errors: list[str] = []  # served one per push, before real pushes

    def add(self, ref: str, image_id: str, cell: str, layers: tuple[str, ...] = ("l1", "l2")) -> None:
        self.images[ref] = {"Id": image_id, "Size": 5000, "Created": "2026-11-29T10:00:00.1Z", "layers": layers,
                            "Config": {"Labels": {"io.pt-multi-gpu.cell": cell, "io.pt-multi-gpu.torch": "2.7.0",
                                                  "org.opencontainers.image.created": "2026-11-30T03:52:14Z",
                                                  "org.opencontainers.image.revision": "4a297245bf90"}}}

    def image_attrs(self, ref: str) -> dict[str, Any] | None:
        return self.images.get(ref)

    def store(self) -> capabilities.Store:
        return self.store_as

    store_as = capabilities.Store(capabilities.CLASSIC, "overlay2")

    def tag(self, image_id: str, ref: str) -> None:
        self.tagged[ref] = image_id

    def untag(self, ref: str) -> None:
        self.tagged.pop(ref, None)

    def push(self, ref: str, auth_config: Mapping[str, str] | None,
             on_event: Callable[[Mapping[str, Any]], None]) -> None:
        self.pushes.append((ref, auth_config))
        if self.push_errors:
            err = self.push_errors.pop(0)
            if err.startswith("raise:"):
                raise EngineError(err[6:])
            on_event({"status": "Pushing", "progressDetail": {"current": 1, "total": 9}, "id": "l1"})
            on_event({"errorDetail": {"message": err}, "error": err})
            return
        image_id = self.tagged[ref]
        attrs = next(a for a in self.images.values() if a["Id"] == image_id)
        for layer in attrs["layers"]:
            on_event({"status": "Layer already exists" if layer in self.registry.blobs else "Pushed", "id": layer})
            self.registry.blobs.add(layer)
        tag = ref.rpartition(":")[2]
        self.registry.tags[tag] = (manifest_digest(image_id), image_id)
        on_event({"aux": {"Tag": tag, "Digest": manifest_digest(image_id), "Size": 900}})


A = MID
B = LATEST  # the matrix's latest: its floating tags include `latest`
IMG_A = "sha256:" + "1" * 64
IMG_B = "sha256:" + "2" * 64
TAGS_A = (f"{A}-20261130", f"{A}-4a29724")
FLOAT_A = (A, "2.7-cuda12.6")
FLOAT_B = (B, "2.14-cuda13.0", "latest")


@pytest.fixture
def matrix(tmp_path: Path) -> Matrix:
    return small_matrix(tmp_path / "matrix")


class World:
    def __init__(self, matrix: Matrix, *, tested: tuple[str, ...] = (IMG_A, IMG_B), allow_untested: bool = False,
                 attempts: int = 4, creds: credentials.Credentials | None = None,
                 engine: type[FakeEngine] | None = None) -> None:
        self.matrix = matrix
        self.registry = FakeRegistry()
        self.engine = (engine or FakeEngine)(self.registry)
        self.engine.add(f"pt-multi-gpu:{A}", IMG_A, A)
        self.engine.add(f"pt-multi-gpu:{B}", IMG_B, B, layers=("l1", "l3"))
        self.tested = set(tested)
        self.sleeps: list[float] = []
        self.cfg = publisher.PublishConfig(address.parse_registry("127.0.0.1:5000/ns"), allow_untested=allow_untested,
                                     retry=faults.RetryPolicy(attempts=attempts))
        self.creds = creds

    def smoke(self, image_id: str) -> passes.SmokePass | None:
        return passes.SmokePass(image_id, "c", 12, 3, 1, "2026-11-30T04:00:00Z") if image_id in self.tested else None

    def run(self, only: tuple[str, ...] = (A, B)) -> publish_report.Report:
        p = publisher.Publisher(self.engine, self.registry, self.cfg, repository="pt-multi-gpu", creds=self.creds,
                          smoke=self.smoke, sleep=self.sleeps.append, rng=lambda: 1.0,
                          store=self.engine.STORE)
        return p.run(self.matrix, [c for c in self.matrix.cells if c.name in only])


def _status(report: publish_report.Report) -> dict[str, str]:
    return {t.tag: t.status for c in report.cells for t in c.tags}


def test_publish_happy_path_immutable_before_floating(matrix: Matrix) -> None:
    w = World(matrix)
    report = w.run()
    assert report.ok and report.floating_gate == {"open": True, "reasons": []}
    assert set(_status(report).values()) == {"pushed"}
    pushed = [ref.rpartition(":")[2] for ref, _ in w.engine.pushes]
    assert set(pushed) == {*TAGS_A, *FLOAT_A, f"{B}-20261130", f"{B}-4a29724", *FLOAT_B}
    first_floating = min(pushed.index(t) for t in (*FLOAT_A, *FLOAT_B))
    assert all(pushed.index(t) < first_floating for t in (*TAGS_A, f"{B}-20261130", f"{B}-4a29724"))
    a = report.cells[[c.cell for c in report.cells].index(A)]
    assert a.digest == manifest_digest(IMG_A) and a.compressed_size == 1234 and a.uncompressed_size == 5000
    assert a.versions["torch"] == "2.7.0" and a.smoke["status"] == "passed"
    assert w.engine.tagged == {}  # registry tags are removed locally after each push
    # Floating pushes after the immutable ones upload nothing new.
    assert all(not t.layers_uploaded for t in a.tags if t.kind == "floating")


class ContainerdStoreEngine(FakeEngine):
    """The containerd image store: a local image ID is the digest of the manifest that a push sends,
    which names the config (the classic store's ID) inside it."""

    STORE = capabilities.CONTAINERD

    def add(self, ref: str, image_id: str, cell: str, layers: tuple[str, ...] = ("l1", "l2")) -> None:
        super().add(ref, manifest_digest(image_id), cell, layers)
        self.images[ref]["config"] = image_id

    def push(self, ref: str, auth_config: Mapping[str, str] | None,
             on_event: Callable[[Mapping[str, Any]], None]) -> None:
        self.pushes.append((ref, auth_config))
        attrs = next(a for a in self.images.values() if a["Id"] == self.tagged[ref])
        tag = ref.rpartition(":")[2]
        self.registry.tags[tag] = (attrs["Id"], attrs["config"])
        # Docker 28.5.2's containerd store ends a successful push with no aux Digest (seen on the real
        # engine: tests/docker/test_modern_engine.py), only the layers' progress.
        on_event({"status": "Pushed", "id": "l1", "progressDetail": {}})
        if self.STORE == capabilities.CLASSIC:  # a classic engine reports what it pushed
            on_event({"aux": {"Tag": tag, "Digest": attrs["Id"], "Size": 900}})


def test_containerd_store_verifies_the_manifest_digest_and_a_rerun_is_unchanged(matrix: Matrix) -> None:
    w = World(matrix, engine=ContainerdStoreEngine, tested=(manifest_digest(IMG_A), manifest_digest(IMG_B)))
    report = w.run()
    assert report.ok and set(_status(report).values()) == {"pushed"}, _status(report)
    assert report.cells[0].digest == report.cells[0].image_id == manifest_digest(IMG_A)
    n = len(w.engine.pushes)
    again = w.run()
    assert again.ok and set(_status(again).values()) == {"unchanged"} and len(w.engine.pushes) == n
    # A registry that serves another manifest under the tag is caught in this store too.
    w.registry.tags[TAGS_A[0]] = ("sha256:" + "9" * 64, IMG_A)
    refused = w.run(only=(A,))
    assert not refused.ok and _status(refused)[TAGS_A[0]] == "refused"


def test_containerd_store_image_read_as_classic_fails_verification(matrix: Matrix) -> None:
    """The same pushes judged by the classic store's rule (config digest == image ID) fail: the store
    decides, so publish must ask the engine which one it is."""
    w = World(matrix, engine=ContainerdStoreEngine, tested=(manifest_digest(IMG_A), manifest_digest(IMG_B)))
    w.engine.STORE = capabilities.CLASSIC
    report = w.run(only=(A,))
    assert not report.ok and "describes image" in report.cells[0].tags[0].message


def test_rerun_is_unchanged_and_pushes_nothing(matrix: Matrix) -> None:
    w = World(matrix)
    assert w.run().ok
    n = len(w.engine.pushes)
    report = w.run()
    assert report.ok and set(_status(report).values()) == {"unchanged"} and len(w.engine.pushes) == n


def test_immutable_overwrite_refused_nothing_pushed_for_that_cell(matrix: Matrix) -> None:
    w = World(matrix)
    w.registry.tags[TAGS_A[1]] = ("sha256:old", OTHER)  # another image already under A's sha tag
    report = w.run()
    st = _status(report)
    assert st[TAGS_A[1]] == "refused" and st[TAGS_A[0]] == "held"
    assert not [ref for ref, _ in w.engine.pushes if f":{A}" in ref or ":2.7-" in ref]
    assert w.registry.tags[TAGS_A[1]] == ("sha256:old", OTHER)
    refused = next(t for c in report.cells for t in c.tags if t.status == "refused")
    assert "never overwritten" in refused.message and "sha256:old" in refused.message
    # B's immutable tags still go up; nobody's floating tags move.
    assert st[f"{B}-20261130"] == "pushed"
    assert all(st[t] == "held" for t in (*FLOAT_A, *FLOAT_B))
    assert not report.ok and not report.floating_gate["open"]


@pytest.mark.parametrize("fault", [
    faults.Fault("auth", "HTTP 401", False),
    faults.Fault("protocol", "HTTP 404 without a registry error", False),
    faults.Fault("tls", "bad cert", False),
])
def test_permanent_read_faults_fail_at_once_and_never_push(matrix: Matrix, fault: faults.Fault) -> None:
    w = World(matrix)
    w.registry.faults[TAGS_A[0]] = [fault] * 10
    report = w.run(only=(A,))
    st = _status(report)
    assert st[TAGS_A[0]] == "failed" and st[TAGS_A[1]] == "held"
    assert w.engine.pushes == [] and w.sleeps == []
    assert w.registry.reads.count(TAGS_A[0]) == 1
    assert fault.message in next(t.message for t in report.cells[0].tags if t.status == "failed")
    assert not report.ok


@pytest.mark.parametrize("fault", [
    faults.Fault("rate-limit", "HTTP 429", True),
    faults.Fault("server", "HTTP 503", True),
    faults.Fault("network", "connection refused", True),
])
def test_transient_read_faults_retried_then_fail_without_push(matrix: Matrix, fault: faults.Fault) -> None:
    w = World(matrix, attempts=4)
    w.registry.faults[TAGS_A[0]] = [fault] * 10
    report = w.run(only=(A,))
    assert _status(report)[TAGS_A[0]] == "failed" and w.engine.pushes == []
    assert w.registry.reads.count(TAGS_A[0]) == 4
    assert w.sleeps == [1.0, 2.0, 4.0]  # exponential (rng pinned to the top of the jitter)


def test_transient_read_fault_recovers(matrix: Matrix) -> None:
    w = World(matrix)
    w.registry.faults[TAGS_A[0]] = [faults.Fault("server", "HTTP 502", True)]
    report = w.run(only=(A,))
    assert report.ok and w.sleeps == [1.0]


def test_transient_push_error_retried_then_pushed(matrix: Matrix) -> None:
    w = World(matrix)
    w.engine.push_errors = ["received unexpected HTTP status: 503 Service Unavailable"]
    report = w.run(only=(A,))
    assert report.ok
    first = report.cells[0].tags[0]
    assert first.status == "pushed" and first.attempts == 2 and w.sleeps == [1.0]


def test_push_errors_exhaust_attempts(matrix: Matrix) -> None:
    w = World(matrix, attempts=3)
    w.engine.push_errors = ["dial tcp 127.0.0.1:5000: connect: connection refused"] * 3
    report = w.run(only=(A,))
    first = report.cells[0].tags[0]
    assert first.status == "failed" and first.attempts == 3 and "connection refused" in first.message
    assert len(w.engine.pushes) == 3 and w.sleeps == [1.0, 2.0]
    # The cell's next immutable tag is not tried against a registry that just failed, nor are floating tags.
    assert report.cells[0].tags[1].status == "held" and "failed before it" in report.cells[0].tags[1].message
    assert all(t.status == "held" for t in report.cells[0].tags if t.kind == "floating")
    assert not report.ok


def test_auth_push_error_not_retried(matrix: Matrix) -> None:
    w = World(matrix)
    w.engine.push_errors = ["unauthorized: authentication required"]
    report = w.run(only=(A,))
    assert report.cells[0].tags[0].status == "failed" and len(w.engine.pushes) == 1 and w.sleeps == []


def test_engine_failure_is_a_failed_tag(matrix: Matrix) -> None:
    w = World(matrix)
    w.engine.push_errors = ["raise:push of x refused: no such image"]
    report = w.run(only=(A,))
    assert report.cells[0].tags[0].status == "failed" and "no such image" in report.cells[0].tags[0].message


def test_retry_after_push_that_landed_reads_unchanged(matrix: Matrix) -> None:
    """A push whose stream broke after the manifest landed: the retry's re-read says unchanged."""
    w = World(matrix)
    real_push = w.engine.push

    def push_then_break(ref: str, auth_config: Mapping[str, str] | None,
                        on_event: Callable[[Mapping[str, Any]], None]) -> None:
        real_push(ref, auth_config, lambda ev: None)
        if len(w.engine.pushes) == 1:
            on_event({"error": "EOF", "errorDetail": {"message": "EOF"}})
        else:
            real_push(ref, auth_config, on_event)

    w.engine.push = push_then_break  # type: ignore[method-assign]
    report = w.run(only=(A,))
    assert report.cells[0].tags[0].status == "unchanged" and report.ok


def test_verify_mismatch_fails(matrix: Matrix) -> None:
    w = World(matrix)
    w.registry.lie[TAGS_A[0]] = "sha256:someone-else"
    report = w.run(only=(A,))
    t = report.cells[0].tags[0]
    assert t.status == "failed" and "sha256:someone-else" in t.message and not report.ok


def test_untested_cell_holds_every_floating_tag(matrix: Matrix) -> None:
    w = World(matrix, tested=(IMG_B,))
    report = w.run()
    st = _status(report)
    assert all(st[t] == "pushed" for t in (*TAGS_A, f"{B}-20261130"))
    assert all(st[t] == "held" for t in (*FLOAT_A, *FLOAT_B))  # B is tested, but A holds the gate
    assert report.floating_gate["reasons"] == [
        f"{A}: no smoke-test pass recorded for image {IMG_A}; run `python build.py test --only {A}`"]
    assert not report.ok


def test_allow_untested_moves_floating_and_says_so(matrix: Matrix) -> None:
    w = World(matrix, tested=(), allow_untested=True)
    report = w.run(only=(A,))
    assert report.ok and report.allow_untested
    assert report.cells[0].smoke["status"] == "untested (--allow-untested)"
    assert "WARNING: --allow-untested" in publish_report.report_markdown(report)


def test_missing_or_foreign_local_image(matrix: Matrix) -> None:
    w = World(matrix)
    del w.engine.images[f"pt-multi-gpu:{B}"]
    w.engine.images[f"pt-multi-gpu:{A}"]["Config"]["Labels"]["io.pt-multi-gpu.cell"] = "dev-cpu"
    report = w.run()
    assert w.engine.pushes == [] and not report.ok
    errors = {c.cell: c.error for c in report.cells}
    assert "not built here" in errors[B] and "'dev-cpu'" in errors[A]


def test_missing_revision_label(matrix: Matrix) -> None:
    w = World(matrix)
    w.engine.images[f"pt-multi-gpu:{A}"]["Config"]["Labels"]["org.opencontainers.image.revision"] = "unknown"
    report = w.run(only=(A,))
    assert "no git revision label" in report.cells[0].error and w.engine.pushes == []


def test_dry_run_contacts_nothing(matrix: Matrix) -> None:
    w = World(matrix)
    w.cfg = publisher.PublishConfig(w.cfg.registry, dry_run=True)
    report = w.run()
    assert report.ok and w.engine.pushes == [] and w.registry.reads == []
    assert set(_status(report).values()) == {"planned"}


def test_credentials_reach_the_push_but_never_the_report(matrix: Matrix, tmp_path: Path) -> None:
    creds = credentials.Credentials("bob", credentials.Secret(PASSWORD), "env PTMG_REGISTRY_USER + PTMG_REGISTRY_PASSWORD")
    w = World(matrix, creds=creds)
    # An engine that echoes the password in its error (some proxies do) must not leak it either.
    w.engine.push_errors = [f"unauthorized: bad password {PASSWORD}"]
    report = w.run(only=(A,))
    assert w.engine.pushes[0][1] == {"username": "bob", "password": PASSWORD, "serveraddress": "127.0.0.1:5000"}
    jpath, mpath = publish_report.write_report(report, tmp_path, creds.secrets())
    for text in (jpath.read_text(), mpath.read_text(), repr(report)):
        assert PASSWORD not in text
    assert "bad password ***" in jpath.read_text()
    assert json.loads(jpath.read_text())["credentials"] == "env PTMG_REGISTRY_USER + PTMG_REGISTRY_PASSWORD"


def test_report_rendering(matrix: Matrix, tmp_path: Path) -> None:
    w = World(matrix, tested=(IMG_B,))
    report = w.run()
    jpath, mpath = publish_report.write_report(report, tmp_path / "out")
    data = json.loads(jpath.read_text())
    assert data["ok"] is False and data["floating_gate"]["open"] is False
    cell = next(c for c in data["cells"] if c["cell"] == B)
    assert cell["digest"] == manifest_digest(IMG_B) and cell["compressed_size"] == 1234
    assert cell["uncompressed_size"] == 5000 and cell["versions"]["torch"] == "2.7.0"
    assert {t["status"] for t in cell["tags"]} == {"pushed", "held"}
    assert {"tag", "ref", "kind", "status", "digest", "message", "attempts", "layers_uploaded"} <= set(cell["tags"][0])
    md = mpath.read_text()
    assert md.startswith("# Publish report: 127.0.0.1:5000/ns/pt-multi-gpu")
    assert "- result: **FAILED**" in md and "- floating tags: **held**" in md
    assert f"| {B} | `{manifest_digest(IMG_B)[:19]}` | 1.23 KB | 5.00 KB | 2.7.0 |" in md
    assert f"| `{B}-20261130` | immutable | pushed |" in md
    assert "| `latest` | floating | held |" in md


def test_image_date_revision_and_versions() -> None:
    assert policy.image_date({"org.opencontainers.image.created": "2026-11-30T03:52:14Z"}, None) == "20261130"
    assert policy.image_date({}, "2026-01-02T10:00:00.123456789Z") == "20260102"
    with pytest.raises(tags.TagError, match="no creation date"):
        policy.image_date({}, None)
    with pytest.raises(tags.TagError, match="no git revision label"):
        policy.image_revision({"org.opencontainers.image.revision": "unknown"})
    labels = {"io.pt-multi-gpu.torch": "2.7.0", "io.pt-multi-gpu.cuda": "12.6", "project": "pt-multi-gpu",
              "org.opencontainers.image.version": "x"}
    assert policy.versions_from_labels(labels) == {"cuda": "12.6", "torch": "2.7.0"}


# --- what the publish verb really hands out: the password goes to the push and the login only ---------
class RecordingEngine(FakeEngine):
    """FakeEngine that records every call with every argument, as the publish verb made it."""

    def __init__(self, registry: FakeRegistry) -> None:
        super().__init__(registry)
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def image_attrs(self, ref: str) -> dict[str, Any] | None:
        self.calls.append(("image_attrs", (ref,)))
        return super().image_attrs(ref)

    def tag(self, image_id: str, ref: str) -> None:
        self.calls.append(("tag", (image_id, ref)))
        super().tag(image_id, ref)

    def untag(self, ref: str) -> None:
        self.calls.append(("untag", (ref,)))
        super().untag(ref)

    def push(self, ref: str, auth_config: Mapping[str, str] | None,
             on_event: Callable[[Mapping[str, Any]], None]) -> None:
        self.calls.append(("push", (ref, auth_config)))
        super().push(ref, auth_config, on_event)

    def cleanup_session(self) -> None:
        self.calls.append(("cleanup_session", ()))


def test_publish_verb_hands_the_password_only_to_the_push_and_the_registry_login(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """`build.py publish` with credentials in the environment, against a recording engine, a recording
    HTTP session and a recording subprocess.Popen: the password reaches engine.push() as auth_config
    and the registry as a Basic Authorization header, and nothing else (no argv, URL, ref, output, report)."""
    import subprocess

    import builder.cli.main as cli

    registry = FakeRegistry()
    engine = RecordingEngine(registry)
    engine.add(f"pt-multi-gpu:{A}", IMG_A, A)

    def answer(url: str, params: dict[str, str], headers: dict[str, str]) -> FakeResponse:
        if headers.get("Authorization") != BASIC:
            return FakeResponse(401, _err("UNAUTHORIZED"), {"WWW-Authenticate": 'Basic realm="r"'})
        tag = url.rpartition("/manifests/")[2]
        if tag not in registry.tags:
            return FakeResponse(404, _err("MANIFEST_UNKNOWN"))
        body = _manifest(registry.tags[tag][1])
        return FakeResponse(200, body, {"Docker-Content-Digest": _digest(body)})

    session = FakeSession(answer)
    spawned: list[Any] = []

    class RecordingPopen(subprocess.Popen[Any]):
        def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
            spawned.append(args)
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr("builder.cli.context.Engine", lambda: engine)
    monkeypatch.setattr(requests, "Session", lambda: session)
    monkeypatch.setattr(subprocess, "Popen", RecordingPopen)
    for var in ("PTMG_REGISTRY", "PTMG_REGISTRY_PASSWORD_FILE", "PTMG_PUSH_ATTEMPTS", "PTMG_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PTMG_REGISTRY_USER", "bob")
    monkeypatch.setenv("PTMG_REGISTRY_PASSWORD", PASSWORD)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))
    monkeypatch.setenv("PTMG_STATE_DIR", str(tmp_path / "state"))
    passes.record_pass(tmp_path, IMG_A, A, passed=3, skipped=0)
    config = write_matrix(tmp_path / "matrix")
    report_dir = tmp_path / "report"

    # --allow-stale-os: these fake images have no OS patch level (the OS-freshness gate is tested in test_debsec_publish).
    rc = cli.main(["publish", "--config", str(config), "--only", A, "--registry", "127.0.0.1:5000/ns",
                   "--report-dir", str(report_dir), "--allow-stale-os"])
    out, err = capfd.readouterr()
    assert rc == 0, err

    auth = {"username": "bob", "password": PASSWORD, "serveraddress": "127.0.0.1:5000"}
    pushes = [args for name, args in engine.calls if name == "push"]
    assert len(pushes) == len(TAGS_A) + len(FLOAT_A) and all(a[1] == auth for a in pushes)
    for name, args in engine.calls:
        rest = args[:1] if name == "push" else args  # push's auth_config is where the password belongs
        assert PASSWORD not in repr(rest), (name, args)
    assert session.calls, "the registry was never asked"
    for url, headers in session.calls:
        assert PASSWORD not in url
        assert PASSWORD not in repr({k: v for k, v in headers.items() if k != "Authorization"})
        assert headers.get("Authorization") in (None, BASIC), headers
    assert any(h.get("Authorization") == BASIC for _, h in session.calls)
    assert all(PASSWORD not in repr(argv) for argv in spawned), spawned
    reports = "".join(p.read_text() for p in report_dir.iterdir())
    for where, text in (("stdout", out), ("stderr", err), ("report", reports)):
        assert PASSWORD not in text, f"the password leaked into {where}"


def test_publish_verb_refuses_an_unknown_image_store_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """An engine whose store is neither classic nor containerd: exit 2, one line with the fix, nothing
    pushed (what its image IDs name is unknown, so no verification could be trusted)."""
    import builder.cli.main as cli

    registry = FakeRegistry()
    engine = RecordingEngine(registry)
    engine.add(f"pt-multi-gpu:{A}", IMG_A, A)
    engine.store_as = capabilities.image_store({"Driver": "stargz", "DriverStatus": [["driver-type", "x.y"]]})
    monkeypatch.setattr("builder.cli.context.Engine", lambda: engine)
    monkeypatch.setattr(requests, "Session", lambda: FakeSession(lambda *a: FakeResponse(404, _err("NAME_UNKNOWN"))))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))
    monkeypatch.setenv("PTMG_STATE_DIR", str(tmp_path / "state"))
    config = write_matrix(tmp_path / "matrix")
    rc = cli.main(["publish", "--config", str(config), "--only", A, "--registry", "127.0.0.1:5000/ns",
                   "--report-dir", str(tmp_path / "report"), "--allow-stale-os"])
    _out, err = capfd.readouterr()
    assert rc == 2 and "Traceback" not in err
    assert "neither Docker's classic store nor the containerd image store" in err and "containerd-snapshotter" in err
    assert not [c for c in engine.calls if c[0] == "push"]


def test_a_push_that_reports_no_digest_is_settled_only_by_the_containerd_store() -> None:
    """Docker 28's containerd store ends a push with no aux Digest: what it sent is its image's own
    target (the image ID). The classic store always reports one, so there silence stays a fault;
    an index it could not push whole names the manifest it sent instead."""
    image_id = manifest_digest(IMG_A)
    silent = push.PushTracker()
    silent.feed({"status": "Pushed", "id": "l1", "progressDetail": {}})
    assert silent.settle(capabilities.CLASSIC, image_id) is None
    assert silent.settle(capabilities.CONTAINERD, image_id) == image_id
    failed = push.PushTracker()
    failed.feed({"errorDetail": {"message": "denied"}, "error": "denied"})
    assert failed.settle(capabilities.CONTAINERD, image_id) is None
    one = push.PushTracker()
    one.feed({"aux": {"ManifestPushedInsteadOfIndex": True, "OriginalIndex": {"digest": image_id},
                      "SelectedManifest": {"digest": "sha256:" + "5" * 64}}})
    assert one.settle(capabilities.CONTAINERD, image_id) == "sha256:" + "5" * 64
