#!/usr/bin/env bash
# Makes the browser pictures of docs/ again from today's code: the ComfyUI node in ComfyUI's real front end
# (docs/comfyui-node.png, and the example workflow's thumbnail in example_workflows/) and the WebUI accordion in
# the WebUI's own gradio (docs/webui-accordion.png). Each picture is taken by the browser test that checks that
# page, and a JSON file beside it records the controls it shows; later test runs compare the page with that
# record, so a change to what the pictures show fails a test until this command is run again.
# (The benchmark's and fidelity benchmark's charts in docs/ come from their own commands: see docs/benchmark.md
# and docs/fidelity.md.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
TOME_PATCH_UPDATE_SCREENSHOTS=1 exec .venv/bin/python -m pytest -q \
  "tests/test_browser_comfyui.py::test_example_workflow_opens_from_the_template_browser" \
  "tests/test_browser_webui.py::test_ticking_the_accordion_and_moving_the_controls_reaches_the_script_as_its_arguments"
