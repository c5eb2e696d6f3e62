#!/usr/bin/env bash
# Sets up .venv if needed, then runs the linter and the whole test suite (engine, ComfyUI, WebUI host).
# Most tests run side by side, one file per worker (pytest-xdist); those that time the machine or drive a browser
# against timeouts (markers "serial" and "browser") run after them, alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
workers=$(nproc)
if ((workers > 4)); then workers=4; fi  # each worker holds its own ComfyUI, diffusers and models in memory
status=0
part() {  # one pytest run; exit status 5 (none of its tests asked for) is not a failure
  .venv/bin/python -m pytest "$@" || { local rc=$?; if ((rc != 5)); then status=$rc; fi; }
}
# One torch thread per worker: two workers of two threads each on two cores run slower than one process.
OMP_NUM_THREADS=1 part -n "$workers" --dist loadfile -m "not serial and not browser" "$@"
part -m "serial or browser" "$@"
exit "$status"
