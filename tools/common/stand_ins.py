"""The test suite's host stand-ins (``tests/hosts``: Forge Neo's, the WebUI's, ComfyUI's test host), for the tools
that run a job through a host that is not on PyPI."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def hosts():
    """(comfy_host, neo_host, webui_host); ComfyUI's test host first: it sets ComfyUI's sys.path."""
    sys.path.insert(0, str(REPO / "tests"))  # the stand-ins live with the tests
    from hosts import comfy_host, neo_host, webui_host  # noqa: I001  (comfy_host first: ComfyUI's sys.path)

    return comfy_host, neo_host, webui_host
