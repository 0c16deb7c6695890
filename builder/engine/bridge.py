"""The host's address on the engine's default bridge, derived the way the engine derives it.

``docker network inspect bridge`` names the gateway in ``IPAM.Config[].Gateway`` only where the
daemon was given one (``--bip``, ``default-address-pools``); a fresh engine's default bridge shows
``"Config": [{"Subnet": "172.17.0.0/16"}]`` alone. The engine then takes the address its bridge
interface (the ``com.docker.network.bridge.name`` option, ``docker0`` by default) already holds,
and on a bridge it creates, the subnet's first host address. :func:`gateway` reads the three in
that order, and takes the interface's address only where it lies in the network's subnet (a remote
engine's bridge is not this host's ``docker0``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Callable, Mapping
from typing import Any

BRIDGE_NAME_OPTION = "com.docker.network.bridge.name"
DEFAULT_BRIDGE = "docker0"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_IFNAMSIZ = 16


def interface_ipv4(name: str) -> str | None:
    """The IPv4 address this host's interface ``name`` holds; None when there is no such interface
    or it has no IPv4 address."""
    raw = name.encode()
    if not raw or len(raw) >= _IFNAMSIZ:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", raw))
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])  # struct ifreq: the name, then a sockaddr_in (family, port, address)


def gateway(attrs: Mapping[str, Any], interface_address: Callable[[str], str | None] = interface_ipv4) -> str | None:
    """The IPv4 gateway of the network ``attrs`` (``docker network inspect``): the configured
    Gateway; else the bridge interface's address inside the subnet; else the subnet's first host
    address. None when the network has no IPv4 subnet or gateway."""
    configs = [c for c in (attrs.get("IPAM") or {}).get("Config") or [] if isinstance(c, Mapping)]
    for cfg in configs:
        given = str(cfg.get("Gateway") or "").split("/")[0]
        if given and ":" not in given:
            return given
    subnets = [_ipv4_network(str(cfg.get("Subnet") or "")) for cfg in configs]
    subnets4 = [s for s in subnets if s is not None]
    if not subnets4:
        return None
    name = str((attrs.get("Options") or {}).get(BRIDGE_NAME_OPTION) or DEFAULT_BRIDGE)
    held = interface_address(name)
    if held:
        address = ipaddress.IPv4Address(held)
        if any(address in s for s in subnets4):
            return str(address)
    first = subnets4[0]
    return str(next(iter(first.hosts()), first.network_address))


def _ipv4_network(text: str) -> ipaddress.IPv4Network | None:
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None
    return net if isinstance(net, ipaddress.IPv4Network) else None
