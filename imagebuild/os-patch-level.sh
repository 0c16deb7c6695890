#!/bin/sh
# os-patch-level.sh FILE
#
# The OS patch level of the image, written at the end of the OS layer's RUN, right after
# `apt-get update && apt-get upgrade`: when the upgrade ran, the snapshot key the host passed as
# the build arg PTMG_OS_SNAPSHOT (the layer's cache key: builder/build/os_snapshot.py), and each
# suite apt read with its Release date, from apt's own lists. `build.py build` reads FILE into the
# io.pt-multi-gpu.os.* labels, so they describe the OS layer as it was made, also when the layer
# came from the cache. Plain `key: value` lines; root's, world-readable.
set -eu
out="$1"
install -d -m 0755 "$(dirname "$out")"
{
    echo "updated: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "snapshot: ${PTMG_OS_SNAPSHOT:-unknown}"
    for release in /var/lib/apt/lists/*_InRelease; do
        [ -f "$release" ] || continue
        codename=$(sed -n 's/^Codename: *//p' "$release" | head -n 1)
        date=$(sed -n 's/^Date: *//p' "$release" | head -n 1)
        echo "suite: $codename $(date -u -d "$date" +%Y-%m-%dT%H:%M:%SZ)"
    done
} > "$out"
chmod 0644 "$out"
