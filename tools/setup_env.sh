#!/usr/bin/env bash
# Creates the environments the tests and the benchmark need. Idempotent: a complete environment is reused.
#   .venv        torch, the hosts (ComfyUI, the WebUI's ldm, tomesd, diffusers) and the test tools
#   .venv-webui  the WebUI's own gradio version (3.41.2, with numpy 1.x and pydantic 1) for the page's tests
set -euo pipefail
cd "$(dirname "$0")/.."

stamp=.venv/.tome_patch_env
want=$(cat requirements/torch.txt requirements/hosts.txt requirements/dev.txt | sha1sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  python3 -m venv .venv
  pip=".venv/bin/python -m pip"
  $pip install -q --disable-pip-version-check -r requirements/torch.txt
  $pip install -q --disable-pip-version-check --no-deps -r requirements/hosts.txt
  $pip install -q --disable-pip-version-check -r requirements/dev.txt
  echo "$want" > "$stamp"
fi

stamp=.venv-webui/.tome_patch_env
want=$(sha1sum requirements/webui-page.txt | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  python3 -m venv .venv-webui
  # torch 2.13.0 is the CPU build (about 200 MB); the UI needs torch only to import the engine's settings.
  .venv-webui/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -r requirements/webui-page.txt
  echo "$want" > "$stamp"
fi
