"""The layer order of every rendered Dockerfile (docs/image-layout.md, "Layers"): the CUDA wheels are
the first layer, below the base's files, made by a stage whose text is the same in every cell, so that
every cell with the same CUDA wheels shares it on a node; the venv sits on the base and the user, below
the weekly OS layer, so that an OS-only rebuild keeps the venv's layers and their chain IDs. Pure rendering, no Docker: the committed docker/*/Dockerfile and the
cells of a small matrix with every flavour and base."""

from __future__ import annotations

import posixpath
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
SHARED = dockerfile.SHARED_STAGES
OS = dockerfile.OS_STAGE
NATIVE = dockerfile.NATIVE_PYTHON
#: The image's OS layer: it applies what the OS stage's apt changed.
OS_APPLY = "sh /ptmg-build/os-layer.sh apply /ptmg-build/os /"


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


def _layers(stage: list[str]) -> list[str]:
    return [ins for ins in stage if ins.startswith(("RUN", "COPY", "ADD"))]


def test_the_cuda_wheels_are_the_first_layer_then_the_base_then_the_venv_below_the_os_layer(
        texts: dict[str, str]) -> None:
    for where, text in texts.items():
        final = _stages(text)[-1]
        assert final[0] == "FROM scratch", where
        layers = _layers(final)
        # The bottom layer's chain ID is its diff ID: the CUDA wheels' tree, shared by every cell with
        # the same CUDA wheels on a node, whatever sits above it; then the base's files, all of them.
        assert layers[0] == f"COPY --from={SHARED['cuda_stage']} {SHARED['cuda_out']}/ /", where
        assert layers[1] == f"COPY --from={SHARED['torch_stage']} {SHARED['torch_out']}/ /", where
        assert re.fullmatch(r"COPY --from=\S+ / /", layers[2]), where
        user, venv, torch, tools, os_layer = (_at(final, m, where) for m in (
            "useradd", "-m venv --without-pip", "source=wheelhouse/torch,", "source=wheelhouse/tools,",
            OS_APPLY))
        sbom, ours = _at(final, "sbom.py", where), _at(final, "COPY entrypoint/ ", where)
        assert user < venv < torch < tools < os_layer < sbom < ours, (where, user, venv, torch, tools, os_layer, sbom,
                                                                       ours)
        # Nothing but the user's RUN between the base and the venv: no apt, no other layer below it.
        assert layers[3:5] == [final[user], final[venv]], where
        assert final.index(layers[5]) == torch, where
        assert not any("source=wheelhouse/cuda," in ins for ins in final), f"{where}: the CUDA wheels come from their stage"
        devel = [i for i, ins in enumerate(final) if "source=wheelhouse/devel," in ins]
        assert all(tools < i < os_layer for i in devel), (where, devel)


def _stage(text: str, name: str, where: str) -> list[str]:
    (stage,) = (st for st in _stages(text) if st[0].endswith(f" AS {name}"))
    assert stage[0] == f"FROM {PY['stage']} AS {name}", where
    return stage


def test_the_cuda_wheels_stage_is_the_same_text_in_every_cell(texts: dict[str, str]) -> None:
    """The layer is the same bytes wherever it is built only if nothing of the cell keys or shapes it:
    not torch (its arch list picks slim-venv.sh's Triton options), not the Python (no bytecode)."""
    stages = {where: tuple(_stage(text, SHARED["cuda_stage"], where)) for where, text in texts.items()}
    assert len(set(stages.values())) == 1, stages
    (run,) = _layers(list(next(iter(stages.values()))))
    tree = f"{SHARED['cuda_out']}{contract.CUDA_WHEELS}"
    assert f" --target {tree} " in run and "source=wheelhouse/cuda," in run
    assert "--compile-bytecode" not in run and "--strip-triton" not in run
    assert "--require-hashes --no-deps --only-binary :all:" in run
    epoch = dockerfile.SOURCE_DATE_EPOCH
    assert run.endswith(f"&& sh /ptmg-build/shared-tree.sh cuda {SHARED['cuda_out']} {contract.CUDA_WHEELS} {contract.UID} "
                        f"{contract.VENV_GID} {epoch}")


def test_torchs_shared_files_come_from_the_cells_torch_set_and_the_venv_links_them(texts: dict[str, str]) -> None:
    epoch = dockerfile.SOURCE_DATE_EPOCH
    for where, text in texts.items():
        (run,) = _layers(_stage(text, SHARED["torch_stage"], where))
        assert "source=wheelhouse/torch," in run and f" --target {SHARED['unpacked']} " in run, where
        assert "--compile-bytecode" not in run, where
        assert re.search(rf"&& sh /ptmg-build/shared-tree.sh torch {SHARED['unpacked']} {SHARED['torch_out']} "
                         rf"{contract.TORCH_FILES} {contract.UID} {contract.VENV_GID} {epoch}( --drop-ptxas-blackwell)?$",
                         run), (where, run[-300:])
        # slim-venv.sh drops Blackwell's ptxas in the venv for these cells: the shared copy must not keep it.
        assert run.endswith("--drop-ptxas-blackwell") == ("--drop-ptxas-blackwell" in text.split("FROM scratch")[1]), where
        final = _stages(text)[-1]
        torch = final[_at(final, "source=wheelhouse/torch,", where)]
        python = re.search(r"PTMG_PYTHON=(\S+)", text)
        assert python, where
        cache = SHARED["uv_cache_mount"]
        link = (f"&& sh /ptmg-build/shared-tree.sh link {contract.TORCH_FILES} "
                f"{contract.VENV}/lib/python{python.group(1)}/site-packages {cache} &&")
        assert link in torch and torch.index(link) < torch.index("import torch, torchvision"), where
        # uv never writes what the venv links: those files leave the copy of the stage's cache first.
        prune = f"&& sh /ptmg-build/shared-tree.sh prune {contract.TORCH_FILES} {cache} &&"
        assert prune in torch and torch.index(prune) < torch.index(f"UV_CACHE_DIR={cache} "), where


def test_the_venv_links_each_entry_of_the_cuda_tree_where_it_resolves(texts: dict[str, str]) -> None:
    for where, text in texts.items():
        final = _stages(text)[-1]
        python = re.search(r"PTMG_PYTHON=(\S+)", text)
        assert python, where
        site_packages = f"{contract.VENV}/lib/python{python.group(1)}/site-packages"
        venv = final[_at(final, "-m venv --without-pip", where)]
        links = re.search(r'for entry in (\S+)/\*; do if \[ -e "\$entry" \]; then ln -s "([^"$]+)/\$\{entry##\*/\}" '
                          r'"([^"$]+)/\$\{entry##\*/\}" && test -e "(\S+)/\$\{entry##\*/\}"; fi \|\| exit 1; done &&', venv)
        assert links, (where, venv)
        tree, link, into, checked = links.groups()
        assert (tree, into, checked) == (contract.CUDA_WHEELS, site_packages, site_packages), where
        assert not link.startswith("/"), f"{where}: an absolute link resolves on the host in an unpacked rootfs"
        assert posixpath.normpath(posixpath.join(site_packages, link)) == contract.CUDA_WHEELS, (where, link)


def test_the_os_snapshot_keys_the_os_layer_and_nothing_below_it(texts: dict[str, str]) -> None:
    """A build arg keys every RUN after its ARG line: the venv's RUNs must come before it, and of the
    stages only the OS stage may name it (the shared trees' stages are the image's first layers)."""
    for where, text in texts.items():
        stages = _stages(text)
        final = stages[-1]
        arg = _at(final, f"ARG {contract.OS_SNAPSHOT_ARG}", where)
        assert arg == _at(final, OS_APPLY, where) - 1, where
        venv_runs = [i for i, ins in enumerate(final) if "/ptmg-build/uv pip install" in ins]
        assert venv_runs and max(venv_runs) < arg, f"{where}: a venv RUN after the ARG would be keyed on the snapshot"
        os_stage = _os_stage(text)
        assert _at(os_stage, f"ARG {contract.OS_SNAPSHOT_ARG}", where) == _at(os_stage, "apt_bounded upgrade", where) - 1
        assert not any(contract.OS_SNAPSHOT_ARG in ins for stage in stages[:-1] if stage != os_stage
                       for ins in stage), where


def _os_stage(text: str) -> list[str]:
    (stage,) = (st for st in _stages(text) if st[0].endswith(f" AS {OS['stage']}"))
    return stage


def test_apt_runs_in_the_os_stage_on_the_base_and_the_user_and_the_image_applies_it(texts: dict[str, str]) -> None:
    """The OS stage starts from the image's base with the image's user RUN (apt adds sshd to the same
    /etc/passwd), after the build's Python (both lock apt's cache mounts: the wheels' stages wait for
    that one, not for apt's whole OS work); its RUN records the tree before apt and collects after
    everything else. The image's layer 4 is one RUN that applies that and strips setuid bits."""
    for where, text in texts.items():
        stages = _stages(text)
        final = stages[-1]
        os_stage = _os_stage(text)
        base = re.fullmatch(r"COPY --from=(\S+) / /", _layers(final)[2])
        assert base and os_stage[0] == f"FROM {base.group(1)} AS {OS['stage']}", where
        user, run = _layers(os_stage)
        assert user == final[_at(final, "useradd", where)], where
        assert f"--mount=type=bind,from={PY['stage']},source={PY['stage_libs']},target=/ptmg-build/after-python,rw " in run, where
        assert stages.index(os_stage) == 1 and stages[0][0].endswith(f" AS {PY['stage']}"), where
        body = run.split("--mount=type=secret,id=ca-bundle ", 1)[1]
        assert body.startswith(f"sh /ptmg-build/os-layer.sh mark / {OS['before']} && "), (where, body[:200])
        assert body.endswith(f"&& sh /ptmg-build/os-layer.sh collect / {OS['before']} {OS['out']}"), where
        assert body.index("apt_bounded upgrade") < body.index("rm -f /etc/ssh/ssh_host_*") < body.index(
            dockerfile.BUILD_LOGS) < body.index("os-layer.sh collect"), where
        apply = final[_at(final, OS_APPLY, where)]
        assert apply.startswith(f"RUN --mount=type=bind,from={OS['stage']},source={OS['out']},target=/ptmg-build/os,rw "), where
        assert apply.endswith(f"{OS_APPLY} && find / -xdev -type f -perm /6000 -exec chmod ug-s {{}} +"), where
        assert final[_at(final, OS_APPLY, where) - 2] == "USER 0:0", where
        assert not any("apt" in ins for ins in final if "build-essential" not in ins), \
            f"{where}: apt runs in the OS stage (and devel's own packages)"


def test_every_venv_run_uses_the_build_python_and_leaves_the_venv_naming_usr_bin(texts: dict[str, str]) -> None:
    for where, text in texts.items():
        final = _stages(text)[-1]
        runs = [ins for ins in final if "/ptmg-build/uv pip install" in ins or "-m venv " in ins]
        assert len(runs) in (3, 4), where  # the venv, torch, tools (+ devel)
        for ins in runs:
            assert f"--mount=type=bind,from={PY['stage']},target={PY['root']} " in ins, where
            assert f"export LD_LIBRARY_PATH={PY['libs']} PATH=$PATH:{PY['root']}/usr/bin &&" in ins, where
            assert ins.endswith(f"&& sh /ptmg-build/build-python.sh restore {contract.VENV}"), where
        assert f"&& {PY['root']}/usr/bin/python3 -m venv --without-pip {contract.VENV} &&" in runs[0], where
        assert all(f"&& sh /ptmg-build/build-python.sh use {contract.VENV} &&" in ins for ins in runs[1:]), where


def test_the_build_python_is_a_stage_from_the_same_base_and_not_in_the_image(texts: dict[str, str]) -> None:
    for where, text in texts.items():
        stages = [s for s in _stages(text) if not s[0].endswith(f" AS {NATIVE['stage']}")]  # its own test
        assert len(stages) == 5, where
        stage, _, _, _, final = stages
        copied = re.fullmatch(r"COPY --from=(\S+) / /", _layers(final)[2])
        assert copied, where
        assert stage[0] == f"FROM {copied.group(1)} AS {PY['stage']}", where
        (run,) = (ins for ins in stage if ins.startswith("RUN "))
        assert "apt_bounded upgrade" not in run, f"{where}: the stage must not be a second OS layer"
        # python3 and strip; not python3-venv (ensurepip: the venv is made --without-pip), which would
        # bring pip's and setuptools' wheels and ca-certificates, whose hashing is minutes under qemu.
        assert "apt_bounded install -y --no-install-recommends binutils python3 &&" \
               in run, where
        # The image gets its python3 (the one the venv names) from its own OS layer.
        os_run = _os_stage(text)[-1]
        assert " python3 " in os_run and " python3-venv " in os_run, where
        assert not any(f"from={PY['stage']}" in ins for ins in final if "build-python.sh" not in ins), where


def test_a_cell_whose_bytecode_uv_cannot_compile_compiles_it_with_the_build_hosts_python_in_one_process(
        texts: dict[str, str]) -> None:
    """A cell built under qemu on x86_64 hosts (the arm64 cell) has a second build-Python stage, FROM the
    same base on $BUILDPLATFORM, whose text is the native cells' stage of that base (one stage in the
    builder's cache for both); a native cell of Python 3.12 or newer (the py3.13 cell: uv's pool of workers
    made its .pyc bytes differ from build to build) uses the build's Python stage itself, at its own
    mount. Either way its venv RUNs install without uv's --compile-bytecode and compile what uv installed
    with that stage's python3, one process, hash-checked. A native Python 3.11 cell has none of it."""
    epoch = dockerfile.SOURCE_DATE_EPOCH
    seen = {"emulated": 0, "ordered": 0, "uv": 0}
    for where, text in texts.items():
        stages = _stages(text)
        native = [s for s in stages if s[0].endswith(f" AS {NATIVE['stage']}")]
        installs = [ins for ins in stages[-1] if "/ptmg-build/uv pip install --python " in ins]
        assert len(installs) in (2, 3), where  # torch, tools (+ devel)
        python = re.search(r"PTMG_PYTHON=(\S+)", text)
        assert python, where
        version = python.group(1)
        if stages[0][0].startswith("FROM debian:") and version == "3.11":  # a linux/amd64 cell, uv compiles
            seen["uv"] += 1
            assert not native and "native-bytecode.sh" not in text, where
            assert all(" --compile-bytecode -r /ptmg-build/requirements.txt; }" in ins for ins in installs), where
            continue
        if stages[0][0].startswith("FROM debian:"):  # linux/amd64, Python 3.12 or newer
            seen["ordered"] += 1
            assert version >= "3.12" and not native, where
            compiler, mount = str(PY["root"]), f"--mount=type=bind,from={PY['stage']},target={PY['root']} "
            assert all(ins.count(f"from={PY['stage']},") == 1 for ins in installs), where  # no second mount
        else:
            seen["emulated"] += 1
            (stage,) = native
            base = stage[0].split()[2]
            assert stage[0] == f"FROM --platform=$BUILDPLATFORM {base} AS {NATIVE['stage']}", where
            twins = [_stages(t)[0] for t in texts.values() if _stages(t)[0][0] == f"FROM {base} AS {PY['stage']}"]
            assert twins and all(twin[1:] == stage[1:] for twin in twins), where
            compiler, mount = NATIVE["root"], f"--mount=type=bind,from={NATIVE['stage']},target={NATIVE['root']} "
        for ins in installs:
            assert "--compile-bytecode" not in ins and mount in ins, where
            tmp, sp = f"{contract.VENV}/.uv-tmp", f"{contract.VENV}/lib/python{version}/site-packages"
            mark = ins.index(f"&& sh /ptmg-build/native-bytecode.sh mark {sp} {tmp}/{NATIVE['list']} &&")
            done = ins.index(f"&& SOURCE_DATE_EPOCH={epoch} sh /ptmg-build/native-bytecode.sh compile {sp} "
                             f"{tmp}/{NATIVE['list']} {compiler} {version} &&")
            assert ins.index("ptmg_uv() {") < mark < ins.rindex("ptmg_uv") < done < ins.index(f"&& rm -rf {tmp} "), where
    # images.yaml's arm64 and py3.13 cells, and the 3.11 cells
    assert all(seen.values()), seen
