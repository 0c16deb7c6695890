"""The registry client's auth handshake (builder/publish/client.py) against a scripted HTTP session:
a Basic challenge, a Bearer token fetched with Basic auth, wrong credentials as an auth fault, a
network error as transient. tests/unit/publish/test_client.py has the client's other rules."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping
from typing import Any

import requests
from requests.structures import CaseInsensitiveDict

from builder.publish import address, client, credentials
from tests.unit.publish.test_address import PASSWORD
from tests.unit.publish.test_faults import _digest, _err, _manifest
from tests.unit.publish.test_policy import IMG


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


