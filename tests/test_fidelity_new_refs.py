"""Smoke test of the Qwen-Image and Flux.2 reference models (``ref-qwen``, ``ref-flux2``, and the second
generation's ``ref-qwen-v2`` and ``ref-flux-v2``): built by ComfyUI's own detection as those families, their
committed weights load, and ComfyUI's KSampler samples them; the fidelity benchmark's DiT rows run on them (reuse
across steps, First Block Cache) with every block counted.

A few seconds: two prompts, few steps. The full runs are in docs/dit.md.
"""

from __future__ import annotations

import pytest
import torch

from tools.fidelity.reference import models

NEW_REFS = ("ref-qwen", "ref-flux2")


def _weights(name: str) -> None:
    if not (models.WEIGHTS / f"{name}.safetensors").exists():
        pytest.skip(f"{name} weights missing from the checkout")


@pytest.mark.parametrize(
    ("name", "config_class", "model_class"),
    [
        ("ref-qwen", "QwenImage", "QwenImageTransformer2DModel"),
        ("ref-flux2", "Flux2", "Flux"),
        ("ref-qwen-v2", "QwenImage", "QwenImageTransformer2DModel"),
        ("ref-flux-v2", "Flux", "Flux"),
    ],
)
def test_reference_is_built_as_its_family_and_samples_one_step(name, config_class, model_class):
    from tools.common.host import setup_comfy

    _weights(name)
    setup_comfy("cpu")  # ComfyUI first on the path: its ``nodes``, not this repository's
    import nodes as comfy_nodes
    from comfy.model_patcher import ModelPatcher

    from tome_core.hosts.comfyui import dit_reuse
    from tools.fidelity import run

    base, encoder = models.load_reference(name)
    assert type(base.model_config).__name__ == config_class
    assert type(base.diffusion_model).__name__ == model_class
    assert type(base.model_sampling).__bases__[0].__name__ == "ModelSamplingFlux"
    keys = dit_reuse.block_keys(base.diffusion_model)
    assert keys is not None and len(keys) >= 10  # the reuse door knows the layout; most blocks are predicted ones
    patcher = ModelPatcher(base, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    prompts = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]])
    size = models.train_size(name)
    positive = run.conditioning(name, base, encoder, prompts, size)
    negative = run.conditioning(name, base, encoder, models.PromptEncoder.empty(1), size)
    latent = {"samples": torch.zeros(models.latent_shape(name, 2, size))}
    with torch.no_grad():
        (out,) = comfy_nodes.common_ksampler(patcher, 0, 1, 4.0, "euler", "normal", positive, negative, latent)
    frames, per_sample = models.as_images(name)
    images = frames(patcher.model.process_latent_in(out["samples"]))
    scene = size * 2 if models.is_v2(name) else size  # the second generation's latents fold 64 px scenes
    assert images.shape == (2 * per_sample, 4, scene, scene)
    assert torch.isfinite(images).all() and images.std() > 0


@pytest.fixture(scope="module")
def qwen_report(tmp_path_factory):
    _weights("ref-qwen")
    from tools.fidelity import run as fidelity

    out = tmp_path_factory.mktemp("fidelity-qwen")
    # 12 steps: reuse across steps reuses from 10 steps on.
    argv = ["--models", "ref-qwen", "--scales", "1", "--prompts", "2", "--seeds", "1", "--steps", "12"]
    argv += ["--only", "=ours reuse every 3,=First Block Cache 0.2,TaylorSeer,=MagCache 0.24 (calibrated),broken"]
    argv[-1] += ",=cache-dit fixed plan fast"
    argv += ["--broken"]
    argv += ["--real", "64", "--grid", "2", "--out", str(out), "--threads", "1"]
    return fidelity.main(argv)["ref-qwen"], out


def _row(report, name):
    return next(r for r in report["records"] if r["row"] == name)


def test_qwen_reference_has_the_dit_rows(qwen_report):
    report, out = qwen_report
    rows = ["unpatched", "ours reuse every 3", "MagCache 0.24 (calibrated)", "First Block Cache 0.2"]
    rows += ["cache-dit fixed plan fast", "TaylorSeer-style every 5"]
    assert [r["row"] for r in report["records"]] == [*rows, "broken (shifted tokens)"]
    assert _row(report, "unpatched")["identical_to_unpatched"]
    broken = _row(report, "broken (shifted tokens)")
    assert not broken["identical_to_unpatched"]  # the attention override reaches Qwen-Image's joint attention
    reuse = _row(report, "ours reuse every 3")
    # Reuse skips the inner blocks at some calls and runs the first at every call; every block is counted.
    assert reuse["work"]["call_share"] == 1.0 and reuse["work"]["token_share"] < 1.0
    shares = reuse["work"]["block_shares"]
    assert len(shares) == models.QWEN_CONFIGS["ref-qwen"]["num_layers"]
    assert shares[0] == 1.0 and min(shares[1:]) < 1.0
    assert reuse["ssim"] > broken["ssim"]
    assert _row(report, "First Block Cache 0.2")["work"]["call_share"] == 1.0  # its first block always runs
    assert _row(report, "TaylorSeer-style every 5")["work"]["token_share"] < 1.0
    # MagCache skips whole calls' blocks (its first block too), calibrated by a run that is neither timed nor counted.
    magcache = _row(report, "MagCache 0.24 (calibrated)")
    assert magcache["work"]["token_share"] < 1.0 and min(magcache["work"]["block_shares"]) < 1.0
    assert magcache["work"]["block_shares"][0] == magcache["work"]["block_shares"][-1]
    # cache-dit's fast plan computes 7 of 12 steps (111010010011); the others run the first block only.
    fixed = _row(report, "cache-dit fixed plan fast")["work"]
    assert fixed["call_share"] == 1.0 and fixed["block_shares"][0] == 1.0
    assert fixed["block_shares"][1:] == pytest.approx([7 / 12] * (len(fixed["block_shares"]) - 1))
    assert report["full_depth"] == 60
    table = (out / "fidelity-ref-qwen.md").read_text()
    assert "at 60 blocks" in table
    assert (out / "fidelity-grid-ref-qwen.png").stat().st_size > 0
