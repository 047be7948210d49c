#!/usr/bin/env bash
# The whole test suite from a fresh machine: set-up, mypy --strict, pyflakes, pytest (datapath tests run in
# throwaway network namespaces and need root).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== mypy --strict"
.venv/bin/mypy
echo "== pyflakes"
.venv/bin/python -m pyflakes usproxy bench tests demo lab
echo "== pytest"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=20 "$@"
