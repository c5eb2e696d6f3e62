"""Runs tests/hosts/webui_gradio (the accordion in WebUI v1.10.1's own gradio 3.41.2) in its environment,
.venv-webui."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = REPO / ".venv-webui" / "bin" / "python"


def test_the_accordion_in_the_webuis_gradio():
    assert PYTHON.exists(), f"{PYTHON} is missing: tools/setup_env.sh creates it"
    result = subprocess.run(
        [str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/hosts/webui_gradio"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert re.search(r"^\d+ passed", output, re.MULTILINE) and "skipped" not in output, output[-2000:]
