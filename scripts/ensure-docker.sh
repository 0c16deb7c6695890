#!/usr/bin/env bash
# Make sure a Docker engine answers, starting one only where none does.
#
#   scripts/ensure-docker.sh            # idempotent; safe to call from make and CI
#
# - An engine that already answers (local socket or DOCKER_HOST) is never touched.
# - Otherwise, as root on Debian: install docker.io (dockerd + the 20.10 CLI that
#   builds with BuildKit) if missing, start dockerd in the background with its
#   log in /var/log/pt-multi-gpu-dockerd.log, and wait for the socket.
# - Anything else gets a clear message with the fix, and exit status 1.
set -euo pipefail

timeout_s=${DOCKERD_START_TIMEOUT:-60}
log=/var/log/pt-multi-gpu-dockerd.log
say() { printf 'ensure-docker: %s\n' "$*" >&2; }

engine_answers() {
    # Prefer Debian's CLI: it is the one we build with; any CLI can ping.
    local cli
    for cli in /usr/bin/docker "$(command -v docker 2>/dev/null || true)"; do
        [ -n "$cli" ] && [ -x "$cli" ] || continue
        timeout 10 "$cli" version --format '{{.Server.Version}}' >/dev/null 2>&1 && return 0
    done
    return 1
}

if engine_answers; then
    exit 0
fi

if [ -n "${DOCKER_HOST:-}" ]; then
    say "DOCKER_HOST=$DOCKER_HOST is set but no engine answers there; not starting a local one."
    say "fix: start that engine, or unset DOCKER_HOST to use a local dockerd."
    exit 1
fi

if [ "$(id -u)" != 0 ]; then
    say "no Docker engine answers and this user is not root, so none can be started here."
    say "fix: start Docker (e.g. 'sudo systemctl start docker') and make sure you are in the 'docker' group."
    exit 1
fi

if ! [ -x /usr/sbin/dockerd ] || ! [ -x /usr/bin/docker ]; then
    if ! command -v apt-get >/dev/null; then
        say "no dockerd found and this is not a Debian-like system; install Docker Engine >= 20.10 with BuildKit."
        exit 1
    fi
    say "installing docker.io (Debian's Docker Engine) ..."
    "$(dirname "$0")/apt-bounded.sh" update -qq
    "$(dirname "$0")/apt-bounded.sh" install -y -qq docker.io >/dev/null
fi

if [ -S /var/run/docker.sock ] && pgrep -x dockerd >/dev/null; then
    say "dockerd is running but does not answer yet; waiting for it"
else
    say "starting dockerd (log: $log)"
    # setsid: dockerd outlives this script and the make/CI step that called it.
    setsid /usr/sbin/dockerd --storage-driver=overlay2 >"$log" 2>&1 < /dev/null &
fi

for _ in $(seq "$timeout_s"); do
    if [ -S /var/run/docker.sock ] && engine_answers; then
        say "engine is up: $(/usr/bin/docker version --format 'server {{.Server.Version}}, storage driver ' 2>/dev/null)$(/usr/bin/docker info --format '{{.Driver}}' 2>/dev/null)"
        exit 0
    fi
    sleep 1
done

say "dockerd did not answer within ${timeout_s}s. Last lines of $log:"
tail -n 20 "$log" >&2 || true
say "fix: read $log; overlay2 needs a filesystem that supports it (try DOCKERD_ARGS or --storage-driver=vfs)."
exit 1
