"""The host's address on the engine's default bridge (`Engine.bridge_gateway`, `builder/engine/bridge.py`):
the wheel server listens there, so a wrong None silently sends a buildx build down the slow context path."""

from __future__ import annotations

from typing import Any

import pytest

from builder.engine import bridge
from builder.engine.docker import Engine

FRESH = {  # a fresh engine's `docker network inspect bridge`: the subnet only, no Gateway
    "IPAM": {"Driver": "default", "Options": None, "Config": [{"Subnet": "172.17.0.0/16"}]},
    "Options": {"com.docker.network.bridge.default_bridge": "true", "com.docker.network.bridge.name": "docker0"},
}
GIVEN = {  # a daemon given --bip or default-address-pools: the Gateway is named
    "IPAM": {"Config": [{"Subnet": "10.99.0.0/24", "Gateway": "10.99.0.254"}]},
    "Options": {"com.docker.network.bridge.name": "docker0"},
}


class _Networks:
    def __init__(self, attrs: dict[str, Any]) -> None:
        self.attrs = attrs

    def get(self, name: str) -> _Networks:
        assert name == "bridge"
        return self


class _Client:
    def __init__(self, attrs: dict[str, Any]) -> None:
        self.networks = _Networks(attrs)


def _with_bridge_name(attrs: dict[str, Any], name: str) -> dict[str, Any]:
    return {**attrs, "Options": {**attrs["Options"], bridge.BRIDGE_NAME_OPTION: name}}


def test_a_fresh_engine_without_a_gateway_field_gets_the_subnets_first_host() -> None:
    engine = Engine(client=_Client(_with_bridge_name(FRESH, "ptmg-absent0")), labels={})
    assert engine.bridge_gateway() == "172.17.0.1"


def test_a_named_gateway_is_taken_as_given() -> None:
    engine = Engine(client=_Client(GIVEN), labels={})
    assert engine.bridge_gateway() == "10.99.0.254"


def test_the_bridge_interfaces_address_wins_over_the_subnets_first_host() -> None:
    asked: list[str] = []

    def held(name: str) -> str | None:
        asked.append(name)
        return "172.17.42.1"

    assert bridge.gateway(_with_bridge_name(FRESH, "br-ptmg"), held) == "172.17.42.1"
    assert asked == ["br-ptmg"]  # the interface the network names, not docker0
    no_name = {**FRESH, "Options": {}}
    assert bridge.gateway(no_name, held) == "172.17.42.1" and asked[-1] == "docker0"


def test_an_interface_address_outside_the_subnet_is_not_the_engines() -> None:
    """A remote engine's bridge is not this host's docker0, which may hold another network's address."""
    assert bridge.gateway(FRESH, lambda _name: "10.1.2.3") == "172.17.0.1"


@pytest.mark.parametrize("config", [
    [],
    [{"Subnet": "fd00:dead::/64", "Gateway": "fd00:dead::1"}],
    [{"Subnet": "not a subnet"}],
])
def test_no_ipv4_subnet_or_gateway_is_none(config: list[dict[str, str]]) -> None:
    assert bridge.gateway({"IPAM": {"Config": config}, "Options": {}}, lambda _name: "172.17.0.1") is None


def test_an_ipv6_gateway_is_passed_over_for_the_ipv4_one() -> None:
    attrs = {"IPAM": {"Config": [{"Subnet": "fd00::/64", "Gateway": "fd00::1"}, {"Subnet": "192.0.2.0/24"}]}}
    assert bridge.gateway(attrs, lambda _name: None) == "192.0.2.1"


def test_the_interface_lookup_reads_this_hosts_addresses() -> None:
    assert bridge.interface_ipv4("lo") == "127.0.0.1"
    assert bridge.interface_ipv4("ptmg-absent0") is None
    assert bridge.interface_ipv4("") is None and bridge.interface_ipv4("x" * 16) is None


def test_an_engine_without_a_default_bridge_is_none() -> None:
    import docker

    class _Missing:
        def get(self, _name: str) -> None:
            raise docker.errors.NotFound("network bridge not found")

    client = _Client({})
    client.networks = _Missing()  # type: ignore[assignment]
    assert Engine(client=client, labels={}).bridge_gateway() is None
