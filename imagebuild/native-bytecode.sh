#!/bin/sh
# native-bytecode.sh mark SITE_PACKAGES LIST
# native-bytecode.sh compile SITE_PACKAGES LIST NATIVE_ROOT PYTHON_VERSION
#
# An emulated cell's bytecode, compiled by the build host's own Python. A .pyc is the same bytes on
# every architecture (one Python X.Y's marshal format, and hash-checked here: SOURCE_DATE_EPOCH set),
# so the venv's RUNs of a cell built under qemu (the arm64 cell on an x86_64 host) install with uv
# but without --compile-bytecode, and this script compiles what they installed with the python3 of
# the `ptmg-native-python` stage (FROM --platform=$BUILDPLATFORM, the same base and release,
# bind-mounted at NATIVE_ROOT), run by its own loader: the kernel runs the host's binaries natively
# in an emulated RUN, as it runs the host's uv. Emulated, the compile took 4 of the arm64 build's
# 13.6 minutes (BENCHMARKS.md); natively, seconds.
# A native cell of Python 3.12 or newer compiles with it too, NATIVE_ROOT being the build's Python
# stage: its marshal output depends on what the same process compiled before (cpython#129724), so
# uv's pool of workers gave some .pyc files other bytes from build to build. Here one process
# compiles every file in path order: the same bytes every time.
#
#   mark     before uv: LIST is every .py file under SITE_PACKAGES (links are not followed, as uv
#            and compileall do not follow them).
#   compile  after uv: compiles each .py file under SITE_PACKAGES that LIST lacks, as uv does: its
#            default optimization level, errors ignored (a wheel may carry Python 2 sources that
#            never compile; uv and pip skip them too). Fails if the host's Python is not
#            PYTHON_VERSION (X.Y): its .pyc files would name another Python.
set -eu
usage() {
    echo "usage: native-bytecode.sh mark SITE_PACKAGES LIST | compile SITE_PACKAGES LIST NATIVE_ROOT X.Y" >&2
    exit 2
}
sources() { find "$1" -name '*.py' -type f | LC_ALL=C sort; }
case ${1:-} in
    mark)
        [ $# -eq 3 ] || usage
        sources "$2" > "$3" ;;
    compile)
        [ $# -eq 5 ] || usage
        sp=$2 list=$3 root=$4 want=$5
        if [ ! -f "$list" ]; then echo "native-bytecode.sh: $list: mark did not run" >&2; exit 1; fi
        if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then  # without it, timestamped .pyc files: not reproducible
            echo "native-bytecode.sh: SOURCE_DATE_EPOCH is not set" >&2; exit 1
        fi
        loader=
        for candidate in "$root"/usr/lib/*-linux-gnu*/ld-linux*.so.*; do
            if [ -f "$candidate" ] && [ ! -L "$candidate" ]; then loader=$candidate; break; fi
        done
        if [ -z "$loader" ]; then echo "native-bytecode.sh: $root: no dynamic loader" >&2; exit 1; fi
        native() {
            PYTHONHOME=$root/usr "$loader" --library-path "${loader%/*}" "$root/usr/bin/python$want" -S "$@"
        }
        have=$(native -c 'import sys; print("%d.%d" % sys.version_info[:2])') || have="none"
        if [ "$have" != "$want" ]; then
            echo "native-bytecode.sh: the build host's Python at $root is $have, the image's $want" >&2
            exit 1
        fi
        sources "$sp" | LC_ALL=C comm -13 "$list" - | native -c '
import compileall, sys, warnings
warnings.filterwarnings("ignore")
count = 0
for line in sys.stdin:
    path = line.rstrip("\n")
    if path:
        compileall.compile_file(path, force=True, quiet=2)
        count += 1
print(f"native-bytecode.sh: {count} files compiled by the build host\x27s Python {sys.version.split()[0]}")
' ;;
    *) usage ;;
esac
