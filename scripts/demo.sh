#!/usr/bin/env bash
# The main job from a fresh machine: set-up, then the demo on examples/ in network namespaces.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python demo/run_demo.py "$@"
