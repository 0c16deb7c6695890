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
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import ptmg_contract as contract
from builder.lock import wheelserver
from builder.render import dockerfile
from tests.support import MID, ROOT, cell, small_matrix

UV = Path(sys.executable).parent / "uv"  # a dev dependency, the version the builds use (pyproject.toml)
NAME, VERSION = "ptmgdemo", "1.0"
WHEEL = f"{NAME}-{VERSION}-py3-none-any.whl"


def uv_commands(text: str) -> list[str]:
    """The locked install of every installing RUN of a Dockerfile: its `&&`-steps from the one that
    picks where the wheels are to the last one that runs uv (the function `ptmg_uv` that the RUN
    defines, called once, or twice where the first try is the torch stage's cache), continuation
    lines joined."""
    commands = []
    for instruction in text.replace("\\\n", " ").splitlines():
        if instruction.startswith("RUN ") and "/ptmg-build/uv pip install" in instruction:
            steps = instruction.split(" && ")
            first = next(i for i, s in enumerate(steps) if s.lstrip().startswith("wheels="))
            last = max(i for i, s in enumerate(steps) if "ptmg_uv" in s)
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
                   dockerfile.SHARED_STAGES["torch_out"], dockerfile.SHARED_STAGES["uv_cache"])

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.build, self.venv, self.secrets = tmp / "ptmg-build", tmp / "venv", tmp / "secrets"
        self.build.mkdir(parents=True)
        self.secrets.mkdir()
        (self.build / "uv").symlink_to(UV)
        (self.build / "shared-tree.sh").symlink_to(ROOT / "imagebuild" / "shared-tree.sh")
        (self.build / "uv-cache").mkdir()  # the torch RUN's mount of the stage's uv cache (here: empty)
        (tmp / "torch-files").mkdir()  # the image's shared tree of torch's files (here: empty)
        self.sha256 = make_wheel(self.build / "wheels")
        subprocess.run([str(UV), "venv", "-q", "--python", sys.executable, str(self.venv)], check=True,
                       capture_output=True, timeout=60)

    def map(self, text: str) -> str:
        for path in self.STAGE_PATHS:
            text = text.replace(path, f"{self.tmp}/stage{path}")
        return (text.replace("/ptmg-build", str(self.build)).replace("/run/secrets", str(self.secrets))
                .replace(contract.VENV, str(self.venv)).replace(contract.TORCH_FILES, str(self.tmp / "torch-files")))

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
    if not store.exists():  # (a second server, for a later build, serves the same store)
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


def torch_set_commands(commands: list[str]) -> tuple[str, str]:
    """The torch files' stage's install (it fills the stage's uv cache) and the venv's torch install
    (it installs from that cache), as rendered."""
    fill = [c for c in commands if f"UV_CACHE_DIR={dockerfile.SHARED_STAGES['uv_cache']} " in c]
    use = [c for c in commands if f"UV_CACHE_DIR={dockerfile.SHARED_STAGES['uv_cache_mount']} " in c]
    assert len(fill) == 1 and len(use) == 1, commands
    return fill[0], use[0]


def fill_the_stage_cache(box: Sandbox, fill: str) -> None:
    """Run the stage's install with the locked hash, then hand its cache to the venv's RUN the way the
    bind mount does (the same folder at /ptmg-build/uv-cache)."""
    stage = box.install(fill, f"{NAME}=={VERSION} --hash=sha256:{box.sha256}\n")
    assert stage.returncode == 0, stage.stderr
    cache = Path(box.map(dockerfile.SHARED_STAGES["uv_cache"]))
    assert any(cache.rglob(f"{NAME}/__init__.py")), "the stage's install left nothing in its uv cache"
    (box.build / "uv-cache").rmdir()
    (box.build / "uv-cache").symlink_to(cache)
    shutil.rmtree(Path(box.map(dockerfile.SHARED_STAGES["unpacked"])))  # the stage's own copy goes


@pytest.mark.parametrize("how", ["context", "server"])
def test_the_venvs_torch_install_takes_the_stages_unpacked_set_and_still_checks_its_hash(
        commands: list[str], tmp_path: Path, how: str) -> None:
    fill, use = torch_set_commands(commands)
    box = Sandbox(tmp_path)
    with transport(box, how):
        fill_the_stage_cache(box, fill)
    # uv still compares the locked hash with the one it recorded when the stage fetched the wheel.
    wrong = box.install(use, f"{NAME}=={VERSION} --hash=sha256:{'0' * 64}\n")
    assert wrong.returncode != 0 and box.sha256 in wrong.stderr, wrong.stderr
    assert not any(box.venv.glob(f"lib/python*/site-packages/{NAME}")), "installed from the cache against the lock"
    locked = box.install(use, f"{NAME}=={VERSION} --hash=sha256:{box.sha256}\n")
    assert locked.returncode == 0, locked.stderr
    assert "fetching it again" not in locked.stderr, locked.stderr
    # Nothing was fetched or unpacked again: uv says "Prepared" for each wheel it downloads or unzips.
    assert "Prepared" not in locked.stderr, locked.stderr
    assert any(box.venv.glob(f"lib/python*/site-packages/{NAME}/__init__.py"))


def test_a_stage_cached_by_another_wheel_server_falls_back_to_fetching(commands: list[str], tmp_path: Path) -> None:
    """uv keys its cache by the wheel's URL; the server's port is not part of the layer cache's key (a
    secret), so a stage cached by an earlier build can hold the set under another address."""
    fill, use = torch_set_commands(commands)
    box = Sandbox(tmp_path)
    with transport(box, "server"):
        fill_the_stage_cache(box, fill)
    with transport(box, "server"):  # a second server, at another port, as the next build has
        locked = box.install(use, f"{NAME}=={VERSION} --hash=sha256:{box.sha256}\n")
    assert locked.returncode == 0, locked.stderr
    assert "fetching it again" in locked.stderr, locked.stderr
    assert any(box.venv.glob(f"lib/python*/site-packages/{NAME}/__init__.py"))
