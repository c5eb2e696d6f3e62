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


def test_the_split_of_a_residual_into_its_shared_part_and_the_rest():
    """Every token carries the vector (3, 0, 0, 0) plus its own +-1 on the second value (zero over the tokens)."""
    r = torch.zeros(2, 3, 4)
    r[..., 0] = 3.0
    r[..., 1] = torch.tensor([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0]])
    shared = torch.tensor([3.0, 0.0, 0.0, 0.0])
    result = step_change.ratios([r, r + shared, 2 * (r + shared)])
    assert result["shared_norm"] == pytest.approx([3.0, 6.0, 12.0])
    assert result["shared_share"] == pytest.approx([0.9, 36 / 37, 36 / 37])
    assert result["rest_norm"] == pytest.approx([1.0, 1.0, 2.0])
    # The shared part doubles, the rest stays: MagCache's ratio moves by sqrt(37 / 10), the rest's not at all.
    assert result["norm_ratio"][1] == pytest.approx((37 / 10) ** 0.5)
    assert result["rest_ratio"] == pytest.approx([1.0, 1.0, 2.0])


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


@pytest.mark.parametrize("name", ["ref-qwen", "ref-flux2", "ref-qwen-v2", "ref-flux-v2"])
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


# Real Flux.1-dev's MagCache ratios at 28 steps (diffusers' FLUX_MAG_RATIOS)
REAL_FLUX_DEV = [
    1.0, 1.21094, 1.11719, 1.07812, 1.0625, 1.03906, 1.03125, 1.03906, 1.02344, 1.03125, 1.02344, 0.98047, 1.01562,
    1.00781, 1.0, 1.00781, 1.0, 1.00781, 1.0, 1.0, 0.99609, 0.99609, 0.98047, 0.98828, 0.96484, 0.95703, 0.93359,
    0.89062,
]  # fmt: skip


def test_the_gate_numbers_of_real_flux():
    """Steps 1-3 grow, steps 1-5 of 28 (the first 20%) multiply to 1.61, steps 6-21 stay within 1.3% of 1."""
    numbers = step_change.gate(REAL_FLUX_DEV)
    assert numbers["least_1_3"] == pytest.approx(1.07812)
    assert numbers["product_first_20pct"] == pytest.approx(1.6102, abs=1e-4)
    assert numbers["middle_deviation"] == pytest.approx(0.01343, abs=1e-4)


def test_per_prompt_ratios_combine_over_seeds_then_prompts():
    r = torch.ones(4, 5, 3)  # 2 seeds x 2 prompts, seed-major; 5 tokens of 3 values
    per_sample = step_change.per_sample_ratios([r, r * torch.tensor([2.0, 1.0, 4.0, 3.0]).view(4, 1, 1)])
    assert per_sample[1].tolist() == pytest.approx([2.0, 1.0, 4.0, 3.0])
    assert step_change.over_prompts(per_sample, 2, "mean") == pytest.approx([1.0, 2.5])
    three = torch.tensor([[1.0] * 3, [1.0, 5.0, 2.0]])  # one seed, three prompts
    assert step_change.over_prompts(three, 1, "median") == pytest.approx([1.0, 2.0])


def test_the_probe_of_flux_dev_runs_at_cfg_1_on_the_image_tokens(tmp_path):
    if not (models.WEIGHTS / "ref-flux.safetensors").exists():
        pytest.skip("ref-flux weights missing from the checkout")
    argv = ["--models", "ref-flux", "--steps", "4", "--prompts", "2", "--cfg", "1", "--seeds", "2"]
    argv += ["--tokens", "image", "--over-prompts", "median", "--judge", "--out", str(tmp_path)]
    argv += ["--chart", str(tmp_path / "curve.png")]
    record = step_change.main(argv)["models"]["ref-flux"]
    assert (tmp_path / "curve.png").stat().st_size > 10_000  # the curve beside real Flux.1's, drawn
    assert len(record["norm_ratio"]) == 4 and all(0.2 < r < 2.0 for r in record["norm_ratio"])
    assert set(record["gate"]) == {"least_1_3", "product_first_20pct", "middle_deviation"}
    assert 0.0 <= record["accuracy"] <= 1.0 and record["frechet"] > 0.0
