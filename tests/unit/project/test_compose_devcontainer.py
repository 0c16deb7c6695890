"""compose.yaml and .devcontainer/devcontainer.json, the ways to run an image without a cluster:
compose.yaml against the Compose Specification's JSON schema (as vendored by check-jsonschema),
devcontainer.json by a structural check (no devcontainer schema can be had from PyPI), both naming
a cell of the real images.yaml."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import yaml

from tests.support import vendored_schema
from tests.unit.launch.test_config import ROOT

# --- compose.yaml ----------------------------------------------------------------------------------------------


def load_compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "compose.yaml").read_text()))


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    validator = vendored_schema("compose-spec.json")
    errors = sorted(validator.iter_errors(load_compose()), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    broken = load_compose()
    broken["services"]["pt"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilitys"] = ["gpu"]
    assert list(validator.iter_errors(broken)), "the schema check must be able to fail"


def test_compose_file_wires_gpus_ports_volumes_and_secrets() -> None:
    doc = load_compose()
    svc = doc["services"]["pt"]
    assert svc["image"] == "${PTMG_IMAGE:-pt-multi-gpu:latest}"
    (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert dev == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    assert svc["shm_size"]
    assert "8888:8888" in svc["ports"] and "2222:22" in svc["ports"]
    mounts = {v["target"]: v for v in svc["volumes"]}
    assert mounts["/workspace"]["type"] == "volume"
    assert mounts["/var/lib/pt-multi-gpu/ssh-host-keys"]["type"] == "volume"
    assert {mounts[t]["source"] for t in mounts} <= set(doc["volumes"])
    assert svc["environment"]["JUPYTER_TOKEN_FILE"] == "/run/secrets/jupyter_token"
    secrets = {s["source"]: s.get("target", s["source"]) for s in svc["secrets"]}
    assert secrets == {"jupyter_token": "jupyter_token", "ssh_authorized_keys": "ssh_authorized_keys"}
    assert set(doc["secrets"]) == {"jupyter_token", "ssh_authorized_keys"}
    assert all("file" in s for s in doc["secrets"].values())
    assert svc["labels"]["project"] == "pt-multi-gpu"


# --- .devcontainer/devcontainer.json ---------------------------------------------------------------------------

#: Top-level devcontainer.json properties and their JSON types, from the Dev Container
#: specification's reference (containers.dev/implementors/json_reference). A structural check:
#: no devcontainer JSON schema is published on PyPI, and nothing may be fetched at test time.
DEVCONTAINER_TYPES: dict[str, type | tuple[type, ...]] = {
    "name": str, "image": str, "build": dict, "dockerComposeFile": (str, list), "service": str,
    "workspaceFolder": str, "workspaceMount": str, "runArgs": list, "remoteUser": str, "containerUser": str,
    "forwardPorts": list, "portsAttributes": dict, "otherPortsAttributes": dict, "containerEnv": dict,
    "remoteEnv": dict, "mounts": list, "features": dict, "overrideFeatureInstallOrder": list,
    "customizations": dict, "hostRequirements": dict, "shutdownAction": str, "overrideCommand": bool,
    "updateRemoteUserUID": bool, "userEnvProbe": str, "init": bool, "privileged": bool, "capAdd": list,
    "securityOpt": list, "appPort": (int, str, list), "initializeCommand": (str, list, dict),
    "onCreateCommand": (str, list, dict), "updateContentCommand": (str, list, dict),
    "postCreateCommand": (str, list, dict), "postStartCommand": (str, list, dict),
    "postAttachCommand": (str, list, dict), "waitFor": str, "$schema": str,
}


def devcontainer_errors(doc: Mapping[str, Any]) -> list[str]:
    errors = [f"{k}: not a devcontainer.json property" for k in doc if k not in DEVCONTAINER_TYPES]
    errors += [f"{k}: expected {DEVCONTAINER_TYPES[k]}, got {type(v).__name__}" for k, v in doc.items()
               if k in DEVCONTAINER_TYPES and not isinstance(v, DEVCONTAINER_TYPES[k])]
    # An image-, Dockerfile- or Compose-based container: exactly one way to get it.
    kinds = [k for k in ("image", "build", "dockerComposeFile") if k in doc]
    if len(kinds) != 1:
        errors.append(f"needs exactly one of image, build, dockerComposeFile (has {kinds})")
    if "workspaceMount" in doc and "workspaceFolder" not in doc:
        errors.append("workspaceMount needs workspaceFolder")
    errors += [f"runArgs[{i}]: not a string" for i, a in enumerate(doc.get("runArgs", [])) if not isinstance(a, str)]
    for p in doc.get("forwardPorts", []):
        if not (isinstance(p, int) and 0 < p < 65536) and not (isinstance(p, str) and re.match(r"^[^:]+:\d+$", p)):
            errors.append(f"forwardPorts: {p!r} is not a port or host:port")
    for key in doc.get("portsAttributes", {}):
        if not re.match(r"^(\d+(-\d+)?|[^:]+:\d+|.+)$", str(key)):
            errors.append(f"portsAttributes: {key!r}")
    return errors


def _strip_jsonc(text: str) -> str:
    """devcontainer.json is JSON with comments: drop // line comments outside strings."""
    out = []
    for line in text.splitlines():
        in_str = False
        for i, ch in enumerate(line):
            if ch == '"' and (i == 0 or line[i - 1] != "\\"):
                in_str = not in_str
            if not in_str and line[i:i + 2] == "//":
                line = line[:i]
                break
        out.append(line)
    return "\n".join(out)


def load_devcontainer() -> dict[str, Any]:
    return dict(json.loads(_strip_jsonc((ROOT / ".devcontainer" / "devcontainer.json").read_text())))


def test_devcontainer_has_the_spec_shape() -> None:
    doc = load_devcontainer()
    assert devcontainer_errors(doc) == []
    assert devcontainer_errors({**doc, "runArg": []}) != [], "the check must be able to fail"
    assert devcontainer_errors({**doc, "build": {"dockerfile": "x"}}) != []


def test_devcontainer_runs_the_image_as_pt_in_workspace_with_gpus() -> None:
    doc = load_devcontainer()
    assert doc["image"].startswith("pt-multi-gpu:")
    assert doc["remoteUser"] == "pt"
    assert doc["workspaceFolder"] == "/workspace"
    assert "target=/workspace" in doc["workspaceMount"]
    args = doc["runArgs"]
    assert args[args.index("--gpus") + 1] == "all"
    assert args[args.index("--shm-size") + 1] == "8g"
    assert 8888 in doc["forwardPorts"]


def test_the_devcontainer_and_compose_name_a_cell_of_the_real_images_yaml() -> None:
    """Both name `pt-multi-gpu:<tag>` of a cell in images.yaml (or latest)."""
    from builder.matrix import load_matrix

    tags = {c.tag for c in load_matrix(ROOT / "images.yaml").cells} | {"latest"}
    assert load_devcontainer()["image"].split(":", 1)[1] in tags
    default = re.search(r":-([^}]+)\}", load_compose()["services"]["pt"]["image"])
    assert default and default.group(1).split(":", 1)[1] in tags


