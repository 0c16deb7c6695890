"""The registry client (builder/publish/client.py), rule by rule against a scripted HTTP session:
how a manifest answer is classified, which faults are final, the token answer's two spellings, the
digest a PUT answers, a blob's HEAD through redirects, and which CA bundle is trusted.
tests/unit/publish/test_publisher.py and tests/unit/publish/test_zstdpush.py drive it through publish."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import pytest

from builder.publish import client
from builder.publish.address import Registry
from builder.publish.client import RegistryClient
from builder.publish.credentials import Credentials, Secret
from builder.publish.faults import Fault

REG = Registry("registry.example:5000")
WHAT = "GET x"


class Answer:
    def __init__(self, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None) -> None:
        self.status_code, self.content, self.headers = status, body, dict(headers or {})
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def json(self) -> Any:
        return json.loads(self.content)


class Session:
    """Answers each request with the next scripted answer and records what was asked."""

    def __init__(self, *answers: Answer | Exception) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[str, str, dict[str, str]]] = []
        self.streamed: list[bool] = []  # each request's `stream=` (False when not passed)
        self.trust_env = True

    def _answer(self, method: str, url: str, headers: Mapping[str, str] | None = None, **kw: Any) -> Answer:
        self.asked.append((method, url, dict(headers or {})))
        self.streamed.append(kw.get("stream", False))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def get(self, url: str, **kw: Any) -> Answer:
        return self._answer("GET", url, **kw)

    def put(self, url: str, **kw: Any) -> Answer:
        return self._answer("PUT", url, **kw)

    def head(self, url: str, **kw: Any) -> Answer:
        return self._answer("HEAD", url, **kw)

    def post(self, url: str, **kw: Any) -> Answer:
        return self._answer("POST", url, **kw)

    def patch(self, url: str, **kw: Any) -> Answer:
        return self._answer("PATCH", url, **kw)


def _client(session: Session, creds: Credentials | None = None) -> RegistryClient:
    return RegistryClient(REG, "img", creds, session=session, verify=False)  # type: ignore[arg-type]


# --- a manifest answer -------------------------------------------------------------------------------
def test_a_manifest_is_read_whole() -> None:
    body = json.dumps({"config": {"digest": "sha256:c"}, "layers": [
        {"size": 5, "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip"},
        {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip"}]}).encode()
    got = client.manifest_remote(200, {"Content-Type": f"{client.OCI_MANIFEST}; charset=utf-8"}, body, WHAT)
    assert got == client.Remote("sha256:" + hashlib.sha256(body).hexdigest(), "sha256:c", client.OCI_MANIFEST, 5,
                                size=len(body), compression="gzip")


@pytest.mark.parametrize(("body", "says"), [(b"not json", "the manifest is not JSON"),
                                            (b"[1]", "the manifest is not a JSON object")])
def test_a_manifest_that_is_not_a_json_object_is_a_final_protocol_fault(body: bytes, says: str) -> None:
    got = client.manifest_remote(200, {}, body, WHAT)
    assert got.fault == Fault("protocol", f"{WHAT}: {says}", False) and not got.present


# --- authentication ------------------------------------------------------------------------------------
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="https://auth.example/token",service="reg"'}


@pytest.mark.parametrize("field", ["token", "access_token"])
def test_either_spelling_of_the_token_is_used(field: str) -> None:
    body = json.dumps({"config": {"digest": "sha256:c"}}).encode()
    session = Session(Answer(401, headers=CHALLENGE), Answer(200, json.dumps({field: "T"}).encode()), Answer(200, body))
    assert _client(session).manifest("v1").present
    token_url, final = session.asked[1], session.asked[2]
    assert token_url[1] == "https://auth.example/token" and final[2]["Authorization"] == "Bearer T"


@pytest.mark.parametrize("answer", [b"not json", b"{}", b'{"token": ""}', b'["token"]'])
def test_a_token_answer_without_a_token_is_a_final_auth_fault(answer: bytes) -> None:
    session = Session(Answer(401, headers=CHALLENGE), Answer(200, answer))
    got = _client(session).manifest("v1")
    assert got.fault == Fault("auth", "GET registry.example:5000/img:v1 manifest: the token endpoint "
                                      "https://auth.example/token gave no token", False)


def test_a_challenge_without_a_realm_or_without_credentials_is_a_final_auth_fault() -> None:
    got = _client(Session(Answer(401, headers={"WWW-Authenticate": 'Bearer service="reg"'}))).manifest("v1")
    assert got.fault == Fault("auth", "GET registry.example:5000/img:v1 manifest: the registry asked for a token "
                                      "without a realm", False)
    basic = _client(Session(Answer(401, headers={"WWW-Authenticate": 'Basic realm="r"'}))).manifest("v1")
    assert basic.fault is not None and basic.fault.kind == "auth" and basic.fault.transient is False
    assert "the registry wants credentials and none are set" in basic.fault.message


def test_basic_credentials_answer_a_basic_challenge() -> None:
    creds = Credentials("u", Secret("p"), "test")
    body = json.dumps({"config": {"digest": "sha256:c"}}).encode()
    session = Session(Answer(401, headers={"WWW-Authenticate": 'Basic realm="r"'}), Answer(200, body))
    assert _client(session, creds).manifest("v1").present
    assert session.asked[1][2]["Authorization"] == "Basic dTpw"  # base64 of u:p


# --- PUT and HEAD ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("status", "headers", "want"), [
    (201, {}, "sha256:" + hashlib.sha256(b"{}").hexdigest()),  # no digest header: the body's own
    (200, {"Docker-Content-Digest": "sha256:answered"}, "sha256:answered"),
])
def test_a_put_manifest_answers_the_registrys_digest_or_the_bodys(status: int, headers: dict[str, str],
                                                                 want: str) -> None:
    assert _client(Session(Answer(status, headers=headers))).put_manifest("v1", client.OCI_INDEX, b"{}") == want
    refused = _client(Session(Answer(202))).put_manifest("v1", client.OCI_INDEX, b"{}")
    assert isinstance(refused, Fault)


@pytest.mark.parametrize(("status", "want"), [(200, True), (301, True), (302, True), (303, True), (307, True),
                                              (308, True), (404, False)])
def test_a_blob_head_follows_the_answer(status: int, want: bool) -> None:
    assert _client(Session(Answer(status))).blob_exists("sha256:b") is want
    assert isinstance(_client(Session(Answer(500))).blob_exists("sha256:b"), Fault)


# --- which certificates are trusted ---------------------------------------------------------------------
def test_the_ca_bundle_is_the_callers_then_the_systems(monkeypatch: pytest.MonkeyPatch) -> None:
    files: set[str] = set()

    class FakePath:
        def __init__(self, p: str) -> None:
            self.p = p

        def is_file(self) -> bool:
            return self.p in files

    monkeypatch.setattr(client, "Path", FakePath)
    assert client.ca_bundle({}) is True  # none anywhere: requests' own
    files.add("/etc/pki/tls/certs/ca-bundle.crt")
    assert client.ca_bundle({}) == "/etc/pki/tls/certs/ca-bundle.crt"
    files.add("/etc/ssl/certs/ca-certificates.crt")
    assert client.ca_bundle({"SSL_CERT_FILE": "/missing"}) == "/etc/ssl/certs/ca-certificates.crt"
    files.update({"/mine.pem", "/yours.pem"})
    assert client.ca_bundle({"SSL_CERT_FILE": "/yours.pem"}) == "/yours.pem"
    assert client.ca_bundle({"REQUESTS_CA_BUNDLE": "/mine.pem", "SSL_CERT_FILE": "/yours.pem"}) == "/mine.pem"
    assert RegistryClient(REG, "img", None, session=Session()).verify == "/etc/ssl/certs/ca-certificates.crt"  # type: ignore[arg-type]
    assert RegistryClient(REG, "img", None, session=Session(), verify=False).verify is False  # type: ignore[arg-type]


def test_a_manifest_whose_digest_header_lies_is_a_final_protocol_fault() -> None:
    got = client.manifest_remote(200, {"Docker-Content-Digest": "sha256:other"}, b"{}", WHAT)
    assert got.fault is not None and got.fault.kind == "protocol" and got.fault.transient is False
    assert got.fault.message.startswith(f"{WHAT}: Docker-Content-Digest sha256:other is not the sha256 of")


def test_a_lists_entries_without_a_platform_or_a_digest_are_not_children() -> None:
    body = json.dumps({"mediaType": client.OCI_INDEX, "manifests": [
        {"digest": "sha256:a", "platform": {"os": "linux", "architecture": "arm64", "variant": "v8"}},
        {"digest": "sha256:b"}, {"platform": {"os": "linux", "architecture": "amd64"}}, "junk",
        {"digest": "sha256:c", "platform": {"os": "linux", "architecture": "amd64"}}]}).encode()
    got = client.manifest_remote(200, {}, body, WHAT)
    assert got.children == (("linux/arm64/v8", "sha256:a"), ("linux/amd64", "sha256:c")) and got.compression == ""


def test_a_challenges_parameters_quoted_or_not() -> None:
    assert client.parse_challenge('Bearer realm="https://a/t",service=reg,scope="repository:x:pull"') == (
        "bearer", {"realm": "https://a/t", "service": "reg", "scope": "repository:x:pull"})


def test_an_upload_posts_patches_and_puts_the_digest() -> None:
    session = Session(Answer(202, headers={"Location": "/v2/img/blobs/uploads/u1?state=s"}),
                      Answer(202, headers={"Location": "/v2/img/blobs/uploads/u1?state=t"}),
                      Answer(201, headers={"Docker-Content-Digest": "sha256:d"}))
    assert _client(session).upload_blob(b"data", lambda: "sha256:d") == "sha256:d"
    assert [(m, u) for m, u, _h in session.asked] == [
        ("POST", "https://registry.example:5000/v2/img/blobs/uploads/"),
        ("PATCH", "https://registry.example:5000/v2/img/blobs/uploads/u1?state=s"),
        ("PUT", "https://registry.example:5000/v2/img/blobs/uploads/u1?state=t&digest=sha256%3Ad")]
    plain = Session(Answer(202), Answer(202), Answer(201))  # no digest answered: the one sent stands
    assert _client(plain).upload_blob(b"data", "sha256:d") == "sha256:d"
    liar = Session(Answer(202), Answer(202), Answer(201, headers={"Docker-Content-Digest": "sha256:x"}))
    got = _client(liar).upload_blob(b"data", "sha256:d")
    assert got == Fault("protocol", "upload to registry.example:5000/img: sent sha256:d, the registry stored sha256:x",
                        False)


def test_a_network_error_is_a_fault_not_an_exception() -> None:
    import requests

    down = requests.exceptions.ConnectionError("refused")
    got = _client(Session(down)).manifest("v1")
    assert got.fault is not None and got.fault.kind == "network" and not got.present
    token = _client(Session(Answer(401, headers=CHALLENGE), down)).manifest("v1")
    assert token.fault is not None and token.fault.kind == "network"
    assert "(token from https://auth.example/token)" in token.fault.message


# --- the bytes of a manifest or a blob, as served (signing reads them) ----------------------------------------
def test_a_raw_manifest_is_its_bytes_none_when_absent_and_a_fault_otherwise() -> None:
    import requests

    body = json.dumps({"mediaType": client.OCI_MANIFEST, "config": {"digest": "sha256:c"}, "layers": []}).encode()
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    session = Session(Answer(200, body, {"Docker-Content-Digest": digest}),
                      Answer(404, json.dumps({"errors": [{"code": "MANIFEST_UNKNOWN"}]}).encode()),
                      Answer(404, b"<html>Not Found</html>"),
                      Answer(200, body, {"Docker-Content-Digest": "sha256:" + "0" * 64}),
                      requests.exceptions.ConnectionError("refused"))
    c = _client(session)
    assert c.raw_manifest("v1") == body
    assert c.raw_manifest("v2") is None  # the registry's own "unknown": absent
    proxy = c.raw_manifest("v3")  # a 404 that is not the registry's: never "absent"
    assert isinstance(proxy, Fault) and (proxy.kind, proxy.transient) == ("protocol", False)
    assert proxy.message.startswith("GET registry.example:5000/img:v3 manifest: HTTP 404 without a registry ")
    lying = c.raw_manifest("v4")
    assert isinstance(lying, Fault) and lying.kind == "protocol"
    assert lying.message.startswith("GET registry.example:5000/img:v4 manifest: Docker-Content-Digest sha256:000")
    down = c.raw_manifest(digest)
    assert isinstance(down, Fault) and down.kind == "network"
    assert [url.rpartition("/manifests/")[2] for _, url, _ in session.asked] == ["v1", "v2", "v3", "v4", digest]


@pytest.mark.parametrize(("answer", "kind"), [
    (Answer(404, json.dumps({"errors": [{"code": "BLOB_UNKNOWN"}]}).encode()), "protocol"),
    (Answer(201, b"created?"), "protocol"),
    (Answer(403, json.dumps({"errors": [{"code": "DENIED"}]}).encode()), "auth"),
])
def test_a_blob_is_its_bytes_only_on_200(answer: Answer, kind: str) -> None:
    blob = "sha256:" + "b" * 64
    session = Session(Answer(200, b"blob bytes"), answer)
    c = _client(session)
    assert c.blob(blob) == b"blob bytes"
    got = c.blob(blob)
    assert isinstance(got, Fault) and (got.kind, got.transient) == (kind, False)
    assert got.message.startswith(f"GET registry.example:5000/img@{blob}: ")
    assert [(m, url) for m, url, _ in session.asked] == [
        ("GET", f"https://registry.example:5000/v2/img/blobs/{blob}")] * 2


def test_a_blob_that_cannot_be_reached_is_a_fault() -> None:
    import requests

    got = _client(Session(requests.exceptions.ConnectionError("refused"))).blob("sha256:" + "b" * 64)
    assert isinstance(got, Fault) and got.kind == "network"


def test_an_opened_blob_is_the_streamed_answer_only_on_200_and_any_other_is_closed_and_a_fault() -> None:
    import requests

    blob = "sha256:" + "b" * 64
    ok, missing = Answer(200, b"layer bytes"), Answer(404, json.dumps({"errors": [{"code": "BLOB_UNKNOWN"}]}).encode())
    session = Session(ok, missing, requests.exceptions.ConnectionError("refused"), Answer(200, b"whole"))
    c = _client(session)
    opened: object = c.open_blob(blob)
    assert opened is ok and not ok.closed  # the caller reads it, then closes it
    got = c.open_blob(blob)
    assert isinstance(got, Fault) and (got.kind, got.transient) == ("protocol", False) and missing.closed
    assert got.message.startswith(f"GET registry.example:5000/img@{blob}: HTTP 404")
    down = c.open_blob(blob)
    assert isinstance(down, Fault) and down.kind == "network"
    assert c.blob(blob) == b"whole"
    # only the opened blob is streamed (a layer of gigabytes is never held whole); the read blob is not
    assert session.streamed == [True, True, True, False]
