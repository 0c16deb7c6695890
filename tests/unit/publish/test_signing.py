"""`publish --sign-key` and `build.py keygen`/`verify` end to end against a REAL registry (docker-registry 2.8 on
127.0.0.1; no Docker engine: the engine's answers are a fake, the registry is not): publish's signing signs
each digest the report says it published and lists what it signed; `build.py verify` (a subprocess, as a user
runs it) accepts it with the right key and this checkout, and exits 1 with the reason otherwise."""

from __future__ import annotations

import base64
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest

import ptmg_contract as contract
from builder.attest import keys, statements
from builder.cli.main import main
from builder.cli.verbs import verify as verify_verb
from builder.imaging import repro
from builder.matrix import Matrix
from builder.publish.address import parse_registry
from builder.publish.client import RegistryClient
from builder.publish.report import PUSHED, CellReport, Report, TagResult, report_json, report_markdown
from builder.publish.signing import ClientStore, Signing
from tests.docker.registry import LocalRegistry
from tests.support import build_py, small_matrix
from tests.unit.attest.test_rebuild import BASE, BUILT_AT, EPOCH, VENV, layer, push, write_layout
from tests.unit.attest.test_verify import SNAPSHOT, push_image

SUITES = "bookworm@2026-07-11T10:16:37Z bookworm-security@2026-12-02T23:13:43Z"
INPUTS = "sha256:" + "5e" * 32  # the image's inputs-hash label


class FakeEngine:
    """The two engine answers signing asks for (pure data): each image id's labels, the base image's id."""

    def __init__(self, labels: dict[str, str], by_id: dict[str, dict[str, str]] | None = None) -> None:
        self.labels = labels
        self.by_id = by_id or {}

    def image_attrs(self, ref: str) -> dict[str, Any] | None:
        if ref.startswith("sha256:"):
            return {"Id": ref, "Config": {"Labels": self.by_id.get(ref, self.labels)}}
        return {"Id": "sha256:" + "42" * 32}  # the base image

    def version(self) -> dict[str, Any]:
        return {"Version": "20.10.24+dfsg1", "ApiVersion": "1.41"}


class Published:
    def __init__(self, tmp: Path, registry: LocalRegistry) -> None:
        self.root = tmp
        self.matrix: Matrix = small_matrix(tmp)
        self.spec = self.matrix.cells[0]
        lock = tmp / "locks" / self.spec.name / "pylock.toml"
        lock.parent.mkdir(parents=True)
        lock.write_text('lock-version = "1.0"\n')
        self.client = RegistryClient(parse_registry(f"{registry.host}/ns"), self.matrix.repository, None)
        self.store = ClientStore(self.client)
        self.digest = push_image(self.store, self.spec.tag, cell=self.spec.name)
        self.ref = f"{registry.host}/ns/{self.matrix.repository}"
        (tmp / "sbom").mkdir()
        (tmp / "sbom" / f"{self.spec.name}.cdx.json").write_text(json.dumps({"bomFormat": "CycloneDX"}))
        priv, self.pub = keys.keygen(tmp / "signing")
        self.key_path = priv
        self.key = keys.load_private(priv)
        self.engine = FakeEngine({contract.LABEL_CELL: self.spec.name, contract.LABEL_OS_SNAPSHOT: SNAPSHOT,
                                  contract.LABEL_OS_SUITES: SUITES, contract.OCI_REVISION: "c9a65d3-dirty",
                                  contract.LABEL_BUILDER: "buildkit", contract.LABEL_INPUTS_HASH: INPUTS})

    def engine_for(self, cells: dict[str, str]) -> FakeEngine:
        """An engine whose image ``sha256:11…`` is the first cell's, ``sha256:33…`` the second's."""
        names = list(cells)
        return FakeEngine(self.engine.labels, {"sha256:" + "33" * 32: {**self.engine.labels,
                                                                       contract.LABEL_CELL: names[1]}})

    def report(self) -> Report:
        tag = TagResult(self.spec.tag, f"{self.ref}:{self.spec.tag}", "immutable", PUSHED, digest=self.digest)
        cell = CellReport(self.spec.name, self.spec.ref, "sha256:" + "11" * 32, smoke={"status": "passed"}, tags=[tag])
        return Report(str(self.client.registry), self.ref, "2026-12-05T06:00:00Z", cells=[cell], ok=True)

    def sign(self, repro_dir: Path | None = None) -> Report:
        report = self.report()
        Signing(self.key, self.client, self.engine, self.matrix, self.root, audited={}, sbom_dir=self.root / "sbom",
                allow_stale_os=False, repro_dir=repro_dir).run(report, [self.spec])
        return report

    def verify(self, *extra: str, key: Path | None = None) -> Any:
        return build_py("verify", f"{self.ref}:{self.spec.tag}", "--key", str(key or self.pub),
                        "--config", str(self.root / "images.yaml"), *extra, timeout=120)


def test_publish_signs_each_digest_and_the_report_lists_what_it_signed(tmp_path: Path, registry: LocalRegistry) -> None:
    w = Published(tmp_path, registry)
    report = w.sign()
    [signed] = report.signed
    assert signed["digest"] == w.digest and signed["cells"] == [w.spec.name]
    assert (signed["att_status"], signed["sig_status"]) == ("signed", "signed")
    assert signed["predicate_types"] == [statements.SLSA_PROVENANCE_V1, statements.CYCLONEDX, statements.GATES_V1]
    assert signed["attestations"] == "sha256-" + w.digest[7:] + ".att" and signed["seconds"] < 5
    assert report.ok and report.signing_key == keys.key_id(w.key.public_key())
    md, js = report_markdown(report), report_json(report)
    assert "## Signed" in md and f"| `{w.digest}` | {w.spec.name} | signed | signed |" in md
    secret = w.key_path.read_text().splitlines()[1]
    assert secret not in md and secret not in js  # the key never reaches the report
    again = w.sign().signed[0]
    assert (again["att_status"], again["sig_status"]) == ("unchanged", "unchanged")

    ok = w.verify()
    assert ok.returncode == 0, ok.stderr
    assert f"{w.digest} ({w.spec.name}): verified" in ok.stdout and "OK, 1 digest(s)" in ok.stdout

    _, other = keys.keygen(tmp_path / "other")
    wrong = w.verify(key=other)
    assert wrong.returncode == 1 and "no signature in sha256-" in wrong.stderr and "verifies with this key" in wrong.stderr

    (tmp_path / "locks" / w.spec.name / "pylock.toml").write_text('lock-version = "1.0"\n# changed\n')
    moved = w.verify()
    assert moved.returncode == 1 and f"locks/{w.spec.name}/pylock.toml has sha256" in moved.stderr


def test_the_provenance_records_the_inputs(tmp_path: Path, registry: LocalRegistry) -> None:
    w = Published(tmp_path, registry)
    w.sign()
    from builder.attest.verify import open_attestations

    got = dict(open_attestations(w.store, w.key.public_key(), w.digest))
    prov = got[statements.SLSA_PROVENANCE_V1]["predicate"]
    [cell] = prov["buildDefinition"]["externalParameters"]["cells"]
    assert cell["cell"] == w.spec.name and cell["osSnapshot"] == SNAPSHOT and cell["sourceDateEpoch"] == 1796253223  # date -d 2026-12-02T23:13:43Z +%s
    assert cell["revision"] == "c9a65d3" and cell["treeClean"] is False
    assert cell["imagesYamlCell"] == statements.cell_entry(w.spec)
    engine = prov["buildDefinition"]["internalParameters"]["images"][w.spec.name]["engine"]
    assert engine == {"engine": "Docker Engine 20.10.24+dfsg1", "api": "1.41", "builder": "buildkit"}
    assert {"uri": w.spec.base, "digest": {"sha256": "42" * 32}, "annotations": {"what": "base image id"}} in \
        prov["buildDefinition"]["resolvedDependencies"]
    assert got[statements.CYCLONEDX]["predicate"] == {"bomFormat": "CycloneDX"}
    assert got[statements.GATES_V1]["predicate"]["cells"][0]["smoke"] == {"status": "passed"}


def test_keygen_and_a_refused_sign_key_on_the_command_line(tmp_path: Path) -> None:
    made = build_py("keygen", str(tmp_path / "k"), timeout=60)
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE((tmp_path / "k.key").stat().st_mode) == 0o600 and (tmp_path / "k.pub").is_file()
    secret = (tmp_path / "k.key").read_text().splitlines()[1]
    assert secret not in made.stdout + made.stderr
    enc = tmp_path / "cosign.key"
    body = base64.b64encode(os.urandom(90)).decode()
    enc.write_text(f"-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----\n{body}\n-----END ENCRYPTED SIGSTORE PRIVATE KEY-----\n")
    for how in (["--sign-key", str(enc)], []):
        r = build_py("publish", "--registry", "127.0.0.1:9", *how, timeout=60,
                     env={"PTMG_SIGN_KEY_FILE": str(enc)} if not how else None)
        assert r.returncode == 2, r.stderr
        assert "ENCRYPTED SIGSTORE PRIVATE KEY) is not supported" in r.stderr and body[:20] not in r.stderr


def test_an_index_is_signed_with_its_platforms_and_verify_checks_all_three(tmp_path: Path,
                                                                           registry: LocalRegistry) -> None:
    """A tag of two platform images (one OCI index): three digests signed, the index's statements naming both
    cells; `build.py verify` on the tag checks the index and each platform's image."""
    w = Published(tmp_path, registry)
    second = w.matrix.cells[1]
    lock = tmp_path / "locks" / second.name / "pylock.toml"
    lock.parent.mkdir(parents=True)
    lock.write_text('lock-version = "1.0"\n# the second platform\n')
    other = push_image(w.store, "other-platform", cell=second.name)
    entries = []
    for digest, arch in ((w.digest, "amd64"), (other, "arm64")):
        body = w.store.get_manifest(digest)
        assert body is not None
        entries.append({"mediaType": "application/vnd.docker.distribution.manifest.v2+json", "size": len(body),
                        "digest": digest, "platform": {"os": "linux", "architecture": arch}})
    index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                        "manifests": entries}).encode()
    index_digest = w.store.put_manifest("both", "application/vnd.oci.image.index.v1+json", index)
    report = w.report()
    report.cells[0].tags.append(TagResult("both", f"{w.ref}:both", "floating", PUSHED, digest=index_digest))
    report.cells.append(CellReport(second.name, second.ref, "sha256:" + "33" * 32, smoke={"status": "passed"},
                                   tags=[TagResult("other-platform", f"{w.ref}:other-platform", "immutable", PUSHED,
                                                   digest=other)]))
    Signing(w.key, w.client, w.engine_for({w.spec.name: w.digest, second.name: other}), w.matrix, tmp_path,
            audited={}, sbom_dir=tmp_path / "sbom", allow_stale_os=False).run(report, w.matrix.cells[:2])
    signed = {s["digest"]: s for s in report.signed}
    assert set(signed) == {w.digest, other, index_digest}
    assert signed[index_digest]["cells"] == [w.spec.name, second.name] and signed[other]["cells"] == [second.name]
    ok = build_py("verify", f"{w.ref}:both", "--key", str(w.pub), "--config", str(tmp_path / "images.yaml"),
                  timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert f"{index_digest} ({w.spec.name}, {second.name}): verified" in ok.stdout and "OK, 3 digest(s)" in ok.stdout


def test_verify_rebuild_checks_the_signatures_before_any_build(tmp_path: Path, registry: LocalRegistry) -> None:
    """`build.py verify REF --key PUB --rebuild` exactly as typed: the wrong key is refused (exit 1) before the
    engine is asked for anything; the right key verifies, and only then is the engine needed (none answers in the
    unit tier: the comparison itself is tests/unit/attest/test_rebuild.py)."""
    w = Published(tmp_path, registry)
    w.sign()
    _, other = keys.keygen(tmp_path / "other")
    wrong = w.verify("--rebuild", key=other)
    assert wrong.returncode == 1 and "verifies with this key" in wrong.stderr, wrong.stderr
    assert "Docker engine" not in wrong.stderr and wrong.stdout == "", wrong.stdout + wrong.stderr
    ok = w.verify("--rebuild")
    assert f"{w.digest} ({w.spec.name}): verified" in ok.stdout and "OK, 1 digest(s)" in ok.stdout, ok.stdout
    assert ok.returncode == 1 and "no Docker engine answers" in ok.stderr, ok.stderr


def _repro_report(folder: Path, cell: str, image: Any, inputs: str = INPUTS, same: bool = True) -> None:
    """`build.py repro CELL`'s report, as its verb writes it, for the OCI layout ``image``."""
    build = {"manifest": image.manifest_digest, "config": image.config_digest, "seconds": 300.0}
    repro.write_report(folder, cell, {"cell": cell, "same": same, "against": None, "source_date_epoch": EPOCH,
                                      "os_snapshot": SNAPSHOT, "inputs": inputs, "differs": [], "builds": [build] * 2})


def test_verify_rebuild_compares_the_rebuilds_digest_with_the_one_repro_proved_and_publish_signed(
        tmp_path: Path, registry: LocalRegistry, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """publish's signing finds `build.py repro`'s report for the pushed image's inputs and signs its digest (the
    report lists it); a report for other inputs, or of builds that differed, is not signed. Then `build.py verify
    REF --key PUB --rebuild` exactly as typed (in process: only the engine's build is replaced, by one that writes
    a real OCI layout): exit 0 when the rebuild has the signed digest and every file matches the published image,
    exit 1 naming both digests when it has another."""
    w = Published(tmp_path, registry)
    w.digest = push(w.store, w.spec.tag, [layer(f, BUILT_AT) for f in (BASE, VENV)],
                    labels={contract.LABEL_CELL: w.spec.name, contract.LABEL_OS_SNAPSHOT: SNAPSHOT})
    proven = write_layout(tmp_path / "what-repro-built", [layer(f, EPOCH) for f in (BASE, VENV)])
    logs = tmp_path / "build-logs"
    logs.mkdir()
    for stale in ({"inputs": "sha256:" + "77" * 32}, {"same": False}):
        _repro_report(logs, w.spec.name, proven, **stale)
        assert w.sign(repro_dir=logs).signed[0]["reproducible"] == {}
    _repro_report(logs, w.spec.name, proven)
    report = w.sign(repro_dir=logs)
    assert report.signed[0]["reproducible"] == {w.spec.name: proven.manifest_digest}
    assert report.signed[0]["att_status"] == "signed"  # the provenance changed: signed again
    assert report_markdown(report).count(f"| `{proven.manifest_digest}` |") == 1

    files, compress = [BASE, VENV], True

    def rebuilder(ctx: Any) -> Any:
        def build(spec: Any, dest: Path) -> str:
            write_layout(dest, [layer(f, EPOCH, compress) for f in files])
            return SNAPSHOT
        return build

    monkeypatch.setattr(verify_verb, "engine_rebuilder", rebuilder)
    argv = ["verify", f"{w.ref}:{w.spec.tag}", "--key", str(w.pub), "--rebuild", "--config",
            str(tmp_path / "images.yaml"), "--log-dir", str(logs)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"provenance signs {proven.manifest_digest} as the reproducible digest of {w.spec.name}" in out, out
    assert f"{w.spec.name}: the rebuild's manifest digest {proven.manifest_digest} is the reproducible digest the " \
           "provenance signs: bit-identical" in out, out
    compress = False  # the same files, other blobs: the digest alone tells them apart
    with caplog.at_level(logging.ERROR):
        assert main(argv) == 1
    assert "differs from the published image" not in caplog.text and "the rebuild matches the published image" in \
        capsys.readouterr().out
    other = write_layout(tmp_path / "uncompressed", [layer(f, EPOCH, compress=False) for f in files]).manifest_digest
    assert f"the rebuild's manifest digest {other} is not the reproducible digest the provenance signs " \
           f"({proven.manifest_digest})" in caplog.text
    caplog.clear()
    compress, files = True, [BASE, {**VENV, "opt/venv/torch.py": (b"import maths\n", 0o644, 1000)}]
    with caplog.at_level(logging.ERROR):
        assert main(argv) == 1
    assert "/opt/venv/torch.py: size, content differ" in caplog.text
