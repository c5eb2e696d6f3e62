#!/usr/bin/env bash
# The README's main command: sets up .venv if needed, then benchmarks the patch on this machine.
# Flags pass through to tools/benchmark.py (see --help); results go to results/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
exec .venv/bin/python -m tools.benchmark "$@"
