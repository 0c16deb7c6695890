"""`build.py publish`'s verb (builder/cli/verbs/publish.py) against fakes: the password goes to the
push and the registry login only, and an unknown image store is refused in one line."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import requests

from builder.engine import capabilities
from builder.smoke import passes
from tests.support import write_matrix
from tests.unit.publish.test_address import PASSWORD
from tests.unit.publish.test_client_auth import BASIC, FakeResponse, FakeSession
from tests.unit.publish.test_faults import _digest, _err, _manifest
from tests.unit.publish.test_publisher import FLOAT_A, IMG_A, TAGS_A, A, FakeEngine, FakeRegistry


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




def test_publish_verb_signs_what_it_pushed_with_the_sboms_beside_the_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """`publish --sign-key`: signing gets the report of the push and reads the SBOMs from the report
    folder's sbom/, where they are written beside the report (the signing itself: tests/unit/publish/test_signing.py,
    against a real registry)."""
    import builder.cli.main as cli
    from builder.attest import keys
    from builder.cli.verbs import publish as verb

    registry = FakeRegistry()
    engine = RecordingEngine(registry)
    engine.add(f"pt-multi-gpu:{A}", IMG_A, A)

    def answer(url: str, params: dict[str, str], headers: dict[str, str]) -> FakeResponse:
        tag = url.rpartition("/manifests/")[2]
        if tag not in registry.tags:
            return FakeResponse(404, _err("MANIFEST_UNKNOWN"))
        body = _manifest(registry.tags[tag][1])
        return FakeResponse(200, body, {"Docker-Content-Digest": _digest(body)})

    signed: list[tuple[Path, list[str], list[str]]] = []

    class RecordingSigning:
        def __init__(self, *args: Any, sbom_dir: Path, **kwargs: Any) -> None:
            self.sbom_dir = sbom_dir

        def run(self, report: Any, cells: Any) -> None:
            signed.append((self.sbom_dir, [c.cell for c in report.cells], [c.name for c in cells]))

    monkeypatch.setattr("builder.cli.context.Engine", lambda: engine)
    monkeypatch.setattr(requests, "Session", lambda: FakeSession(answer))
    monkeypatch.setattr(verb, "Signing", RecordingSigning)
    for var in ("PTMG_REGISTRY", "PTMG_REGISTRY_USER", "PTMG_REGISTRY_PASSWORD", "PTMG_REGISTRY_PASSWORD_FILE",
                "PTMG_PUSH_ATTEMPTS", "PTMG_CONFIG", "PTMG_SIGN_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))
    monkeypatch.setenv("PTMG_STATE_DIR", str(tmp_path / "state"))
    passes.record_pass(tmp_path, IMG_A, A, passed=3, skipped=0)
    config = write_matrix(tmp_path / "matrix")
    key, _pub = keys.keygen(tmp_path / "signer")
    report_dir = tmp_path / "report"
    rc = cli.main(["publish", "--config", str(config), "--only", A, "--registry", "127.0.0.1:5000/ns",
                   "--report-dir", str(report_dir), "--allow-stale-os", "--sign-key", str(key)])
    _out, err = capfd.readouterr()
    assert rc == 0, err
    assert signed == [(report_dir / "sbom", [A], [A])]
