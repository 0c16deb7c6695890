"""Run the built image once to read what is really installed; fail on any mismatch; label it.

The versions in an image's labels come from this probe, never from images.yaml alone.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import ptmg_contract as contract
from builder.engine import Engine, EngineError
from builder.matrix import ImageSpec

PROBE = (f"CUDNN_DISTS = {contract.CUDNN_DISTS!r}\nNCCL_DISTS = {contract.NCCL_DISTS!r}\n"
         f"OS_PATCH_FILE = {contract.OS_PATCH_FILE!r}\n") + r"""
import hashlib, importlib.metadata as md, json, subprocess, sys
import torch, torchvision

def digest(lines):
    return "sha256:" + hashlib.sha256("\n".join(sorted(set(lines))).encode()).hexdigest()

def os_patch():  # the OS layer's record (imagebuild/os-patch-level.sh): key -> [values]
    out = {}
    try:
        with open(OS_PATCH_FILE, encoding="utf-8") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep:
                    out.setdefault(key.strip(), []).append(value.strip())
    except OSError:
        pass
    return out

def os_packages():  # installed Debian packages (name:arch version)
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev} ${binary:Package} ${Version}\n"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return digest(" ".join(l.split()[1:]) for l in out.splitlines() if l.startswith("ii "))

def dist(*names):
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            pass
    return None

try:
    v = torch.cuda.nccl.version()
    nccl = ".".join(map(str, v)) if isinstance(v, tuple) else "%d.%d.%d" % (v // 1000, v % 1000 // 100, v % 100)
except Exception:
    nccl = None
try:
    arch = torch._C._cuda_getArchFlags().split()
except Exception:
    arch = []
print(json.dumps({
    "torch": torch.__version__.split("+")[0],
    "torchvision": torchvision.__version__.split("+")[0],
    "cuda": torch.version.cuda,
    "cudnn": dist(*CUDNN_DISTS),
    "nccl": dist(*NCCL_DISTS) or nccl,
    "nccl_runtime": nccl,
    "python": "%d.%d" % sys.version_info[:2],
    "arch_list": arch,
    "os_patch": os_patch(),
    "os_packages": os_packages(),
    "venv_packages": digest("%s==%s" % (d.metadata["Name"].lower(), d.version) for d in md.distributions()),
}))
"""


def check_probe(spec: ImageSpec, probed: dict[str, object]) -> list[str]:
    """Where the built image disagrees with images.yaml (empty when it agrees)."""
    expect = {"torch": spec.torch, "torchvision": spec.torchvision, "cuda": spec.cuda, "cudnn": spec.cudnn,
              "python": spec.python}
    if spec.nccl:
        expect["nccl"] = spec.nccl
    out = [f"{k}: images.yaml/compat data says {v}, the image has {probed.get(k)}"
           for k, v in expect.items() if probed.get(k) != v]
    arch = probed.get("arch_list")
    if isinstance(arch, list) and arch and set(arch) != set(spec.arch_list):
        # the image's ENV (PTMG_CUDA_ARCH_LIST) and `selftest` expect the compat data's list
        missing, extra = sorted(set(spec.arch_list) - set(arch)), sorted(set(arch) - set(spec.arch_list))
        out.append(f"cuda arch list: the compat data says {' '.join(spec.arch_list)}, torch in the image has "
                   f"{' '.join(arch)} (missing {missing or 'none'}, extra {extra or 'none'}); fix arch_list "
                   "in builder/matrix/compat_data.yaml")
    return out


def patch_labels(probed: dict[str, object], recipe: str) -> dict[str, str]:
    """The patch-level labels: from the OS layer's own record and the probe's package hashes."""
    raw = probed.get("os_patch")
    record: dict[str, list[str]] = {str(k): [str(x) for x in v] for k, v in raw.items()
                                    if isinstance(v, list)} if isinstance(raw, dict) else {}
    suites = sorted((s.replace(" ", "@", 1) for s in record.get("suite", [])), key=lambda s: (s.split("@")[0], s))
    out = {contract.LABEL_OS_UPDATED: (record.get("updated") or [""])[0],
           contract.LABEL_OS_SNAPSHOT: (record.get("snapshot") or [""])[0],
           contract.LABEL_OS_SUITES: " ".join(suites),
           contract.LABEL_OS_PACKAGES: str(probed.get("os_packages") or ""),
           contract.LABEL_VENV_PACKAGES: str(probed.get("venv_packages") or ""),
           contract.LABEL_RECIPE_HASH: recipe}
    return {k: v for k, v in out.items() if v}


def labels_for(spec: ImageSpec, probed: dict[str, object], digest: str, builder: str,
               revision: str, project_url: str, recipe: str = "") -> dict[str, str]:
    """OCI and compatibility labels; versions come from the probe of the built image."""
    arch = probed.get("arch_list")
    return {
        **patch_labels(probed, recipe),
        contract.OCI_CREATED: dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        contract.OCI_REVISION: revision,
        "org.opencontainers.image.version": spec.tag,
        "org.opencontainers.image.title": f"{spec.repository} {spec.name}",
        "org.opencontainers.image.source": project_url,
        "org.opencontainers.image.base.name": spec.base,
        contract.label("cell"): spec.name,
        contract.label("torch"): str(probed["torch"]),
        contract.label("torchvision"): str(probed["torchvision"]),
        contract.label("cuda"): str(probed["cuda"]),
        contract.label("cudnn"): str(probed["cudnn"]),
        contract.label("nccl"): str(probed.get("nccl") or ""),
        contract.label("python"): str(probed["python"]),
        contract.label("min-driver"): spec.min_driver,
        contract.label("cuda-arch-list"): " ".join(arch) if isinstance(arch, list) else "",
        contract.label("builder"): builder,
        contract.LABEL_INPUTS_HASH: digest,
        contract.PROJECT_LABEL[0]: contract.PROJECT_LABEL[1],
    }


def probe(engine: Engine, image_id: str, *, emulated: bool = False) -> dict[str, Any]:
    # Under emulation `import torch` alone takes 80-170 s on a busy 2-core host (the engine adds an init).
    r = engine.run(image_id, [], entrypoint=[contract.VENV_PYTHON, "-c", PROBE], timeout=1200 if emulated else 300,
                   environment={"CUDA_VISIBLE_DEVICES": ""})
    if r.exit_code != 0:
        raise EngineError(f"probing the built image failed (exit {r.exit_code}):\n{r.output[-2000:]}")
    return parse_probe(r.output)


def parse_probe(output: str) -> dict[str, Any]:
    """The probe's JSON (its last line of output); EngineError when it printed something else."""
    lines = output.strip().splitlines()
    try:
        data = json.loads(lines[-1]) if lines else None
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise EngineError("probing the built image printed no JSON result; its last lines:\n  "
                          + "\n  ".join(lines[-10:]))
    return data


