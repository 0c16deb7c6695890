#!/bin/sh
# build-python.sh use|restore VENV
#
# The Python that fills the venv while the image has none yet (docs/image-layout.md, "Layers").
# The venv's RUNs sit right on the base, below the OS layer, so that Debian's weekly fixes (the
# OS layer) leave the venv's layers and their chain IDs alone. The image's own python3 comes from
# the OS layer above them; while they run, the `ptmg-python` stage (the same base, with python3
# and binutils from apt, and copies of the libraries they load that the base lacks:
# builder/render/templates/dockerfile/05-python.j2) is bind-mounted at /ptmg-build/python and its
# python3 fills the venv. The venv's files do not depend on which python3 X.Y of the base's
# release made them (the .pyc files are hash-checked, the scripts' shebangs name the venv's own
# bin/python), except its bin/python3 link and pyvenv.cfg:
#
#   use VENV        in a venv RUN: VENV's python3 link and pyvenv.cfg name /ptmg-build/python;
#   restore VENV    at its end: they name /usr/bin again (what `python3 -m venv` makes there),
#                   where the OS layer puts python3. Fails if anything still names the stage.
set -eu
py=/ptmg-build/python
case ${1:-} in
    use|restore)
        venv=$2
        if [ "$1" = use ]; then from=/usr/bin to=$py/usr/bin; else from=$py/usr/bin to=/usr/bin; fi
        for link in "$venv"/bin/python*; do
            target=$(readlink "$link") || continue
            case $target in "$from"/*) ln -sfn "$to/${target#"$from"/}" "$link" ;; esac
        done
        sed -i "s#= $from#= $to#" "$venv/pyvenv.cfg"
        if [ "$1" = restore ]; then
            left=$(grep -l "$py" "$venv/pyvenv.cfg" || true)
            for link in "$venv"/bin/python*; do
                case $(readlink "$link" || true) in "$py"/*) left="$left $link" ;; esac
            done
            if [ -n "$left" ]; then echo "build-python.sh: still naming $py: $left" >&2; exit 1; fi
        fi ;;
    *)
        echo "usage: build-python.sh use|restore VENV" >&2; exit 2 ;;
esac
