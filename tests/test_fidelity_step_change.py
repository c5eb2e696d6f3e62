"""The step-change measurement (``tools/fidelity/step_change.py``): its ratios on known residuals, and a short run
on the Flux reference model through ComfyUI's sampler."""

from __future__ import annotations

import pytest
import torch

from tools.fidelity import step_change
from tools.fidelity.reference import models


def test_ratios_of_known_residuals():
    r = torch.ones(1, 3, 4)
    result = step_change.ratios([r, 2 * r, 2 * r])
    assert result["norm_ratio"] == pytest.approx([1.0, 2.0, 1.0])
    assert result["relative_change"][0] is None
    assert result["relative_change"][1:] == pytest.approx([1.0, 0.0])


def test_a_short_run_records_every_step(tmp_path):
    if not (models.WEIGHTS / "ref-flux.safetensors").exists():
        pytest.skip("ref-flux weights missing from the checkout")
    result = step_change.main(["--models", "ref-flux", "--steps", "4", "--prompts", "2", "--out", str(tmp_path)])
    record = result["models"]["ref-flux"]
    assert len(record["norm_ratio"]) == 4 and record["norm_ratio"][0] == 1.0
    assert all(0.5 < r < 2.0 for r in record["norm_ratio"])  # a trained model's residual moves by percents a step
    assert (tmp_path / "step-change.json").is_file()


def test_a_short_video_run_records_every_step(tmp_path):
    if not (models.WEIGHTS / "ref-wan.safetensors").exists():
        pytest.skip("ref-wan weights missing from the checkout")
    result = step_change.main(["--models", "ref-wan", "--steps", "4", "--prompts", "2", "--out", str(tmp_path)])
    record = result["models"]["ref-wan"]
    assert len(record["norm_ratio"]) == 4 and record["relative_change"][1] > 0.0
