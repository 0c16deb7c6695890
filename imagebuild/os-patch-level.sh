#!/bin/sh
# os-patch-level.sh FILE
#
# The OS patch level of the image, written at the end of the OS layer's RUN, right after
# `apt-get update && apt-get upgrade`: the archive's state the upgrade applied (`updated`: the
# newest Release date of the suites apt read, so the file is the same for every build of one
# snapshot, never the build's wall-clock time), the snapshot key the host passed as the build arg
# PTMG_OS_SNAPSHOT (the layer's cache key: builder/imaging/os_snapshot.py), and each suite apt read
# with its Release date, from apt's own lists. `build.py build` reads FILE into the
# io.pt-multi-gpu.os.* labels, so they describe the OS layer as it was made, also when the layer
# came from the cache. Plain `key: value` lines; root's, world-readable.
set -eu
out="$1"
install -d -m 0755 "$(dirname "$out")"
suites=$(
    for release in /var/lib/apt/lists/*_InRelease; do
        [ -f "$release" ] || continue
        codename=$(sed -n 's/^Codename: *//p' "$release" | head -n 1)
        date=$(sed -n 's/^Date: *//p' "$release" | head -n 1)
        echo "$codename $(date -u -d "$date" +%Y-%m-%dT%H:%M:%SZ)"
    done | sort)
# ISO 8601 UTC sorts as text: the newest suite's date is the archive state the upgrade applied.
updated=$(printf '%s\n' "$suites" | awk 'NF == 2 { print $2 }' | sort | tail -n 1)
{
    echo "updated: ${updated:-unknown}"
    echo "snapshot: ${PTMG_OS_SNAPSHOT:-unknown}"
    printf '%s\n' "$suites" | awk 'NF == 2 { print "suite: " $0 }'
} > "$out"
chmod 0644 "$out"
