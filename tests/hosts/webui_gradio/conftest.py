"""Tests of the accordion in the gradio version WebUI v1.10.1 pins (3.41.2), which lives in its own environment,
``.venv-webui`` (it cannot share one with ComfyUI). tests/test_webui_gradio.py runs them there; the main
environment has no gradio and does not collect them."""

import importlib.util

if importlib.util.find_spec("gradio") is None:
    collect_ignore_glob = ["test_*.py"]
