#!/bin/bash
# The GPU acceptance run (scripts/gpu_acceptance.py): every GPU check in one go, at most 10 minutes,
# on a bare GPU host with python3 + torch, Triton, pytest (ninja, g++, Python.h, nvcc for the compiling
# steps); no Docker, no network. At most 540 s (--budget): one 10-minute device call with room.
#   scripts/gpu-acceptance.sh [--dry-run] [--out DIR] [--python PATH]     (PYTHON: the interpreter)
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/gpu_acceptance.py" --python "${PYTHON:-$(command -v python3)}" "$@"
