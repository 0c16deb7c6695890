#!/bin/sh
# mypy --strict over every Python file of the project, in two runs (why two: [tool.mypy] in
# pyproject.toml). `make lint` calls this.
#   scripts/typecheck.sh                     # .venv/bin/mypy, else mypy on PATH
#   MYPY=/path/to/mypy scripts/typecheck.sh
set -eu
cd "$(dirname "$0")/.."
if [ -z "${MYPY:-}" ]; then
    if [ -x .venv/bin/mypy ]; then MYPY=.venv/bin/mypy; else MYPY=mypy; fi
fi
# 1. builder/, build.py, ptmg_contract.py, tests/ and entrypoint/ (the files and mypy_path in pyproject.toml).
"$MYPY"
# 2. smoke_tests/ as the image runs it: modules import each other by bare name, the contract
#    comes from the folder above.
MYPYPATH=smoke_tests:. "$MYPY" --namespace-packages --explicit-package-bases smoke_tests/*.py
