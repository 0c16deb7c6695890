"""Builds through the Docker CLI with BuildKit (cache mounts, build secrets, --platform).

The Docker SDK drives only the classic builder, so BuildKit builds go through a CLI:
Debian's 20.10 ``docker`` with ``DOCKER_BUILDKIT=1``, or any CLI with the buildx plugin.
:func:`to_classic` rewrites a Dockerfile for the classic builder when no such CLI exists.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from builder.engine.capabilities import parse_inspect
from builder.engine.model import BuildOutcome, BuildRequest


@dataclass(frozen=True)
class BuildkitCli:
    """A docker CLI that builds with BuildKit, and how to ask it to."""

    path: str
    argv_prefix: tuple[str, ...]  # ("build",) with DOCKER_BUILDKIT=1, or ("buildx", "build", "--load", ...)
    env: Mapping[str, str] = field(repr=False)

    @property
    def buildx(self) -> bool:
        return self.argv_prefix[:1] == ("buildx",)

    def describe(self) -> str:
        return f"{self.path} {'buildx' if self.buildx else 'build with DOCKER_BUILDKIT=1'}"


#: buildx's own additions to a build, off: an image is one manifest, as the 20.10 builder makes it, in
#: both image stores (with a provenance attestation the containerd store's image would be an index).
BUILDX_ARGS = ("buildx", "build", "--load", "--provenance=false", "--sbom=false")
MISSING_BUILDX = ("{cli} is Docker {version}, whose `docker build` builds with BuildKit only through the buildx "
                  "plugin, and the plugin is missing. Fix: install it (Debian: apt-get install docker-buildx; "
                  "Docker's repository: docker-buildx-plugin), or put Debian 12's docker.io CLI (20.10) first")


def _candidates() -> list[str]:
    seen: list[str] = []
    for cand in ("/usr/bin/docker", shutil.which("docker") or ""):
        if cand and cand not in seen and os.access(cand, os.X_OK):
            seen.append(cand)
    return seen


def find_buildkit_cli() -> BuildkitCli | None:
    """The docker CLI here that builds with BuildKit, asking each CLI what it can do.

    A CLI with the buildx plugin (any of them: the first on PATH or /usr/bin/docker) builds with
    `buildx build --load`. Else a 20.10 CLI (Debian's docker.io) builds with BuildKit when
    DOCKER_BUILDKIT=1, exactly as before the buildx path existed. A newer CLI without buildx refuses
    BuildKit, so it is skipped (:func:`missing_builder` says why).
    """
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    cands = _candidates()
    for cand in cands:
        if _quiet([cand, "buildx", "version"]):
            return BuildkitCli(cand, BUILDX_ARGS, env)
    for cand in cands:
        major = _client_major(cand)
        if major is not None and major < 23:
            return BuildkitCli(cand, ("build",), env)
    return None


def missing_builder() -> str | None:
    """The one line that says why no CLI here builds with BuildKit (a CLI >= 23 without buildx), or
    None when there is no docker CLI at all (the classic builder's case)."""
    for cand in _candidates():
        major = _client_major(cand)
        if major is not None and major >= 23:
            return MISSING_BUILDX.format(cli=cand, version=major)
    return None


def _client_major(cli: str) -> int | None:
    try:
        out = subprocess.run([cli, "version", "--format", "{{.Client.Version}}"], capture_output=True,
                             text=True, check=False, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.match(r"(\d+)\.", out)
    return int(m.group(1)) if m else None


def buildx_facts(cli: BuildkitCli) -> tuple[str | None, str | None]:
    """(buildx version, BuildKit version as `buildx inspect` reports it) of a buildx CLI; (None, None)
    for a 20.10 CLI, whose engine's BuildKit reports no version."""
    if not cli.buildx:
        return None, None
    try:
        ver = subprocess.run([cli.path, "buildx", "version"], capture_output=True, text=True, check=False,
                             timeout=20, env=dict(cli.env)).stdout.strip()
        inspect = subprocess.run([cli.path, "buildx", "inspect"], capture_output=True, text=True, check=False,
                                 timeout=30, env=dict(cli.env)).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    return (ver.split()[1] if len(ver.split()) > 1 else ver) or None, parse_inspect(inspect)


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
        iidfile, metadata = Path(tmp) / "iid", Path(tmp) / "metadata.json"
        argv = [cli.path, *_prefix(cli, req), "--progress=plain", "--pull=false",
                "--file", str(req.dockerfile), "--iidfile", str(iidfile)]
        if cli.buildx:
            argv += ["--metadata-file", str(metadata)]
        if req.source_date_epoch is not None:
            argv += ["--build-arg", f"SOURCE_DATE_EPOCH={req.source_date_epoch}"]
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
        if req.oci_dest is not None:  # nothing is loaded: the layout folder is the result
            done = code == 0 and (req.oci_dest / "index.json").is_file()
            return BuildOutcome(done, _metadata(metadata, "containerimage.config.digest") if done else None,
                                "buildkit", "" if done else failed_step or f"docker buildx build exited {code}",
                                () if done else tuple(tail), _metadata(metadata, "containerimage.digest"))
        if code != 0 or not iidfile.exists():
            return BuildOutcome(False, None, "buildkit", failed_step or f"docker build exited {code}", tuple(tail))
        return BuildOutcome(True, iidfile.read_text().strip(), "buildkit",
                            manifest_digest=_metadata(metadata, "containerimage.digest"))


def _prefix(cli: BuildkitCli, req: BuildRequest) -> tuple[str, ...]:
    """The CLI's build verb and its output: the engine's image store (`--load`), or for a reproducible
    export an OCI layout folder with every timestamp clamped to SOURCE_DATE_EPOCH."""
    if req.oci_dest is None:
        return cli.argv_prefix
    if not cli.buildx:
        raise ValueError("an OCI export needs the buildx CLI")  # callers check builder.imaging.repro's needs first
    out = f"type=oci,tar=false,dest={req.oci_dest},rewrite-timestamp=true"
    return (*(a for a in cli.argv_prefix if a != "--load"), "--output", out)


def _metadata(metadata: Path, key: str) -> str | None:
    """A digest buildx wrote to its metadata file (containerimage.digest: the manifest's,
    containerimage.config.digest: the config's), or None."""
    try:
        digest = json.loads(metadata.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return str(digest) if isinstance(digest, str) and digest.startswith("sha256:") else None
