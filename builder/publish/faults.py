"""Retries with backoff, and what a failed request or push means (transient or not)."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import requests


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


def registry_errors(body: bytes) -> list[tuple[str, str]]:
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
    errs = registry_errors(body)
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


