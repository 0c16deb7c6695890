"""Run a smoke test in a fresh Python process, so the suite's own process never holds a CUDA context.

A GPU in EXCLUSIVE_PROCESS compute mode (common on shared clusters: `nvidia-smi -c 3`) takes one
process at a time. If the pytest process ran the per-GPU checks itself, its CUDA context would
live until the suite ends, and every later process on that GPU (the DDP job's torchrun ranks, the
seed templates) would fail with "all CUDA-capable devices are busy or unavailable". Tests marked
``child`` therefore run again in a child pytest (the same file, test id and suite options) whose
context ends with it; the parent only reports the child's outcome. Counting GPUs
(``torch.cuda.device_count()``) creates no context, so the parent may still do that.

Standard library only, no syntax newer than Python 3.8: it runs inside every image.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from typing import Any

#: Set in the child: there the marked test runs in-process.
IN_CHILD = "PTMG_SMOKE_IN_CHILD"
#: The suite's options a child needs to decide as the parent would.
FLAG_OPTIONS = ("--require-gpu", "--require-multi-gpu")
VALUE_OPTIONS = ("--nproc", "--smoke-out", "--expect-json", "--ddp-timeout")
HERE = os.path.dirname(os.path.abspath(__file__))


def child_argv(test_id: str, options: dict[str, Any], junit: str) -> list[str]:
    argv = [sys.executable, "-m", "pytest", "-c", os.path.join(HERE, "pytest.ini"), "-q", "-p", "no:cacheprovider",
            "--junitxml", junit, test_id]
    for name in FLAG_OPTIONS:
        if options.get(name):
            argv.append(name)
    for name in VALUE_OPTIONS:
        if options.get(name) is not None:
            argv += [name, str(options[name])]
    return argv


def outcome(junit_xml: str) -> tuple[str, str]:
    """(passed | failed | skipped, message) of the one test case in the child's JUnit XML."""
    root = ET.fromstring(junit_xml)  # noqa: S314 - our own child's report
    cases = list(root.iter("testcase"))
    if len(cases) != 1:
        return "failed", f"the child ran {len(cases)} test(s), not 1"
    case = cases[0]
    for tag in ("failure", "error"):
        node = case.find(tag)
        if node is not None:
            return "failed", (node.get("message") or "") + "\n" + (node.text or "")
    node = case.find("skipped")
    if node is not None:
        return "skipped", node.get("message") or ""
    return "passed", ""


def run(test_id: str, options: dict[str, Any], timeout: float = 900.0) -> tuple[str, str]:
    """Run ``test_id`` (``/path/test_x.py::test_y[gpu0]``) in a child pytest; its outcome and message."""
    with tempfile.TemporaryDirectory(prefix="ptmg-child-") as tmp:
        junit = os.path.join(tmp, "junit.xml")
        env = dict(os.environ, **{IN_CHILD: "1"})
        try:
            proc = subprocess.run(child_argv(test_id, options, junit), capture_output=True, text=True,
                                  timeout=timeout, env=env, check=False)
        except subprocess.TimeoutExpired:
            return "failed", f"the child process running {test_id} did not finish in {timeout:g} s"
        if not os.path.exists(junit):
            return "failed", f"the child process exited {proc.returncode} without a result:\n{_tail(proc)}"
        with open(junit, encoding="utf-8") as fh:
            state, message = outcome(fh.read())
        if state == "failed" and not message.strip():
            message = _tail(proc)
        return state, message


def _tail(proc: subprocess.CompletedProcess[str], lines: int = 30) -> str:
    return "\n".join(((proc.stdout or "") + (proc.stderr or "")).splitlines()[-lines:])


def suite_options(config: Any, names: Sequence[str] = FLAG_OPTIONS + VALUE_OPTIONS) -> dict[str, Any]:
    return {name: config.getoption(name) for name in names}
