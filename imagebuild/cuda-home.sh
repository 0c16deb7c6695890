#!/bin/bash
# cuda-home.sh CUDA VENV   (devel flavour; root, after the CUDA toolkit wheels are installed)
#
# Lays out /usr/local/cuda-CUDA (and /usr/local/cuda -> it) the way torch.utils.cpp_extension
# expects a CUDA_HOME, from NVIDIA's CUDA 13 PyPI wheels, which all unpack into one tree,
# site-packages/nvidia/cuMAJOR/{bin,include,lib,nvvm}. Only symbolic links: no byte is copied.
#  - bin, include, nvvm: links to the wheel's folders. nvcc resolves its own real path and finds
#    include/ and nvvm/ beside it (nvcc.profile: TOP = $(_HERE_)/..).
#  - lib64: a link per library, plus libcudart.so -> libcudart.so.MAJOR (the wheel ships only the
#    SONAME file; extensions link with -lcudart).
set -euo pipefail
cuda=${1:?usage: cuda-home.sh CUDA VENV}
venv=${2:?usage: cuda-home.sh CUDA VENV}
major=${cuda%%.*}
sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
tree=$sp/nvidia/cu$major
for need in bin/nvcc include/cuda_runtime.h "lib/libcudart.so.$major" nvvm; do
    if [[ ! -e $tree/$need ]]; then
        echo "cuda-home.sh: $tree/$need is missing: the CUDA $cuda toolkit wheels are not installed" >&2
        exit 1
    fi
done
home=/usr/local/cuda-$cuda
mkdir -p "$home/lib64"
ln -sfn "$tree/bin" "$home/bin"
ln -sfn "$tree/include" "$home/include"
ln -sfn "$tree/nvvm" "$home/nvvm"
for lib in "$tree"/lib/*; do ln -sfn "$lib" "$home/lib64/"; done
ln -sfn "libcudart.so.$major" "$home/lib64/libcudart.so"
ln -sfn "cuda-$cuda" /usr/local/cuda
# The toolkit must be the cell's CUDA: nvcc says "release 13.0, V13.0.88".
release=$("$home/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
if [[ $release != "$cuda" ]]; then
    echo "cuda-home.sh: nvcc is CUDA $release, the cell is CUDA $cuda" >&2
    exit 1
fi
echo "cuda-home.sh: /usr/local/cuda -> $home (nvcc $release) from $tree"
