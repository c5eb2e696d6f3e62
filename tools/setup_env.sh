#!/usr/bin/env bash
# Creates what the tests and the benchmark need. Idempotent: a complete environment is reused.
#   .venv        torch, the hosts (ComfyUI with its front end, the WebUI's ldm, tomesd, diffusers), the test tools
#   .venv-webui  the WebUI's own gradio version (3.41.2, with numpy 1.x and pydantic 1) for the page's tests
#   .venv-pack   comfy-cli, which builds ComfyUI's registry archive in the packaging test
#   chromium     Debian's package, the browser the page tests drive (installed with apt-get when missing, as root)
# Quiet: one line for each thing it sets up. pip's and apt's own output goes to .venv/setup.log and is shown only
# when a step fails (it includes pip's dependency-conflict warnings, which are expected: the hosts of
# requirements/hosts.txt are installed without their dependencies, since only their code is used).
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p .venv
log="$PWD/.venv/setup.log"

# quietly COMMAND...: runs it with its output appended to the log; on failure shows the log's end and stops.
quietly() {
  if ! "$@" >>"$log" 2>&1; then
    echo "Setup failed: $*" >&2
    tail -n 40 "$log" >&2
    echo "(the whole output is in $log)" >&2
    exit 1
  fi
}

pip_flags=(--disable-pip-version-check --no-input --progress-bar off)

# needs_disk GB WHAT: stops with a clear line when the disk holding the project has less than GB free, before pip
# would fail halfway with "No space left on device" (the sizes are what each environment takes once installed).
needs_disk() {
  local free_kb
  free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
  if ((free_kb < $1 * 1024 * 1024)); then
    echo "Setup needs about $1 GB of free disk for $2; $((free_kb / 1024 / 1024)) GB are free here." >&2
    exit 1
  fi
}

stamp=.venv/.tome_patch_env
want=$(cat requirements/torch.txt requirements/hosts.txt requirements/dev.txt | sha1sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "Setting up .venv (torch, ComfyUI, the WebUI's ldm, diffusers, test tools; a few minutes the first time)..."
  needs_disk 8 .venv
  : >"$log"
  [ -x .venv/bin/python ] || quietly python3 -m venv .venv
  pip=(.venv/bin/python -m pip install "${pip_flags[@]}")
  quietly "${pip[@]}" -r requirements/torch.txt
  quietly "${pip[@]}" --no-deps -r requirements/hosts.txt
  quietly "${pip[@]}" -r requirements/dev.txt
  echo "$want" >"$stamp"
fi

stamp=.venv-webui/.tome_patch_env
want=$(cat requirements/webui-page.txt requirements/webui-page-hosts.txt | sha1sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "Setting up .venv-webui (the WebUI's gradio 3.41.2 for the page tests)..."
  needs_disk 2 .venv-webui
  [ -x .venv-webui/bin/python ] || quietly python3 -m venv .venv-webui
  pip=(.venv-webui/bin/python -m pip install "${pip_flags[@]}")
  # torch 2.13.0 is the CPU build (about 200 MB); the page needs torch for the script and a small ldm UNet.
  quietly "${pip[@]}" torch==2.13.0 -r requirements/webui-page.txt
  quietly "${pip[@]}" --no-deps -r requirements/webui-page-hosts.txt
  echo "$want" >"$stamp"
fi

stamp=.venv-pack/.tome_patch_env
want=$(sha1sum requirements/pack.txt | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "Setting up .venv-pack (comfy-cli, for the registry archive's test)..."
  needs_disk 1 .venv-pack
  [ -x .venv-pack/bin/python ] || quietly python3 -m venv .venv-pack
  quietly .venv-pack/bin/python -m pip install "${pip_flags[@]}" -r requirements/pack.txt
  echo "$want" >"$stamp"
fi

if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "Installing Chromium (Debian's package chromium) for the browser tests..."
    quietly apt-get update -q
    quietly env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
  else
    echo "Chromium is missing and cannot be installed from here (that needs root and apt-get): the browser" \
      "tests will fail until Debian's package chromium is installed (apt-get install -y chromium)." >&2
  fi
fi
