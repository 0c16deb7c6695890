"""Compare two images' facts (pure): packages added, removed and changed, the biggest size changes
by directory, layer sizes, labels that differ. Text for people, a dict (JSON) for tools."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import ptmg_contract as contract
from builder.diff.facts import ImageFacts

#: Directory changes smaller than this are noise (du block rounding, pyc timestamps).
MIN_DIR_DELTA = 1 << 20
#: Labels that always differ between two builds and say nothing about the contents.
VOLATILE_LABELS = frozenset({contract.OCI_CREATED, contract.LABEL_INPUTS_HASH})


def packages(a: Mapping[str, str], b: Mapping[str, str]) -> dict[str, list[dict[str, str]]]:
    return {
        "added": [{"name": n, "version": b[n]} for n in sorted(set(b) - set(a))],
        "removed": [{"name": n, "version": a[n]} for n in sorted(set(a) - set(b))],
        "changed": [{"name": n, "a": a[n], "b": b[n]} for n in sorted(set(a) & set(b)) if a[n] != b[n]],
        "same": [{"name": n, "version": a[n]} for n in sorted(set(a) & set(b)) if a[n] == b[n]],
    }


def directories(a: Mapping[str, int], b: Mapping[str, int], top: int = 15) -> list[dict[str, Any]]:
    """The directories whose size changed most, each the deepest that explains its change: a
    directory is left out when one of its subdirectories accounts for 90% of its change."""
    delta = {p: b.get(p, 0) - a.get(p, 0) for p in set(a) | set(b)}
    delta = {p: d for p, d in delta.items() if abs(d) >= MIN_DIR_DELTA}
    children: dict[str, list[str]] = {}
    for p in delta:
        parent = os.path.dirname(p)
        if parent != p:
            children.setdefault(parent, []).append(p)
    explained = {p for p, d in delta.items()
                 if any(abs(delta[c]) >= 0.9 * abs(d) and (delta[c] > 0) == (d > 0) for c in children.get(p, []))}
    keep = sorted((p for p in delta if p not in explained), key=lambda p: (-abs(delta[p]), p))[:top]
    return [{"path": p, "a": a.get(p, 0), "b": b.get(p, 0), "delta": delta[p]} for p in keep]


def labels(a: Mapping[str, str], b: Mapping[str, str]) -> dict[str, Any]:
    keys = sorted((set(a) | set(b)) - VOLATILE_LABELS)
    return {"changed": {k: [a[k], b[k]] for k in keys if k in a and k in b and a[k] != b[k]},
            "added": {k: b[k] for k in keys if k not in a}, "removed": {k: a[k] for k in keys if k not in b}}


def diff(a: ImageFacts, b: ImageFacts) -> dict[str, Any]:
    return {
        "a": {"ref": a.ref, "id": a.image_id, "size": a.size},
        "b": {"ref": b.ref, "id": b.image_id, "size": b.size},
        "python": packages(a.python, b.python),
        "debian": packages(a.debian, b.debian),
        "directories": directories(a.dirs, b.dirs),
        "layers": {"a": [asdict(x) for x in a.layers if x.size], "b": [asdict(x) for x in b.layers if x.size]},
        "labels": labels(a.labels, b.labels),
    }


def _gb(n: int) -> str:
    sign = "+" if n > 0 else "-" if n < 0 else " "
    n = abs(n)
    return f"{sign}{n / 1e9:.2f} GB" if n >= 1e8 else f"{sign}{n / 1e6:.1f} MB"


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def _packages(title: str, d: Mapping[str, list[dict[str, str]]], limit: int) -> list[str]:
    out = [f"{title}: {len(d['added'])} added, {len(d['removed'])} removed, {len(d['changed'])} changed, "
           f"{len(d['same'])} the same"]
    rows = [("changed", x["name"], f"{x['a']} -> {x['b']}") for x in d["changed"]]
    rows += [("added", x["name"], x["version"]) for x in d["added"]]
    rows += [("removed", x["name"], x["version"]) for x in d["removed"]]
    width = max((len(r[1]) for r in rows), default=0)
    out += [f"  {kind:<8} {name:<{width}}  {what}" for kind, name, what in rows[:limit]]
    if len(rows) > limit:
        out.append(f"  ... {len(rows) - limit} more (--json lists all)")
    return out


def text(d: Mapping[str, Any], limit: int = 60) -> str:
    a, b = d["a"], d["b"]
    out = [f"A: {a['ref']}  {a['id'][:19]}  {_size(a['size'])}",
           f"B: {b['ref']}  {b['id'][:19]}  {_size(b['size'])}  ({_gb(b['size'] - a['size'])})", ""]
    out += [*_packages("Python distributions", d["python"], limit), ""]
    out += [*_packages("Debian packages", d["debian"], limit), ""]
    out.append("Biggest size changes by directory:")
    out += [f"  {_gb(x['delta']):>10}  {x['path']}  ({_size(x['a'])} -> {_size(x['b'])})" for x in d["directories"]]
    if not d["directories"]:
        out.append("  none over 1 MB")
    out += ["", "Layers (with content; A | B):"]
    la, lb = d["layers"]["a"], d["layers"]["b"]
    for i in range(max(len(la), len(lb))):
        left = f"{_size(la[i]['size']):>9}  {la[i]['created_by'][:48]:<48}" if i < len(la) else " " * 59
        right = f"{_size(lb[i]['size']):>9}  {lb[i]['created_by'][:48]}" if i < len(lb) else ""
        out.append(f"  {left} | {right}".rstrip())
    lab = d["labels"]
    out += ["", f"Labels that differ ({len(lab['changed'])} changed, {len(lab['added'])} only in B, "
            f"{len(lab['removed'])} only in A):"]
    out += [f"  {k}: {v[0]} -> {v[1]}" for k, v in lab["changed"].items()]
    out += [f"  {k}: (none) -> {v}" for k, v in lab["added"].items()]
    out += [f"  {k}: {v} -> (none)" for k, v in lab["removed"].items()]
    return "\n".join(out) + "\n"
