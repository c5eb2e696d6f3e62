"""Headless Chromium for the browser tests: Debian's ``chromium`` driven by Playwright, and the screenshots.

The browser is the system's own (``tools/setup_env.sh`` installs Debian's package); Playwright never downloads
one. Where the browser or Playwright is missing, a test that needs them fails with a message saying what is
missing and how to install it: the tests are never skipped.

Screenshots go to the test's temporary folder; with ``TOME_PATCH_UPDATE_SCREENSHOTS=1`` they are also written,
reduced to a small palette, to ``docs/`` (and the example workflow's thumbnail to ``example_workflows/``), which
is how the pictures in the README are made (``bash tools/pictures.sh``). Next to each such picture a JSON file
records what it shows (the visible controls); every other run compares the page with that record, so a picture
that no longer shows today's page fails its test instead of going stale.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = REPO_ROOT / "docs"
UPDATE_SCREENSHOTS = os.environ.get("TOME_PATCH_UPDATE_SCREENSHOTS") == "1"
TIMEOUT_MS = 30_000  # any one step on the page (a click, a wait for an element); generous for a busy 2-core CPU
SETUP_HINT = "run `bash tools/setup_env.sh` (as root it installs what is missing)"


def chromium_executable() -> str:
    for name in (os.environ.get("TOME_PATCH_CHROMIUM"), "chromium", "chromium-browser"):
        path = name and shutil.which(name)
        if path:
            return path
    pytest.fail(
        "The browser tests need Chromium, and none was found: install Debian's package `chromium` "
        f"(`apt-get install -y chromium`), or {SETUP_HINT}, or name a Chromium binary in TOME_PATCH_CHROMIUM.",
        pytrace=False,
    )


@contextmanager
def chromium():
    """A headless Chromium browser (Playwright's ``Browser``)."""
    executable = chromium_executable()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(
            f"The browser tests need Playwright for Python (requirements/dev.txt): {SETUP_HINT}.", pytrace=False
        )
    with sync_playwright() as playwright:
        # --no-sandbox: Chromium's sandbox refuses to run as root, which CI and containers are.
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"], timeout=TIMEOUT_MS * 2)
        try:
            yield browser
        finally:
            browser.close()


def new_page(browser, width=1600, height=1000, init_script=None):
    context = browser.new_context(viewport={"width": width, "height": height}, device_scale_factor=1)
    context.set_default_timeout(TIMEOUT_MS)
    if init_script:
        context.add_init_script(init_script)
    return context.new_page()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def screenshot(page, out_dir: Path, name: str, clip: dict | None = None, for_docs: bool = False) -> Path:
    """Save ``name``.png of the page (or of ``clip``) to ``out_dir``; a picture ``for_docs`` also goes to docs/
    when updating screenshots."""
    path = out_dir / f"{name}.png"
    page.screenshot(path=str(path), clip=clip)
    if for_docs and UPDATE_SCREENSHOTS:
        save_small(path, DOCS / path.name)
    return path


def check_picture_record(name: str, shown) -> None:
    """``shown`` is what the picture docs/``name``.png shows (a JSON-able list of its visible controls). Updating
    the pictures writes it to docs/``name``.json; any other run asserts that the page still shows the same."""
    path = DOCS / f"{name}.json"
    if UPDATE_SCREENSHOTS:
        path.write_text("[\n" + ",\n".join(" " + json.dumps(item) for item in shown) + "\n]\n")  # one a line
        return
    assert path.is_file(), f"{path.name} is missing: make the pictures again with `bash tools/pictures.sh`"
    committed = json.loads(path.read_text())
    assert committed == shown, (
        f"docs/{name}.png no longer shows today's page (its record {path.name}: {committed}; the page: {shown}): "
        "make the pictures again with `bash tools/pictures.sh`"
    )


def save_small(source: Path, target: Path) -> None:
    """A copy with at most 256 colours (the pages are flat UI colours), a fraction of the PNG's size."""
    from PIL import Image

    with Image.open(source) as image:
        image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(target, optimize=True)


def save_thumbnail(source: Path, target: Path, width: int = 512) -> None:
    from PIL import Image

    with Image.open(source) as image:
        image = image.convert("RGB")
        image.thumbnail((width, width))
        image.save(target, quality=85, optimize=True)
