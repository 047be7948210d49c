#!/usr/bin/env bash
# Benchmarks (bench/): set-up plus the bench extras, then one run. `--quick` for a short run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/pip install -q --disable-pip-version-check -e '.[test,bench]'
exec .venv/bin/python -m bench.run "$@"
