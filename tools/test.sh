#!/usr/bin/env bash
# Sets up .venv if needed, then runs the linter and the whole test suite (engine, ComfyUI, WebUI host).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
