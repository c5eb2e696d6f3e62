"""Run by the AUTOMATIC1111 WebUI / Forge at every start (a subprocess with the WebUI folder on PYTHONPATH).

Idempotent and fast: it only checks that the packages the project declares besides torch are importable, and
installs one through the WebUI's own ``launch.run_pip`` only if it is missing (no network otherwise). Both ship
with the WebUI and Forge, so normally nothing happens. torch is never installed here: the WebUI owns it.
"""

from __future__ import annotations

import importlib.util

# pip name -> import name; the project's dependencies (pyproject.toml) other than torch.
REQUIREMENTS = {"einops": "einops", "safetensors": "safetensors"}


def _is_installed(import_name: str) -> bool:
    try:
        import launch  # the WebUI's launch module, present when the WebUI runs this file

        return launch.is_installed(import_name)
    except ImportError:
        return importlib.util.find_spec(import_name) is not None


def main() -> None:
    missing = [pip_name for pip_name, import_name in REQUIREMENTS.items() if not _is_installed(import_name)]
    if not missing:
        return
    try:
        import launch
    except ImportError:
        print(f"[ToMe Patch] missing packages: {', '.join(missing)} (install them with pip)")
        return
    for pip_name in missing:
        launch.run_pip(f"install {pip_name}", f"{pip_name} for ToMe Patch")


if __name__ == "__main__":
    main()
