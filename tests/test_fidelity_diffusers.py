"""The fidelity benchmark's diffusers path (``tools/fidelity/diffusers/flux.py``, ``run.py``): the
reference converted to diffusers' Flux transformer computes what the ComfyUI model does, and a short run gives
every row its figures, ours and diffusers' own caches side by side."""

from __future__ import annotations

import pytest
import torch

from tools.fidelity.diffusers import flux as diffusers_flux
from tools.fidelity.diffusers import run as diffusers_run
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
    from tools.common.host import setup_comfy

    setup_comfy("cpu")
    # Both run the same float32 operations in another order (fused against split projections): rounding only.
    assert diffusers_flux.max_difference("ref-flux") < 1e-4


def test_at_depth_keeps_first_and_last_and_spreads_the_middle():
    from tools.fidelity.work import at_depth

    assert at_depth([1.0, 0.5, 0.5, 1.0], depth=10) == pytest.approx((2 + 8 * 0.5) / 10)
    assert at_depth([1.0] * 5, depth=57) == 1.0


def test_a_short_run_measures_ours_and_diffusers_caches(tmp_path):
    argv = ["--model", "ref-flux", "--prompts", "2", "--steps", "12", "--real", "16", "--out", str(tmp_path)]
    report = diffusers_run.main([*argv, "--only", "ours reuse every 4,First Block Cache 0.08,MagCache 0.06"])
    rows = {r["row"]: r for r in report["records"]}
    assert list(rows) == ["unpatched", "ours reuse every 4", "First Block Cache 0.08", "MagCache 0.06"]
    assert rows["unpatched"]["ssim"] == 1.0 and rows["unpatched"]["blocks_work"] == 1.0
    assert rows["ours reuse every 4"]["blocks_work"] < 1.0  # 12 steps: it reused some calls
    assert len(report["mag_ratios"]) == 12  # MagCache was calibrated on this model and step count
    assert (tmp_path / "diffusers-fidelity-ref-flux.json").is_file()


wan_weights = pytest.mark.skipif(
    not (models.WEIGHTS / "ref-wan.safetensors").exists(), reason="ref-wan weights missing from the checkout"
)


@wan_weights
def test_the_converted_video_reference_computes_what_comfyuis_model_does():
    from tools.common.host import setup_comfy
    from tools.fidelity.diffusers import wan as diffusers_wan

    setup_comfy("cpu")
    # diffusers' own converter; the two models differ in the order of float32 operations only.
    assert diffusers_wan.max_difference("ref-wan") < 1e-4


@wan_weights
def test_a_short_video_run_measures_frames_and_motion(tmp_path):
    argv = ["--model", "ref-wan", "--prompts", "2", "--steps", "12", "--real", "40", "--out", str(tmp_path)]
    # MagCache's calibration run is the image test's; here one of ours and one peer's row.
    report = diffusers_run.main([*argv, "--only", "ours reuse every 4,First Block Cache 0.08"])
    rows = {r["row"]: r for r in report["records"]}
    assert list(rows) == ["unpatched", "ours reuse every 4", "First Block Cache 0.08"]
    assert report["settings"]["scheduler"] == "unipc" and report["full_depth"] == 30
    assert rows["unpatched"]["motion_error"] == 0.0 and rows["unpatched"]["motion_kept"] == 1.0
    assert rows["ours reuse every 4"]["blocks_work"] < 1.0  # UniPC on a DiT: reuse runs
    assert len(rows["ours reuse every 4"]["block_shares"]) == models.WAN_CONFIGS["ref-wan"]["num_layers"]
    assert "motion error" in diffusers_run.table(report)
