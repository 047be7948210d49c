#!/usr/bin/env bash
# The VM lab (issue 26): boot a machine whose kernel lacks features (or an edge-sized one, or an
# emulated arm64 board) under qemu and run a usproxy scenario inside, with real traffic.
#   bash scripts/vm.sh SCENARIO [--memory MiB] [--smp N] [--duration S] [--results DIR]
#   bash scripts/vm.sh SCENARIO --run 'python -m pytest -q tests/offload -k ipvs'   a command from the repository, in the guest
#   bash scripts/vm.sh build [amd64|arm64|all] [--fresh]              the cached root file systems
#   bash scripts/vm.sh list
# SCENARIO: no-nftables, no-xtables, cgroup1, ipvs, edge-256, arm64. As root, after scripts/setup.sh.
# Exit 0 only when the scenario passed; the last line of stdout is one JSON object (lab/__main__.py).
# The lab's code is lab/ (standard library only: it runs with the system python3).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m lab "$@"
