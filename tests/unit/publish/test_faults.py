"""Fault classification (builder/publish/faults.py): which manifest answers mean present or absent,
which faults are final and which are retried (exponential, capped, jittered backoff), and the
registry's auth challenge (no daemon, no registry)."""

from __future__ import annotations

import hashlib
import json

import pytest
import requests

from builder.publish import client, faults, push


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


