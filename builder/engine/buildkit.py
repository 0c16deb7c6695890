"""Builds through the Docker CLI with BuildKit (cache mounts, build secrets, --platform).

The Docker SDK drives only the classic builder, so BuildKit builds go through a CLI:
Debian's 20.10 ``docker`` with ``DOCKER_BUILDKIT=1``, or any CLI with the buildx plugin.
:func:`to_classic` rewrites a Dockerfile for the classic builder when no such CLI exists.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from builder.engine.model import BuildOutcome, BuildRequest


@dataclass(frozen=True)
class BuildkitCli:
    """A docker CLI that builds with BuildKit, and how to ask it to."""

    path: str
    argv_prefix: tuple[str, ...]  # ("build",) with DOCKER_BUILDKIT=1, or ("buildx", "build", "--load")
    env: Mapping[str, str] = field(repr=False)


def find_buildkit_cli() -> BuildkitCli | None:
    """The first docker CLI here that can build with BuildKit.

    A CLI with the buildx plugin builds with `buildx build --load`. A 20.10 CLI
    (Debian's docker.io) builds with BuildKit when DOCKER_BUILDKIT=1. A newer CLI
    without buildx refuses BuildKit, so it is skipped.
    """
    seen: set[str] = set()
    for cand in ("/usr/bin/docker", shutil.which("docker") or ""):
        if not cand or cand in seen or not os.access(cand, os.X_OK):
            continue
        seen.add(cand)
        env = {**os.environ, "DOCKER_BUILDKIT": "1"}
        if _quiet([cand, "buildx", "version"]):
            return BuildkitCli(cand, ("buildx", "build", "--load"), env)
        out = subprocess.run([cand, "version", "--format", "{{.Client.Version}}"], capture_output=True,
                             text=True, check=False, timeout=20).stdout.strip()
        m = re.match(r"(\d+)\.", out)
        if m and int(m.group(1)) < 23:
            return BuildkitCli(cand, ("build",), env)
    return None


def _quiet(argv: Sequence[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, check=False, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


STEP_RE = re.compile(r"^#\d+ \[[^\]]*\d+/\d+\] ")


def to_classic(dockerfile_text: str) -> str:
    """The same Dockerfile for the classic builder, which has no RUN --mount.

    Cache mounts become plain directories that the same RUN empties at its end, so
    the layer holds what a BuildKit build's layer holds. Secret mounts are dropped:
    the classic builder has no safe way to carry them (see build_classic).
    """
    out: list[str] = []
    lines = dockerfile_text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("RUN --mount="):
            out.append(line)
            i += 1
            continue
        caches: list[str] = []
        head = line[len("RUN "):]
        body: list[str] = []
        # Consume mount options until the first line that is the command itself.
        while True:
            stripped = head.strip().rstrip("\\").strip()
            if stripped.startswith("--mount="):
                opts = dict(kv.split("=", 1) for kv in stripped[len("--mount="):].split(",") if "=" in kv)
                if opts.get("type") == "cache":
                    caches.append(opts["target"])
                i += 1
                head = lines[i]
                continue
            break
        body.append("RUN " + head.strip())
        i += 1
        while body[-1].endswith("\\") and i < len(lines):
            body.append(lines[i])
            i += 1
        if caches:
            body[-1] = body[-1] + " \\"
            body.append(" && rm -rf " + " ".join(f"{c}/*" for c in caches))
        out.extend(body)
    return "\n".join(out) + "\n"


def build_with_cli(req: BuildRequest, on_line: Callable[[str], None], cli: BuildkitCli) -> BuildOutcome:
    """`docker build` through a BuildKit CLI, streaming every line to the log and `on_line`."""
    with tempfile.TemporaryDirectory(prefix="ptmg-build-") as tmp:
        iidfile = Path(tmp) / "iid"
        argv = [cli.path, *cli.argv_prefix, "--progress=plain", "--pull=false",
                "--file", str(req.dockerfile), "--iidfile", str(iidfile)]
        if req.no_cache:
            argv.append("--no-cache")
        if req.platform:
            argv += ["--platform", req.platform]
        for k, v in sorted(req.build_args.items()):
            argv += ["--build-arg", f"{k}={v}"]
        for k, v in sorted(req.labels.items()):
            argv += ["--label", f"{k}={v}"]
        for sid, path in sorted(req.secrets.items()):
            argv += ["--secret", f"id={sid},src={path}"]
        argv.append(str(req.context))
        tail: list[str] = []
        failed_step = ""
        with req.log_path.open("w", encoding="utf-8") as log:
            log.write("$ " + " ".join(argv) + "\n")
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace", env=dict(cli.env), cwd=req.context)
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.rstrip("\n")
                log.write(line + "\n")
                tail.append(line)
                del tail[:-30]
                if line.startswith("ERROR: ") or line.startswith("error: "):
                    failed_step = failed_step or line
                elif " > [" in line and line.lstrip().startswith(">"):
                    failed_step = line.strip()
                on_line(line)
            code = proc.wait()
        if code != 0 or not iidfile.exists():
            return BuildOutcome(False, None, "buildkit", failed_step or f"docker build exited {code}", tuple(tail))
        return BuildOutcome(True, iidfile.read_text().strip(), "buildkit")
