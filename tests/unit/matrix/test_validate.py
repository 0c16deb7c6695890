"""images.yaml validation: every kind of bad input gives a located message, never a traceback."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from builder.common.yamlpos import ProblemsError
from builder.matrix import load_matrix, select
from tests.support import small_matrix

ROOT = Path(__file__).resolve().parents[3]

GOOD = """\
repository: pt-multi-gpu
tag: "{torch}-cuda{cuda}-cudnn{cudnn}-{flavour}"
defaults:
  base: debian:bookworm-slim
include:
  - torch: "2.7.0"
    torchvision: "0.22.0"
    cuda: "12.6"
    cudnn: 9
"""

# (id, images.yaml text, expected "line:col" or None, expected message fragments)
BAD: list[tuple[str, str, str | None, tuple[str, ...]]] = [
    ("malformed-yaml", "include:\n  - torch: [2.7.0\n", "3:1", ("malformed YAML",)),
    ("tab-indent", "include:\n\t- torch: \"2.7.0\"\n", "2:1", ("malformed YAML",)),
    ("top-not-mapping", "- torch: 2.7.0\n", "1:1", ("the matrix file must be a mapping",)),
    ("unknown-top-key", GOOD + "incldue: []\n", "10:1", ("unknown key 'incldue'", "did you mean 'include'")),
    ("unknown-cell-key", GOOD.replace("cudnn: 9", "cudnn: 9\n    torchvison: \"0.22.0\""), "10:5",
     ("unknown key 'torchvison'", "did you mean 'torchvision'")),
    ("unknown-defaults-key", GOOD.replace("  base:", "  flavor: runtime\n  base:"), "4:3",
     ("unknown key 'flavor'", "did you mean 'flavour'")),
    ("duplicate-key", GOOD.replace("    cuda: \"12.6\"", "    cuda: \"12.6\"\n    cuda: \"12.8\""), "9:5",
     ("duplicate key 'cuda'",)),
    ("torch-wrong-type", GOOD.replace('torch: "2.7.0"', "torch: [2.7]"), "6:12", ("torch must be text",)),
    ("torch-number", GOOD.replace('torch: "2.7.0"', "torch: 2.7"), "6:12", ("must be quoted text",)),
    ("python-number", GOOD.replace("cudnn: 9", "cudnn: 9\n    python: 3.10"), "10:13", ("3.10 would read as 3.1",)),
    ("cudnn-wrong-type", GOOD.replace("cudnn: 9", "cudnn: [9]"), "9:12", ("cudnn must be the cuDNN major",)),
    ("apt-not-list", GOOD.replace("cudnn: 9", "cudnn: 9\n    apt: htop"), "10:10", ("apt must be a list",)),
    ("bad-apt-name", GOOD.replace("cudnn: 9", "cudnn: 9\n    apt: [\"Bad Name\"]"), "10:10",
     ("not a valid Debian package name",)),
    ("bad-pip-req", GOOD.replace("cudnn: 9", "cudnn: 9\n    pip: [\"wandb===?\"]"), "10:10", ("not a valid pip requirement",)),
    ("missing-torch", GOOD.replace('  - torch: "2.7.0"\n    torchvision', "  - torchvision"), "6:5",
     ("cell has no torch version",)),
    ("duplicate-cell", GOOD + '  - torch: "2.7.0"\n', "10:5", ("duplicate cell '2.7.0-cuda12.6-cudnn9-runtime'", "line 6")),
    ("unknown-torch", GOOD.replace('torch: "2.7.0"', 'torch: "2.7.9"'), "6:12",
     ("torch 2.7.9 is unknown", "did you mean '2.7.1'")),
    ("cuda-never-built", GOOD.replace('torch: "2.7.0"', 'torch: "2.0.1"').replace('"0.22.0"', '"0.15.2"'), "8:11",
     ("torch 2.0.1 has no CUDA 12.6 build; available: 11.7, 11.8",)),
    ("cudnn-mismatch", GOOD.replace("cudnn: 9", "cudnn: 8"), "9:12",
     ("ships cuDNN 9.5.1.17", "use cudnn: 9")),
    ("python-out-of-range", GOOD.replace('torch: "2.7.0"', 'torch: "2.0.1"').replace('"0.22.0"', '"0.15.2"')
     .replace('cuda: "12.6"', 'cuda: "11.7"').replace("cudnn: 9", "cudnn: 8")
     .replace("debian:bookworm-slim", "debian:trixie-slim"), "4:9",
     ("Python 3.13 (from base debian:trixie-slim) is outside torch 2.0.1's range",)),
    ("python-not-base", GOOD.replace("cudnn: 9", "cudnn: 9\n    python: \"3.12\""), "10:13",
     ("python 3.12 does not match base debian:bookworm-slim", "ubuntu:24.04")),
    ("torchvision-mismatch", GOOD.replace('"0.22.0"', '"0.21.0"'), "7:18",
     ("torchvision 0.21.0 does not pair with torch 2.7.0", "pairs with torch 2.6.0", "use torchvision 0.22.0")),
    ("no-torchvision-yet", GOOD.replace('torch: "2.7.0"', 'torch: "2.15.0"').replace('    torchvision: "0.22.0"\n', "")
     .replace('cuda: "12.6"', 'cuda: "13.2"'), "6:12", ("has no matching torchvision release",)),
    ("unknown-flavour", GOOD.replace("cudnn: 9", "cudnn: 9\n    flavour: devl"), "10:14",
     ("unknown flavour 'devl'", "did you mean 'devel'")),
    ("unknown-base", GOOD.replace("debian:bookworm-slim", "debian:bookwrm-slim"), "4:9",
     ("unknown base 'debian:bookwrm-slim'", "did you mean 'debian:bookworm-slim'")),
    ("empty-matrix", "repository: pt-multi-gpu\n", "1:1", ("the matrix is empty",)),
    ("empty-include", "include: []\n", "1:1", ("the matrix is empty",)),
    ("empty-file", "", "1:1", ("the matrix is empty",)),
    ("comments-only", "# nothing here\n", "1:1", ("the matrix is empty",)),
    ("exclude-matches-nothing", 'axes:\n  torch: ["2.7.0"]\nexclude:\n  - {torch: "2.0.1"}\n', "4:5",
     ("matches no cell",)),
    ("axis-not-list", 'axes:\n  torch: "2.7.0"\n', "2:10", ("axis torch must be a non-empty list",)),
    ("tag-unknown-placeholder", GOOD.replace("{flavour}", "{flavor}"), "2:6",
     ("unknown placeholder {flavor}", "did you mean 'flavour'")),
    ("tag-malformed", GOOD.replace('"{torch}-cuda', '"{torch-cuda'), "2:6", ("tag template is malformed",)),
    ("tag-invalid-docker", GOOD.replace('tag: "{torch}', 'tag: "/{torch}'), "2:6", ("not a valid Docker tag",)),
    ("bad-repository", GOOD.replace("repository: pt-multi-gpu", "repository: PT Multi"), "1:13",
     ("is not a valid image name",)),
    ("include-not-list", "include: {torch: \"2.7.0\"}\n", "1:10", ("include must be a list",)),
    ("include-entry-scalar", "include:\n  - 2.7.0\n", "2:5", ("an include entry must be a mapping",)),
]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "images.yaml"
    p.write_text(text, encoding="utf-8")
    return p


def problems_for(path: Path) -> list[str]:
    with pytest.raises(ProblemsError) as info:
        load_matrix(path, "images.yaml")
    return [str(p) for p in info.value.problems]


def test_corpus_is_big_enough() -> None:
    assert len(BAD) >= 25


@pytest.mark.parametrize(("text", "where", "fragments"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_is_located(tmp_path: Path, text: str, where: str | None, fragments: tuple[str, ...]) -> None:
    msgs = problems_for(write(tmp_path, text))
    joined = "\n".join(msgs)
    for frag in fragments:
        assert frag in joined, joined
    hit = next(m for m in msgs if fragments[0] in m)
    prefix = f"images.yaml:{where}: " if where else "images.yaml: "
    assert hit.startswith(prefix), hit


def test_all_errors_reported_at_once(tmp_path: Path) -> None:
    text = GOOD.replace('"0.22.0"', '"0.21.0"').replace("cudnn: 9", "cudnn: 8") + "incldue: []\n"
    msgs = problems_for(write(tmp_path, text))
    assert len(msgs) == 3, msgs


def test_non_utf8(tmp_path: Path) -> None:
    p = tmp_path / "images.yaml"
    p.write_bytes(b"repository: pt\ninclude:\n  - torch: \"2.7.0\" # caf\xe9\n")
    (msg,) = problems_for(p)
    assert msg.startswith("images.yaml:3:") and "not valid UTF-8" in msg


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(ProblemsError) as info:
        load_matrix(tmp_path, "cfgdir")
    assert "cfgdir: is a directory" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProblemsError) as info:
        load_matrix(tmp_path / "nope.yaml", "nope.yaml")
    assert "nope.yaml: file not found" in str(info.value)


def test_good_config_defaults(tmp_path: Path) -> None:
    m = load_matrix(write(tmp_path, GOOD), "images.yaml")
    (c,) = m.cells
    assert (c.name, c.python, c.cudnn, c.nccl, c.wheel_source) == (
        "2.7.0-cuda12.6-cudnn9-runtime", "3.11", "9.5.1.17", "2.26.2", "pypi")
    assert c.latest and c.ref == "pt-multi-gpu:2.7.0-cuda12.6-cudnn9-runtime"


def test_axes_exclude_include(tmp_path: Path) -> None:
    text = textwrap.dedent("""\
        axes:
          torch: ["2.11.0", "2.14.1"]
          flavour: [runtime, devel]
        exclude:
          - {torch: "2.11.0", flavour: devel}
        include:
          - {torch: "2.0.1"}
        """)
    m = load_matrix(write(tmp_path, text), "images.yaml")
    assert [c.name for c in m.cells] == [
        "2.11.0-cuda13.0-cudnn9-runtime", "2.14.1-cuda13.0-cudnn9-runtime", "2.14.1-cuda13.0-cudnn9-devel",
        "2.0.1-cuda11.7-cudnn8-runtime"]
    dev = m.cells[2]
    assert dev.devel_toolkit == "cuda-toolkit[cccl,cudart,nvcc]" and m.cells[1].devel_toolkit == ""
    assert dev.apt == ()  # the devel layer's packages are not the OS layer's (the two images share it)
    assert [c.latest for c in m.cells] == [False, True, False, False]


def test_real_images_yaml_has_the_seed_cells() -> None:
    m = load_matrix(ROOT / "images.yaml", "images.yaml")
    by = {(c.torch, c.cuda, c.cudnn_major, c.flavour): c for c in m.cells}
    assert ("2.0.1", "11.7", 8, "runtime") in by and by[("2.0.1", "11.7", 8, "runtime")].torchvision == "0.15.2"
    assert ("2.7.0", "12.6", 9, "runtime") in by and by[("2.7.0", "12.6", 9, "runtime")].torchvision == "0.22.0"
    latest = [c for c in m.cells if c.latest]
    assert len(latest) == 1 and latest[0].torch == max((c.torch for c in m.cells),
                                                       key=lambda v: tuple(map(int, v.split("."))))


def test_select(tmp_path: Path) -> None:
    m = small_matrix(tmp_path)
    assert [c.torch for c in select(m.cells, ["2.0.1-*"])] == ["2.0.1"]
    assert "2.0.1" not in [c.torch for c in select(m.cells, exclude=["2.0.1-*"])]
    with pytest.raises(ProblemsError, match="--only 'nope' matches no cell"):
        select(m.cells, ["nope"])


@pytest.mark.parametrize("name", ["malformed-yaml", "unknown-torch", "empty-matrix"])
def test_cli_exit_2_no_traceback(tmp_path: Path, name: str) -> None:
    text = next(b[1] for b in BAD if b[0] == name)
    cfg = write(tmp_path, text)
    r = subprocess.run([sys.executable, str(ROOT / "build.py"), "render", "--config", str(cfg)],
                       capture_output=True, text=True, cwd=tmp_path, check=False)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    (line,) = r.stderr.splitlines()  # one located line
    assert re.match(r"^images\.yaml:\d+:\d+: ", line), line
    assert not (tmp_path / "docker").exists(), "nothing may be rendered from an invalid matrix"
