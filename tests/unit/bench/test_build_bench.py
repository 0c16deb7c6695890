"""bench/bench_build.py's "before locked installs" Dockerfile, made from the rendered one: the cell's base and
user, its OS layer (pip needs the image's python3), then pip's two RUNs as the user; no locked install."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from builder.matrix import load_matrix
from tests.support import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import bench_build


@pytest.mark.parametrize("cell", ["2.0.1-cuda11.7-cudnn8-runtime", "2.7.0-cuda12.6-cudnn9-runtime"])
def test_the_pip_baseline_has_the_os_layer_then_pip_as_the_user(cell: str) -> None:
    spec = next(c for c in load_matrix(Path(ROOT / "images.yaml")).cells if c.name == cell)
    lines = [ln for ln in bench_build.before_dockerfile(spec).splitlines() if ln.startswith(("FROM", "USER", "RUN", "ARG"))]
    final = lines[max(i for i, ln in enumerate(lines) if ln.startswith("FROM")):]
    runs = [i for i, ln in enumerate(final) if ln.startswith("RUN")]
    assert "groupadd" in final[runs[0]], final  # the user's RUN first, as rendered
    assert final[runs[1] - 2:runs[1]] == ["USER 0:0", "ARG PTMG_OS_SNAPSHOT"], final  # the OS layer, as rendered
    assert final[runs[2] - 1] == "USER 1000" and len(runs) == 4, final  # then pip's two RUNs as pt
    text = bench_build.before_dockerfile(spec)
    assert "apt-get upgrade" in text and "/ptmg-build/uv pip install" not in text
    assert text.index("apt-get upgrade") < text.index("python3 -m venv") < text.index("pip download")


def test_step_times_finds_the_os_step_of_the_rendered_and_the_before_dockerfile() -> None:
    """The rendered OS stage runs apt through its bounded functions; the "before" Dockerfile, apt-get."""
    import benchlib

    step = "#" + "17"  # BuildKit's plain progress numbers each step so
    rendered = (f"{step} [ptmg-os 3/3] RUN --mount=type=cache,id=ptmg-apt-bookworm ... && apt_bounded update "
                " && apt_bounded upgrade -y --with-new-pkgs  && apt_bounded install -y ...\n"
                f"{step} 3.528 Download complete and in download only mode\n{step} DONE 15.6s\n")
    before = f"{step} [stage-1 4/6] RUN apt-get update -q && apt-get upgrade -y -q\n{step} DONE 21.0s\n"
    assert benchlib.step_times(rendered) == {"os": 15.6}
    assert benchlib.step_times(before) == {"os": 21.0}
