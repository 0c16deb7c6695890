"""Liveness probes, shared by the supervisor (to log "ready") and the healthcheck.

A probe takes the service's entry from the state file and returns (ok, detail).
Standard library only, short timeouts, loopback only.
"""

from __future__ import annotations

import http.client
import socket


def _token(token_file: str | None) -> str | None:
    """The token, if the file holds one that can go into a header (printable ASCII, no
    spaces): anything else is not sent (Jupyter refuses such a token anyway)."""
    if not token_file:
        return None
    try:
        with open(token_file, "rb") as f:
            raw = f.read(4096).strip()
    except OSError:
        return None
    if not raw or any(b < 0x21 or b > 0x7E for b in raw):
        return None
    return raw.decode("ascii")


def http_alive(port: int, path: str, timeout: float,
               token_file: str | None = None) -> tuple[bool, str]:
    """Any HTTP answer below 500 counts: an unauthenticated /api/status gets 403 from
    Jupyter, which proves it is up. With the token (pt's file; the probe runs as pt) the
    answer is 200, which Jupyter does not log: the healthcheck stays out of the logs."""
    headers = {"User-Agent": "pt-multi-gpu-healthcheck"}
    token = _token(token_file)
    if token:
        headers["Authorization"] = f"token {token}"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers)
        status = conn.getresponse().status
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return False, f"GET :{port}{path}: {exc}"
    finally:
        conn.close()
    return status < 500, f"GET :{port}{path} -> {status}"


HEALTHCHECK_IDENT = b"SSH-2.0-ptmg-healthcheck\r\n"


def ssh_banner(port: int, timeout: float) -> tuple[bool, str]:
    """sshd accepts and sends its banner. Sending our own identification first makes
    sshd log a single "Connection closed by 127.0.0.1 ... [preauth]" line, which the
    supervisor filters out of sshd's output."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(HEALTHCHECK_IDENT)
            banner = sock.recv(256).split(b"\r\n", 1)[0].decode("ascii", "replace")
    except OSError as exc:
        return False, f"ssh :{port}: {exc}"
    return banner.startswith("SSH-2.0-"), f"ssh :{port} -> {banner!r}"


def probe(entry: dict[str, object], timeout: float = 2.0) -> tuple[bool, str]:
    kind = entry.get("check")
    try:
        port = int(str(entry.get("port", 0)))
    except ValueError:
        return False, f"bad port {entry.get('port')!r}"
    if kind == "http":
        token_file = entry.get("token_file")
        return http_alive(port, str(entry.get("path", "/")), timeout,
                          str(token_file) if token_file else None)
    if kind == "ssh":
        return ssh_banner(port, timeout)
    if kind == "pending":
        return False, "enabled, still starting"
    if kind == "failed":
        return False, "enabled, but it could not be started (see the container log)"
    return False, f"unknown check {kind!r}"
