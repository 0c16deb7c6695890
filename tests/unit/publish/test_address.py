"""The registry address (builder/publish/address.py): what `--registry` parses to, and what it
refuses (no daemon, no registry)."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.publish import address

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


