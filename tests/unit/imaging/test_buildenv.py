"""The build's environment from the host (builder/imaging/buildenv.py): CA certificates and proxy
and index settings detected, a bad --ca-cert refused, the env script's quoting, the CA bundle
deduplicated, and the secret files private and removed."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.imaging import buildenv

PEM = b"-----BEGIN CERTIFICATE-----\nTUFSS0VS\n-----END CERTIFICATE-----\n"

def test_detect_ca_and_env(tmp_path: Path) -> None:
    d = tmp_path / "cas"
    d.mkdir()
    (d / "corp.crt").write_bytes(PEM)
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(PEM)
    env = buildenv.detect({"SSL_CERT_FILE": str(bundle), "PIP_INDEX_URL": "https://u:p@mirror/simple",
                           "https_proxy": "http://proxy:3128", "UNRELATED": "x"}, ca_dirs=[d])
    assert env.ca_files == (d / "corp.crt", bundle)
    assert dict(env.env) == {"PIP_INDEX_URL": "https://u:p@mirror/simple", "HTTPS_PROXY": "http://proxy:3128"}
    assert all("u:p" not in line for line in env.describe())


def test_ca_cert_flag_validated(tmp_path: Path) -> None:
    with pytest.raises(buildenv.BuildEnvError, match="no such file"):
        buildenv.detect({}, [tmp_path / "missing.pem"], ca_dirs=[])
    bad = tmp_path / "bad.pem"
    bad.write_text("hello")
    with pytest.raises(buildenv.BuildEnvError, match="no PEM certificate"):
        buildenv.detect({}, [bad], ca_dirs=[])


def test_env_script_quotes_values() -> None:
    env = buildenv.BuildEnv((), (("PIP_INDEX_URL", "https://u:p'x@h/simple"), ("HTTPS_PROXY", "http://p:1")))
    script = buildenv.env_script(env)
    assert "export PIP_INDEX_URL='https://u:p'\"'\"'x@h/simple'" in script
    assert "export https_proxy=http://p:1" in script
    assert "PIP_CERT" not in script


def test_bundle_dedupes(tmp_path: Path) -> None:
    a = tmp_path / "a.pem"
    a.write_bytes(PEM + PEM)
    env = buildenv.BuildEnv((a,), ())
    assert buildenv.bundle(env, [a]).count(b"BEGIN CERTIFICATE") == 1


def test_secret_files_are_private_and_removed() -> None:
    env = buildenv.BuildEnv((), (("PIP_TRUSTED_HOST", "h"),))
    with buildenv.secret_files(env) as files:
        assert set(files) == {"build-env"}
        assert oct(files["build-env"].stat().st_mode & 0o777) == "0o600"
        kept = files["build-env"]
    assert not kept.exists()


