"""Smoke test of the fidelity benchmark on the committed reference models: the plumbing, and that the metrics
tell a correct patch from a broken one.

A few images and three sampling steps only: the full run is ``bash tools/bench.sh --fidelity``.
"""

from __future__ import annotations

import json

import pytest

from tools.fidelity import run as fidelity
from tools.fidelity.reference import models

pytestmark = pytest.mark.skipif(
    not (models.WEIGHTS / "ref-sd1.safetensors").exists(), reason="reference weights missing from the checkout"
)


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity")
    argv = ["--models", "ref-sd1", "--scales", "1", "--prompts", "4", "--seeds", "1", "--steps", "3"]
    argv += ["--broken", "--only", "ours ToMe 0.5,ours ToDo 2,broken", "--real", "64", "--grid", "4", "--out", str(out)]
    reports = fidelity.main(argv)
    return reports["ref-sd1"], out


def _row(report, name):
    return next(r for r in report["records"] if r["row"] == name)


def test_outputs_are_written(smoke_report):
    report, out = smoke_report
    for name in ("fidelity-ref-sd1.md", "fidelity-ref-sd1.json", "fidelity-ref-sd1.png", "fidelity-grid-ref-sd1.png"):
        assert (out / name).stat().st_size > 0, name
    saved = json.loads((out / "fidelity-ref-sd1.json").read_text())
    assert [r["row"] for r in saved["records"]] == [r["row"] for r in report["records"]]
    assert "| 32 | ours ToMe 0.5 |" in (out / "fidelity-ref-sd1.md").read_text()


def test_unpatched_row_is_its_own_reference(smoke_report):
    report, _ = smoke_report
    unpatched = _row(report, "unpatched")
    assert unpatched["identical_to_unpatched"] and unpatched["ssim"] == pytest.approx(1.0, abs=1e-6)
    assert unpatched["psnr"] is None


def test_patched_rows_change_the_picture_but_less_than_a_broken_patch(smoke_report):
    report, _ = smoke_report
    broken = _row(report, "broken (shifted tokens)")
    for name in ("ours ToMe 0.5", "ours ToDo 2"):
        row = _row(report, name)
        assert not row["identical_to_unpatched"], name  # the reduction really ran (skip_when_slower is off)
        # A one-token shift of every self-attention output wrecks the image; a correct reduction stays close.
        # 0.1 of SSIM is several times the spread between the correct rows seen in full runs.
        assert row["ssim"] > broken["ssim"] + 0.1, (name, row["ssim"], broken["ssim"])
        assert row["psnr"] > broken["psnr"], name
    assert "broken (shifted tokens)" not in sum(report["pareto_front"].values(), [])


@pytest.fixture(scope="module")
def flux_report(tmp_path_factory):
    if not (models.WEIGHTS / "ref-flux.safetensors").exists():
        pytest.skip("ref-flux weights missing from the checkout")
    out = tmp_path_factory.mktemp("fidelity-flux")
    # 12 steps: reuse across steps reuses from 10 steps on.
    argv = ["--models", "ref-flux", "--scales", "1", "--prompts", "2", "--seeds", "1", "--steps", "12"]
    argv += ["--only", "ToDo,ToMe,=ours reuse every 3,=EasyCache 0.1,=First Block Cache 0.2,TaylorSeer,broken"]
    argv += ["--broken", "--real", "64", "--grid", "2", "--out", str(out)]
    return fidelity.main(argv)["ref-flux"], out


def test_flux_reference_has_the_dit_rows(flux_report):
    report, out = flux_report
    ours = ["ours ToDo 2", "ours ToDo 3", "ours ToDo 2 until 60%"]
    ours += ["ToMe attention 0.5 (not shipped)", "ToMe attention 0.25 (not shipped)", "ours reuse every 3"]
    rows = ["unpatched", *ours, "ours ToDo 2 + reuse every 3", "EasyCache 0.1", "First Block Cache 0.2"]
    rows += ["TaylorSeer-style every 5"]
    assert [r["row"] for r in report["records"]] == [*rows, "broken (shifted tokens)"]
    # Reuse skips the inner blocks at some calls, EasyCache whole calls: the counted work shows both.
    reuse, easycache = _row(report, "ours reuse every 3")["work"], _row(report, "EasyCache 0.1")["work"]
    assert reuse["call_share"] == 1.0 and reuse["token_share"] < 1.0
    assert easycache["call_share"] < 1.0 and easycache["token_share"] == easycache["call_share"]
    # The published ideas as rows: a forecast of every block skips them all between computed calls.
    assert _row(report, "TaylorSeer-style every 5")["work"]["token_share"] < reuse["token_share"]
    assert _row(report, "First Block Cache 0.2")["work"]["call_share"] == 1.0  # its first block always runs
    assert _row(report, "unpatched")["identical_to_unpatched"]
    broken = _row(report, "broken (shifted tokens)")
    assert not broken["identical_to_unpatched"]  # the attention override reaches Flux's joint attention
    for name in ours:
        row = _row(report, name)
        # Each reduces Flux (never identical) and keeps the picture better than the broken row.
        assert not row["identical_to_unpatched"] and row["ssim"] > broken["ssim"], (name, row["ssim"], broken["ssim"])
    assert (out / "fidelity-grid-ref-flux.png").stat().st_size > 0


@pytest.fixture(scope="module")
def wan_report(tmp_path_factory):
    if not (models.WEIGHTS / "ref-wan.safetensors").exists():
        pytest.skip("ref-wan weights missing from the checkout")
    out = tmp_path_factory.mktemp("fidelity-wan")
    argv = ["--models", "ref-wan", "--scales", "1", "--prompts", "2", "--seeds", "1", "--steps", "12"]
    argv += ["--only", "=ours ToDo 2,=ours reuse every 3,=EasyCache 0.1,=First Block Cache 0.2,TaylorSeer,broken"]
    argv += ["--broken", "--real", "40", "--grid", "5", "--out", str(out)]
    return fidelity.main(argv)["ref-wan"], out


def test_video_reference_is_measured_frame_by_frame_and_for_its_motion(wan_report):
    report, out = wan_report
    rows = ["unpatched", "ours ToDo 2", "ours reuse every 3", "EasyCache 0.1", "First Block Cache 0.2"]
    assert [r["row"] for r in report["records"]] == [*rows, "TaylorSeer-style every 5", "broken (shifted tokens)"]
    unpatched = _row(report, "unpatched")
    assert unpatched["motion_error"] == 0.0 and unpatched["motion_kept"] == 1.0
    broken = _row(report, "broken (shifted tokens)")
    assert broken["motion_error"] > 0.0 and broken["ssim"] < 1.0
    for name in rows[1:]:
        row = _row(report, name)
        assert row["motion_error"] >= 0.0 and row["motion_kept"] > 0.0, name
    # Reuse skips the inner blocks of some calls, First Block Cache never skips its first block.
    assert _row(report, "ours reuse every 3")["work"]["token_share"] < 1.0
    assert _row(report, "First Block Cache 0.2")["work"]["call_share"] == 1.0
    # Every Wan block counted, in call order.
    blocks = models.WAN_CONFIGS["ref-wan"]["num_layers"]
    assert len(_row(report, "ours reuse every 3")["work"]["block_shares"]) == blocks
    table = (out / "fidelity-ref-wan.md").read_text()
    assert "motion error" in table and "2 clips" in table and "at 30 blocks" in table
    assert (out / "fidelity-grid-ref-wan.png").stat().st_size > 0


def test_motion_metrics_tell_a_frozen_clip_from_a_moving_one():
    import torch

    from tools.fidelity.reference import data

    clips, _ = data.clip_batch(2, 16, 5, torch.Generator().manual_seed(0))
    frozen = clips[:, :, :1].expand_as(clips)
    same = fidelity.motion_metrics(clips, clips)
    assert same == {"motion_error": 0.0, "motion_kept": 1.0}
    lost = fidelity.motion_metrics(frozen, clips)
    assert lost["motion_kept"] == 0.0 and lost["motion_error"] == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["ref-sd1", "ref-flux", "ref-wan", "ref-qwen", "ref-flux2"])
def test_training_feeds_the_model_what_comfyui_feeds_it_while_sampling(name):
    """The training pair (input, timestep, conditioning, target) against ComfyUI's own sampling path: the same
    inputs reach the diffusion model, and ComfyUI turns the training target back into the clean latent."""
    import torch

    from tools.fidelity import run
    from tools.fidelity.reference import train

    if not (models.WEIGHTS / f"{name}.safetensors").exists():
        pytest.skip(f"{name} weights missing from the checkout")
    base, encoder = models.load_reference(name)
    sampling = base.model_sampling
    assert type(sampling).__name__ == "ModelSampling"
    expected = {"ref-sd1": ("ModelSamplingDiscrete", "V_PREDICTION"), "ref-flux": ("ModelSamplingFlux", "CONST")}
    expected["ref-wan"] = ("ModelSamplingDiscreteFlow", "CONST")
    expected["ref-qwen"] = expected["ref-flux2"] = ("ModelSamplingFlux", "CONST")  # QwenImage / Flux2 shifts
    assert tuple(cls.__name__ for cls in type(sampling).__bases__) == expected[name]
    generator = torch.Generator().manual_seed(0)
    size = models.train_size(name)
    x0, prompts = models.samples(name, 3, size, generator)
    eps = torch.randn(x0.shape, generator=generator)
    t = torch.tensor([10, len(sampling.sigmas) // 2, len(sampling.sigmas) - 1])
    x_in, timestep, target, _ = train.noised_pair(models.is_dit(name), sampling.sigmas.float(), t, x0, eps)
    if models.is_dit(name):  # as training does: the model's sampling turns sigma into its timestep
        timestep = sampling.timestep(timestep)
    with torch.no_grad():
        context, pooled = encoder(prompts.as_tensor())
    inputs = models.model_inputs(name, base, context, pooled, size)

    seen = {}
    hook = base.diffusion_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(x=args[0], t=args[1], **kwargs), with_kwargs=True
    )
    sigma = sampling.sigmas[t].float()
    noisy = sampling.noise_scaling(sigma, eps, x0)
    (cond,) = run.conditioning(name, base, encoder, prompts.as_tensor(), size)
    conds = base.extra_conds(cross_attn=cond[0], noise=noisy, device="cpu", **cond[1])
    try:
        with torch.no_grad():
            base.apply_model(noisy, sigma, **{key: value.cond for key, value in conds.items()})
    finally:
        hook.remove()
    torch.testing.assert_close(seen["x"], x_in)
    torch.testing.assert_close(seen["t"], timestep)
    torch.testing.assert_close(seen["context"], inputs["context"])
    for key in ("y", "guidance"):
        if inputs.get(key) is None:
            assert seen.get(key) is None, key
        else:
            torch.testing.assert_close(seen[key].expand_as(inputs[key]), inputs[key])
    torch.testing.assert_close(sampling.calculate_denoised(sigma, target, noisy), x0, atol=1e-5, rtol=1e-5)
