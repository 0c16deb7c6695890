#!/usr/bin/env bash
# A second, current Docker engine beside the system's, for the docker tier's `modern_engine` tests.
#
#   scripts/engine28.sh start overlay2|containerd   # idempotent; prints the user's environment on stdout:
#                                                  # DOCKER_HOST, DOCKER_CONFIG (finds buildx), PTMG_E28_BIN
#   scripts/engine28.sh install                    # only fetches and unpacks the packages (idempotent;
#                                                  # the docker tier's zstd pull engine runs their dockerd)
#   scripts/engine28.sh stop                       # stops it and deletes its data-root (idempotent)
#   scripts/engine28.sh status                     # exit 0 when it answers
#
# It is Debian forky's docker.io (dockerd, containerd 2.x), docker-cli and docker-buildx, fetched with
# `apt-get download` through a private apt configuration (the system's sources are never touched)
# and unpacked with `dpkg-deb -x` under $PTMG_E28_HOME. Their binaries need GLIBC 2.34, so they run
# on bookworm; forky's runc needs 2.38, so the system's runc (bookworm's docker.io depends on it) runs
# the containers. The daemon has everything of its own: --data-root, --exec-root, socket, pidfile,
# a containerd it supervises (no system containerd socket exists: the system dockerd supervises its
# own), and a bridge of its own (ptmg-e28, 10.213.28.0/24) with --iptables=false, so it never edits
# the system engine's chains; three rules of its own (comment ptmg-e28) let its containers out.
# One store at a time: `start` with the other store stops the running one and deletes its data.
# Its builder's garbage collection is off, so that BuildKit's default policies (by cache size and
# free space) never prune a layer cache a test relies on (the patch-day rebuild reuses the cell's)
# behind its back; the tests prune what they make themselves, and `stop` deletes the data-root.
set -euo pipefail

HOME_DIR=${PTMG_E28_HOME:-/var/cache/pt-multi-gpu/engine28}   # the unpacked packages (kept)
DATA=${PTMG_E28_DATA:-/var/lib/pt-multi-gpu-engine28}          # data-root (deleted by stop)
RUN=${PTMG_E28_RUN:-/run/ptmg-e28}                             # exec-root, socket, pidfile
BRIDGE=ptmg-e28
SUBNET=10.213.28.0/24
GATEWAY=10.213.28.1/24
SUITE=forky
PACKAGES="docker.io docker-cli docker-buildx containerd tini-static"
timeout_s=${PTMG_E28_START_TIMEOUT:-90}
say() { printf 'engine28: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }
apt_bounded=$(cd "$(dirname "$0")" && pwd)/apt-bounded.sh

root=$HOME_DIR/root
sock=$RUN/docker.sock
log=/var/log/pt-multi-gpu-engine28.log
cli=$root/usr/bin/docker

need_root() {
    [ "$(id -u)" = 0 ] || die "the second engine needs root (its own dockerd, bridge and data-root); run as root"
}

install_packages() {
    [ -x "$root/usr/sbin/dockerd" ] && [ -x "$root/usr/libexec/docker/cli-plugins/docker-buildx" ] \
        && [ -x "$root/usr/bin/containerd" ] && [ -x "$cli" ] && return 0
    command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null \
        || die "apt-get and dpkg-deb are needed to fetch Debian $SUITE's docker.io; this is not a Debian system"
    local apt=$HOME_DIR/apt
    mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/etc" "$HOME_DIR/debs"
    cat >"$apt/etc/$SUITE.sources" <<SRC
Types: deb
URIs: http://deb.debian.org/debian
Suites: $SUITE
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    local opts=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$apt/etc"
                -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o APT::Sandbox::User=root)
    say "fetching Debian $SUITE's $PACKAGES (private apt configuration under $apt)"
    "$apt_bounded" update "${opts[@]}" -qq || die "apt-get update of Debian $SUITE failed (network?)"
    rm -f "$HOME_DIR"/debs/*.deb
    # shellcheck disable=SC2086
    (cd "$HOME_DIR/debs" && "$apt_bounded" download "${opts[@]}" -qq $PACKAGES) || die "apt-get download failed"
    rm -rf "$root.new" && mkdir -p "$root.new"
    for deb in "$HOME_DIR"/debs/*.deb; do dpkg-deb -x "$deb" "$root.new"; done
    rm -rf "$root" && mv "$root.new" "$root"
}

answers() { [ -S "$sock" ] && DOCKER_HOST=unix://$sock timeout 10 "$cli" version --format '{{.Server.Version}}' >/dev/null 2>&1; }
running_store() { cat "$RUN/store" 2>/dev/null || true; }

RULES=("nat POSTROUTING -s $SUBNET ! -o $BRIDGE -j MASQUERADE"
       "filter FORWARD -i $BRIDGE -j ACCEPT"
       "filter FORWARD -o $BRIDGE -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT")
rules() {  # rules add|del: this engine's own iptables rules, each marked with the comment $BRIDGE
    local spec table chain args
    for spec in "${RULES[@]}"; do
        read -r table chain args <<<"$spec"
        # shellcheck disable=SC2086
        if [ "$1" = add ]; then
            iptables -w -t "$table" -C "$chain" $args -m comment --comment "$BRIDGE" 2>/dev/null \
                || iptables -w -t "$table" -I "$chain" 1 $args -m comment --comment "$BRIDGE"
        else
            while iptables -w -t "$table" -C "$chain" $args -m comment --comment "$BRIDGE" 2>/dev/null; do
                iptables -w -t "$table" -D "$chain" $args -m comment --comment "$BRIDGE"
            done
        fi
    done
}

print_env() {
    echo "DOCKER_HOST=unix://$sock"
    echo "DOCKER_CONFIG=$RUN/cli"
    echo "PTMG_E28_BIN=$root/usr/bin"
}

start() {
    local store=$1 features
    case "$store" in
        overlay2) features=false ;;
        containerd) features=true ;;
        *) say "unknown store '$store' (overlay2 or containerd)"; exit 2 ;;
    esac
    need_root
    if answers && [ "$(running_store)" = "$store" ]; then
        print_env; return 0
    fi
    [ -z "$(running_store)" ] || stop
    install_packages
    command -v runc >/dev/null || die "runc is missing (Debian: apt-get install runc; docker.io brings it)"
    mkdir -p "$RUN/cli" "$DATA"
    # The CLI finds buildx through its config (cliPluginsExtraDirs): nothing is put where the system's
    # CLIs look for plugins, so the 20.10 engine's builds go on exactly as before.
    printf '{"cliPluginsExtraDirs": ["%s"]}\n' "$root/usr/libexec/docker/cli-plugins" >"$RUN/cli/config.json"
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
        ip addr add "$GATEWAY" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
    rules add
    cat >"$RUN/daemon.json" <<JSON
{
  "features": {"containerd-snapshotter": $features},
  "storage-driver": "$([ "$store" = overlay2 ] && echo overlay2 || echo overlayfs)",
  "bridge": "$BRIDGE",
  "iptables": false,
  "ip6tables": false,
  "ip-masq": false,
  "userland-proxy": true,
  "builder": {"gc": {"enabled": false}}
}
JSON
    echo "$store" >"$RUN/store"
    say "starting dockerd $("$root/usr/sbin/dockerd" --version | sed 's/Docker version //') ($store store; log: $log)"
    # The packaged binaries first on PATH (containerd, its shim, docker-init), the system's runc after.
    PATH=$root/usr/bin:$root/usr/sbin:$root/usr/lib/containerd:$PATH setsid "$root/usr/sbin/dockerd" \
        --config-file "$RUN/daemon.json" --data-root "$DATA/$store" --exec-root "$RUN/exec" \
        -H "unix://$sock" --pidfile "$RUN/dockerd.pid" --containerd-namespace ptmg-e28 \
        --containerd-plugins-namespace ptmg-e28-plugins >"$log" 2>&1 </dev/null &
    for _ in $(seq "$timeout_s"); do
        if answers; then print_env; return 0; fi
        sleep 1
    done
    say "dockerd did not answer within ${timeout_s}s; last lines of $log:"; tail -n 20 "$log" >&2 || true
    stop; exit 1
}

stop() {
    need_root
    local pid t0=$SECONDS
    pid=$(cat "$RUN/dockerd.pid" 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        if answers; then  # containers first, so their mounts are gone before the data-root is
            DOCKER_HOST=unix://$sock "$cli" ps -aq | xargs -r env DOCKER_HOST=unix://$sock "$cli" rm -f >/dev/null || true
        fi
        kill "$pid"
        for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -0 "$pid" 2>/dev/null && { say "dockerd $pid did not stop in 30 s; killing it"; kill -9 "$pid"; }
    fi
    # Anything still mounted under the data-root or exec-root (a killed daemon's leftovers).
    grep -E " ($DATA|$RUN)/" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
    local t1=$SECONDS
    rm -rf "$DATA" "$RUN"
    [ -z "$pid" ] || say "stopped: daemon $((t1 - t0)) s, data-root deleted in $((SECONDS - t1)) s"
    rules del
    ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE"
    return 0
}

case "${1:-}" in
    start) start "${2:-overlay2}" ;;
    install) need_root; install_packages ;;
    stop) stop ;;
    status) answers && echo "DOCKER_HOST=unix://$sock store=$(running_store)" ;;
    *) say "usage: $0 start overlay2|containerd | install | stop | status"; exit 2 ;;
esac
