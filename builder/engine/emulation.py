"""Can this host run another architecture's binaries (qemu-user through binfmt_misc), and which qemu?

Cells for linux/arm64 build and run on an x86 host under qemu-user emulation. The kernel
hands every aarch64 ELF to the interpreter registered in binfmt_misc; with the F flag it
opened that file at registration, so after a package upgrade the kernel may still run the
old one. `qemu-aarch64-static --version` names the package's binary, not necessarily the one in
use, so :func:`probe` asks the one in use: it runs a tiny static aarch64 program (it sleeps a
moment, then exits), reads /proc/PID/exe (the interpreter the kernel really started) and asks
that file for its version. No Docker and no root filesystem needed.

bookworm's qemu 7.2 crashes on `import torch` (SIGSEGV, exit 139; without an init in the
container it hangs as PID 1); 10.0.2 from bookworm-backports works. The fix for both an old and a
missing qemu is `scripts/ensure-tools.sh emulation` (installs it from backports as root, and
registers it: scripts/register-binfmt.sh).
"""

from __future__ import annotations

import contextlib
import os
import platform as host_platform
import re
import struct
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: The oldest qemu-user verified to run torch (10.0.2, bookworm-backports). 7.2 crashes.
MIN_QEMU = (10, 0)
FIX = ("run `scripts/ensure-tools.sh emulation` as root (installs qemu-user-static >= "
       f"{MIN_QEMU[0]} from bookworm-backports and registers it with binfmt_misc)")
BINFMT_DIR = Path("/proc/sys/fs/binfmt_misc")
#: Docker platform -> (the kernel's machine name, the binfmt_misc handler qemu registers).
HANDLERS = {"linux/arm64": ("aarch64", "qemu-aarch64"), "linux/amd64": ("x86_64", "qemu-x86_64")}


@dataclass(frozen=True)
class Emulation:
    """What this host offers for one platform."""

    platform: str
    native: bool = False  # the host is this architecture: nothing to emulate
    version: str = ""  # the qemu in use, e.g. "10.0.2"
    interpreter: str = ""  # its path as the kernel sees it ("... (deleted)" after an upgrade)
    flags: str = ""  # the binfmt_misc handler's flags (F: opened at registration)
    problem: str = ""  # "" when usable
    too_old: bool = False  # registered and working, but a qemu known to crash torch

    @property
    def ok(self) -> bool:
        return self.native or not self.problem

    @property
    def stale(self) -> bool:
        """The registered binary was replaced on disk since it was registered (re-register)."""
        return self.interpreter.endswith("(deleted)")

    def describe(self) -> str:
        if self.native:
            return f"{self.platform}: native ({host_platform.machine()})"
        if self.problem:
            return f"{self.platform}: {self.problem}"
        return (f"{self.platform}: qemu {self.version} through binfmt_misc ({self.interpreter}, "
                f"flags {self.flags or '-'})")


def tiny_aarch64_elf(sleep_s: int = 2) -> bytes:
    """A 92-byte static aarch64 program: nanosleep(sleep_s), then exit(0)."""
    code = struct.pack("<7I",
                       0xD2800CA8,  # mov x8, #101 (nanosleep)
                       0x100000C0,  # adr x0, timespec (+24)
                       0xD2800001,  # mov x1, #0
                       0xD4000001,  # svc #0
                       0xD2800000,  # mov x0, #0
                       0xD2800BA8,  # mov x8, #93 (exit)
                       0xD4000001)  # svc #0
    code += struct.pack("<qq", sleep_s, 0)
    base, ehsize, phsize = 0x400000, 64, 56
    total = ehsize + phsize + len(code)
    header = struct.pack("<16sHHIQQQIHHHHHH", b"\x7fELF\x02\x01\x01" + b"\0" * 9, 2, 183, 1,
                         base + ehsize + phsize, ehsize, 0, 0, ehsize, phsize, 1, 0, 0, 0)
    program = struct.pack("<IIQQQQQQ", 1, 5, 0, base, base, total, total, 0x1000)
    return header + program + code


def parse_handler(text: str) -> tuple[bool, str, str]:
    """A binfmt_misc handler file -> (enabled, interpreter, flags)."""
    interp = re.search(r"^interpreter (.*)$", text, re.M)
    flags = re.search(r"^flags: ?(\S*)", text, re.M)
    return text.startswith("enabled"), interp.group(1).strip() if interp else "", flags.group(1) if flags else ""


def parse_version(text: str) -> tuple[int, ...] | None:
    """``qemu-aarch64 version 10.0.2 (Debian ...)`` -> (10, 0, 2)."""
    m = re.search(r"version (\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(x) for x in m.groups(default="0")) if m else None


def judge(platform: str, handler: str | None, version_text: str, interpreter: str) -> Emulation:
    """The verdict from what the probe saw (pure, so it is unit-tested)."""
    if handler is None:
        return Emulation(platform, problem=f"no binfmt_misc handler for {platform} (qemu-user not installed "
                                           "or not registered): emulated cells can't build or run here")
    enabled, registered, flags = parse_handler(handler)
    if not enabled:
        return Emulation(platform, interpreter=registered, flags=flags,
                         problem=f"the binfmt_misc handler for {platform} is disabled")
    if "F" not in flags:
        return Emulation(platform, interpreter=registered, flags=flags,
                         problem=f"the binfmt_misc handler for {platform} lacks the F flag: containers, which "
                                 f"have no {registered}, can't start their programs")
    version = parse_version(version_text)
    if version is None:
        return Emulation(platform, interpreter=interpreter or registered, flags=flags,
                         problem=f"could not read the version of the qemu in use ({version_text.strip()[:120]!r})")
    shown = ".".join(str(x) for x in version)
    if version[:2] < MIN_QEMU:
        return Emulation(platform, version=shown, interpreter=interpreter or registered, flags=flags, too_old=True,
                         problem=f"qemu {shown} is in use for {platform}, older than "
                                 f"{'.'.join(map(str, MIN_QEMU))}: it crashes on `import torch` (qemu 7.2: "
                                 "SIGSEGV, exit 139)")
    return Emulation(platform, version=shown, interpreter=interpreter or registered, flags=flags)


def probe(platform: str = "linux/arm64") -> Emulation:
    """Ask the kernel which qemu runs ``platform``'s binaries here, and whether it is usable."""
    machine, name = HANDLERS[platform]
    if host_platform.machine() == machine:
        return Emulation(platform, native=True)
    try:
        handler: str | None = (BINFMT_DIR / name).read_text(encoding="utf-8", errors="replace")
    except OSError:
        handler = None
    if handler is None or platform != "linux/arm64":
        return judge(platform, handler, "", "")
    enabled, _, flags = parse_handler(handler)
    if not enabled or "F" not in flags:
        return judge(platform, handler, "", "")
    interpreter, version_text = _run_probe()
    return judge(platform, handler, version_text, interpreter)


def _run_probe() -> tuple[str, str]:
    """Run the tiny aarch64 program; (the interpreter the kernel started, its --version line)."""
    fd, path = tempfile.mkstemp(prefix="ptmg-aarch64-probe-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(tiny_aarch64_elf())
        os.chmod(path, 0o700)  # our own temporary file, executable by us only
        try:
            proc = subprocess.Popen([path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as exc:  # ENOEXEC: the handler did not take it (noexec /tmp gives EACCES)
            return "", f"the probe program did not start: {exc}"
        try:
            interpreter = os.readlink(f"/proc/{proc.pid}/exe")
            out = subprocess.run([f"/proc/{proc.pid}/exe", "--version"], capture_output=True, text=True,
                                 timeout=30, check=False).stdout
        except (OSError, subprocess.TimeoutExpired) as exc:
            interpreter, out = "", f"the probe could not ask the interpreter: {exc}"
        finally:
            proc.kill()  # it has served: the kernel started the interpreter, which answered
            proc.wait()
        return interpreter, (out.splitlines() or [""])[0]
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def findings(platforms: Sequence[str], cells: Mapping[str, Sequence[str]],
             check: Callable[[str], Emulation] = probe) -> list[tuple[str, str, str]]:
    """What `build.py doctor` says about emulation: (level, what, fix) per platform other than the
    host's (``cells``: platform -> the selected cells on it). A missing qemu is a warning (native
    cells still build); a qemu known to crash torch is a failure; the cells that need it are named."""
    out: list[tuple[str, str, str]] = []
    for platform in platforms:
        emu = check(platform)
        if emu.native:
            continue
        names = cells.get(platform, ())
        needed = f" (needed by {', '.join(names)})" if names else ""
        if emu.ok:
            slow = "; emulated cells build and run on CPU only, much slower than native" if names else ""
            stale = " (the registered binary was replaced since: re-register it)" if emu.stale else ""
            out.append(("warn" if emu.stale else "ok", f"emulation: {emu.describe()}{stale}{slow}",
                        "" if not emu.stale else FIX))
        else:
            out.append(("fail" if emu.too_old else "warn", f"emulation: {emu.describe()}{needed}", FIX))
    return out
