"""arm64 cells without Docker or qemu: the platform flag, the foreign base's name and apt
caches, the emulation probe's verdicts, the doctor's findings, the in-image skips under
emulation, the engine's --init for foreign images, and the tags a multi-platform cell shares."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import ptmg_contract as contract
from builder.cli import main as cli
from builder.engine import Engine, emulation
from builder.host import doctor
from builder.matrix import Matrix, platforms, tags
from builder.render import dockerfile
from tests.support import LATEST, SEED_MATRIX, cell, load_module, small_matrix, write_matrix

ROOT = Path(__file__).resolve().parents[3]
ARM = f"{LATEST}-arm64"
ARM_MATRIX = SEED_MATRIX + """\
  - torch: "2.14.1"
    torchvision: "0.29.1"
    cuda: "13.0"
    cudnn: 9
    platform: linux/arm64
"""


@pytest.fixture
def matrix(tmp_path: Path) -> Matrix:
    return small_matrix(tmp_path / "m", ARM_MATRIX)


# --- the cell ---------------------------------------------------------------------------
def test_arm64_cell_names_its_own_base_and_apt_caches(matrix: Matrix) -> None:
    arm, amd = cell(matrix, ARM), cell(matrix, LATEST)
    assert (arm.tag, arm.platform, arm.emulated) == (LATEST, "linux/arm64", True)
    assert arm.base == amd.base == "debian:bookworm-slim"
    assert (amd.base_ref, arm.base_ref) == ("debian:bookworm-slim", "arm64v8/debian:bookworm-slim")
    assert (amd.apt_cache_key, arm.apt_cache_key) == ("bookworm", "bookworm-arm64")
    text = dockerfile.render(arm)
    assert "\nFROM arm64v8/debian:bookworm-slim AS ptmg-python\n" in text and "\nCOPY --from=arm64v8/debian:bookworm-slim / /\n" in text
    assert "id=ptmg-apt-bookworm-arm64," in text and "id=ptmg-apt-lists-bookworm-arm64," in text
    amd_text = dockerfile.render(amd)
    assert "\nCOPY --from=debian:bookworm-slim / /\n" in amd_text and "id=ptmg-apt-bookworm," in amd_text
    # The build host's Python (the bytecode compiler: test_layer_order) is the one stage on the
    # host's own base and apt caches; take it and its calls out.
    native = re.search(r"\n# 0n\. .*?\n\n(?=# 0b\. )", text, re.S)
    assert native and "\nFROM --platform=$BUILDPLATFORM debian:bookworm-slim AS ptmg-native-python\n" in native.group()
    text = text.replace(native.group(), "\n")
    assert "id=ptmg-apt-bookworm," not in text and "--compile-bytecode" not in text
    text = re.sub(r"    --mount=type=bind,from=ptmg-native-python,\S+ \\\n    --mount=\S+native-bytecode.sh \\\n", "", text)
    text = re.sub(r"\n && (?:SOURCE_DATE_EPOCH=\d+ )?sh /ptmg-build/native-bytecode\.sh [^\n]*"
                  r"(?:\n      [^\n]*native-python 3\.11 \\)?", "", text)
    text = re.sub(r"(--python /opt/venv/bin/python \\\n[^\n]*\n      )-r ", r"\1--compile-bytecode -r ", text)
    # the same image otherwise: only the base, the apt caches, the cell's name and the CUDA
    # targets of the aarch64 wheel (compat data: aarch64_arch_list) differ
    assert arm.arch_list != amd.arch_list and "sm_110" in arm.arch_list
    strip = (("arm64v8/", ""), ("bookworm-arm64", "bookworm"), (ARM, LATEST),
             (" ".join(arm.arch_list), " ".join(amd.arch_list)))
    for old, new in strip:
        text = text.replace(old, new)
    assert text == amd_text


def test_real_images_yaml_has_the_newest_torch_as_an_arm64_cell() -> None:
    from builder.matrix import load_matrix

    m = load_matrix(ROOT / "images.yaml")
    arm = [c for c in m.cells if c.platform == "linux/arm64"]
    newest = max(m.cells, key=lambda c: [int(x) for x in c.torch.split(".")])
    assert [c.torch for c in arm] == [newest.torch] and arm[0].cuda != "cpu"
    assert any(c.tag == arm[0].tag and c.platform == "linux/amd64" for c in m.cells)
    assert not arm[0].latest


# --- --platforms ------------------------------------------------------------------------
def test_platform_words() -> None:
    assert platforms.parse("native") == ("native",) and platforms.parse("all") == ("all",)
    assert platforms.parse("linux/arm64, linux/amd64") == ("linux/arm64", "linux/amd64")
    for bad in ("", ",", "arm64", "native,all", "linux/riscv64"):
        with pytest.raises(ValueError, match="native, all"):
            platforms.parse(bad)
    assert platforms.host_platform("x86_64") == "linux/amd64"
    assert platforms.host_platform("aarch64") == "linux/arm64"


def test_choose_keeps_matrix_order(matrix: Matrix) -> None:
    names = [c.name for c in matrix.cells]
    kept, left = platforms.choose(matrix.cells, ("native",), "linux/amd64")
    assert [c.name for c in left] == [ARM] and [c.name for c in kept] == [n for n in names if n != ARM]
    kept, left = platforms.choose(matrix.cells, ("native",), "linux/arm64")  # on a Grace Hopper host
    assert [c.name for c in kept] == [ARM]
    assert [c.name for c in platforms.choose(matrix.cells, ("all",), "linux/amd64")[0]] == names
    assert [c.name for c in platforms.choose(matrix.cells, ("linux/arm64",), "linux/amd64")[0]] == [ARM]


def _run(tmp_path: Path, *argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    path = write_matrix(tmp_path / "cli", ARM_MATRIX)
    code = cli.main([*argv, "--config", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def test_build_covers_the_native_platform_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PTMG_PLATFORMS", raising=False)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    # the selection main.py hands the verb (running `build` itself would need an engine)
    ctx = cli._context(cli.parser().parse_args(["build", "--config", str(write_matrix(tmp_path / "x", ARM_MATRIX))]))
    assert ARM not in [c.name for c in ctx.cells] and len(ctx.cells) == 3
    args = cli.parser().parse_args(["test", "--platforms", "all", "--config", str(tmp_path / "x" / "images.yaml")])
    assert ARM in [c.name for c in cli._context(args).cells]
    monkeypatch.setenv("PTMG_PLATFORMS", "linux/arm64")
    args = cli.parser().parse_args(["build", "--config", str(tmp_path / "x" / "images.yaml")])
    assert [c.name for c in cli._context(args).cells] == [ARM]
    monkeypatch.delenv("PTMG_PLATFORMS")
    args = cli.parser().parse_args(["publish", "--config", str(tmp_path / "x" / "images.yaml")])
    assert ARM in [c.name for c in cli._context(args).cells]  # publish: every platform of a tag


@pytest.mark.parametrize(("argv", "says"), [
    (("build", "--platforms", "arm64"), "--platforms: 'arm64': unknown platform 'arm64'"),
    (("build", "--only", "*-arm64"), "--platforms native: leaves none of the selected cells"),
])
def test_platform_flag_errors_are_one_located_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...],
                                                   says: str) -> None:
    monkeypatch.delenv("PTMG_PLATFORMS", raising=False)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    try:
        code, _, err = _run(tmp_path, *argv, capsys=capsys)
    except SystemExit as exc:  # argparse's own refusal (our Parser exits 2)
        code, err = int(str(exc.code)), capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


# --- emulation ----------------------------------------------------------------------------
HANDLER = ("enabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\nflags: POF\noffset 0\n"
           "magic 7f454c460201010000000000000000000200b700\n")


def test_judge_the_handler_and_the_qemu_in_use() -> None:
    ok = emulation.judge("linux/arm64", HANDLER, "qemu-aarch64 version 10.0.2 (Debian 1:10.0.2+ds-2)",
                         "/usr/bin/qemu-aarch64")
    assert ok.ok and ok.version == "10.0.2" and ok.flags == "POF" and "qemu 10.0.2" in ok.describe()
    old = emulation.judge("linux/arm64", HANDLER, "qemu-aarch64 version 7.2.22 (Debian 1:7.2+dfsg-7)",
                          "/usr/bin/qemu-aarch64-static")
    assert not old.ok and old.too_old and "7.2.22" in old.problem and "import torch" in old.problem
    stale = emulation.judge("linux/arm64", HANDLER, "qemu-aarch64 version 10.0.2", "/usr/bin/qemu-aarch64 (deleted)")
    assert stale.ok and stale.stale
    none = emulation.judge("linux/arm64", None, "", "")
    assert not none.ok and not none.too_old and "no binfmt_misc handler" in none.problem
    no_f = emulation.judge("linux/arm64", HANDLER.replace("POF", "P"), "", "")
    assert not no_f.ok and "F flag" in no_f.problem
    off = emulation.judge("linux/arm64", HANDLER.replace("enabled", "disabled"), "", "")
    assert not off.ok and "disabled" in off.problem
    assert emulation.parse_version("garbage") is None


def test_probe_program_is_a_static_aarch64_elf() -> None:
    elf = emulation.tiny_aarch64_elf()
    assert len(elf) == 64 + 56 + 44 and elf[:4] == b"\x7fELF"
    assert int.from_bytes(elf[18:20], "little") == 183  # EM_AARCH64


def test_doctor_refuses_an_old_qemu_and_names_the_fix() -> None:
    def fake(version: str | None) -> Any:
        return lambda platform: (emulation.judge(platform, HANDLER, f"qemu-aarch64 version {version}", "/q")
                                 if version else emulation.judge(platform, None, "", ""))

    cells = {"linux/arm64": [ARM]}
    (level, what, fix), = emulation.findings(["linux/arm64"], cells, fake("7.2.22"))
    assert level == "fail" and ARM in what and "bookworm-backports" in fix
    (level, what, fix), = emulation.findings(["linux/arm64"], cells, fake(None))
    assert level == "warn" and "ensure-tools.sh emulation" in fix
    (level, what, _), = emulation.findings(["linux/arm64"], cells, fake("10.0.2"))
    assert level == "ok" and "qemu 10.0.2" in what
    assert emulation.findings(["linux/arm64"], cells, lambda p: emulation.Emulation(p, native=True)) == []


def test_doctor_never_promises_gpus_to_an_emulated_cell(matrix: Matrix) -> None:
    gpus = [doctor.Gpu("NVIDIA H100", "580.65")]
    by_cell = {f.what.split(":")[0]: f for f in doctor.cell_findings(matrix.cells, gpus, "")}
    assert by_cell[ARM].level == "warn" and "emulation only" in by_cell[ARM].what
    assert by_cell[LATEST].level == "ok"



def test_selftest_skips_what_takes_minutes_under_emulation_with_the_reason() -> None:
    conftest = load_module("ptmg_smoke_conftest", ROOT / "smoke_tests" / "conftest.py")

    def item(module: str, *markers: str) -> Any:
        return SimpleNamespace(module=SimpleNamespace(__name__=module),
                               get_closest_marker=lambda m: m if m in markers else None)

    where = "linux/arm64 on linux/amd64, qemu 10.0.2"
    assert "torchrun" in conftest.emulation_skip(item("test_ddp", "ddp"), where)
    assert where in conftest.emulation_skip(item("test_seeds", "seed", "ddp"), where)
    assert "torch.compile" in conftest.emulation_skip(item("test_compile"), where)
    assert conftest.emulation_skip(item("test_versions"), where) == ""
    assert conftest.emulation_skip(item("test_rdma"), where) == ""
    assert conftest.emulation_skip(item("test_ddp", "ddp"), "") == ""  # natively: everything runs


# --- the engine: --init for another architecture's containers -------------------------------
class _Images:
    def get(self, ref: str) -> Any:
        arch = "arm64" if "arm64" in ref else "amd64"
        return SimpleNamespace(attrs={"Id": "sha256:x", "Architecture": arch, "Os": "linux"})


class _Containers:
    def __init__(self) -> None:
        self.kwargs: list[dict[str, Any]] = []

    def run(self, image: str, command: Any, **kwargs: Any) -> Any:
        self.kwargs.append(kwargs)
        return SimpleNamespace(id="c1", name="n1")


def test_engine_starts_foreign_images_with_an_init_and_their_platform() -> None:
    fake = SimpleNamespace(images=_Images(), containers=_Containers(), info=lambda: {"Architecture": "x86_64"})
    engine = Engine(client=fake, labels={"project": "pt-multi-gpu"})
    engine.start("pt-multi-gpu:x-arm64", ["true"])
    engine.start("pt-multi-gpu:x", ["true"])
    arm, amd = fake.containers.kwargs
    assert arm["init"] is True and arm["platform"] == "linux/arm64"
    assert arm["environment"] == {"TINI_SUBREAPER": "1"}  # the image's tini, no longer PID 1, still reaps
    assert "init" not in amd and "platform" not in amd
    assert engine.foreign_platform("pt-multi-gpu:x-arm64") == "linux/arm64"


# --- tags: one tag, every platform ----------------------------------------------------------
def test_platforms_of_a_cell_share_its_tags_and_get_one_each(matrix: Matrix) -> None:
    plans = tags.plan(matrix, "20261201", "4a297245bf90")
    arm, amd = plans[ARM], plans[LATEST]
    assert arm.immutable == amd.immutable and arm.group == amd.group == LATEST
    assert "latest" in amd.floating and "latest" not in arm.floating
    assert tags.platform_tag(cell(matrix, ARM), "4a297245bf90") == f"{LATEST}-4a29724-arm64"
    assert tags.platform_tag(cell(matrix, LATEST), "4a297245bf90-dirty") == f"{LATEST}-4a29724-dirty-amd64"
    clash = tags.CellTags("other", (amd.immutable[0],), ())  # another cell claiming that tag: still refused
    with pytest.raises(tags.TagError, match="ambiguous"):
        tags.check_unambiguous([amd, arm, clash])


def test_contract_names_the_emulation_variable() -> None:
    assert contract.ENV_SMOKE_EMULATED.startswith("PTMG_")


# --- launch: arm64 nodes ---------------------------------------------------------------------
def test_kubernetes_jobs_of_an_arm64_cell_select_arm64_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    import yaml

    path = write_matrix(tmp_path / "l", ARM_MATRIX)
    for target in ("pytorchjob", "jobset"):
        assert cli.main(["launch", "--target", target, "--only", ARM, "--no-pin", "--config", str(path)]) == 0
        docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d and d["kind"] != "Service"]
        text = yaml.safe_dump(docs)
        assert "kubernetes.io/arch: arm64" in text and f"pt-multi-gpu:{LATEST}\n" in text  # the tag, not -arm64
    assert cli.main(["launch", "--target", "pytorchjob", "--only", LATEST, "--no-pin", "--config", str(path)]) == 0
    assert "kubernetes.io/arch: amd64" in capsys.readouterr().out
    assert cli.main(["launch", "--target", "slurm", "--only", ARM, "--no-pin", "--config", str(path)]) == 0
    assert f"pt-multi-gpu:{LATEST}" in capsys.readouterr().out  # Slurm: the multi-platform tag, nothing else


# --- the foreign base ------------------------------------------------------------------------
class _BaseEngine:
    """image_attrs/pull/untag/image_labels of an engine that has (or lacks) one image."""

    def __init__(self, arch: str | None, pull_error: str | None = "no registry here") -> None:
        self.arch = arch
        self.pull_error = pull_error
        self.pulls: list[tuple[str, str | None]] = []

    def image_attrs(self, ref: str) -> dict[str, Any] | None:
        return None if self.arch is None else {"Architecture": self.arch, "Os": "linux"}

    def image_labels(self, ref: str) -> dict[str, str]:
        return {contract.LABEL_BASE_APT_SUITES: "bookworm bookworm-updates bookworm-security"}

    def pull(self, ref: str, platform: str | None = None) -> str | None:
        self.pulls.append((ref, platform))
        return self.pull_error

    def untag(self, ref: str) -> None:
        self.arch = None


def test_foreign_base_local_pulled_or_refused(matrix: Matrix, monkeypatch: pytest.MonkeyPatch) -> None:
    from builder.imaging import base_foreign
    from builder.imaging.base_image import BaseError

    arm = cell(matrix, ARM)
    assert base_foreign.ensure(_BaseEngine("arm64"), arm).how == "local"  # type: ignore[arg-type]
    with pytest.raises(BaseError, match=r"(?s)is amd64, not arm64.*docker rmi arm64v8/debian:bookworm-slim"):
        base_foreign.ensure(_BaseEngine("amd64"), arm)  # type: ignore[arg-type]
    engine = _BaseEngine(None)
    monkeypatch.setattr(emulation, "probe", lambda p: emulation.judge(p, None, "", ""))
    with pytest.raises(BaseError, match=r"(?s)no binfmt_misc handler.*ensure-tools\.sh emulation"):
        base_foreign.ensure(engine, arm)  # type: ignore[arg-type]
    assert engine.pulls == [("arm64v8/debian:bookworm-slim", "linux/arm64")]  # pulled for its platform first


def test_a_base_is_made_by_one_process_at_a_time(matrix: Matrix, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Two build.py processes (`make images` and a `--only X`, or the test tier's background builds)
    that both find a base missing must not both bootstrap it. While another process holds the
    base's lock, ensure() waits without touching the engine; then it finds the base local."""
    from builder.common import flock
    from builder.imaging import base_foreign

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    arm = cell(matrix, ARM)
    path = flock.lock_file("base", f"{arm.base_ref}-{arm.arch}")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; p = sys.argv[1];"
         "os.makedirs(os.path.dirname(p), exist_ok=True); fd = os.open(p, os.O_RDWR | os.O_CREAT);"
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)", str(path)],
        stdout=subprocess.PIPE, text=True)
    engine = _BaseEngine("arm64")
    looked: list[str] = []
    attrs = engine.image_attrs

    def image_attrs(ref: str) -> dict[str, Any] | None:
        looked.append(ref)
        return attrs(ref)

    engine.image_attrs = image_attrs  # type: ignore[method-assign]
    done: list[str] = []
    worker = threading.Thread(target=lambda: done.append(base_foreign.ensure(engine, arm).how),  # type: ignore[arg-type]
                              daemon=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        worker.start()
        worker.join(1.0)
        assert worker.is_alive() and not looked, "ensure() went on while another process held the base's lock"
    finally:
        holder.kill()
        holder.wait()
    worker.join(30)
    assert done == ["local"] and looked


def test_an_emulated_cells_inputs_name_the_build_hosts_base_too(matrix: Matrix, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The arm64 cell's bytecode is compiled by the python3 of a stage FROM the host's own base
    (dockerfile/06-native-python.j2), so build.py makes that base where it is absent, and its id
    keys the cell's inputs with the arm64 base's: a re-made host base rebuilds the cell."""
    from builder.imaging import base_foreign, base_image, orchestrate

    arm, amd = cell(matrix, ARM), cell(matrix, LATEST)
    ids = {arm.base_ref: "sha256:arm"}
    made: list[tuple[str, str]] = []

    class Engine:
        def image_exists(self, ref: str) -> bool:
            return ref in ids

        def image_id(self, ref: str) -> str:
            return ids[ref]

    def ensure_host_base(engine: object, spec: Any, mirror: str) -> None:
        made.append(("host", spec.base))
        ids[spec.base] = "sha256:amd"

    monkeypatch.setattr(base_image, "ensure", ensure_host_base)
    monkeypatch.setattr(base_foreign, "ensure", lambda *a, **k: made.append(("foreign", "")))
    cfg = orchestrate.BuildConfig(root=ROOT, docker_dir=tmp_path / "d", log_dir=tmp_path / "l")
    builder = orchestrate._Builder(Engine(), cfg, lambda _c, _l: None)  # type: ignore[arg-type]
    monkeypatch.setattr(builder, "cli", lambda: None)
    assert builder.base_id(arm) == "sha256:arm sha256:amd" and made == [("host", "debian:bookworm-slim")]
    assert builder.base_id(arm) == "sha256:arm sha256:amd" and len(made) == 1  # there now: made once
    ids["debian:bookworm-slim"] = "sha256:amd-remade"
    assert builder.base_id(arm) == "sha256:arm sha256:amd-remade"
    assert builder.base_id(amd) == "sha256:amd-remade"  # a native cell: its own base alone
