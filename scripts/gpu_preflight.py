"""What the GPU acceptance run needs of its host, found all at once before any step runs.

One probe runs in the python under test (torch's version, its CUDA, the GPUs it sees, which
modules import, where Python.h is, whether Triton can cache); the rest is looked up here: ninja
and g++ on PATH, the CUDA toolkit torch would use. Every missing prerequisite comes back as one
`Problem` naming the steps it stops and how to get it; what only weakens a step (another nvcc
minor, no TensorBoard) comes back as a warning.

Standard library only, as scripts/gpu_acceptance.py.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: How to get each module a step imports (the pip name where it differs).
HOW = {
    "torch": "pip install torch (a CUDA build: https://pytorch.org/get-started/locally/)",
    "triton": "pip install triton (torch's CUDA wheels pull it in)",
    "pytest": "pip install pytest",
    "yaml": "pip install pyyaml, or --unit-python with the checkout's venv (make .venv)",
    "jinja2": "pip install jinja2, or --unit-python with the checkout's venv (make .venv)",
    "docker": "pip install docker, or --unit-python with the checkout's venv (make .venv)",
    "requests": "pip install requests, or --unit-python with the checkout's venv (make .venv)",
    "packaging": "pip install packaging, or --unit-python with the checkout's venv (make .venv)",
}
#: Modules a step can do without: what is lost.
#: Needs that are not python modules.
NON_MODULES = frozenset({"nvidia-smi", "ninja", "g++", "Python.h", "nvcc", "triton-cache", "gpu"})
OPTIONAL = {"tensorboard": "the DDP job writes no TensorBoard events (its tensorboard-events check skips)"}

PROBE = r"""
import importlib.util, json, os, sys, sysconfig, tempfile
mods = sys.argv[1:]
d = {"python": sys.version.split()[0], "executable": sys.executable,
     "missing": [m for m in mods if importlib.util.find_spec(m) is None]}
inc = sysconfig.get_paths().get("include") or ""
d["python_h"] = os.path.join(inc, "Python.h")
d["python_h_found"] = os.path.isfile(d["python_h"])
cache = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
d["triton_cache"] = cache
try:
    os.makedirs(cache, exist_ok=True)
    tempfile.NamedTemporaryFile(dir=cache).close()
    d["triton_cache_writable"] = True
except OSError as exc:
    d["triton_cache_writable"] = False
    d["triton_cache_error"] = str(exc)
if "torch" not in d["missing"]:
    try:
        import torch
        d["torch"] = torch.__version__
        d["cuda"] = torch.version.cuda
        d["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:
        d["torch_error"] = f"{type(exc).__name__}: {exc}"
print("PTMG_PROBE " + json.dumps(d))
"""


@dataclass(frozen=True)
class Problem:
    """A missing prerequisite: what it is, the steps it stops, how to get it."""

    what: str
    steps: tuple[str, ...]
    how: str

    def line(self) -> str:
        return f"{self.what} (stops {', '.join(self.steps)}): {self.how}"


def find_cuda_home(env: Mapping[str, str]) -> str | None:
    """The CUDA toolkit torch.utils.cpp_extension uses (its _find_cuda_home, on Linux): CUDA_HOME or
    CUDA_PATH, else the folder above the ``bin`` of the first nvcc on PATH, else /usr/local/cuda
    when it exists. torch builds with ``CUDA_HOME/bin/nvcc`` and ``CUDA_HOME/include``."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home is None:
        nvcc = shutil.which("nvcc", path=env.get("PATH", ""))
        if nvcc is not None:
            home = os.path.dirname(os.path.dirname(nvcc))
        else:
            home = "/usr/local/cuda" if os.path.exists("/usr/local/cuda") else None
    return home


def nvcc_release(nvcc: str, env: Mapping[str, str]) -> str | None:
    """``13.0`` from ``nvcc --version`` (None when it does not run or says no release)."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, env=dict(env),
                             check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def probe(python: str, modules: Sequence[str], env: Mapping[str, str], timeout: float = 90) -> dict[str, Any]:
    """What ``python`` has (see PROBE); {"error": ...} when it does not run."""
    try:
        proc = subprocess.run([python, "-c", PROBE, *modules], capture_output=True, text=True, timeout=timeout,
                              env=dict(env), check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{python}: {exc}", "missing": list(modules)}
    for line in proc.stdout.splitlines():
        if line.startswith("PTMG_PROBE "):
            facts: dict[str, Any] = json.loads(line[len("PTMG_PROBE "):])
            return facts
    return {"error": f"{python} -c PROBE exited {proc.returncode}: {proc.stderr.strip()[-300:]}",
            "missing": list(modules)}


def _users(steps: Mapping[str, Sequence[str]], need: str) -> tuple[str, ...]:
    return tuple(name for name, needs in steps.items() if need in needs)


def check(needs: Mapping[str, Sequence[str]], facts: Mapping[str, Any], unit_facts: Mapping[str, Any],
          unit_steps: Sequence[str], env: Mapping[str, str]) -> tuple[list[Problem], list[str], dict[str, Any]]:
    """(problems, warnings, toolkit facts) for the steps in ``needs`` (step -> its needs: module names,
    or "nvidia-smi", "ninja", "g++", "Python.h", "nvcc", "triton-cache", "gpu")."""
    problems: list[Problem] = []
    warnings: list[str] = []
    for step, step_needs in needs.items():
        source = unit_facts if step in unit_steps else facts
        for module in step_needs:
            if module in source.get("missing", ()):
                python = source.get("executable") or "the python"
                problems.append(Problem(f"python module {module} ({python})", (step,),
                                        HOW.get(module, f"pip install {module}")))
    merged: dict[str, Problem] = {}
    for p in problems:  # one line per module and python, naming every step it stops
        key = p.what
        merged[key] = Problem(key, (*merged[key].steps, *p.steps), p.how) if key in merged else p
    problems = list(merged.values())
    for module, lost in OPTIONAL.items():
        if module in facts.get("missing", ()):
            warnings.append(f"python module {module} not installed: {lost}")
    if facts.get("error"):
        problems.append(Problem(f"python {facts['error']}", tuple(needs), "pass --python (or PYTHON=) a python 3 "
                                                                            "with torch"))
    if facts.get("torch_error"):
        problems.append(Problem(f"import torch fails: {facts['torch_error']}", _users(needs, "torch"),
                                "reinstall torch"))

    path = env.get("PATH", "")
    tools = {"nvidia-smi": "the NVIDIA driver's tools (nvidia-utils); on PATH",
             "ninja": "pip install ninja into the python under test, or apt-get install ninja-build "
                      "(torch.utils.cpp_extension runs `ninja` from PATH)",
             "g++": "apt-get install g++ (Inductor's C++ code and extensions compile with it)"}
    for tool, how in tools.items():
        if _users(needs, tool) and shutil.which(tool, path=path) is None:
            problems.append(Problem(f"{tool} not on PATH", _users(needs, tool), how))
    if _users(needs, "Python.h") and facts.get("python_h") and not facts.get("python_h_found"):
        problems.append(Problem(f"Python.h ({facts['python_h']})", _users(needs, "Python.h"),
                                f"apt-get install python{'.'.join(str(facts.get('python', '3')).split('.')[:2])}-dev "
                                "(Triton and Inductor build C modules against it)"))
    if _users(needs, "triton-cache") and facts.get("triton_cache") and not facts.get("triton_cache_writable"):
        problems.append(Problem(f"Triton's cache {facts['triton_cache']} not writable "
                                f"({facts.get('triton_cache_error', '')})", _users(needs, "triton-cache"),
                                "set HOME to a writable folder, or TRITON_CACHE_DIR"))
    if _users(needs, "gpu") and "torch" in facts and not facts.get("gpus"):
        problems.append(Problem("no GPU visible to torch (torch.cuda.device_count() is 0"
                                + (", a CPU-only torch" if not facts.get("cuda") else "") + ")",
                                _users(needs, "gpu"), "a GPU host, its driver, and torch's CUDA build"))

    toolkit = toolkit_facts(env)
    users = _users(needs, "nvcc")
    if users:
        problems_tk, warnings_tk = judge_toolkit(toolkit, facts.get("cuda"), users)
        problems += problems_tk
        warnings += warnings_tk
    return problems, warnings, toolkit


def toolkit_facts(env: Mapping[str, str]) -> dict[str, Any]:
    """CUDA_HOME as torch resolves it, its nvcc and headers, and the nvcc on PATH."""
    home = find_cuda_home(env)
    nvcc = os.path.join(home, "bin", "nvcc") if home else None
    found = bool(nvcc and os.path.isfile(nvcc) and os.access(nvcc, os.X_OK))
    on_path = shutil.which("nvcc", path=env.get("PATH", ""))
    return {"cuda_home": home, "nvcc": nvcc, "nvcc_found": found,
            "nvcc_release": nvcc_release(nvcc, env) if found and nvcc else None,
            "cuda_runtime_h": bool(home and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h"))),
            "nvcc_on_path": on_path, "toolkits": toolkits(on_path)}


def toolkits(nvcc_on_path: str | None, roots: Sequence[str] = ("/usr/local/cuda", "/usr/local/cuda-*")) -> list[str]:
    """Folders that hold a whole toolkit (bin/nvcc and include/cuda_runtime.h): the one above the real
    nvcc on PATH (a symlink resolved), then /usr/local/cuda*; for the hint when CUDA_HOME has none."""
    found = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc_on_path)))] if nvcc_on_path else []
    for root in roots:
        found += sorted(glob.glob(root), reverse=True)
    return list(dict.fromkeys(d for d in found if os.path.isfile(os.path.join(d, "bin", "nvcc"))
                              and os.path.isfile(os.path.join(d, "include", "cuda_runtime.h"))))


def judge_toolkit(tk: Mapping[str, Any], torch_cuda: str | None,
                  steps: tuple[str, ...]) -> tuple[list[Problem], list[str]]:
    """The toolkit against torch's CUDA: another major (or none) is a problem, another minor a warning."""
    others = [d for d in tk.get("toolkits", ()) if d != tk.get("cuda_home")]
    hint = f"; a whole toolkit is at {others[0]}: export CUDA_HOME={others[0]}" if others else ""
    if not tk.get("cuda_home") or not tk.get("nvcc_found"):
        return [Problem(f"no nvcc at CUDA_HOME/bin (CUDA_HOME={tk.get('cuda_home')})", steps,
                        f"install the CUDA toolkit {torch_cuda or ''} (nvcc) and set CUDA_HOME or put its bin on "
                        f"PATH{hint}")], []
    problems: list[Problem] = []
    if not tk.get("cuda_runtime_h"):
        problems.append(Problem(f"no include/cuda_runtime.h under CUDA_HOME={tk['cuda_home']}", steps,
                                f"point CUDA_HOME at the toolkit's own folder{hint}"))
    release = tk.get("nvcc_release")
    if not torch_cuda or not release:
        return problems, ([] if release else [f"{tk['nvcc']} --version names no release"])
    if release.split(".")[0] != torch_cuda.split(".")[0]:
        problems.append(Problem(f"nvcc is CUDA {release}, torch is built for CUDA {torch_cuda}", steps,
                                f"a CUDA {torch_cuda.split('.')[0]}.x toolkit (torch refuses another major){hint}"))
        return problems, []
    if release != ".".join(torch_cuda.split(".")[:2]):
        return problems, [f"nvcc is CUDA {release}, torch is built for CUDA {torch_cuda}: another minor, "
                          "which torch only warns about"]
    return problems, []
