"""What `build.py diff` compares of one image: labels, layers, Debian packages, Python distributions,
and the size of every directory, read once through the engine (one container, removed after)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import ptmg_contract as contract
from builder.engine import Engine, EngineError

MARK = "@@PTMG-DIFF"
#: Runs as root in a throwaway container of the image (its entrypoint replaced): read-only listings.
SCRIPT = f"""
echo "{MARK} dpkg"
dpkg-query -W -f '${{binary:Package}}\\t${{Version}}\\n' 2>/dev/null
echo "{MARK} python"
if [ -x {contract.VENV_PYTHON} ]; then
  {contract.VENV_PYTHON} -I -c 'import importlib.metadata as m
for d in m.distributions(): print(d.metadata["Name"], d.version, sep="\\t")'
fi
echo "{MARK} du"
du -x -k / 2>/dev/null
echo "{MARK} end"
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Layer:
    created_by: str
    size: int


@dataclass
class ImageFacts:
    ref: str
    image_id: str
    size: int
    labels: dict[str, str] = field(default_factory=dict)
    layers: list[Layer] = field(default_factory=list)
    debian: dict[str, str] = field(default_factory=dict)
    python: dict[str, str] = field(default_factory=dict)
    dirs: dict[str, int] = field(default_factory=dict)  # path -> bytes (du -k, apparent blocks)


def parse_listing(output: str, facts: ImageFacts) -> None:
    section = ""
    for line in output.splitlines():
        if line.startswith(MARK):
            section = line[len(MARK):].strip()
            continue
        if section == "dpkg" and "\t" in line:
            name, version = line.split("\t", 1)
            facts.debian[name.split(":")[0] if name.endswith(":all") else name] = version.strip()
        elif section == "python" and "\t" in line:
            name, version = line.split("\t", 1)
            facts.python[canonical(name)] = version.strip()
        elif section == "du":
            size, _, path = line.partition("\t")
            if size.isdigit() and path.startswith("/"):
                facts.dirs[path] = int(size) * 1024


def read(engine: Engine, ref: str, timeout: float = 1200) -> ImageFacts:
    attrs = engine.image_attrs(ref)
    if attrs is None:
        raise EngineError(f"no image {ref} here: give a cell of images.yaml (built) or a local image reference")
    facts = ImageFacts(ref, str(attrs["Id"]), int(attrs.get("Size") or 0),
                       dict((attrs.get("Config") or {}).get("Labels") or {}))
    for h in engine.image_history(ref):
        facts.layers.append(Layer(_step(str(h.get("CreatedBy") or "")), int(h.get("Size") or 0)))
    r = engine.run(ref, ["-c", SCRIPT], entrypoint=["/bin/sh"], user="0", timeout=timeout,
                   environment={"LC_ALL": "C"})
    if f"{MARK} end" not in r.output:
        raise EngineError(f"reading {ref} failed (exit {r.exit_code}):\n{r.output[-1500:]}")
    parse_listing(r.output, facts)
    return facts


def _step(created_by: str) -> str:
    """A history line as the Dockerfile said it (``RUN ...``, ``COPY ...``), without the shell and markers."""
    text = re.sub(r"\s+", " ", created_by).strip()
    text = re.sub(r" # buildkit$", "", text)
    text = re.sub(r"^(RUN )?(\|\d+ (\S+=\S* )+)?/bin/(ba)?sh (-o pipefail )?-c (#\(nop\) )?", r"\1", text)
    return text.strip()


def summary(facts: ImageFacts) -> dict[str, Any]:
    return {"ref": facts.ref, "id": facts.image_id, "size": facts.size}
