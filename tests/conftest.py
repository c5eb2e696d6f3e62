"""Fixtures shared by the hosts' calibration tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def kept_file(tmp_path, monkeypatch):
    """A calibrations file of the test's own (the WebUI's and diffusers' ``FILE_ENV``): no plan kept at the start."""
    from tome_core.calibration.store import FILE_ENV

    path = tmp_path / "calibrations.json"
    monkeypatch.setenv(FILE_ENV, str(path))
    return path


@pytest.fixture
def searches(monkeypatch):
    """Each calibration the WebUI family's jobs make (the engine's ``Calibration``, a DiT's included): what it
    reduced and its ``kept`` latent after the search."""
    from tome_core.hosts.webui import calibrate as webui_calibrate

    made = []

    class Recorded(webui_calibrate.Calibration):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(webui_calibrate, "Calibration", Recorded)
    return made
