"""The workflow matrix's pictures (ComfyUI, the trained reference ``ref-sd1``): where the default reuses, the same
workflow's picture patched against unpatched, same seed, keeps a mean SSIM of 0.97 over two prompts (25 steps, the
reference's 32x32 latents, no ToDo: reuse alone). The passes that run every step in full give the unpatched picture
bit for bit (test_workflow_matrix*.py); so do DPM++ SDE's (it reuses nothing) and ddim's are Euler's.

Two prompts are a thin sample: one image can move the mean by 0.05 (over 16 prompts the Euler default keeps 0.983 with
one image at 0.82). The combinations chosen: each workflow with Euler's forecast on ComfyUI's default scheduler, DPM++
2M's on Karras sigmas and off them, Heun's layer reuse (on `ddim_uniform` too, where it lost the picture until its
low-noise calls ran in full), and the schedules where the plans lose the picture (every step runs there).
"""

from __future__ import annotations

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

from tools.fidelity.reference import models

pytestmark = pytest.mark.skipif(
    not (models.WEIGHTS / "ref-sd1.safetensors").exists(), reason="reference weights missing from the checkout"
)

NAME, PROMPTS, SIZE = "ref-sd1", 2, 32
KEEPS = 0.97  # the bound; the default's own figure over 16 prompts is 0.983 (normal), 0.975 (exponential)
TXT2IMG, IMG2IMG, ADVANCED = host.WORKFLOWS[:3]


# (workflow, sampler, scheduler), with the mean SSIM over these two prompts (16 prompts) measured on a 2-core CPU.
CASES = [
    pytest.param(TXT2IMG, "euler", "normal", id="txt2img-euler-normal"),  # 0.993 (0.983)
    pytest.param(IMG2IMG, "euler", "normal", id="img2img-euler-normal"),  # 0.999
    pytest.param(ADVANCED, "euler", "normal", id="advanced-euler-normal"),  # 0.998
    pytest.param(TXT2IMG, "dpmpp_2m", "karras", id="txt2img-dpmpp_2m-karras"),  # 0.989
    pytest.param(TXT2IMG, "dpmpp_2m", "normal", id="txt2img-dpmpp_2m-normal"),  # 1.000
    pytest.param(TXT2IMG, "heun", "normal", id="txt2img-heun-normal"),  # 0.996 (0.991)
    pytest.param(TXT2IMG, "heun", "ddim_uniform", id="txt2img-heun-ddim_uniform"),  # 0.997 (0.990)
]


@pytest.fixture(scope="module")
def reference():
    """(the reference's patcher, its inputs for ``run_workflow``)."""
    import comfy.model_patcher
    import comfy.utils

    from tools.fidelity.run import benchmark_prompts, conditioning

    comfy.utils.PROGRESS_BAR_ENABLED = False
    base, encoder = models.load_reference(NAME)
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=host.CPU, offload_device=host.CPU)
    positive = conditioning(NAME, base, encoder, benchmark_prompts(0, PROMPTS), SIZE)
    negative = conditioning(NAME, base, encoder, models.PromptEncoder.empty(1), SIZE)
    scenes, _ = models.samples(NAME, PROMPTS, SIZE, torch.Generator().manual_seed(5))  # img2img's start: real scenes
    start = base.process_latent_out(scenes)
    return patcher, (positive, negative, torch.zeros(models.latent_shape(NAME, PROMPTS, SIZE)), start)


def sampled(patcher, workflow, sampler, scheduler, inputs):
    """(the scenes, UNet calls) of ``workflow``."""
    calls = []
    handle = patcher.model.diffusion_model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        out = host.run_workflow(patcher, workflow, sampler, scheduler, *inputs)
    finally:
        handle.remove()
    return patcher.model.process_latent_in(out), len(calls)


@pytest.mark.parametrize(("workflow", "sampler", "scheduler"), CASES)
def test_where_the_default_reuses_it_keeps_the_picture(reference, monkeypatch, workflow, sampler, scheduler):
    from tools.fidelity.run import image_metrics

    patcher, inputs = reference
    plain, plain_calls = sampled(patcher, workflow, sampler, scheduler, inputs)
    patched = host.patch_with_node(host.load_our_package(), patcher, downsample_factor=1.0)
    runs = host.recorded_runs(monkeypatch)
    out, calls = sampled(patched, workflow, sampler, scheduler, inputs)
    assert runs and all(run.reused_calls > 0 for run in runs)  # the default reuses in every pass here
    skipped = sum(run.reused_calls for run in runs if type(run).__name__ == "WholeStepRun")  # a forecast's
    assert calls == plain_calls - skipped
    assert image_metrics(out, plain)["ssim"] >= KEEPS


# Exponential and KL-optimal sigmas lost the picture (Euler 0.948 over these two prompts, 0.975 over 16; Heun 0.945 /
# 0.924 here, 0.933 / 0.941 over 16): read from the levels, such a pass runs every step, the unpatched picture.
@pytest.mark.parametrize(
    ("sampler", "scheduler"), [("euler", "exponential"), ("heun", "exponential"), ("heun", "kl_optimal")]
)
def test_where_the_plans_lose_the_picture_every_step_runs(reference, sampler, scheduler):
    patcher, inputs = reference
    plain, plain_calls = sampled(patcher, TXT2IMG, sampler, scheduler, inputs)
    patched = host.patch_with_node(host.load_our_package(), patcher, downsample_factor=1.0)
    out, calls = sampled(patched, TXT2IMG, sampler, scheduler, inputs)
    assert calls == plain_calls and torch.equal(out, plain)


def custom_sampled(patcher, sigmas, inputs, sampler="euler"):
    """(the scenes, UNet calls) of SamplerCustom with ``sampler`` on ``sigmas`` (CFG 4, seed 0)."""
    import comfy.sample
    import comfy.samplers

    positive, negative, empty, _ = inputs
    calls = []
    handle = patcher.model.diffusion_model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        noise = comfy.sample.prepare_noise(empty, 0)
        with torch.no_grad():
            out = comfy.sample.sample_custom(
                patcher, noise, 4.0, comfy.samplers.sampler_object(sampler), sigmas, positive, negative, empty, seed=0
            )
    finally:
        handle.remove()
    return patcher.model.process_latent_in(out), len(calls)


# Align Your Steps' levels are no schedule the door names: Euler forecasts there (7 of 10 calls, 13 of 25) and keeps
# the picture (mean over 16 prompts 0.990 at 10 steps, 0.994 at 25; Euler on normal sigmas 0.981 / 0.983).
@pytest.mark.parametrize("steps", [10, 25])
def test_align_your_steps_sigmas_keep_the_picture(reference, steps):
    from comfy_extras.nodes_align_your_steps import AlignYourStepsScheduler

    from tools.fidelity.run import image_metrics

    patcher, inputs = reference
    sigmas = AlignYourStepsScheduler.execute("SD1", steps, 1.0).result[0]
    plain, plain_calls = custom_sampled(patcher, sigmas, inputs)
    patched = host.patch_with_node(host.load_our_package(), patcher, downsample_factor=1.0)
    out, calls = custom_sampled(patched, sigmas, inputs)
    assert (plain_calls, calls) == (steps, {10: 7, 25: 13}[steps])
    assert image_metrics(out, plain)["ssim"] >= KEEPS
