"""The registry address: ``HOST[:PORT][/NAMESPACE]``, parsed and checked."""

from __future__ import annotations

import re
from dataclasses import dataclass

from builder.common.errors import InputError


class PublishInputError(InputError):
    """Bad --registry, unusable credentials settings: exit 2, nothing contacted."""



# --- the registry address --------------------------------------------------------------
HOST_RE = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
                     r"|\[[0-9A-Fa-f:]+\])(?::[0-9]{1,5})?$")
PATH_COMPONENT_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
DOCKER_HUB = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})


@dataclass(frozen=True)
class Registry:
    host: str  # as image references name it: "127.0.0.1:5000", "ghcr.io", "docker.io"
    namespace: str = ""  # "" or "org" or "org/team"

    def repository(self, name: str) -> str:
        """The full image repository for `name`: what `docker push` is given."""
        return "/".join(p for p in (self.host, self.namespace, name) if p)

    def api_path(self, name: str) -> str:
        """The repository name in registry API URLs (Docker Hub puts bare names under library/)."""
        path = "/".join(p for p in (self.namespace, name) if p)
        return f"library/{path}" if self.is_docker_hub and "/" not in path else path

    @property
    def hostname(self) -> str:
        host = self.host
        if host.startswith("["):
            return host[1:host.index("]")]
        return host.rsplit(":", 1)[0] if ":" in host else host

    @property
    def is_docker_hub(self) -> bool:
        return self.hostname in DOCKER_HUB

    @property
    def is_loopback(self) -> bool:
        """dockerd talks plain HTTP to these without configuration (127.0.0.0/8); so do we."""
        h = self.hostname
        return h in {"localhost", "::1"} or h.startswith("127.")

    @property
    def api_base(self) -> str:
        if self.is_docker_hub:
            return "https://registry-1.docker.io"
        return f"{'http' if self.is_loopback else 'https'}://{self.host}"

    @property
    def auth_keys(self) -> tuple[str, ...]:
        """Keys the docker config may file this registry's credentials under, best first."""
        if self.is_docker_hub:
            return ("https://index.docker.io/v1/", "index.docker.io", "docker.io", "registry-1.docker.io")
        return (self.host, f"https://{self.host}", f"http://{self.host}", f"https://{self.host}/v1/",
                f"https://{self.host}/v2/")

    @property
    def server_address(self) -> str:
        return "https://index.docker.io/v1/" if self.is_docker_hub else self.host

    def __str__(self) -> str:
        return "/".join(p for p in (self.host, self.namespace) if p)


def parse_registry(text: str) -> Registry:
    """``HOST[:PORT][/NAMESPACE]`` -> Registry, with a located explanation when it is not one."""
    raw = (text or "").strip()
    if "://" in raw:
        raise PublishInputError(f"--registry {text!r}: give HOST[:PORT][/NAMESPACE] without a scheme "
                                "(plain HTTP is used for 127.0.0.1/localhost, HTTPS for everything else)")
    if not raw:
        raise PublishInputError("--registry is empty; give HOST[:PORT][/NAMESPACE], e.g. ghcr.io/my-org or "
                                "127.0.0.1:5000 (or set PTMG_REGISTRY)")
    host, _, namespace = raw.rstrip("/").partition("/")
    if not HOST_RE.match(host):
        raise PublishInputError(f"--registry {text!r}: {host!r} is not a host[:port]")
    if "." not in host and ":" not in host and host != "localhost":
        # Docker reads a first component without '.' or ':' as a Docker Hub namespace.
        raise PublishInputError(f"--registry {text!r}: {host!r} is not a registry host (no '.' or ':'); "
                                f"for a Docker Hub namespace write docker.io/{host}")
    port = host.rsplit("]", 1)[-1].rpartition(":")[2] if ":" in host.rsplit("]", 1)[-1] else ""
    if port and not 0 < int(port) < 65536:
        raise PublishInputError(f"--registry {text!r}: port {port} is out of range")
    for comp in namespace.split("/") if namespace else ():
        if not PATH_COMPONENT_RE.match(comp):
            raise PublishInputError(f"--registry {text!r}: namespace component {comp!r} is not valid "
                                    "(lowercase letters, digits, '.', '_', '-')")
    if host in DOCKER_HUB:
        host = "docker.io"
    return Registry(host, namespace)


