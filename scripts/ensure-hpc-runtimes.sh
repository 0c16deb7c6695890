#!/usr/bin/env bash
# Build and install enroot and pyxis (NVIDIA's Slurm plugin that runs jobs in enroot containers)
# from their release sources, under /usr/local only. `scripts/ensure-tools.sh hpc` (and `test`)
# runs it after installing the build and runtime packages (libbsd-dev, makeself, libslurm-dev, jq,
# parallel, squashfs-tools, ...).
#
#   PTMG_THIRDPARTY_DIR=DIR scripts/ensure-hpc-runtimes.sh
#
# DIR holds enroot-4.1.2.tar.gz and pyxis-0.24.0.tar.gz (`make tools` and `make test` set it to
# ../shared/thirdparty when that folder exists). Each is checked against a sha256 before it is
# unpacked. The pinned sums are those of the `git archive`s of the release tags in
# ../shared/thirdparty; NVIDIA's own release tarballs (github.com/NVIDIA/enroot/archive/v4.1.2.tar.gz,
# .../NVIDIA/pyxis/archive/v0.24.0.tar.gz) have other sums: give the ones you checked in
# PTMG_ENROOT_SHA256 and PTMG_PYXIS_SHA256. Neither kind carries git submodules; the build below
# replaces the two that enroot needs (makeself from Debian's package; the Linux headers from the
# system's) and builds enroot's helpers against glibc instead of musl.
#
# Installed enroot 4.1.2 and pyxis 0.24.0 are left alone: a second run does nothing.
set -euo pipefail

say() { printf 'ensure-tools: %s\n' "$*" >&2; }
ENROOT_VERSION=4.1.2
PYXIS_VERSION=0.24.0
ENROOT_SHA256=${PTMG_ENROOT_SHA256:-65d7098241b5a86faf48ba29bbca1462e19682bf49d6b89c8a2d934f0196b4da}
PYXIS_SHA256=${PTMG_PYXIS_SHA256:-ede95ba2d48542881f137d9c07c417c5c765994710a74c593a21b3328f311f5d}
PREFIX=/usr/local
PYXIS_SO=$PREFIX/lib/slurm/spank_pyxis.so

enroot_ok() { [ "$("$PREFIX/bin/enroot" version 2>/dev/null)" = "$ENROOT_VERSION" ]; }
pyxis_ok() { [ -f "$PYXIS_SO" ] && grep -aqF "pyxis: version v$PYXIS_VERSION" "$PYXIS_SO"; }

todo=()
enroot_ok || todo+=(enroot)
pyxis_ok || todo+=(pyxis)
[ ${#todo[@]} -eq 0 ] && exit 0

dir=${PTMG_THIRDPARTY_DIR:-}
tarball() { echo "$dir/$1-$([ "$1" = enroot ] && echo $ENROOT_VERSION || echo $PYXIS_VERSION).tar.gz"; }
for tool in "${todo[@]}"; do
    if [ -z "$dir" ] || [ ! -f "$(tarball "$tool")" ]; then
        say "no source for ${todo[*]}: set PTMG_THIRDPARTY_DIR to a folder holding enroot-$ENROOT_VERSION.tar.gz and pyxis-$PYXIS_VERSION.tar.gz (NVIDIA's release tarballs, with PTMG_ENROOT_SHA256/PTMG_PYXIS_SHA256 set to their sha256), then rerun; the enroot/pyxis tests fail until then"
        exit 0
    fi
done
if [ "$(id -u)" != 0 ]; then
    say "enroot $ENROOT_VERSION / pyxis $PYXIS_VERSION are not installed; run this as root to build them into $PREFIX"
    exit 0
fi

work=$(mktemp -d /tmp/ptmg-hpc-build.XXXXXX)
trap 'rm -rf "$work"' EXIT
unpack() {  # unpack TOOL SHA256 -> $work/TOOL, after checking the tarball's sum
    local file want got
    file=$(tarball "$1"); want=$2
    got=$(sha256sum "$file" | cut -d' ' -f1)
    if [ "$got" != "$want" ]; then
        say "$file: sha256 $got, expected $want (for NVIDIA's own tarball set PTMG_${1^^}_SHA256 to the sum you checked)"
        exit 2
    fi
    mkdir "$work/$1"
    tar -xzf "$file" -C "$work/$1" --strip-components=1 --no-same-owner
}

for tool in "${todo[@]}"; do
    case "$tool" in
        enroot)
            unpack enroot "$ENROOT_SHA256"
            src=$work/enroot
            say "building enroot $ENROOT_VERSION into $PREFIX"
            # The submodules the source lacks: Debian's makeself (the same 2.4.5), and the system's
            # Linux headers (an `install` that does nothing). FORCE_GLIBC: no musl. glibc 2.36 has
            # no strlcpy/strlcat, so libbsd.so follows enroot's own libbsd.a (a plain -lbsd would
            # resolve to that libbsd.a first).
            install -m 755 /usr/bin/makeself "$src/deps/makeself/makeself.sh"
            printf 'install:\n\t@:\n' > "$src/deps/linux-headers/Makefile"
            libbsd=$(dpkg -L libbsd-dev 2>/dev/null | grep '/libbsd\.so$' | head -n 1)
            [ -n "$libbsd" ] || { say "libbsd-dev is missing (apt-get install libbsd-dev)"; exit 1; }
            make -s -C "$src" FORCE_GLIBC=1 LDLIBS="-l:libbsd.a $libbsd" prefix="$PREFIX" >"$work/enroot.log" 2>&1 \
                && make -s -C "$src" FORCE_GLIBC=1 LDLIBS="-l:libbsd.a $libbsd" prefix="$PREFIX" install \
                    >>"$work/enroot.log" 2>&1 \
                || { tail -n 20 "$work/enroot.log" >&2; say "building enroot failed"; exit 1; }
            enroot_ok || { say "enroot installed but '$PREFIX/bin/enroot version' is not $ENROOT_VERSION"; exit 1; }
            ;;
        pyxis)
            unpack pyxis "$PYXIS_SHA256"
            say "building pyxis $PYXIS_VERSION into $PREFIX (against libslurm-dev $(dpkg-query -W -f '${Version}' libslurm-dev 2>/dev/null))"
            make -s -C "$work/pyxis" prefix="$PREFIX" install >"$work/pyxis.log" 2>&1 \
                || { tail -n 20 "$work/pyxis.log" >&2; say "building pyxis failed"; exit 1; }
            pyxis_ok || { say "pyxis installed but $PYXIS_SO is not $PYXIS_VERSION"; exit 1; }
            ;;
    esac
done
say "installed: $("$PREFIX/bin/enroot" version | sed 's/^/enroot /'), pyxis $PYXIS_VERSION ($PYXIS_SO)"
