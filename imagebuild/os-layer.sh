#!/bin/sh
# os-layer.sh mark ROOT STATE
# os-layer.sh collect ROOT STATE OUT
# os-layer.sh apply OUT ROOT
#
# The OS layer (apt: Debian's fixes and the image's packages) sits above the venv, so that Debian's
# weekly fixes renew only it (docs/image-layout.md, "Layers"). apt itself needs nothing of the venv,
# so it runs in a stage of its own (builder/render/templates/dockerfile/06-os.j2), on the base and
# the user as the image has them, beside the wheels' stages; the image's layer then only applies
# what that stage changed. Every cell on one base and package list shares the stage, so a second
# cell's build runs no apt, and their OS layers are the same files, times included.
#
#   mark     before apt: STATE gets every entry of ROOT that is on ROOT's own filesystem (mounts,
#            such as the RUN's /proc, /etc/hosts and apt's cache mounts, are left out), each with
#            its inode and its ctime. Anything that changes an entry (its bytes, mode, owner, links,
#            a replacement under its name) gives it another ctime or inode.
#   collect  after apt: OUT/layer.tar holds every entry of ROOT that is new or changed since mark
#            (owners by number, hard links as links, file capabilities), parents before children;
#            OUT/deleted lists every path that went, NUL-separated. STATE and OUT themselves are not
#            part of it. Paths are relative to ROOT.
#   apply    in the image's layer, as root: extract OUT/layer.tar over ROOT, then delete what
#            OUT/deleted lists. The layer then holds what the same commands would have changed in
#            place (deleted base files as whiteouts, as before).
set -eu
usage() {
    echo "usage: os-layer.sh mark ROOT STATE | collect ROOT STATE OUT | apply OUT ROOT" >&2
    exit 2
}

entries() {  # ROOT SKIP...: "<inode> <ctime> <path>\0" for each entry on ROOT's filesystem but each
             # SKIP (a path relative to ROOT) and what is below it, sorted
    root=$1
    shift
    dev=$(stat -c %d "$root")
    skip='^$'
    for path in "$@"; do
        case $path in
            *[!A-Za-z0-9/_.-]* | '') echo "os-layer.sh: can only leave out a path of [A-Za-z0-9/_.-]: '$path'" >&2
                                     exit 2 ;;
        esac
        skip="$skip|^[0-9]+ [^ ]+ \./$(echo "$path" | sed 's/\./\\./g')(/|\$)"
    done
    (cd "$root" && find . -xdev -printf '%D %i %C@ %p\0') \
        | { grep -z "^$dev " || true; } | cut -z -d' ' -f2- \
        | { grep -zvE "$skip" || true; } | LC_ALL=C sort -z
}

root_of() {  # ROOT as given: without a trailing / (but / itself)
    r=${1%/}
    echo "${r:-/}"
}

relative() {  # ROOT PATH: PATH under ROOT, without ROOT and without a leading /
    if [ "$1" = / ]; then
        echo "${2#/}"
        return
    fi
    case $2 in
        "$1"/*) echo "${2#"$1"/}" ;;
        *) echo "os-layer.sh: $2 is not under $1" >&2; exit 2 ;;
    esac
}

[ $# -ge 1 ] || usage
case $1 in
    mark)
        [ $# -eq 3 ] || usage
        root=$(root_of "$2")
        skip_state=$(relative "$root" "$(readlink -f "$3")")
        entries "$root" "$skip_state" > "$3"
        ;;
    collect)
        [ $# -eq 4 ] || usage
        root=$(root_of "$2") state=$3 out=$4
        # STATE and OUT are the stage's own: never in the layer (a path is skipped with all below
        # it), and so are the lists made here, in OUT.
        skip_state=$(relative "$root" "$(readlink -f "$state")")
        mkdir -p "$out"
        skip_out=$(relative "$root" "$(readlink -f "$out")")
        after=$out/.after changed=$out/.changed level=$out/.level
        trap 'rm -f "$after" "$changed" "$level" "$level.up"' EXIT
        entries "$root" "$skip_state" "$skip_out" > "$after"
        # New or changed: in the list after, not in the one before; the root itself is not an entry
        # of the layer. Gone: a path before that is not one after.
        LC_ALL=C comm -z -13 "$state" "$after" | cut -z -d' ' -f3- | { grep -zvx '\.' || true; } > "$changed"
        cut -z -d' ' -f3- "$state" | LC_ALL=C sort -z > "$level"
        cut -z -d' ' -f3- "$after" | LC_ALL=C sort -z | LC_ALL=C comm -z -23 "$level" - > "$out/deleted"
        # With every folder above each of them that is still there, so that the layer gives each
        # folder the times it had (a changed entry is replaced, not rewritten); by path, so that a
        # folder comes before what is in it.
        cat "$changed" "$out/deleted" > "$level"
        while [ -s "$level" ]; do
            sed -z 's|/[^/]*$||' "$level" | { grep -zvx '\.' || true; } | LC_ALL=C sort -zu > "$level.up"
            cat "$level.up" >> "$changed"
            mv "$level.up" "$level"
        done
        LC_ALL=C sort -zu "$changed" | LC_ALL=C comm -z -23 - "$out/deleted" > "$level"
        mv "$level" "$changed"
        tar -C "$root" --null --no-recursion -T "$changed" --numeric-owner \
            --xattrs --xattrs-include=security.capability -cf "$out/layer.tar.tmp"
        mv "$out/layer.tar.tmp" "$out/layer.tar"
        echo "os-layer.sh: $(tr -cd '\0' < "$changed" | wc -c) entries new, changed or above one," \
             "$(tr -cd '\0' < "$out/deleted" | wc -c) gone" >&2
        ;;
    apply)
        [ $# -eq 3 ] || usage
        out=$2 root=$3
        [ -f "$out/layer.tar" ] && [ -f "$out/deleted" ] || {
            echo "os-layer.sh: $out has no layer.tar and deleted (made by collect)" >&2; exit 2; }
        (cd "$root" && xargs -0 -r rm -rf -- < "$out/deleted")
        tar -C "$root" --numeric-owner --same-owner --same-permissions \
            --xattrs --xattrs-include=security.capability -xf "$out/layer.tar"
        ;;
    *) usage ;;
esac
