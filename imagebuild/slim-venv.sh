#!/bin/bash
# slim-venv.sh [--strip-triton] [--drop-ptxas-blackwell] VENV
#
# Drops from a venv what no runtime user needs. It runs at the end of every RUN that installs
# into the venv (builder/render/templates/dockerfile/_after-install.j2): a later layer can hide
# a file but never shrink the layer below, so the trim must happen in the installing RUN.
#
# It only ever rewrites files made by this RUN: a stamp file (VENV/.ptmg-slim-stamp), touched
# when it ends, marks the end of the previous trim, and strip/hardlink look only at files whose
# inode changed after it. So it must be the last thing an installing RUN does to the venv
# (_after-install.j2: after the root boundary's chmod g+w, which changes inodes too). Touching a file of a
# lower layer would copy it up into this one (a 300 MB libtriton.so twice); deleting one only
# leaves a whiteout, so deletions are not restricted.
#
# Removed (measured on torch 2.7.0: 180 MiB, +172 MiB with --strip-triton, +30 MiB ptxas):
#  1. Triton's bundled CUPTI/nvperf static archives: nothing links them at run time (Triton's
#     profiler loads the .so beside them).
#  2. Third-party packages' own test suites (sympy, numpy, networkx, tornado, ...). Never torch
#     (torch.testing is API and some torch modules import their test helpers), not
#     jupyterlab/tests (jupyterlab.browser_check imports it), not jedi's typeshed stubs.
#     Folders named `testing` (numpy.testing) are API and stay.
#  3. Triton's test-only instrumentation plugin.
#  4. --drop-ptxas-blackwell: Triton's ptxas for sm_100+, for a torch without kernels for them.
#  5. --strip-triton: the DWARF sections of Triton's own libraries (libtriton.so is half
#     .debug_*); .symtab stays, so backtraces keep function names. Needs binutils (g++ brings it).
#  6. Identical files (pip copies of symlinked libraries, duplicated static assets, licences)
#     become hard links: the same bytes counted once in the layer.
#  7. uv's install record of each distribution (`*.dist-info/uv_cache.json`: the install's
#     wall-clock time, for uv's own staleness check of path installs) and its line in RECORD:
#     without them two builds of one lock give the same files (`build.py repro`).
set -euo pipefail

strip_triton=0
drop_bw=0
while [[ $# -gt 1 ]]; do
    case $1 in
        --strip-triton) strip_triton=1 ;;
        --drop-ptxas-blackwell) drop_bw=1 ;;
        *) echo "slim-venv.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
venv=${1:?usage: slim-venv.sh [--strip-triton] [--drop-ptxas-blackwell] VENV}
stamp=$venv/.ptmg-slim-stamp
sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
newer=()
if [[ -e $stamp ]]; then newer=(-cnewer "$stamp"); fi
before=$(du -sb "$venv" | cut -f1)

if [[ -d $sp/triton ]]; then
    find "$sp/triton" -type f -name '*.a' -delete
    rm -f "$sp/triton/instrumentation/libGPUInstrumentationTestLib.so"
    if [[ $drop_bw = 1 ]]; then rm -f "$sp/triton/backends/nvidia/bin/ptxas-blackwell"; fi
    if [[ $strip_triton = 1 && -d $sp/triton/_C ]]; then
        if command -v strip >/dev/null; then
            find "$sp/triton/_C" -type f -name '*.so' "${newer[@]}" \
                -exec strip --strip-debug --preserve-dates {} +
        else
            echo "slim-venv.sh: no strip (binutils) here; Triton's libraries keep their debug sections" >&2
        fi
    fi
fi
find "$sp" -mindepth 2 -type d \( -name tests -o -name test \) \
    -not -path "$sp/torch/*" -not -path "$sp/jupyterlab/tests" -not -path "$sp/jedi/third_party/*" \
    -prune -exec rm -rf {} +
find "$sp" -mindepth 2 -maxdepth 2 -type f -path '*.dist-info/uv_cache.json' -print0 |
    while IFS= read -r -d '' record; do
        rm -f "$record"
        dist=${record%/uv_cache.json}
        if [[ -f $dist/RECORD ]]; then sed -i '/^[^,]*\.dist-info\/uv_cache\.json,/d' "$dist/RECORD"; fi
    done
if command -v hardlink >/dev/null; then
    # -t: contents decide (not mtimes); modes and owners must still match. Only this RUN's files.
    find "$venv" -type f -size +4k "${newer[@]}" -print0 | xargs -0 -r hardlink -q -t >/dev/null || true
fi

touch "$stamp" && chmod g+w "$stamp"
after=$(du -sb "$venv" | cut -f1)
echo "slim-venv.sh: $venv $((before / 1048576)) MiB -> $((after / 1048576)) MiB" \
     "(saved $(((before - after) / 1048576)) MiB)"
