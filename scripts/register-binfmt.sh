#!/bin/sh
# Register qemu-user's aarch64 handler with binfmt_misc, without systemd (idempotent).
#
#   scripts/register-binfmt.sh          # as root; scripts/ensure-tools.sh emulation runs it
#
# Debian's qemu-user-binfmt (>= 10) ships /usr/lib/binfmt.d/qemu-aarch64.conf and relies on
# systemd-binfmt to load it at boot; without systemd (containers, CI machines) nothing does, and
# /proc/sys/fs/binfmt_misc is often not even mounted. The handler is re-registered every time:
# its flags include F (the kernel opens the interpreter at registration, so containers need no
# copy of qemu), which also means that after a qemu upgrade the kernel keeps running the OLD
# binary until the handler is registered again (`build.py doctor` shows the qemu in use).
set -eu

say() { printf 'register-binfmt: %s\n' "$*" >&2; }
BINFMT=/proc/sys/fs/binfmt_misc
CONF=/usr/lib/binfmt.d/qemu-aarch64.conf

if [ "$(uname -m)" = aarch64 ]; then
    say "this host is aarch64: linux/arm64 runs natively, nothing to register"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    # Like ensure-tools.sh off root: say what to do and go on; `build.py doctor` and the tests that
    # need emulation fail with the same fix.
    say "not root: left $BINFMT as it is (registering needs root: sudo $0)"
    exit 0
fi
if [ ! -r "$CONF" ]; then
    say "$CONF is missing: install qemu-user-static >= 10 (Debian bookworm: apt-get install -t bookworm-backports qemu-user-static)"
    exit 1
fi
if [ ! -e "$BINFMT/register" ]; then
    mount -t binfmt_misc binfmt_misc "$BINFMT"
fi
if [ -e "$BINFMT/qemu-aarch64" ]; then
    echo -1 > "$BINFMT/qemu-aarch64"   # drop the old registration (a stale or older qemu)
fi
# The binfmt.d line already is a register line: :name:type:offset:magic:mask:interpreter:flags
line=$(grep -v '^[[:space:]]*#' "$CONF" | grep -m 1 ':')
case "${line##*:}" in   # the flags field
    *F*) ;;
    *) line="${line}F" ;;   # without F, containers (which have no /usr/libexec/qemu-binfmt) can't start
esac
printf '%s' "$line" > "$BINFMT/register"
state=$(head -n 1 "$BINFMT/qemu-aarch64")
flags=$(sed -n 's/^flags: //p' "$BINFMT/qemu-aarch64")
interp=$(sed -n 's/^interpreter //p' "$BINFMT/qemu-aarch64")
# The -P wrapper refuses to run outside binfmt_misc; ask the binary it links to.
say "qemu-aarch64 $state: $interp (flags $flags); $("$(readlink -f "$interp")" --version 2>/dev/null | head -n 1 || true)"
