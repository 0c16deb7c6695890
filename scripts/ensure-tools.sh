#!/usr/bin/env bash
# Make sure the host tools a make target needs are installed, installing only what is missing.
#
#   scripts/ensure-tools.sh images          # what `make images` needs (debootstrap)
#   scripts/ensure-tools.sh emulation       # qemu >= 10 for linux/arm64 cells, registered with binfmt_misc
#   scripts/ensure-tools.sh export          # `build.py export`: squashfs-tools, siftool
#   scripts/ensure-tools.sh hpc             # enroot + pyxis built from PTMG_THIRDPARTY_DIR (ensure-hpc-runtimes.sh)
#   scripts/ensure-tools.sh unit            # what the unit tier drives (docker-registry: a real registry, no engine)
#   scripts/ensure-tools.sh test            # everything the docker test tier drives
#
# - As root on Debian: installs the missing packages with apt-get (qemu from bookworm-backports,
#   since bookworm's qemu 7.2 crashes on `import torch`). Installed packages are left alone,
#   except a qemu-user-static older than 10, which is upgraded from backports.
# - Anywhere else: prints what is missing and the command that installs it, and exits 0. The
#   tests that need a missing tool then fail with the same fix in their message (never a skip).
set -euo pipefail

say() { printf 'ensure-tools: %s\n' "$*" >&2; }
QEMU_MIN_MAJOR=10
BACKPORTS_LIST=/etc/apt/sources.list.d/pt-multi-gpu-backports.list

packages_for() {
    case "$1" in
        images) echo "debootstrap" ;;
        emulation) echo "qemu-user-static binfmt-support" ;;
        export) echo "squashfs-tools siftool" ;;
        # enroot's build (libbsd-dev, makeself), pyxis's (libslurm-dev: 22.05, the test cluster's
        # Slurm) and enroot's runtime dependencies (its Debian package's Depends and Suggests).
        hpc) echo "libbsd-dev makeself libslurm-dev jq parallel squashfs-tools zstd bsdmainutils pigz"
             echo "squashfuse fuse-overlayfs" ;;
        # The unit tier signs and verifies against a real registry on 127.0.0.1 (no Docker engine).
        unit) echo "docker-registry" ;;
        # docker-registry: publish tests; docker-compose: compose.yaml; openssh-client: SSH tests;
        # chromium: the browser test; slurm-wlm + munge: the Slurm tests; skopeo: multi-platform
        # publish; charliecloud-runtime + squashfuse + fuse-overlayfs: an HPC runtime runs the
        # exported squashfs unprivileged; the rest as for images, emulation and export.
        test) echo "debootstrap docker-registry docker-compose openssh-client chromium slurm-wlm munge skopeo"
              echo "charliecloud-runtime squashfuse fuse-overlayfs"
              packages_for emulation; packages_for export; packages_for hpc ;;
        *) say "unknown group '$1' (images, emulation, export, hpc, unit, test)"; exit 2 ;;
    esac
}

qemu_major() {
    local exe=/usr/bin/qemu-aarch64-static
    [ -x "$exe" ] || { echo 0; return; }
    "$exe" --version 2>/dev/null | sed -n 's/.*version \([0-9]*\)\..*/\1/p' | head -n 1
}

# Charliecloud mounts the exported squashfs with squashfuse as an unprivileged user, which needs
# /dev/fuse open to everyone: Debian's udev rule makes it 0666, and this machine's (no udev) 0600.
fuse_for_users() {
    if [ -c /dev/fuse ] && [ "$(stat -c %a /dev/fuse)" != 666 ] && [ "$(id -u)" = 0 ]; then
        say "making /dev/fuse 0666, as Debian's udev rule does (unprivileged squashfuse for ch-run)"
        chmod 0666 /dev/fuse
    fi
}

is_debian_root() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ -r /etc/debian_version ]; }

# After the packages: enroot and pyxis from their release sources (does nothing when installed).
hpc_runtimes() { $want_hpc && "$(dirname "$0")/ensure-hpc-runtimes.sh"; return 0; }

missing=()
want_qemu=false
want_hpc=false
for group in "$@"; do
    [ "$group" = test ] && fuse_for_users
    case "$group" in hpc|test) want_hpc=true ;; esac
    for pkg in $(packages_for "$group"); do
        [ "$pkg" = qemu-user-static ] && want_qemu=true
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
done
old_qemu=false
if $want_qemu && [ "$(qemu_major)" -lt "$QEMU_MIN_MAJOR" ] && dpkg -s qemu-user-static >/dev/null 2>&1; then
    old_qemu=true
fi

if [ ${#missing[@]} -eq 0 ] && ! $old_qemu; then
    hpc_runtimes
    $want_qemu && exec "$(dirname "$0")/register-binfmt.sh"
    exit 0
fi

if ! is_debian_root; then
    [ ${#missing[@]} -gt 0 ] && say "missing: ${missing[*]}; install them (Debian: apt-get install ${missing[*]}; qemu-user-static from bookworm-backports)"
    $old_qemu && say "qemu-user-static $(qemu_major).x is too old for torch under emulation; install >= $QEMU_MIN_MAJOR (Debian: apt-get install -t bookworm-backports qemu-user-static)"
    say "the tests that need them will fail and name the same fix"
    hpc_runtimes
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
regular=()
for pkg in "${missing[@]}"; do
    [ "$pkg" = qemu-user-static ] || regular+=("$pkg")
done
if $want_qemu && { $old_qemu || printf '%s\n' "${missing[@]}" | grep -qx qemu-user-static; }; then
    codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    if [ "$codename" = bookworm ] && [ ! -f "$BACKPORTS_LIST" ] \
            && ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
        say "adding bookworm-backports (for qemu-user-static >= $QEMU_MIN_MAJOR) in $BACKPORTS_LIST"
        echo "deb http://deb.debian.org/debian bookworm-backports main" > "$BACKPORTS_LIST"
    fi
fi
say "installing: ${missing[*]}$($old_qemu && echo " (and qemu-user-static from backports)")"
apt_bounded=$(dirname "$0")/apt-bounded.sh
"$apt_bounded" update -qq
if [ ${#regular[@]} -gt 0 ]; then
    "$apt_bounded" install -y -qq --no-install-recommends "${regular[@]}" >/dev/null
fi
if $want_qemu && { $old_qemu || printf '%s\n' "${missing[@]}" | grep -qx qemu-user-static; }; then
    target=()
    grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/ && target=(-t bookworm-backports)
    "$apt_bounded" install -y -qq --no-install-recommends "${target[@]}" qemu-user-static >/dev/null
    if [ "$(qemu_major)" -lt "$QEMU_MIN_MAJOR" ]; then
        say "qemu-user-static is $(qemu_major).x after the install; >= $QEMU_MIN_MAJOR is needed (torch crashes under older qemu)"
        exit 1
    fi
fi
hpc_runtimes
$want_qemu && exec "$(dirname "$0")/register-binfmt.sh"
exit 0
