"""The Docker engine, through the Docker SDK (with :mod:`builder.engine.buildcache`, its build cache, and
:mod:`builder.engine.translate`, which turns every SDK error into :class:`EngineError`).

Everything else in ``builder`` is pure and works on plain data; it reaches the engine through an
:class:`Engine`, made once per run by the CLI. Nothing of the SDK escapes: containers and networks
come back as opaque handles (:mod:`builder.engine.model`), and every SDK or HTTP error is translated
into :class:`EngineError` (exit 1, with the fix). BuildKit builds go through a CLI
(:mod:`builder.engine.buildkit`); the classic builder through the SDK.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import requests

from builder.engine import bridge, solverturn
from builder.engine.buildcache import BuildCache
from builder.engine.buildkit import BuildkitCli, build_with_cli, to_classic
from builder.engine.capabilities import CONTAINERD, Store, image_store
from builder.engine.client import connect, env_file_has_values, quote_value
from builder.engine.model import BuildOutcome, BuildRequest, Container, EngineError, Network, RunResult
from builder.engine.translate import _errors, _translated, docker
from ptmg_contract import PROJECT_LABEL


class Engine(BuildCache):
    """A thin, typed facade over the Docker SDK client. Every public method translates errors."""

    def __init__(self, client: Any = None, labels: Mapping[str, str] | None = None) -> None:
        self.client: Any = client if client is not None else connect()
        self.labels: dict[str, str] = dict(labels) if labels is not None else {
            PROJECT_LABEL[0]: PROJECT_LABEL[1], "session": uuid.uuid4().hex}
        self._host_arch: str | None = None
        self._store: Store | None = None

    # --- images ------------------------------------------------------------
    @_translated
    def image_exists(self, ref: str) -> bool:
        try:
            self.client.images.get(ref)
        except docker.errors.ImageNotFound:
            return False
        return True

    @_translated
    def image_attrs(self, ref: str) -> dict[str, Any] | None:
        """`docker image inspect` of `ref` (Id, Size, Config.Labels, RepoDigests, ...); None if absent."""
        try:
            return dict(self.client.images.get(ref).attrs)
        except docker.errors.ImageNotFound:
            return None

    def _attrs(self, ref: str) -> dict[str, Any]:
        attrs = self.image_attrs(ref)
        if attrs is None:
            raise EngineError(f"no image {ref} here; build it first (`build.py build`)")
        return attrs

    def image_labels(self, ref: str) -> dict[str, str]:
        return dict((self._attrs(ref).get("Config") or {}).get("Labels") or {})

    def image_id(self, ref: str) -> str:  # the config digest (classic store) or the manifest's (containerd)
        return str(self._attrs(ref)["Id"])

    def image_size(self, ref: str) -> int:
        return int(self._attrs(ref).get("Size", 0))

    def save(self, ref: str, chunk_size: int = 8 << 20) -> Iterator[bytes]:
        """`docker save` of one image (ID or reference), streamed in chunks; a failure mid-stream too is EngineError."""
        with _errors("save"):
            yield from self.client.api.get_image(ref, chunk_size=chunk_size)

    @_translated
    def image_history(self, ref: str) -> list[dict[str, Any]]:
        """`docker history` of ``ref``, oldest layer first: Id, Created, CreatedBy, Size (bytes), Tags."""
        return [dict(h) for h in reversed(self.client.api.history(ref))]

    def host_arch(self) -> str:
        """The engine's architecture in image terms (amd64, arm64), asked once."""
        if self._host_arch is None:
            machine = str(self.info().get("Architecture") or "")
            self._host_arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)
        return self._host_arch

    def foreign_platform(self, ref: str) -> str | None:
        """``linux/<arch>`` when the local image ``ref`` is for another architecture than the engine's
        (it runs under emulation), else None (also for an absent image)."""
        attrs = self.image_attrs(ref)
        arch = str((attrs or {}).get("Architecture") or "")
        if not arch or arch == self.host_arch():
            return None
        return f"{attrs.get('Os') or 'linux'}/{arch}" if attrs else None

    @_translated
    def tag(self, image_id: str, ref: str) -> None:
        repo, _, tag = ref.rpartition(":")
        self.client.images.get(image_id).tag(repo, tag)

    @_translated
    def untag(self, ref: str) -> None:
        with contextlib.suppress(docker.errors.ImageNotFound, docker.errors.APIError):
            self.client.images.remove(ref, noprune=True)

    @_translated
    def remove_image(self, ref: str) -> None:
        """Remove an image (and its now-unused layers); absent is fine."""
        with contextlib.suppress(docker.errors.ImageNotFound):
            self.client.images.remove(ref, force=True)

    @_translated
    def remove_if_untagged(self, image_id: str) -> bool:
        """Remove ``image_id`` when no tag names it any more (the image a rebuild replaced); True if it
        went. One a container uses, another builds on or a tag names stays: this never forces."""
        try:
            if self.client.images.get(image_id).tags:
                return False
            self.client.images.remove(image_id)
        except (docker.errors.ImageNotFound, docker.errors.APIError):
            return False
        return True

    @_translated
    def pull(self, ref: str, platform: str | None = None) -> str | None:
        """Pull an image (for ``platform``, e.g. linux/arm64; default the host's); the error text on
        failure, None on success."""
        repo, _, tag = ref.rpartition(":")
        try:
            self.client.images.pull(repo, tag=tag or "latest", platform=platform)
        except docker.errors.APIError as exc:
            return str(exc.explanation or exc)
        return None

    @_translated
    def import_rootfs(self, tar_path: Path, ref: str, changes: Sequence[str]) -> str:
        """`docker import` a root filesystem tarball as `ref`."""
        repo, _, tag = ref.rpartition(":")
        out = self.client.api.import_image_from_file(str(tar_path), repository=repo, tag=tag, changes=list(changes))
        text = out.decode() if isinstance(out, bytes) else str(out)
        m = re.search(r"sha256:[0-9a-f]{64}", text)
        if not m:
            raise EngineError(f"docker import of {ref} gave no image id: {text[-300:]}")
        return m.group(0)

    @_translated
    def relabel(self, image_id: str, labels: Mapping[str, str], ref: str) -> str:
        """A new image that is `image_id` plus labels (config only, no layer), tagged `ref`."""
        # One LABEL instruction, so one commit: the classic builder commits each (~10 s in the containerd store).
        pairs = " ".join(f"{k}={quote_value(v)}" for k, v in sorted(labels.items()))
        fileobj = io.BytesIO(f"FROM {image_id}\nLABEL {pairs}\n".encode())
        try:
            image, _logs = self.client.images.build(fileobj=fileobj, tag=ref, rm=True, pull=False)
        except docker.errors.BuildError as exc:
            raise EngineError(f"labelling {ref} failed: {exc.msg}") from None
        return str(image.id)

    @_translated
    def info(self) -> dict[str, Any]:
        return dict(self.client.info())

    @_translated
    def version(self) -> dict[str, Any]:
        return dict(self.client.version())

    def store(self) -> Store:  # the engine's image store, asked once (capabilities.image_store)
        self._store = self._store or image_store(self.info())
        return self._store

    # --- builds --------------------------------------------------------------
    def build(self, req: BuildRequest, on_line: Callable[[str], None], cli: BuildkitCli | None) -> BuildOutcome:
        """Build through BuildKit when a CLI for it exists, else the classic builder."""
        req.log_path.parent.mkdir(parents=True, exist_ok=True)
        if cli is not None:  # the containerd store names the image by its manifest's digest, not the iidfile's
            with solverturn.turn(cli.env, req.platform, req.no_cache):  # a --no-cache build runs alone
                out = build_with_cli(req, on_line, cli)
            if req.oci_dest is not None:  # exported, not loaded: its ID is its config digest
                return out
            ok = out.ok and out.manifest_digest and self.store().kind == CONTAINERD
            return dataclasses.replace(out, image_id=out.manifest_digest) if ok else out
        return self._build_classic(req, on_line)

    @_translated
    def _build_classic(self, req: BuildRequest, on_line: Callable[[str], None]) -> BuildOutcome:
        if req.secrets.get("ca-bundle") or env_file_has_values(req.secrets.get("build-env")):
            # The classic builder can only pass settings as build args or files, and both
            # end up in the image history or a layer. Refuse rather than leak.
            return BuildOutcome(False, None, "classic",
                                "this build needs CA certificates or pip/proxy settings, which only BuildKit can "
                                "carry without leaving them in the image; install a docker CLI with BuildKit "
                                "(Debian: apt-get install docker.io) or unset them")
        text = to_classic(req.dockerfile.read_text(encoding="utf-8"))
        tail: list[str] = []
        image_id = None
        with tempfile.NamedTemporaryFile("w", suffix=".Dockerfile", delete=False) as df, \
                req.log_path.open("w", encoding="utf-8") as log:
            df.write(text)
            df.flush()
            try:
                stream = self.client.api.build(path=str(req.context), dockerfile=df.name, labels=dict(req.labels),
                                               rm=True, forcerm=True, pull=False, nocache=req.no_cache, decode=True,
                                               buildargs=dict(req.build_args), platform=req.platform)
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
    @_translated
    def start(self, image: str, command: Sequence[str] | None = None, *,
              extra_labels: Mapping[str, str] | None = None, network: str | None = None,
              alias: str | None = None, **kwargs: Any) -> Container:
        """Start a detached, labelled container (plain-data kwargs as for `docker run`).

        With ``network`` it joins that network, where others reach it as ``alias`` (Docker's
        DNS resolves aliases and names, not hostnames). The caller removes it (:meth:`remove`).
        """
        labels = {**self.labels, **(extra_labels or {})}
        foreign = self.foreign_platform(image)
        if foreign is not None:
            # Another architecture runs under qemu-user. A crashing qemu as PID 1 never exits (the
            # container hangs), so such containers always get an init; the platform avoids a pull.
            kwargs.setdefault("init", True)
            kwargs.setdefault("platform", foreign)
            # The image's own tini is then not PID 1: as a subreaper it still reaps (and does not warn).
            env = kwargs.get("environment")
            if env is None or isinstance(env, Mapping):
                kwargs["environment"] = {"TINI_SUBREAPER": "1", **(env or {})}
            elif not any(str(e).startswith("TINI_SUBREAPER=") for e in env):
                kwargs["environment"] = [*env, "TINI_SUBREAPER=1"]
        if network is not None:
            kwargs["network"] = network
            if alias is not None:
                kwargs["networking_config"] = {network: self.client.api.create_endpoint_config(aliases=[alias])}
        obj = self.client.containers.run(image, list(command) if command is not None else None, detach=True,
                                         labels=labels, **kwargs)
        return Container(str(obj.id), str(obj.name), obj)

    def run(self, image: str, command: Sequence[str], *, timeout: float = 600, **kwargs: Any) -> RunResult:
        """Run a container to completion (bounded by ``timeout``) and remove it."""
        container = self.start(image, command, **kwargs)
        try:
            return self.wait(container, timeout)
        finally:
            self.remove(container)

    @_translated
    def wait(self, container: Container, timeout: float) -> RunResult:
        """Wait for the container to stop; after ``timeout`` s kill it (exit 124, timed_out)."""
        timed_out = False
        try:
            status = container._obj.wait(timeout=timeout)
            code = int(status.get("StatusCode", 1))
        except requests.exceptions.RequestException:  # ReadTimeout/ConnectionError: a hung container
            timed_out = True
            with contextlib.suppress(docker.errors.APIError):
                container._obj.kill()
            code = 124
        return RunResult(code, self.logs(container), timed_out)

    @_translated
    def remove(self, container: Container) -> None:
        with contextlib.suppress(docker.errors.NotFound):
            container._obj.remove(force=True, v=True)

    @_translated
    def kill(self, container: Container, signal: str = "SIGKILL") -> None:
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):  # already stopped
            container._obj.kill(signal=signal)

    @_translated
    def state(self, container: Container) -> dict[str, Any]:
        """The container's ``State`` (ExitCode, StartedAt, FinishedAt, OOMKilled, ...)."""
        container._obj.reload()
        return dict(container._obj.attrs.get("State") or {})

    @_translated
    def logs(self, container: Container) -> str:
        return bytes(container._obj.logs(stdout=True, stderr=True)).decode("utf-8", "replace")

    @_translated
    def archive(self, container: Container, path: str) -> bytes | None:
        """``docker cp CONTAINER:path -`` as tar bytes; None when the path does not exist."""
        try:
            stream, _stat = container._obj.get_archive(path)
        except docker.errors.NotFound:
            return None
        return b"".join(stream)

    @_translated
    def export_filesystem(self, image: str, write: Callable[[bytes], None]) -> None:
        """``docker export`` of a created (never started), labelled container: a tar stream to ``write``."""
        obj = self.client.containers.create(image, command=["true"], entrypoint=[], labels=dict(self.labels))
        try:
            for chunk in obj.export(chunk_size=1 << 20):
                write(chunk)
        finally:
            self.remove(Container(str(obj.id), str(obj.name), obj))

    # --- networks ------------------------------------------------------------
    @_translated
    def bridge_gateway(self) -> str | None:
        """The host's IPv4 address on the engine's default bridge, which a build's RUNs (BuildKit's
        default network) reach the host by, derived as the engine does (:func:`bridge.gateway`: a fresh
        engine names no Gateway, only the subnet); None when the engine has no such bridge."""
        try:
            net = self.client.networks.get("bridge")
        except docker.errors.NotFound:
            return None
        return bridge.gateway(dict(net.attrs))

    @_translated
    def create_network(self, name: str) -> Network:
        obj = self.client.networks.create(name, driver="bridge", labels=dict(self.labels))
        return Network(str(obj.id), str(obj.name), obj)

    @_translated
    def remove_network(self, network: Network) -> None:
        with contextlib.suppress(docker.errors.NotFound):
            network._obj.remove()

    @contextlib.contextmanager
    def network(self, name: str) -> Iterator[Network]:
        net = self.create_network(name)
        try:
            yield net
        finally:
            self.remove_network(net)

    # --- cleanup -------------------------------------------------------------
    @_translated
    def cleanup_session(self) -> None:
        """Remove every container and network carrying this engine's session label."""
        flt = {"label": [f"{k}={v}" for k, v in self.labels.items()]}
        for c in self.client.containers.list(all=True, filters=flt):
            with contextlib.suppress(docker.errors.NotFound):
                c.remove(force=True, v=True)
        for n in self.client.networks.list(filters=flt):
            with contextlib.suppress(docker.errors.NotFound):
                n.remove()

    # --- publish -------------------------------------------------------------
    @_translated
    def push(self, ref: str, auth_config: Mapping[str, str] | None,
             on_event: Callable[[Mapping[str, Any]], None]) -> None:
        """`docker push ref`, handing every progress event to `on_event`. The credentials travel to
        dockerd in the request's X-Registry-Auth header (the SDK's auth_config), never in argv. Errors
        the engine reports mid-stream arrive as events with "error"; a refused request or a dropped
        connection raises EngineError."""
        repo, _, tag = ref.rpartition(":")
        stream = self.client.api.push(repo, tag=tag, stream=True, decode=True,
                                      auth_config=dict(auth_config) if auth_config else None)
        for event in stream:
            on_event(event)
