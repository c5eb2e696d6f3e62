#!/usr/bin/env bash
# The README's main command: sets up .venv if needed, then benchmarks the patch on this machine.
# Flags pass through to tools/benchmark.py (see --help); results go to results/.
# With --fidelity first, runs the fidelity benchmark on the trained reference models instead
# (tools/fidelity.py, see --fidelity --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
if [ "${1:-}" = "--fidelity" ]; then
  shift
  exec .venv/bin/python -m tools.fidelity "$@"
fi
exec .venv/bin/python -m tools.benchmark "$@"
