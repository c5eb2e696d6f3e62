#!/usr/bin/env bash
# The README's main command: sets up .venv if needed, then benchmarks the patch on this machine.
#   bash tools/bench.sh              the quick run: speed and picture in about five minutes (tools/bench/quick.py)
#   bash tools/bench.sh --full ...   the whole speed benchmark (tools/bench/speed.py, see --full --help)
#   bash tools/bench.sh --fidelity   the fidelity benchmark on the reference models (tools/fidelity/run.py)
#   bash tools/bench.sh --dit        ToDo on DiTs: Flux, SD3.5 Medium and Wan 2.1 at full width (tools/bench/dit/todo.py)
# Results go to results/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
exec .venv/bin/python -m tools.bench "$@"
