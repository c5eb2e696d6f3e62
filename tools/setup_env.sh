#!/usr/bin/env bash
# Creates .venv with everything the tests and the benchmark need. Idempotent: a complete .venv is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.tome_patch_env
want=$(cat requirements/*.txt | sha1sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
python3 -m venv .venv
pip=".venv/bin/python -m pip"
$pip install -q --disable-pip-version-check -r requirements/torch.txt
$pip install -q --disable-pip-version-check --no-deps -r requirements/hosts.txt
$pip install -q --disable-pip-version-check -r requirements/dev.txt
echo "$want" > "$stamp"
