#!/bin/sh
# shared-tree.sh cuda OUT TREE UID GID EPOCH
# shared-tree.sh torch FROM OUT TREE UID GID EPOCH [--drop-ptxas-blackwell]
# shared-tree.sh prune TREE UV_CACHE
# shared-tree.sh link TREE SITE_PACKAGES [UV_CACHE]
#
# The image's first layers are trees of files that are the same bytes for every cell that installs the
# same wheels, whatever its base or Python, so that a node keeps them once (docs/image-layout.md,
# "Layers"). Their stages (builder/render/templates/dockerfile/07-shared.j2) unpack wheels with uv's
# --target and hand the final stage the folder OUT, whose contents it copies in:
#
#   cuda    the CUDA wheels, unpacked by uv at OUT/TREE: the whole tree (nvidia/, every
#           nvidia_*.dist-info; empty where the lock has none). The venv's site-packages links each
#           of its entries.
#   torch   of the lock's torch set, unpacked by uv at FROM, the files that are the same bytes in
#           the wheels of every Python: torch/lib/* but libtorch_python.so and libtorch_cpu.so, and
#           Triton's backends/ (ptxas, libdevice, headers) but its static archives, which
#           slim-venv.sh drops too (and ptxas-blackwell with --drop-ptxas-blackwell, as slim-venv.sh
#           does). Measured on torch 2.14.1 and Triton 3.8.0, cp311 against cp313, from the wheels'
#           RECORDs: 555.6 MB of torch/lib and 386.0 MB of triton/backends/nvidia are equal; every
#           other file of torch/lib and triton/_C differs. They move to OUT/TREE/<the same path>;
#           FROM goes. FROM's files are hard links into the uv cache that the venv's torch RUN
#           copies the set from: the move takes the link, not the cache's name, and sealing the tree
#           leaves the cache's bytes as uv wrote them (a copy takes neither owner nor time, and the
#           modes are the ones uv gave under umask 0002); a copy here would write 1.2 GB more.
#   prune   in the venv's torch RUN, before uv copies the set from the stage's uv cache (bind-mounted
#           read-write, its writes dropped): deletes from each wheel unpacked in UV_CACHE every file
#           that TREE holds at the same path, and lists those paths in UV_CACHE/ptmg-pruned. In the
#           stage they were two names of one inode (see torch), so they are the same bytes; uv then
#           copies only the files the venv keeps (735 MiB less written for torch 2.14.1: uv installs
#           what the unpacked wheel holds and keeps its RECORD as the wheel wrote it). Python sources
#           (Triton's backends have a few) stay, so that uv compiles their bytecode as before. A cache that
#           is not that layout (another uv) loses nothing and lists nothing: uv copies everything,
#           and link compares as it would without prune.
#   link    in the venv's torch RUN, after uv installed the same wheels into SITE_PACKAGES: each
#           file there that is byte for byte the one at TREE/<its path> becomes a relative link to
#           it, so the venv's layer keeps a link, not a second copy; so does each file that prune
#           took out of UV_CACHE and uv therefore did not write (and only those: a file the wheels
#           do not have stays absent). A file that differs stays (and is counted): the image is right
#           either way, it only shares less.
#
# cuda and torch then make the tree the same bytes whenever and wherever the stage runs:
#  - uv's install record of each distribution (`*.dist-info/uv_cache.json`: the install's wall-clock
#    time) and its line in RECORD go, as imagebuild/slim-venv.sh does in the venv;
#  - no __pycache__ (a .pyc names one Python) and no bin/ (the venv links packages only: a program
#    there would be on no PATH, so a CUDA wheel that brings one fails the build here);
#  - files of the same bytes (over 4 kB) are one inode, hard-linked in byte order of their paths
#    (only files whose size another file shares are hashed: sha256sum over the 3 GB of CUDA wheels
#    cost 8 s on the critical path of a cold build);
#  - the tree is the venv's: UID, group GID, folders 2775 (setgid), files 0664, or 0775 where the
#    wheel made them executable, whatever the stage's umask (the root boundary: `pip install`
#    works as pt, also after a uid remap, through the group); the folders above it (OUT/opt) are
#    root's, 0755;
#  - every entry gets the time EPOCH (touch -h: links too), so the layer's tar is the same.
set -eu
usage() {
    echo "usage: shared-tree.sh cuda OUT TREE UID GID EPOCH | torch FROM OUT TREE UID GID EPOCH" \
         "[--drop-ptxas-blackwell] | prune TREE UV_CACHE | link TREE SITE_PACKAGES [UV_CACHE]" >&2
    exit 2
}

seal() {  # OUT TREE UID GID EPOCH
    out=$1 tree=$1$2
    rm -f "$tree/.lock"
    for record in "$tree"/*.dist-info/uv_cache.json; do
        [ -e "$record" ] || continue
        rm -f "$record"
        sed -i '/^[^,]*\.dist-info\/uv_cache\.json,/d' "${record%/uv_cache.json}/RECORD"
    done
    find "$tree" -depth -type d -name __pycache__ -exec rm -rf {} +
    # Identical files (Triton's backends carry each CUPTI library three times: 27 MB) become hard links,
    # as slim-venv.sh makes them in the venv; by content, the first path in byte order keeps the inode,
    # so every stage makes the same links on any base (BuildKit's COPY keeps them).
    find "$tree" -type f -size +4k -printf '%s %p\n' \
        | awk '{ size[NR] = $1; sub(/^[0-9]+ /, ""); path[NR] = $0; count[size[NR]]++ }
               END { for (i = 1; i <= NR; i++) if (count[size[i]] > 1) print path[i] }' \
        | LC_ALL=C sort | xargs -d '\n' -r sha256sum | LC_ALL=C sort -s -k1,1 | {
        prev='' first=''
        while read -r hash path; do
            if [ "$hash" = "$prev" ]; then ln -f "$first" "$path"; else prev=$hash first=$path; fi
        done
    }
    find "$out" -path "$tree" -prune -o -exec chown -h 0:0 {} + -exec chmod 0755 {} +
    chown -hR "$3:$4" "$tree"
    find "$tree" -type d -exec chmod 2775 {} +
    find "$tree" -type f -perm -u+x -exec chmod 0775 {} +
    find "$tree" -type f ! -perm -u+x -exec chmod 0664 {} +
    find "$out" -exec touch -h -d "@$5" {} +
    echo "shared-tree.sh: $tree: $(du -sm "$tree" | cut -f1) MiB, $(find "$tree" -type f | wc -l) files"
}

case ${1:-} in
    cuda)
        [ $# -eq 6 ] || usage
        tree=$2$3
        # No CUDA wheel at all (a CPU-only torch, or one that bundles CUDA) leaves an empty tree.
        if ls -d "$tree"/*.dist-info >/dev/null 2>&1 && [ ! -d "$tree/nvidia" ]; then
            echo "shared-tree.sh: $tree/nvidia: the CUDA wheels were unpacked elsewhere" >&2
            exit 1
        fi
        if [ -e "$tree/bin" ]; then
            echo "shared-tree.sh: $tree/bin: a CUDA wheel installs programs ($(ls "$tree/bin" | head -3 | tr '\n' ' '))" >&2
            exit 1
        fi
        seal "$2" "$3" "$4" "$5" "$6" ;;
    torch)
        case $# in 7) ;; 8) [ "$8" = --drop-ptxas-blackwell ] || usage ;; *) usage ;; esac
        from=$2 tree=$3$4
        if [ ! -d "$from/torch/lib" ]; then echo "shared-tree.sh: $from/torch/lib: torch was not unpacked there" >&2; exit 1; fi
        dirs=torch/lib
        if [ -d "$from/triton/backends" ]; then
            dirs="$dirs triton/backends"
            find "$from/triton" -type f -name '*.a' -delete
        fi
        if [ "${8:-}" = --drop-ptxas-blackwell ]; then rm -f "$from/triton/backends/nvidia/bin/ptxas-blackwell"; fi
        mkdir -p "$tree"
        # shellcheck disable=SC2086 # $dirs: two fixed words
        (cd "$from" && find $dirs -type f ! -name libtorch_python.so ! -name libtorch_cpu.so) | while IFS= read -r path; do
            mkdir -p "$tree/${path%/*}"
            mv "$from/$path" "$tree/$path"
        done
        rm -rf "$from"
        seal "$3" "$4" "$5" "$6" "$7" ;;
    prune)
        [ $# -eq 3 ] || usage
        tree=$2 cache=$3
        for need in "$tree" "$cache"; do
            if [ ! -d "$need" ]; then echo "shared-tree.sh: $need: not a folder" >&2; exit 1; fi
        done
        # uv keeps each unpacked wheel at <cache>/archive-v<N>/<id>/, laid out as site-packages.
        # find's output: no file name in a wheel has a newline.
        (cd "$tree" && find . -type f ! -name '*.py' | sed 's#^\./##') | while IFS= read -r path; do
            for wheel in "$cache"/archive-v*/*/; do
                if [ -f "$wheel$path" ] && [ ! -L "$wheel$path" ]; then
                    rm -f "$wheel$path"
                    printf '%s\n' "$path"
                fi
            done
        done > "$cache/ptmg-pruned"
        echo "shared-tree.sh: $cache: $(wc -l < "$cache/ptmg-pruned") files that $tree holds taken out" ;;
    link)
        case $# in 3|4) ;; *) usage ;; esac
        tree=$2 sp=$3 pruned=/dev/null linked=0 bytes=0 kept=0
        for need in "$tree" "$sp"; do
            if [ ! -d "$need" ]; then echo "shared-tree.sh: $need: not a folder" >&2; exit 1; fi
        done
        if [ $# -eq 4 ]; then
            pruned=$4/ptmg-pruned
            if [ ! -f "$pruned" ]; then echo "shared-tree.sh: $pruned: prune did not run" >&2; exit 1; fi
        fi
        # find's output: no file name in a wheel has a newline.
        while IFS= read -r path; do
            here=$sp/$path
            if [ ! -e "$here" ] && [ ! -L "$here" ] && grep -Fxq -- "$path" "$pruned"; then
                size=$(stat -c %s "$tree/$path")
                mkdir -p "${here%/*}"
                ln -sr "$tree/$path" "$here"
                linked=$((linked + 1)) bytes=$((bytes + size))
            elif [ -f "$here" ] && [ ! -L "$here" ] && cmp -s "$tree/$path" "$here"; then
                size=$(stat -c %s "$here")
                ln -sfr "$tree/$path" "$here"
                linked=$((linked + 1)) bytes=$((bytes + size))
            else
                kept=$((kept + 1))
            fi
        done <<LIST
$(cd "$tree" && find . -type f | sed 's#^\./##')
LIST
        echo "shared-tree.sh: $sp: $linked files ($((bytes / 1048576)) MiB) are links to $tree;" \
             "$kept of its files are not the venv's (not shared)" ;;
    *) usage ;;
esac
