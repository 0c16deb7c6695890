"""The image's locked install refuses what the lock does not vouch for, tested on its behaviour, not
on the Dockerfile's text: every uv install of a rendered Dockerfile (the _uv-install.j2 macro, as
each installing RUN has it: the steps from choosing where the wheels are to uv itself), run with
bash and the same uv against a small wheel, with /ptmg-build, /run/secrets and the image's venv
mapped to temporary folders. Both ways the wheels reach a RUN:

- ``context``: no wheel-server secret, the wheel in the bind-mounted folder (20.10's builds);
- ``server``: the secret names a real builder.lock.wheelserver on 127.0.0.1 serving the wheel
  (with a dead HTTP proxy in the environment, as the Docker CLI's proxy settings would put there).

In each:
- a wheel whose sha256 is not the one its requirement line names is refused;
- a requirement line without a hash is refused (that is what --require-hashes adds: uv checks the
  hashes it is given anyway, but without the flag it installs a line that has none);
- the control: the same command installs the wheel when its hash is the locked one.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import ptmg_contract as contract
from builder.lock import wheelserver
from builder.render import dockerfile
from tests.support import MID, cell, small_matrix

UV = Path(sys.executable).parent / "uv"  # a dev dependency, the version the builds use (pyproject.toml)
NAME, VERSION = "ptmgdemo", "1.0"
WHEEL = f"{NAME}-{VERSION}-py3-none-any.whl"


def uv_commands(text: str) -> list[str]:
    """The locked install of every installing RUN of a Dockerfile: its `&&`-steps from the one that
    picks where the wheels are to the one that runs uv, continuation lines joined."""
    commands = []
    for instruction in text.replace("\\\n", " ").splitlines():
        if instruction.startswith("RUN ") and "/ptmg-build/uv pip install" in instruction:
            steps = instruction.split(" && ")
            first = next(i for i, s in enumerate(steps) if s.lstrip().startswith("wheels="))
            last = next(i for i, s in enumerate(steps) if "/ptmg-build/uv pip install" in s)
            commands.append(" && ".join(" ".join(s.split()) for s in steps[first:last + 1]))
    return commands


def make_wheel(folder: Path) -> str:
    """A minimal pure-Python wheel in `folder`; its sha256."""
    files = {f"{NAME}/__init__.py": b"X = 1\n",
             f"{NAME}-{VERSION}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n".encode(),
             f"{NAME}-{VERSION}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                  b"Tag: py3-none-any\n"}
    record = "".join(f"{k},sha256={base64.urlsafe_b64encode(hashlib.sha256(v).digest()).rstrip(b'=').decode()},"
                     f"{len(v)}\n" for k, v in files.items()) + f"{NAME}-{VERSION}.dist-info/RECORD,,\n"
    folder.mkdir(parents=True)
    with zipfile.ZipFile(folder / WHEEL, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
        z.writestr(f"{NAME}-{VERSION}.dist-info/RECORD", record)
    return hashlib.sha256((folder / WHEEL).read_bytes()).hexdigest()


class Sandbox:
    """/ptmg-build, /run/secrets and the image's venv, as temporary folders."""

    #: Where the shared trees' stages install (uv's --target) and unpack: folders of the sandbox too.
    STAGE_PATHS = ("/tmp/ptmg-uv", dockerfile.SHARED_STAGES["unpacked"], dockerfile.SHARED_STAGES["cuda_out"],
                   dockerfile.SHARED_STAGES["torch_out"])

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.build, self.venv, self.secrets = tmp / "ptmg-build", tmp / "venv", tmp / "secrets"
        self.build.mkdir(parents=True)
        self.secrets.mkdir()
        (self.build / "uv").symlink_to(UV)
        self.sha256 = make_wheel(self.build / "wheels")
        subprocess.run([str(UV), "venv", "-q", "--python", sys.executable, str(self.venv)], check=True,
                       capture_output=True, timeout=60)

    def map(self, text: str) -> str:
        for path in self.STAGE_PATHS:
            text = text.replace(path, f"{self.tmp}/stage{path}")
        return (text.replace("/ptmg-build", str(self.build)).replace("/run/secrets", str(self.secrets))
                .replace(contract.VENV, str(self.venv)))

    def install(self, command: str, requirements: str) -> subprocess.CompletedProcess[str]:
        (self.build / "requirements.txt").write_text(requirements)
        (self.venv / ".uv-tmp").mkdir(exist_ok=True)  # the RUN's step before
        (self.tmp / "stage/tmp/ptmg-uv").mkdir(parents=True, exist_ok=True)  # ... in a shared tree's stage
        # A build's RUNs get the Docker CLI's proxy settings as build args: here a proxy that answers
        # nothing, which the wheel server must not be reached through.
        dead = {k: "http://127.0.0.1:9" for k in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY")}
        return subprocess.run(["bash", "-o", "pipefail", "-c", self.map(command)], capture_output=True, text=True,
                              timeout=120, check=False, env={**os.environ, **dead})

    def installed(self) -> bool:
        return any(self.venv.glob(f"lib/python*/site-packages/{NAME}/__init__.py")) or \
            any((self.tmp / "stage").glob(f"**/{NAME}/__init__.py"))


@contextlib.contextmanager
def transport(box: Sandbox, how: str) -> Iterator[None]:
    """``server``: the wheel leaves the RUN's folder for a wheel server, whose URL is the secret."""
    if how == "context":
        yield
        return
    store = box.build / "store"
    (box.build / "wheels").rename(store)
    (box.build / "wheels").mkdir()  # the staged layer folder: empty
    with wheelserver.serve(store, {layer: [WHEEL] for layer in dockerfile.INSTALL_LAYERS}) as server:
        server.ready(WHEEL)
        (box.secrets / dockerfile.WHEEL_SERVER_ID).write_text(server.url + "\n")
        yield
        assert server.served[0] >= 1, "uv did not take the wheel from the server"


@pytest.fixture(scope="module")
def commands(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    matrix = small_matrix(tmp_path_factory.mktemp("m"), "include:\n  - {torch: \"2.7.0\"}\n"
                          "  - {torch: \"2.14.1\", flavour: devel}\n")
    found = {c for spec in matrix.cells for c in uv_commands(dockerfile.render(spec))}
    assert found, "no RUN installs with uv"
    return sorted(found)


def test_every_installing_run_is_found(tmp_path: Path) -> None:
    m = small_matrix(tmp_path)
    assert len(uv_commands(dockerfile.render(cell(m, MID)))) >= 2  # torch and the tools, at least
    assert UV.exists(), f"{UV}: uv is a dev dependency (pip install -e '.[dev]')"


@pytest.mark.parametrize("how", ["context", "server"])
def test_the_rendered_install_refuses_a_wrong_hash_and_a_line_without_one(commands: list[str], tmp_path: Path,
                                                                          how: str) -> None:
    for i, command in enumerate(commands):
        box = Sandbox(tmp_path / str(i))
        with transport(box, how):
            wrong = box.install(command, f"{NAME}=={VERSION} --hash=sha256:{'0' * 64}\n")
            assert wrong.returncode != 0 and box.sha256 in wrong.stderr, (command, wrong.stderr)
            assert not box.installed()
            unhashed = box.install(command, f"{NAME}=={VERSION}\n")
            assert unhashed.returncode != 0 and "must have a hash" in unhashed.stderr, (command, unhashed.stderr)
            assert not box.installed(), f"installed a requirement without a hash: {command}"
            locked = box.install(command, f"{NAME}=={VERSION} --hash=sha256:{box.sha256}\n")
            assert locked.returncode == 0 and box.installed(), (command, locked.stderr)

