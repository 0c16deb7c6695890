"""The only module that talks to the Docker engine.

Everything else in ``builder`` is pure and works on plain data; it reaches the
engine through an :class:`Engine`. Builds go through the Docker CLI when it can
use BuildKit (cache mounts, build secrets); everything else goes through the
Docker SDK.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
from docker.models.containers import Container
from docker.models.networks import Network

PROJECT_LABEL = "project"
PROJECT = "pt-multi-gpu"


class EngineError(RuntimeError):
    """The engine could not do what was asked; the message says what and how to fix it."""


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    output: str
    timed_out: bool = False


@dataclass(frozen=True)
class BuildRequest:
    """One image build: everything the engine needs, nothing it must work out."""

    context: Path
    dockerfile: Path
    labels: Mapping[str, str]
    secrets: Mapping[str, Path]  # id -> file on the host
    log_path: Path
    no_cache: bool = False


@dataclass(frozen=True)
class BuildOutcome:
    ok: bool
    image_id: str | None
    builder: str  # "buildkit" or "classic"
    failed_step: str = ""
    tail: tuple[str, ...] = ()


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


@dataclass
class Engine:
    """A thin, typed facade over the Docker SDK client."""

    client: docker.DockerClient = field(default_factory=lambda: connect())  # noqa: PLW0108 - defined below
    labels: Mapping[str, str] = field(
        default_factory=lambda: {PROJECT_LABEL: PROJECT, "session": uuid.uuid4().hex}
    )

    # --- images ------------------------------------------------------------
    def image_exists(self, ref: str) -> bool:
        try:
            self.client.images.get(ref)
        except docker.errors.ImageNotFound:
            return False
        return True

    def image_labels(self, ref: str) -> dict[str, str]:
        image = self.client.images.get(ref)
        return dict(image.labels or {})

    def image_id(self, ref: str) -> str:
        return str(self.client.images.get(ref).id)

    def rootfs_layers(self, ref: str) -> list[str]:
        return list(self.client.images.get(ref).attrs.get("RootFS", {}).get("Layers", []))

    def image_size(self, ref: str) -> int:
        return int(self.client.images.get(ref).attrs.get("Size", 0))

    def tag(self, image_id: str, ref: str) -> None:
        repo, _, tag = ref.rpartition(":")
        self.client.images.get(image_id).tag(repo, tag)

    def untag(self, ref: str) -> None:
        with contextlib.suppress(docker.errors.ImageNotFound, docker.errors.APIError):
            self.client.images.remove(ref, noprune=True)

    def pull(self, ref: str) -> str | None:
        """Pull an image; the error text on failure, None on success."""
        repo, _, tag = ref.rpartition(":")
        try:
            self.client.images.pull(repo, tag=tag or "latest")
        except docker.errors.APIError as exc:
            return str(exc.explanation or exc)
        return None

    def import_rootfs(self, tar_path: Path, ref: str, changes: Sequence[str]) -> str:
        """`docker import` a root filesystem tarball as `ref`."""
        repo, _, tag = ref.rpartition(":")
        try:
            out = self.client.api.import_image_from_file(str(tar_path), repository=repo, tag=tag,
                                                         changes=list(changes))
        except docker.errors.APIError as exc:
            raise EngineError(f"docker import of {ref} failed: {exc.explanation or exc}") from None
        text = out.decode() if isinstance(out, bytes) else str(out)
        m = re.search(r"sha256:[0-9a-f]{64}", text)
        if not m:
            raise EngineError(f"docker import of {ref} gave no image id: {text[-300:]}")
        return m.group(0)

    def relabel(self, image_id: str, labels: Mapping[str, str], ref: str) -> str:
        """A new image that is `image_id` plus labels (config only, no layer), tagged `ref`."""
        lines = [f"FROM {image_id}"]
        for k, v in sorted(labels.items()):
            lines.append(f"LABEL {k}={_quote(v)}")
        fileobj = io.BytesIO(("\n".join(lines) + "\n").encode())
        try:
            image, _logs = self.client.images.build(fileobj=fileobj, tag=ref, rm=True, pull=False)
        except docker.errors.BuildError as exc:
            raise EngineError(f"labelling {ref} failed: {exc.msg}") from None
        return str(image.id)

    def info(self) -> dict[str, Any]:
        return dict(self.client.info())

    def version(self) -> dict[str, Any]:
        return dict(self.client.version())

    # --- builds --------------------------------------------------------------
    def build(self, req: BuildRequest, on_line: Callable[[str], None], cli: BuildkitCli | None) -> BuildOutcome:
        """Build through BuildKit when a CLI for it exists, else the classic builder."""
        req.log_path.parent.mkdir(parents=True, exist_ok=True)
        if cli is not None:
            return self._build_buildkit(req, on_line, cli)
        return self._build_classic(req, on_line)

    def _build_buildkit(self, req: BuildRequest, on_line: Callable[[str], None], cli: BuildkitCli) -> BuildOutcome:
        with tempfile.TemporaryDirectory(prefix="ptmg-build-") as tmp:
            iidfile = Path(tmp) / "iid"
            argv = [cli.path, *cli.argv_prefix, "--progress=plain", "--pull=false",
                    "--file", str(req.dockerfile), "--iidfile", str(iidfile)]
            if req.no_cache:
                argv.append("--no-cache")
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

    def _build_classic(self, req: BuildRequest, on_line: Callable[[str], None]) -> BuildOutcome:
        if req.secrets.get("ca-bundle") or _has_values(req.secrets.get("build-env")):
            # The classic builder can only pass settings as build args or files, and both
            # end up in the image history or a layer. Refuse rather than leak.
            return BuildOutcome(False, None, "classic",
                                "this build needs CA certificates or pip/proxy settings, which only BuildKit can "
                                "carry without leaving them in the image; install a docker CLI with BuildKit "
                                "(Debian: apt-get install docker.io) or unset them")
        text = to_classic(req.dockerfile.read_text(encoding="utf-8"))
        tail: list[str] = []
        with tempfile.NamedTemporaryFile("w", suffix=".Dockerfile", delete=False) as df, \
                req.log_path.open("w", encoding="utf-8") as log:
            df.write(text)
            df.flush()
            try:
                stream = self.client.api.build(path=str(req.context), dockerfile=df.name, labels=dict(req.labels),
                                               rm=True, forcerm=True, pull=False, nocache=req.no_cache, decode=True)
                image_id = None
                for chunk in stream:
                    for line in str(chunk.get("stream", "")).splitlines():
                        log.write(line + "\n")
                        tail.append(line)
                        del tail[:-30]
                        on_line(line)
                    if "error" in chunk:
                        log.write(str(chunk["error"]) + "\n")
                        return BuildOutcome(False, None, "classic", str(chunk["error"]).strip(), tuple(tail))
                    if "aux" in chunk and "ID" in chunk["aux"]:
                        image_id = str(chunk["aux"]["ID"])
            finally:
                os.unlink(df.name)
        if image_id is None:
            return BuildOutcome(False, None, "classic", "the engine returned no image id", tuple(tail))
        return BuildOutcome(True, image_id, "classic")

    # --- containers ----------------------------------------------------------
    def start(
        self,
        image: str,
        command: Sequence[str] | None = None,
        *,
        extra_labels: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> Container:
        """Start a detached, labelled container. The caller removes it (see :meth:`remove`)."""
        labels = {**self.labels, **(extra_labels or {})}
        return self.client.containers.run(
            image, list(command) if command is not None else None, detach=True, labels=labels, **kwargs
        )

    def run(
        self, image: str, command: Sequence[str], *, timeout: float = 600, **kwargs: Any
    ) -> RunResult:
        """Run a container to completion (bounded by ``timeout``) and remove it."""
        container = self.start(image, command, **kwargs)
        try:
            return self.wait(container, timeout)
        finally:
            self.remove(container)

    def wait(self, container: Container, timeout: float) -> RunResult:
        timed_out = False
        try:
            status = container.wait(timeout=timeout)
            code = int(status.get("StatusCode", 1))
        except Exception:  # requests' ReadTimeout/ConnectionError: a hung container
            timed_out = True
            with contextlib.suppress(docker.errors.APIError):
                container.kill()
            code = 124
        output = container.logs(stdout=True, stderr=True).decode("utf-8", "replace")
        return RunResult(code, output, timed_out)

    def remove(self, container: Container) -> None:
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)

    # --- networks ------------------------------------------------------------
    def create_network(self, name: str) -> Network:
        return self.client.networks.create(name, driver="bridge", labels=dict(self.labels))

    def remove_network(self, network: Network) -> None:
        with contextlib.suppress(docker.errors.NotFound):
            network.remove()

    @contextlib.contextmanager
    def network(self, name: str) -> Iterator[Network]:
        net = self.create_network(name)
        try:
            yield net
        finally:
            self.remove_network(net)

    # --- cleanup -------------------------------------------------------------
    def cleanup_session(self) -> None:
        """Remove every container and network carrying this engine's session label."""
        flt = {"label": [f"{k}={v}" for k, v in self.labels.items()]}
        for c in self.client.containers.list(all=True, filters=flt):
            self.remove(c)
        for n in self.client.networks.list(filters=flt):
            self.remove_network(n)

    # --- smoke ---
    def start_on_network(
        self,
        image: str,
        command: Sequence[str] | None,
        *,
        network: str,
        alias: str,
        extra_labels: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> Container:
        """Like :meth:`start`, attached to ``network`` where other containers reach it as ``alias``
        (Docker's DNS resolves aliases and names, not hostnames)."""
        endpoint = self.client.api.create_endpoint_config(aliases=[alias])
        return self.start(image, command, extra_labels=extra_labels, network=network,
                          networking_config={network: endpoint}, **kwargs)

    def kill(self, container: Container, signal: str = "SIGKILL") -> None:
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):  # already stopped
            container.kill(signal=signal)

    def state(self, container: Container) -> dict[str, Any]:
        """The container's ``State`` (ExitCode, StartedAt, FinishedAt, OOMKilled, ...)."""
        container.reload()
        return dict(container.attrs.get("State") or {})

    def logs(self, container: Container) -> str:
        return bytes(container.logs(stdout=True, stderr=True)).decode("utf-8", "replace")

    def archive(self, container: Container, path: str) -> bytes | None:
        """``docker cp CONTAINER:path -`` as tar bytes; None when the path does not exist."""
        try:
            stream, _stat = container.get_archive(path)
        except docker.errors.NotFound:
            return None
        return b"".join(stream)

    # --- publish ---
    def image_attrs(self, ref: str) -> dict[str, Any] | None:
        """`docker image inspect` of `ref` (Id, Size, Config.Labels, RepoDigests, ...); None if absent."""
        try:
            return dict(self.client.images.get(ref).attrs)
        except docker.errors.ImageNotFound:
            return None

    def push(self, ref: str, auth_config: Mapping[str, str] | None,
             on_event: Callable[[Mapping[str, Any]], None]) -> None:
        """`docker push ref`, handing every progress event to `on_event`.

        The credentials travel to dockerd in the request's X-Registry-Auth header (the SDK's
        auth_config), never in argv. Errors the engine reports mid-stream arrive as events
        with "error"; a refused request or a dropped connection raises EngineError.
        """
        import requests

        repo, _, tag = ref.rpartition(":")
        try:
            stream = self.client.api.push(repo, tag=tag, stream=True, decode=True,
                                          auth_config=dict(auth_config) if auth_config else None)
            for event in stream:
                on_event(event)
        except docker.errors.APIError as exc:
            raise EngineError(f"push of {ref} refused: {exc.explanation or exc}") from None
        except requests.exceptions.RequestException as exc:
            raise EngineError(f"the Docker engine stopped answering during the push of {ref}: {exc}") from None


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _has_values(env_file: Path | None) -> bool:
    if env_file is None or not env_file.exists():
        return False
    return any(line.startswith("export ") for line in env_file.read_text(encoding="utf-8").splitlines())


def connect() -> docker.DockerClient:
    try:
        client = docker.from_env(timeout=600)
        client.ping()
    except docker.errors.DockerException as exc:
        raise EngineError(
            f"no Docker engine answers ({exc}).\n"
            "  fix: run `scripts/ensure-docker.sh` (starts dockerd as root on Debian), "
            "or start Docker and check DOCKER_HOST."
        ) from None
    return client
