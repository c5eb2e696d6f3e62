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


@pytest.mark.parametrize("name", ["ref-qwen", "ref-flux2"])
def test_the_new_references_record_every_step(tmp_path, name):
    """Qwen-Image's image stream (its blocks return text and image apart) and Flux.2's joined streams."""
    if not (models.WEIGHTS / f"{name}.safetensors").exists():
        pytest.skip(f"{name} weights missing from the checkout")
    result = step_change.main(["--models", name, "--steps", "4", "--prompts", "2", "--out", str(tmp_path)])
    record = result["models"][name]
    # A trained model's residual moves by a factor under 2 a step; it shrinks over the last one (real Qwen-Image's by
    # 0.55 at 50 steps; a 4-step run's last step is longer).
    assert len(record["norm_ratio"]) == 4 and all(0.2 < r < 2.0 for r in record["norm_ratio"])
    assert record["relative_change"][1] > 0.0
