"""The fidelity benchmark's diffusers path (``tools/fidelity/diffusers_flux.py``, ``diffusers_run.py``): the
reference converted to diffusers' Flux transformer computes what the ComfyUI model does, and a short run gives
every row its figures, ours and diffusers' own caches side by side."""

from __future__ import annotations

import pytest
import torch

from tools.fidelity import diffusers_flux, diffusers_run
from tools.fidelity.reference import models

pytestmark = pytest.mark.skipif(
    not (models.WEIGHTS / "ref-flux.safetensors").exists(), reason="ref-flux weights missing from the checkout"
)


def test_pack_and_unpack_are_inverse():
    latent = torch.randn(2, 4, 6, 8)
    tokens = diffusers_flux.pack(latent)
    assert tokens.shape == (2, 12, 16)
    assert torch.equal(diffusers_flux.unpack(tokens, 6, 8), latent)


def test_the_converted_reference_computes_what_comfyuis_model_does():
    from tools.bench.host import setup_comfy

    setup_comfy("cpu")
    # Both run the same float32 operations in another order (fused against split projections): rounding only.
    assert diffusers_flux.max_difference("ref-flux") < 1e-4


def test_at_depth_keeps_first_and_last_and_spreads_the_middle():
    assert diffusers_run.at_depth([1.0, 0.5, 0.5, 1.0], depth=10) == pytest.approx((2 + 8 * 0.5) / 10)
    assert diffusers_run.at_depth([1.0] * 5) == 1.0


def test_a_short_run_measures_ours_and_diffusers_caches(tmp_path):
    argv = ["--model", "ref-flux", "--prompts", "2", "--steps", "12", "--real", "16", "--out", str(tmp_path)]
    report = diffusers_run.main([*argv, "--only", "ours reuse every 4,First Block Cache 0.08,MagCache 0.06"])
    rows = {r["row"]: r for r in report["records"]}
    assert list(rows) == ["unpatched", "ours reuse every 4", "First Block Cache 0.08", "MagCache 0.06"]
    assert rows["unpatched"]["ssim"] == 1.0 and rows["unpatched"]["blocks_work"] == 1.0
    assert rows["ours reuse every 4"]["blocks_work"] < 1.0  # 12 steps: it reused some calls
    assert len(report["mag_ratios"]) == 12  # MagCache was calibrated on this model and step count
    assert (tmp_path / "diffusers-fidelity-ref-flux.json").is_file()
