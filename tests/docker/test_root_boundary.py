"""Root boundary, attacked: code running as `pt` must never get root to run, import,
write, chown or read something it planted.

The attack (tests/docker/rootattack.py) is generic: it finds, in the running containers,
every PATH and sys.path a root process uses or could use (the PATH of every uid-0
process, the image's and the container's Config.Env, `docker exec`'s environment, root
login shells, /etc/login.defs, the programs root Python code starts, seen by an audit
hook bind-mounted read-only into the system python), then, as pt:

* plants a payload named after every executable of the system bin dirs (and what a GPU
  host injects: nvidia-smi, ...) in every pt-writable dir on any of those PATHs; each
  payload records its uid and then runs the real program;
* plants sitecustomize.py, usercustomize.py and a .pth in every pt-writable dir on any
  python's sys.path, and shadows of every stdlib module in the dirs that come before the
  stdlib (a script's dir, the cwd);
* replaces every path root wrote, chowned or renamed in a pt-controlled place (from the
  audit log, plus root-owned entries in pt-writable dirs, plus seeds in the trees the uid
  remap walks) with a link to a fresh root-owned canary, and every path root only read
  with a link to a root-only canary holding a secret marker;

then drives every path on which root acts: each service killed (the supervisor restarts
it), healthchecks (every 2 s), `docker exec` without -u, SSH logins, a Jupyter call,
`docker restart`, a root-mode start with PT_UID/PT_GID=4242 of the planted container,
a restart of that, and a root start without the documented flags (which must refuse).

Passes only if no payload ran as uid 0, no root-owned file under /opt /etc /usr /root
/var/lib /bin /sbin /lib changed owner, mode or content (no file appeared in a canary
dir), no root-only marker became readable by pt, pt cannot signal or hard-link root's
things, and the attack was armed (every planting worked, every payload recorded a run).

It fails against the image before the root boundary (2.7.0-cuda12.6-cudnn9-runtime from 1e80d55, image
bba3c813; run of 2026-12-01, 106 s): 3 failed, 3 passed. 21 distinct payloads ran as uid 0, 172
runs: dirname and ssh-keygen at every start, setpriv at every service start and restart (for
uid 1000 and 4242), groupmod/usermod in the remap, nvidia-smi in the diagnostics; on `docker
exec` without -u: python, python3, pip, bash, sh, cat, env, id (from /etc/profile), mesg (from
/root/.profile), a .pth in four venv site dirs, 38 stdlib modules shadowed in /opt/venv/bin and
2 in /workspace. The root-owned canaries behind Jupyter's token and password-hash files changed
owner to pt (4 changes, before and after the remap); the secret behind ~pt/.ssh/authorized_keys
became readable by pt (and reached the log). Against the fixed image: 6 passed, about 80 s.
See docs/security.md for the design it attacks.

    PTMG_TEST_IMAGE=pt-multi-gpu:<cell> python -m pytest -s tests/docker/test_root_boundary.py

Takes 3-6 minutes on a 2-core host. The full record (what ran where, the discovery, the
audit log) goes to $PTMG_TEST_ARTIFACTS/root-boundary.json (default: test-artifacts/).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from .rootattack import Result, run_attack

ARTIFACTS = Path(os.environ.get("PTMG_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))


@pytest.fixture(scope="module")
def attack(docker_client: docker.DockerClient, test_image: str, session_labels: dict[str, str],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Result]:
    work = tmp_path_factory.mktemp("attack")
    work.chmod(0o755)  # the audit hook is bind-mounted from here, read by root in the container
    result = run_attack(docker_client, test_image, work, session_labels, print)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    out = ARTIFACTS / "root-boundary.json"
    out.write_text(json.dumps(result.to_json(), indent=1, default=str))
    print("\n" + result.summary() + f"\n(details: {out})")
    yield result


def test_no_payload_ran_as_root(attack: Result) -> None:
    rp = attack.root_payloads()
    assert not rp, ("pt-planted code ran as uid 0:\n" +
                    "\n".join(f"  {k}  e.g. {v[0][:120]}" for k, v in sorted(rp.items())))


def test_no_root_owned_file_changed(attack: Result) -> None:
    assert not attack.file_changes and not attack.new_in_canary_dirs, (
        "root wrote through pt-controlled paths:\n" +
        "\n".join(f"  [{c['container']}] {c['path']}: {c['what']} {c['before']} -> {c['after']}"
                  for c in attack.file_changes) +
        "".join(f"\n  new file {p}" for p in attack.new_in_canary_dirs))


def test_no_root_only_content_reaches_pt(attack: Result) -> None:
    assert not attack.leaks, f"root copied root-only canary content where pt can read it: {attack.leaks}"
    assert not attack.log_leaks, f"root-only canary content in the container log: {attack.log_leaks}"


def test_pt_cannot_signal_root_processes(attack: Result) -> None:
    assert not attack.signalled_root, f"pt could signal root processes: {attack.signalled_root}"


def test_pt_cannot_hardlink_root_files(attack: Result) -> None:
    assert attack.hardlinks, "the hard-link attempt did not run"
    assert all(v != "linked" for v in attack.hardlinks.values()), attack.hardlinks


def test_the_attack_was_armed(attack: Result) -> None:
    """Sanity of the harness itself, so that a pass means 'attacked and held': every
    payload it planted works (records, then runs the real program), every planting
    succeeded, and the venv (on the image's PATH, writable by pt) was planted."""
    errors = {d: v["errors"] for d, v in attack.planted.get("path_dirs", {}).items() if v["errors"]}
    assert not errors, f"planting failed: {errors}"
    link_errors = [x for x in attack.planted.get("links", []) if "error" in x]
    assert not link_errors, f"link planting failed: {link_errors}"
    broken = {k: v for k, v in attack.selftest.items() if v != 0}
    assert not broken, f"planted payloads broke these (exit status): {broken}"
    assert "/opt/venv/bin" in attack.planted.get("path_dirs", {}), "the venv's bin dir was not planted"
    for d in attack.planted.get("path_dirs", {}):
        assert any(r.kind == "exec" and r.where.startswith(d + "/") for r in attack.records), (
            f"the payload planted in {d} never recorded a run (not even the self-test)")
    assert any(r.kind == "py" for r in attack.records), "no planted python hook ever ran"
