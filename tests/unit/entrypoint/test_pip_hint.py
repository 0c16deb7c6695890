"""The venv's `pip` wrapper (entrypoint/pip-hint), its pure parts: which pins the constraint files
hold, when a failed install's output calls for the hint and which pins it names, and the output
kept for that search. tests/unit/project/test_hpc_env.py runs the wrapper with a real pip."""

from __future__ import annotations

import os
import threading
import types
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _load(name: str, path: Path) -> types.ModuleType:
    module = types.ModuleType(name)
    SourceFileLoader(name, str(path)).exec_module(module)
    return module


pip_hint = _load("pip_hint", ROOT / "entrypoint" / "pip-hint")
CONFLICT = "ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/...\n"


@pytest.fixture
def constraint(tmp_path: Path) -> str:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("# head\ntorch==2.7.0\n  Nvidia-NCCL-cu12 == 2.26.2  \nnumpy<2\ntriton>=3\n-e ./local\n")
    b.write_text("torchvision==0.22.0\n")
    return f"{a} {tmp_path / 'missing.txt'} {b}"


def test_pins_reads_every_file_of_the_list_and_only_exact_pins(constraint: str) -> None:
    assert pip_hint.pins(constraint) == {"torch": "torch==2.7.0", "nvidia-nccl-cu12": "Nvidia-NCCL-cu12==2.26.2",
                                         "torchvision": "torchvision==0.22.0"}
    assert pip_hint.pins("") == {}


@pytest.mark.parametrize("trigger", [
    CONFLICT,
    "The conflict is caused by:\n    The user requested torch==2.5.0\n    torch 2.7.0 (constraint)\n",
    "ERROR: Cannot install torch==2.5.0 because these package versions have conflicting dependencies.\n",
])
def test_each_kind_of_conflict_names_the_pin_in_the_way(trigger: str, constraint: str) -> None:
    text = pip_hint.hint(trigger + "torch==2.5.0\n", ["install", "torch==2.5.0"], constraint)
    assert text == (f"pt-multi-gpu: this image pins torch==2.7.0 in {constraint} (PIP_CONSTRAINT), so that no "
                    "install replaces its CUDA build.\n"
                    "pt-multi-gpu: to install anyway, for this one command: PIP_CONSTRAINT= pip install torch==2.5.0")


def test_every_pin_named_is_listed_sorted_and_matched_whole_and_in_any_case(constraint: str) -> None:
    text = pip_hint.hint(CONFLICT + "TorchVision 0.23 needs nvidia-nccl-cu12>=2.27 and torch>=2.8\n", [], constraint)
    assert text is not None
    assert "pins Nvidia-NCCL-cu12==2.26.2, torch==2.7.0, torchvision==0.22.0 in " in text
    assert text.endswith("PIP_CONSTRAINT= pip install ...")  # no arguments: a placeholder
    # a longer name that starts or ends with a pinned one is another distribution
    for other in ("torchx", "xtorch", "pytorch-lightning", "torch_tb_profiler", "nvidia-nccl-cu12x", "my.torch"):
        assert pip_hint.hint(CONFLICT + f"{other}==1.0\n", ["install", other], constraint) is None, other


def test_no_hint_without_a_conflict_or_without_a_pin_in_it(constraint: str) -> None:
    assert pip_hint.hint("ERROR: No matching distribution found for torch==9\n", ["install"], constraint) is None
    assert pip_hint.hint(CONFLICT + "foo 1 needs bar 2\n", ["install", "foo"], constraint) is None
    assert pip_hint.hint(CONFLICT + "torch==2.5.0\n", ["install", "torch"], "") is None  # no pins at all


def test_the_output_kept_for_the_search_is_its_last_256_kib() -> None:
    """pip's output passes through whole; only its tail is kept to search."""
    assert pip_hint.KEEP == 256 * 1024
    read_fd, write_fd = os.pipe()
    sink_r, sink_w = os.pipe()
    data = b"x" * (pip_hint.KEEP + 1000) + b"ResolutionImpossible torch\n"
    seen = bytearray()

    def drain() -> None:
        while chunk := os.read(sink_r, 65536):
            seen.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    keep, lock = bytearray(), threading.Lock()
    pump = threading.Thread(target=pip_hint.pump, args=(read_fd, sink_w, keep, lock))
    pump.start()
    os.write(write_fd, data[:100000])
    os.write(write_fd, data[100000:])
    os.close(write_fd)
    pump.join(timeout=30)
    os.close(sink_w)
    reader.join(timeout=30)
    os.close(read_fd)
    os.close(sink_r)
    assert bytes(seen) == data  # everything passed on, in order
    assert bytes(keep) == data[-pip_hint.KEEP:]


class _Pip:
    """pip as main() starts it: its output on two pipes, then its exit code (a Ctrl-C first, if asked)."""

    def __init__(self, code: int, interrupted: bool) -> None:
        self.code, self.interrupted = code, interrupted
        self.argv: list[str] = []

    def __call__(self, argv: list[str], **kwargs: object) -> _Pip:
        self.argv = argv
        pipes = []
        for text in (b"Collecting torch==2.5.0\n", b"ERROR: ResolutionImpossible: torch==2.5.0 (constraint)\n"):
            r, w = os.pipe()
            os.write(w, text)
            os.close(w)
            pipes.append(os.fdopen(r, "rb"))
        self.stdout, self.stderr = pipes
        return self

    def wait(self) -> int:
        if self.interrupted:
            self.interrupted = False
            raise KeyboardInterrupt  # the terminal's Ctrl-C reaches pip too: wait for its own exit
        return self.code


@pytest.mark.parametrize("interrupted", [False, True])
def test_main_passes_pips_output_and_code_and_hints_only_on_failure(
        constraint: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], interrupted: bool) -> None:
    monkeypatch.setenv("PIP_CONSTRAINT", constraint)
    for code in (1, 0):
        pip = _Pip(code, interrupted)
        monkeypatch.setattr(pip_hint.subprocess, "Popen", pip)
        try:
            assert pip_hint.main(["install", "torch==2.5.0"]) == code
        except KeyboardInterrupt:
            pytest.fail("a Ctrl-C while pip runs escaped the wrapper", pytrace=False)
        assert pip.argv[1:] == ["-m", "pip", "install", "torch==2.5.0"]
        out, err = capfd.readouterr()
        assert out == "Collecting torch==2.5.0\n"
        assert err.startswith("ERROR: ResolutionImpossible: torch==2.5.0 (constraint)\n")
        hinted = "pt-multi-gpu: this image pins torch==2.7.0" in err
        assert hinted == (code != 0), (code, err)


def test_the_wrapper_as_a_command_hands_pip_exactly_its_arguments(tmp_path: Path) -> None:
    """Run as `pip ...` is run: every argument after the program's own name reaches pip, none more."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}
    p = subprocess.run([sys.executable, str(ROOT / "entrypoint" / "pip-hint"), "--version"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0 and p.stdout.startswith("pip "), (p.returncode, p.stdout[:300], p.stderr[-300:])


def test_main_returns_only_after_all_of_pips_output_is_passed_on(
        constraint: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """The pumps are waited for: a pump that starts late still passes every byte on before main returns."""

    class LateThread(threading.Thread):
        def run(self) -> None:
            threading.Event().wait(0.3)
            super().run()

    monkeypatch.setenv("PIP_CONSTRAINT", constraint)
    monkeypatch.setattr(pip_hint.threading, "Thread", LateThread)
    monkeypatch.setattr(pip_hint.subprocess, "Popen", _Pip(1, False))
    assert pip_hint.main(["install", "torch==2.5.0"]) == 1
    out, err = capfd.readouterr()
    assert out == "Collecting torch==2.5.0\n"
    assert "pt-multi-gpu: this image pins torch==2.7.0" in err
