#!/usr/bin/env bash
# apt-get with a bound, for this host's installs (ensure-docker.sh, ensure-tools.sh, engine28.sh).
#
#   scripts/apt-bounded.sh update|download ARG...          # the command, bounded and retried
#   scripts/apt-bounded.sh install|upgrade ARG...          # a bounded, retried fetch, then the command offline
#
# A mirror connection that stalls hangs apt-get with no end: seen once, a build sat 14 minutes in
# `apt-get update`, its http method on an open socket with nothing coming, and apt's own timeout
# never fired (it counts silence, and a connection that trickles is never silent). So each try of a
# step that reaches the network runs under `timeout` (which signals apt's whole process group, its
# http methods too), up to PTMG_APT_TRIES times (3), PTMG_APT_TRY_SECONDS each (300). `install` and
# `upgrade` fetch first (--download-only; a killed fetch resumes from apt's partial folder), then
# run from apt's cache alone (--no-download), which reaches no network and needs no bound.
# The images' RUNs do the same with the shell functions of builder/render/templates/dockerfile/_apt.j2
# (a RUN cannot source a file of the build context without waiting for the context).
set -euo pipefail

seconds=${PTMG_APT_TRY_SECONDS:-300}
tries=${PTMG_APT_TRIES:-3}
pause=${PTMG_APT_PAUSE:-5}
say() { printf 'apt-bounded: %s\n' "$*" >&2; }

try() {
    local n=1
    until timeout -k 10 "$seconds" apt-get "$@"; do
        if [ "$n" -ge "$tries" ]; then
            say "apt-get $1 failed $tries times (each try bounded to $seconds s); is the mirror reachable?"
            return 1
        fi
        say "apt-get $1 failed or ran past $seconds s (try $n of $tries); again"
        n=$((n + 1))
        sleep "$pause"
    done
}

case "${1:-}" in
    update | download) try "$@" ;;
    install | upgrade) try "$@" --download-only && DEBIAN_FRONTEND=noninteractive exec apt-get "$@" --no-download ;;
    *) say "usage: $0 update|download|install|upgrade [apt-get arguments]"; exit 2 ;;
esac
