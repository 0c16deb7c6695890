"""The layer order of every rendered Dockerfile (docs/image-layout.md, "Layers"): the venv sits right
on the base and the user, below the weekly OS layer, so that an OS-only rebuild keeps the venv's
layers and their chain IDs; in it, the CUDA wheels come first, so that a new torch keeps theirs. Pure rendering, no Docker: the committed docker/*/Dockerfile and the
cells of a small matrix with every flavour and base."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

import ptmg_contract as contract
from builder.render import dockerfile
from tests.support import small_matrix

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = sorted((ROOT / "docker").glob("*/Dockerfile"))
CELLS = textwrap.dedent("""\
    include:
      - {torch: "2.7.0"}
      - {torch: "2.14.1"}
      - {torch: "2.14.1", flavour: devel}
      - {torch: "2.14.1", base: "debian:trixie-slim", tag: "{torch}-cuda{cuda}-{flavour}-py{python}"}
    """)
PY = dockerfile.BUILD_PYTHON


def _stages(text: str) -> list[list[str]]:
    """The Dockerfile's stages, each a list of instructions (comments dropped, continuations joined)."""
    joined = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    stages: list[list[str]] = []
    for ins in (" ".join(ln.split()) for ln in joined.splitlines() if ln.strip()):
        if ins.startswith("FROM "):
            stages.append([])
        stages[-1].append(ins)
    return stages


def _texts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {f"docker/{p.parent.name}": p.read_text() for p in COMMITTED}
    for spec in small_matrix(tmp_path_factory.mktemp("order"), CELLS).cells:
        out[f"rendered {spec.name}"] = dockerfile.render(spec)
    return out


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    found = _texts(tmp_path_factory)
    assert len(COMMITTED) >= 5 and len(found) >= len(COMMITTED) + 4, sorted(found)
    return found


def _at(stage: list[str], marker: str, where: str) -> int:
    found = [i for i, ins in enumerate(stage) if marker in ins]
    assert len(found) == 1, f"{where}: {len(found)} instructions with {marker!r}"
    return found[0]


def test_the_venv_sits_on_the_base_and_the_user_below_the_os_layer(texts: dict[str, str]) -> None:
    for where, text in texts.items():
        final = _stages(text)[-1]
        user, cuda, torch, tools, os_layer = (_at(final, m, where) for m in (
            "useradd", "source=wheelhouse/cuda,", "source=wheelhouse/torch,", "source=wheelhouse/tools,",
            "apt-get upgrade"))
        sbom, ours = _at(final, "sbom.py", where), _at(final, "COPY entrypoint/ ", where)
        assert user < cuda < torch < tools < os_layer < sbom < ours, (where, user, cuda, torch, tools, os_layer, sbom,
                                                                       ours)
        assert [ins for ins in final[cuda + 1:torch] if ins.startswith(("RUN", "COPY", "ADD"))] == [], where
        # Nothing but the user's RUN between the base and the venv: no apt, no other layer below it.
        below = [ins for ins in final[1:cuda] if ins.startswith(("RUN", "COPY", "ADD"))]
        assert below == [final[user]], (where, below)
        devel = [i for i, ins in enumerate(final) if "source=wheelhouse/devel," in ins]
        assert all(tools < i < os_layer for i in devel), (where, devel)


def test_the_cuda_wheels_run_is_the_same_text_in_every_cell(texts: dict[str, str]) -> None:
    """Its cache key is its text and its mounted files (the cell's CUDA wheels): nothing of torch (its arch list
    picks slim-venv.sh's Triton options) may key it, or a new torch over the same CUDA wheels would rebuild 3 GB."""
    runs = {where: _stages(text)[-1][_at(_stages(text)[-1], "source=wheelhouse/cuda,", where)]
            for where, text in texts.items()}
    assert len(set(runs.values())) == 1, {w: r[-160:] for w, r in runs.items()}
    assert "--strip-triton" not in next(iter(runs.values()))


def test_the_os_snapshot_keys_the_os_layer_and_nothing_below_it(texts: dict[str, str]) -> None:
    """A build arg keys every RUN after its ARG line: the venv's RUNs must come before it."""
    for where, text in texts.items():
        stages = _stages(text)
        final = stages[-1]
        arg = _at(final, f"ARG {contract.OS_SNAPSHOT_ARG}", where)
        assert arg == _at(final, "apt-get upgrade", where) - 1, where
        venv_runs = [i for i, ins in enumerate(final) if "/ptmg-build/uv pip install" in ins]
        assert venv_runs and max(venv_runs) < arg, f"{where}: a venv RUN after the ARG would be keyed on the snapshot"
        assert not any(contract.OS_SNAPSHOT_ARG in ins for stage in stages[:-1] for ins in stage), where


def test_every_venv_run_uses_the_build_python_and_leaves_the_venv_naming_usr_bin(texts: dict[str, str]) -> None:
    for where, text in texts.items():
        final = _stages(text)[-1]
        runs = [ins for ins in final if "/ptmg-build/uv pip install" in ins]
        assert len(runs) in (3, 4), where  # cuda, torch, tools (+ devel)
        for ins in runs:
            assert f"--mount=type=bind,from={PY['stage']},target={PY['root']} " in ins, where
            assert f"export LD_LIBRARY_PATH={PY['libs']} PATH=$PATH:{PY['root']}/usr/bin &&" in ins, where
            assert ins.endswith(f"&& sh /ptmg-build/build-python.sh restore {contract.VENV}"), where
        assert f"&& {PY['root']}/usr/bin/python3 -m venv --without-pip {contract.VENV} &&" in runs[0], where
        assert all(f"&& sh /ptmg-build/build-python.sh use {contract.VENV} &&" in ins for ins in runs[1:]), where


def test_the_build_python_is_a_stage_from_the_same_base_and_not_in_the_image(texts: dict[str, str]) -> None:
    for where, text in texts.items():
        stages = _stages(text)
        assert len(stages) == 2, where
        stage, final = stages
        base = final[0].removeprefix("FROM ")
        assert stage[0] == f"FROM {base} AS {PY['stage']}", where
        (run,) = (ins for ins in stage if ins.startswith("RUN "))
        assert "apt-get upgrade" not in run, f"{where}: the stage must not be a second OS layer"
        assert "install -y -q --no-install-recommends -o Dpkg::Options::=--force-unsafe-io binutils python3 " \
               "python3-venv &&" in run, where
        # The image gets its python3 (the one the venv names) from its own OS layer.
        os_run = final[_at(final, "apt-get upgrade", where)]
        assert " python3 " in os_run and " python3-venv " in os_run, where
        assert not any(f"from={PY['stage']}" in ins for ins in final if "pip install" not in ins), where
