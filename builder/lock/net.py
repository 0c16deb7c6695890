"""HTTP for the lock stage with the host's settings: index (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL),
proxies (HTTPS_PROXY, HTTP_PROXY, NO_PROXY) and CA bundle, the same ones a build carries as its
secrets (builder/imaging/buildenv.py). Index credentials (``https://user:token@mirror/simple``) go
only into an Authorization header for that index's host: never into argv, a log, a message or a
lock (:func:`redact`).
"""

from __future__ import annotations

import base64
import html.parser
import http.client
import json
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

from packaging.utils import canonicalize_name

SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"

# HTTP answers that say "not now" rather than "no": an overloaded index, a proxy between restarts.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class CutShort(ConnectionError):
    """The server closed the connection before sending the body its Content-Length promised
    (http.client returns the short body from read(n) without a word)."""


def check_whole(r: http.client.HTTPResponse, got: int) -> None:
    """CutShort when fewer than the response's Content-Length bytes came: a transfer cut short,
    never to be mistaken for a file that differs from the lock's."""
    promised = r.headers.get("Content-Length", "")
    if promised.isdigit() and got < int(promised):
        raise CutShort(f"the connection closed after {got} of {promised} bytes")


def transient(exc: BaseException) -> bool:
    """A failure worth trying again: the network or the server hiccuped (a DNS lookup that timed
    out, a reset or cut-short connection, a timeout, a 5xx/429). A 404, a refused connection, a
    name that does not exist, a TLS error or a wrong hash are answers: trying again changes nothing."""
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code in TRANSIENT_STATUS
    if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException):
        exc = exc.reason
    if isinstance(exc, socket.gaierror):
        return exc.errno == socket.EAI_AGAIN  # "Temporary failure in name resolution"
    return isinstance(exc, (TimeoutError, ConnectionResetError, ConnectionAbortedError, BrokenPipeError, CutShort,
                            http.client.IncompleteRead))


@dataclass(frozen=True)
class NetConfig:
    """What the host's network needs: the carried environment and a PEM bundle (b"": system trust)."""

    env: Mapping[str, str] = field(default_factory=dict)
    ca_pem: bytes = b""

    def indexes(self) -> list[str]:
        """Indexes to look files up on, first to last (none: the lock's own URLs only)."""
        out = [self.env.get("PIP_INDEX_URL", ""), *self.env.get("PIP_EXTRA_INDEX_URL", "").split()]
        return [u.rstrip("/") + "/" for u in out if u]


def redact(url: str) -> str:
    """The URL without user:password@."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _no_proxy(host: str, no_proxy: str) -> bool:
    for item in (x.strip().lower() for x in no_proxy.split(",")):
        if item == "*" or (item and (host == item.lstrip(".") or host.endswith("." + item.lstrip(".")))):
            return True
    return False


class Http:
    def __init__(self, cfg: NetConfig, timeout: float = 120) -> None:
        self.cfg = cfg
        self.timeout = timeout
        self.ctx = ssl.create_default_context(cadata=cfg.ca_pem.decode("ascii", "replace")) if cfg.ca_pem \
            else ssl.create_default_context()
        self.auth: dict[str, str] = {}  # host -> Authorization header (from an index URL's userinfo)
        for index in cfg.indexes():
            parts = urlsplit(index)
            if parts.username is not None:
                token = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
                self.auth[parts.hostname or ""] = "Basic " + base64.b64encode(token).decode()

    def _opener(self, url: str) -> urllib.request.OpenerDirector:
        host = (urlsplit(url).hostname or "").lower()
        env = self.cfg.env
        proxies = {} if _no_proxy(host, env.get("NO_PROXY", "")) else {
            k: v for k, v in (("https", env.get("HTTPS_PROXY", "")), ("http", env.get("HTTP_PROXY", ""))) if v}
        return urllib.request.build_opener(urllib.request.ProxyHandler(proxies),
                                           urllib.request.HTTPSHandler(context=self.ctx))

    @contextmanager
    def open(self, url: str, accept: str = "*/*") -> Iterator[http.client.HTTPResponse]:
        clean = redact(url)
        if urlsplit(clean).scheme not in ("https", "http"):
            raise OSError(f"{clean}: only http(s) URLs are fetched")
        req = urllib.request.Request(clean, headers={"Accept": accept, "User-Agent": "pt-multi-gpu"})  # noqa: S310
        auth = self.auth.get((urlsplit(clean).hostname or "").lower())
        if auth:
            req.add_unredirected_header("Authorization", auth)
        with self._opener(clean).open(req, timeout=self.timeout) as r:  # http(s) only: checked above
            yield cast(http.client.HTTPResponse, r)

    def json(self, url: str, body: bytes | None = None) -> Any:
        """GET (or POST ``body`` as JSON to) an http(s) URL; the parsed JSON answer. OSError on failure."""
        clean = redact(url)
        if urlsplit(clean).scheme not in ("https", "http"):
            raise OSError(f"{clean}: only http(s) URLs are fetched")
        if body is None:
            with self.open(clean, "application/json") as r:
                return json.loads(r.read())
        req = urllib.request.Request(clean, data=body, headers={  # noqa: S310 - http(s) only: checked above
            "Content-Type": "application/json", "Accept": "application/json", "User-Agent": "pt-multi-gpu"})
        with self._opener(clean).open(req, timeout=self.timeout) as r:
            return json.loads(r.read())

    def find_file(self, index: str, project: str, filename: str) -> str | None:
        """The URL of ``filename`` on a PEP 503/691 index (None when the index does not list it)."""
        page = urljoin(index, canonicalize_name(project) + "/")
        with self.open(page, f"{SIMPLE_JSON}, text/html;q=0.1") as r:
            body = r.read()
            kind = r.headers.get("Content-Type", "")
            base = r.geturl()
        if SIMPLE_JSON in kind:
            for f in json.loads(body).get("files", []):
                if f.get("filename") == filename:
                    return str(urljoin(base, str(f["url"])).split("#", 1)[0])
            return None
        links = _Links()
        links.feed(body.decode("utf-8", "replace"))
        for href in links.hrefs:
            url = urljoin(base, href).split("#", 1)[0]
            if unquote(url.rsplit("/", 1)[-1]) == filename:
                return str(url)
        return None


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.hrefs.append(href)
