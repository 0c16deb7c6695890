"""The image on HPC terms, with real clients: what users type, run exactly as they type it.

- `docker run --rm IMAGE selftest` (README) passes for every default cell of images.yaml, and
  `build.py test` (the harness path) for both seed cells;
- python, pip, torchrun, jupyter and tensorboard work from every kind of shell without the
  entrypoint, as pt and as a uid with no passwd entry, with HOME unset, on a read-only root,
  where torch.compile, Triton and Jupyter find writable caches;
- `pip install` cannot replace torch: the conflict names the pin and the way out; an unrelated
  install works.

The exported squashfs and SIF, and Charliecloud running them: test_hpc_export.py (it runs last,
when the background builds are done and their leftovers gone: an export needs ~10 GB for a while).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from builder.matrix import load_matrix
from builder.matrix.model import ImageSpec

from . import cellimage, readme_selftest, sessions

ROOT = Path(__file__).resolve().parents[2]
BUILD_PY = [sys.executable, str(ROOT / "build.py")]
SEEDS = ("2.0.1-cuda11.7-cudnn8-runtime", "2.7.0-cuda12.6-cudnn9-runtime")
CELLS = [c for c in load_matrix(ROOT / "images.yaml").cells if not c.emulated]
OTHER_UID = 4242  # in no passwd file, on the host or in the image
TOOLS = ("python -c 'import torch, torchvision' && pip --version && torchrun --help >/dev/null"
         " && jupyter --version >/dev/null && tensorboard --version >/dev/null && echo TOOLS-OK")


def _docker(labels: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`docker run --rm` with this session's labels, as a user types it (plus the labels)."""
    return subprocess.run(["docker", "run", "--rm", *sessions.label_flags(labels), *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def _need(ref: str) -> None:
    cellimage.wait_for_native_cells()  # built in the background from the session's start
    if subprocess.run(["docker", "image", "inspect", ref], capture_output=True, check=False).returncode != 0:
        pytest.fail(f"{ref} is not built. Fix: make images", pytrace=False)


# --- what the README says, for every cell ---------------------------------------------------
def _readme_ref(spec: ImageSpec) -> str:
    """What the README types for a cell: `pt-multi-gpu` alone for the cell that takes `latest`."""
    return spec.repository if spec.latest else spec.ref


#: How many of the module's long runs (a cell's selftest, a seed cell's `build.py test`) go at once.
#: Each is mostly one busy core (the selftest's C++ extension build, torch's imports), and by this
#: module the background builds are done: run one after another they left the second core idle for
#: most of the module.
AT_ONCE = 2


@pytest.fixture(scope="module")
def long_runs(request: pytest.FixtureRequest, session_labels: dict[str, str], test_image: str,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """The README selftest of every cell and `build.py test` of both seed cells, exactly as typed,
    started AT_ONCE at a time when the first test of them asks (after the background build of the
    native cells ended), each only if its test was selected; each test then checks its own run's
    result. test_image: the session's own cell is built first."""
    selected = {f"{_RUN_OF[item.originalname]} {item.callspec.params['cell']}" for item in request.session.items
                if item.path == request.path and isinstance(item, pytest.Function) and item.originalname in _RUN_OF}

    def harness(cell: str, junit_dir: Path) -> Callable[[], subprocess.CompletedProcess[str]]:
        argv = [*BUILD_PY, "test", "--only", cell, "--junit-dir", str(junit_dir)]
        return lambda: subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=2400, check=False)

    cellimage.wait_for_native_cells()
    harnesses = {f"build.py test {cell}": harness(cell, tmp_path_factory.mktemp(f"junit-{cell}")) for cell in SEEDS}
    pool = ThreadPoolExecutor(max_workers=AT_ONCE, thread_name_prefix="test_hpc")
    try:
        # The README selftests go in readme_selftest.RUNS too: test_training_features reads its checks there.
        yield {name: readme_selftest.start(pool.submit, c.name, _readme_ref(c), session_labels)
               for c in CELLS if (name := f"selftest {c.name}") in selected} | \
              {name: pool.submit(run) for name, run in harnesses.items() if name in selected}
    finally:
        # A run no test waited for (its test failed first) ends here, within its own time limit, so that
        # none outlives the module: the native cells this session built are removed after the last
        # module that uses them. One not started yet never starts.
        pool.shutdown(wait=True, cancel_futures=True)


#: Each test of the long runs, and the name its run has in long_runs.
_RUN_OF = {"test_readme_selftest_passes_on_every_cell": "selftest",
           "test_build_py_test_passes_on_both_seed_cells": "build.py test"}


@pytest.mark.parametrize("cell", [c.name for c in CELLS])
def test_readme_selftest_passes_on_every_cell(cell: str, long_runs: dict[str, Future[subprocess.CompletedProcess[str]]]) -> None:
    ref = _readme_ref(next(c for c in CELLS if c.name == cell))
    _need(ref)
    r = long_runs[f"selftest {cell}"].result()
    assert r.returncode == 0, f"`docker run --rm {ref} selftest` failed:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    assert f"pt-multi-gpu selftest: {cell} in docker" in r.stdout, r.stdout[-2000:]
    assert re.search(r"PASS\s+test_cpp_extension", r.stdout), r.stdout[-3000:]


@pytest.mark.parametrize("cell", SEEDS)
def test_build_py_test_passes_on_both_seed_cells(cell: str, long_runs: dict[str, Future[subprocess.CompletedProcess[str]]]) -> None:
    """The harness path: the selftest with the image's probed labels as its expectations (so the
    version checks really compare), JUnit XML per cell, then the DDP job."""
    _need(f"pt-multi-gpu:{cell}")
    r = long_runs[f"build.py test {cell}"].result()
    assert r.returncode == 0, f"build.py test --only {cell}:\n{r.stdout[-4000:]}\n{r.stderr[-3000:]}"
    junit_arg = r.args[r.args.index("--junit-dir") + 1]
    junit = (Path(junit_arg) / f"{cell}.xml").read_text(encoding="utf-8")
    assert junit.count("<testcase") >= 20 and 'failures="0"' in junit and 'errors="0"' in junit, junit[:600]
    for check in ("test_env[torch]", "test_env[torchvision]", "test_env[python]", "test_env[cuda-arch-list]",
                  "test_cpp_extension"):
        case = re.search(rf'<testcase [^>]*name="{re.escape(check)}"[^>]*?(?:/>|>(.*?)</testcase>)', junit, re.S)
        assert case is not None and "<skipped" not in (case.group(1) or "") and "<failure" not in (case.group(1) or ""), check


# --- without the entrypoint ---------------------------------------------------------------------
SHELLS = {
    "login bash": ["bash", "-lc", TOOLS],
    "bash -c": ["bash", "-c", TOOLS],
    "login sh": ["sh", "-lc", TOOLS],
    "sh -c": ["sh", "-c", TOOLS],
}
USERS = {
    "pt": [],
    "uid without passwd entry": ["--user", f"{OTHER_UID}:{OTHER_UID}"],
    "no HOME, read-only root": ["--user", f"{OTHER_UID}:{OTHER_UID}", "--read-only", "-e", "HOME="],
}


@pytest.mark.parametrize("user", list(USERS))
def test_tools_from_every_shell_without_the_entrypoint(test_image: str, session_labels: dict[str, str],
                                                       user: str) -> None:
    """One container per user, every kind of shell in it (`docker run --entrypoint ""` each time)."""
    script = "; ".join(f"{shlex.join(argv)} | sed 's/^TOOLS-OK$/TOOLS-OK {name}/'" for name, argv in SHELLS.items())
    r = _docker(session_labels, *USERS[user], "--entrypoint", "", test_image, "sh", "-c", script, timeout=300)
    for name in SHELLS:
        assert f"TOOLS-OK {name}" in r.stdout, f"{name} as {user}:\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"


CACHES = r"""
import getpass, os, tempfile, torch
import jupyter_core.paths as jp
print("user", getpass.getuser(), "home", os.environ["HOME"], "tmp", tempfile.gettempdir())
for d in (jp.jupyter_runtime_dir(), jp.jupyter_data_dir()):
    os.makedirs(d, exist_ok=True)
f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
assert torch.allclose(f(torch.ones(8)), torch.sin(torch.ones(8)) * 2 + 1)
from torch._inductor import config as ic
print("CACHES-OK", ic.cache_dir() if hasattr(ic, "cache_dir") else "")
"""


def test_caches_are_writable_as_a_stranger_on_a_read_only_root(test_image: str,
                                                                session_labels: dict[str, str]) -> None:
    """HOME unset, a uid with no name, / read-only with a /tmp as HPC runtimes give one (writable,
    exec): torch.compile, Inductor's and Triton's caches and Jupyter's dirs find a private place."""
    r = _docker(session_labels, "--user", f"{OTHER_UID}:{OTHER_UID}", "--read-only", "--tmpfs", "/tmp:exec",
                "-e", "HOME=", "--entrypoint", "", test_image, "python", "-c", CACHES, timeout=600)
    assert r.returncode == 0 and "CACHES-OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"user uid{OTHER_UID} home /tmp/ptmg-{OTHER_UID}/home tmp /tmp" in r.stdout, r.stdout
    # No writable /tmp at all: HOME goes to /dev/shm (noexec, so no compiled kernels: Inductor says
    # so itself), where Jupyter, matplotlib and the other caches still work.
    jupyter = "import jupyter_core.paths as jp, os; os.makedirs(jp.jupyter_runtime_dir()); print(os.environ['HOME'])"
    r = _docker(session_labels, "--user", f"{OTHER_UID}:{OTHER_UID}", "--read-only", "-e", "HOME=",
                "--entrypoint", "", test_image, "python", "-c", jupyter, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == f"/dev/shm/ptmg-{OTHER_UID}/home", r.stdout + r.stderr


# --- pip cannot replace torch -----------------------------------------------------------------------
def _wheel(dest: Path, name: str, version: str) -> None:
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(dest / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def test_pip_cannot_replace_torch_and_says_how(test_image: str, session_labels: dict[str, str],
                                               tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "torch", "99.0.0")
    _wheel(wheels, "ptmgdemo", "1.0")
    tmp_path.chmod(0o755)
    mount = ["-v", f"{wheels}:/wheels:ro", "--network", "none", "--entrypoint", "", test_image]
    bad = _docker(session_labels, *mount, "pip", "install", "-q", "--no-index", "--find-links", "/wheels",
                  "torch==99.0.0")
    assert bad.returncode != 0, bad.stdout + bad.stderr
    assert "pins torch==" in bad.stderr and "PIP_CONSTRAINT= pip install" in bad.stderr, bad.stderr
    ok = _docker(session_labels, *mount, "sh", "-c",
                 "pip install -q --no-index --find-links /wheels ptmgdemo && python -c 'import ptmgdemo, torch; "
                 "print(\"PIP-OK\", torch.__version__)'")
    assert ok.returncode == 0 and "PIP-OK" in ok.stdout, ok.stdout + ok.stderr
