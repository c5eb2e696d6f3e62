"""``reuse_interval`` (reuse across steps, layer by layer) on real diffusers pipelines, assembled offline.

The pipelines of diffusers_host (random weights, 32 px images, 16x16 latents) run end to end. With 10 steps and
interval 3 (a short run: one in two at most), steps 0 and 1 (the first fifth, two at least), every second step
after them (3, 5) and the last three (7-9) run every layer: 3 of the 10 UNet calls (cond and uncond batched in
one) reuse the inner layers' output.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hosts import diffusers_host as H
from test_diffusers import module_snapshot, unet_inputs

import tome_core
from tome_core.hosts.diffusers import layer_reuse as diffusers_layer_reuse
from tome_core.hosts.diffusers import patch

# Reuse alone, no token merging, layer by layer: "forecast" (the default) runs no layer at its skipped steps with
# DDIM and Euler (test_diffusers_forecast.py).
REUSE = {"reuse_interval": 3, "method": "tome", "ratio": 0.0, "reuse_plan": "auto"}


@pytest.fixture(scope="module")
def pipes():
    return {}


def pipeline(pipes, kind):
    return H.cached_pipeline(pipes, kind)


def last_run(pipe):
    return diffusers_layer_reuse.installed(pipe.unet).run


def generate(pipe, steps=10, px=H.IMAGE_PX, seed=0):
    """A text-to-image generation at another size than diffusers_host's."""
    with torch.no_grad():
        return pipe(
            prompt=H.PROMPT,
            num_inference_steps=steps,
            guidance_scale=5.0,
            height=px,
            width=px,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
        ).images


def test_inner_layers_follow_the_ldm_split():
    """Kept: conv_in, the last up block's last resnet (and its attention) and what follows; the rest in order."""
    sd1 = [name for name, _ in diffusers_layer_reuse.inner_layers(H.sd1_unet())]
    assert sd1 == [
        "down_blocks.0",
        "down_blocks.1",
        "mid_block",
        "up_blocks.0",
        "up_blocks.1.resnets.0",
        "up_blocks.1.attentions.0",  # two resnets per up block (layers_per_block 1): resnets.1 is kept
    ]
    sdxl = [name for name, _ in diffusers_layer_reuse.inner_layers(H.sdxl_unet())]
    assert sdxl[-3:] == ["up_blocks.0", "up_blocks.1", "up_blocks.2.resnets.0"]  # UpBlock2D: no attention


@pytest.mark.parametrize("kind", ["txt2img", "sdxl", "controlnet"])
def test_reuse_skips_the_expected_calls_and_removal_is_exact(pipes, kind):
    pipe = pipeline(pipes, kind)
    before = module_snapshot(pipe.unet)
    plain = H.run(pipe, kind, steps=10)
    tome_core.apply_patch(pipe, **REUSE)
    assert patch.is_patched(pipe)
    reused = H.run(pipe, kind, steps=10)
    run = last_run(pipe)
    assert (run.calls, run.reused_calls) == (10, 2)  # a short run: steps 2 and 4 (6-9 are the last four)
    assert not run.entries  # the cache is dropped after the last step
    tome_core.remove_patch(pipe)
    assert module_snapshot(pipe.unet) == before
    assert np.array_equal(H.run(pipe, kind, steps=10), plain)
    assert np.isfinite(reused).all() and reused.shape == plain.shape
    assert not np.array_equal(reused, plain)


def test_runs_where_every_step_is_full_are_bit_identical(pipes):
    """Interval 1 installs nothing; with 3 steps interval 3 keeps every step full: the layers run and record,
    and the picture is the unpatched one. Token merging with reuse_interval 1 is token merging alone."""
    pipe = pipeline(pipes, "txt2img")
    plain = H.run(pipe, "txt2img", steps=3)
    tome_core.apply_patch(pipe, **{**REUSE, "reuse_interval": 1})
    assert not patch.is_patched(pipe)
    tome_core.apply_patch(pipe, **REUSE)
    assert np.array_equal(H.run(pipe, "txt2img", steps=3), plain)
    assert last_run(pipe).reused_calls == 0
    merging = {"method": "tome", "ratio": 0.5, "skip_when_slower": False}
    tome_core.apply_patch(pipe, **merging)
    tome = H.run(pipe, "txt2img", steps=3)
    tome_core.apply_patch(pipe, **merging, reuse_interval=1)
    assert np.array_equal(H.run(pipe, "txt2img", steps=3), tome)
    tome_core.remove_patch(pipe)


def test_a_second_call_with_another_size_and_step_count_is_a_fresh_run(pipes):
    pipe = pipeline(pipes, "txt2img")
    tome_core.apply_patch(pipe, **REUSE)
    try:
        generate(pipe, steps=10)
        second = generate(pipe, steps=7, px=48)
        assert last_run(pipe).calls == 7
        tome_core.apply_patch(pipe, **REUSE)  # a fresh patch
        assert np.array_equal(generate(pipe, steps=7, px=48), second)
    finally:
        tome_core.remove_patch(pipe)


def test_an_interrupted_call_leaves_nothing_for_the_next(pipes):
    """A run cut short by an exception in the pipeline's step callback; the next call starts from scratch."""
    pipe = pipeline(pipes, "txt2img")
    tome_core.apply_patch(pipe, **REUSE)

    def stop_at_step_5(pipeline, step, timestep, kwargs):
        if step == 5:
            raise KeyboardInterrupt
        return kwargs

    try:
        with pytest.raises(KeyboardInterrupt):
            H.run(pipe, "txt2img", steps=10, callback_on_step_end=stop_at_step_5)
        after = H.run(pipe, "txt2img", steps=10)
        tome_core.apply_patch(pipe, **REUSE)
        assert np.array_equal(H.run(pipe, "txt2img", steps=10), after)
    finally:
        tome_core.remove_patch(pipe)


def test_image_to_image_counts_steps_from_its_first_call(pipes):
    """Strength 0.8 of 15 steps: the pipeline runs the last 12 of the scheduler's 15 timesteps; the run is those
    12 (reusing: 3, 5 and 7), as in ComfyUI, where the sampler gets the shortened schedule."""
    pipe = pipeline(pipes, "img2img")
    plain = H.run(pipe, "img2img", steps=15)
    tome_core.apply_patch(pipe, **REUSE)
    try:
        reused = H.run(pipe, "img2img", steps=15)
        run = last_run(pipe)
        assert (run.steps, run.calls, run.reused_calls) == (12, 12, 3)
    finally:
        tome_core.remove_patch(pipe)
    assert np.isfinite(reused).all() and not np.array_equal(reused, plain)


def test_calls_off_the_schedule_run_in_full(pipes):
    """A UNet call at a timestep the scheduler does not list, between a pipeline's runs, computes as unpatched."""
    pipe = pipeline(pipes, "txt2img")
    sample, kwargs = unet_inputs(pipe.unet)
    with torch.no_grad():
        plain = pipe.unet(sample, torch.tensor(123.25), **kwargs).sample
        tome_core.apply_patch(pipe, **REUSE)
        try:
            H.run(pipe, "txt2img", steps=10)
            assert torch.equal(pipe.unet(sample, torch.tensor(123.25), **kwargs).sample, plain)
        finally:
            tome_core.remove_patch(pipe)


def test_a_bare_unet_is_refused_and_left_as_it_was():
    unet = H.sd1_unet()
    tome_core.apply_patch(unet, method="tome", ratio=0.5, skip_when_slower=False)
    before = module_snapshot(unet)
    with pytest.raises(ValueError, match="reuse_interval above 1 needs the pipeline"):
        tome_core.apply_patch(unet, reuse_interval=3)
    assert module_snapshot(unet) == before  # the earlier patch stays as it was
    tome_core.remove_patch(unet)


def test_the_default_reuses_on_a_pipeline_and_leaves_reuse_out_on_a_bare_unet(pipes, caplog):
    """apply_patch with no settings: ToDo 2 with reuse every 3 on a pipeline; a bare UNet has no scheduler to
    follow, so there the default's reuse is left out (with a log line) instead of refusing the call."""
    pipe = pipeline(pipes, "txt2img")
    tome_core.apply_patch(pipe)
    try:
        schedule = diffusers_layer_reuse.installed(pipe.unet).schedule
        assert schedule.interval == 3
        # From 25 steps, the plan of a UNet with attention at full resolution (this SD1.x-layout UNet).
        assert schedule.full_steps(25) == 12 and schedule.for_run(25).extrapolate == 0.75
    finally:
        tome_core.remove_patch(pipe)
    tome_core.apply_patch(pipe, reuse_plan="every N")  # one step in N: 14 of 25
    try:
        assert diffusers_layer_reuse.installed(pipe.unet).schedule.full_steps(25) == 14
    finally:
        tome_core.remove_patch(pipe)
    unet = H.sd1_unet()
    with caplog.at_level("INFO", logger="tome_patch"):
        tome_core.apply_patch(unet, skip_when_slower=False)
    try:
        assert diffusers_layer_reuse.installed(unet) is None and patch.is_patched(unet)
        assert any("is left out" in r.getMessage() for r in caplog.records)
    finally:
        tome_core.remove_patch(unet)


def test_second_order_schedulers_count_each_model_call_as_a_step(pipes):
    """Heun lists each timestep but the first twice (19 UNet calls for 10 steps); the scheduler's step index
    tells the two calls apart. 19 calls, a short run: full calls 0-3 (a fifth of 19), every second after them (5,
    7, ..., 13), the last four (15-18)."""
    from diffusers import HeunDiscreteScheduler

    pipe = pipeline(pipes, "txt2img")
    original = pipe.scheduler
    pipe.scheduler = HeunDiscreteScheduler.from_config(original.config)
    tome_core.apply_patch(pipe, **REUSE)
    try:
        H.run(pipe, "txt2img", steps=10)
        run = last_run(pipe)
        assert (run.steps, run.calls, run.reused_calls) == (19, 19, 6)
    finally:
        tome_core.remove_patch(pipe)
        pipe.scheduler = original


@pytest.mark.parametrize(
    ("scheduler", "options"),
    [("EulerAncestralDiscreteScheduler", {}), ("EulerDiscreteScheduler", {"use_karras_sigmas": True})],
    ids=("euler-ancestral", "euler-karras"),
)
def test_a_scheduler_it_does_not_keep_the_picture_with_runs_every_step_in_full(pipes, scheduler, options):
    """Euler ancestral (or any scheduler but Euler, Heun, DDIM and DPM++ SDE), and Euler on Karras sigmas
    (``use_karras_sigmas``): nothing reused, the output that of reuse off."""
    import diffusers

    pipe = pipeline(pipes, "txt2img")
    original = pipe.scheduler
    pipe.scheduler = getattr(diffusers, scheduler).from_config(original.config, **options)
    try:
        tome_core.apply_patch(pipe, **{**REUSE, "reuse_interval": 1})
        off = H.run(pipe, "txt2img", steps=12)
        tome_core.apply_patch(pipe, **REUSE)
        assert np.array_equal(H.run(pipe, "txt2img", steps=12), off)
        assert last_run(pipe) is None
    finally:
        tome_core.remove_patch(pipe)
        pipe.scheduler = original


def test_dpm_solver_plus_plus_2m_on_karras_sigmas_reuses_with_every_call_below_sigma_1_in_full(pipes):
    """``DPMSolverMultistepScheduler`` at its defaults (DPM-Solver++ of order 2) with ``use_karras_sigmas``: the
    general plan's (14 full steps of 25) reusing steps whose sigma is 1.0 or more reuse, every call below runs in
    full (docs/step-reuse.md); without Karras sigmas, or at order 3, nothing is reused."""
    import diffusers

    pipe = pipeline(pipes, "txt2img")
    original = pipe.scheduler
    try:
        for options, reuses in (
            ({"use_karras_sigmas": True}, True),
            ({}, False),
            ({"use_karras_sigmas": True, "solver_order": 3}, False),
        ):
            pipe.scheduler = diffusers.DPMSolverMultistepScheduler.from_config(original.config, **options)
            tome_core.apply_patch(pipe, **REUSE)
            H.run(pipe, "txt2img", steps=25)
            run = last_run(pipe)
            if not reuses:
                assert run is None, options
                continue
            plan = [step for step in range(25) if not run.schedule.is_full(step, 25)]
            kept = [step for step in plan if float(pipe.scheduler.sigmas[step]) >= 1.0]
            assert 0 < len(kept) < len(plan)
            assert (run.steps, run.full_below, run.reused_calls) == (25, 1.0, len(kept))
            assert (run.schedule.full_steps(25), run.extrapolate) == (14, 0.5)  # the general plan
    finally:
        tome_core.remove_patch(pipe)
        pipe.scheduler = original


def test_dpm_solver_plus_plus_2m_on_karras_sigmas_under_every_n_keeps_every_step_in_full(pipes):
    """With ``reuse_plan`` "every N" (what a script written before the rule ran) DPM++ 2M on Karras sigmas keeps
    every step in full: nothing reused, the output that of reuse off."""
    import diffusers

    pipe = pipeline(pipes, "txt2img")
    original = pipe.scheduler
    pipe.scheduler = diffusers.DPMSolverMultistepScheduler.from_config(original.config, use_karras_sigmas=True)
    try:
        tome_core.apply_patch(pipe, **{**REUSE, "reuse_interval": 1})
        off = H.run(pipe, "txt2img", steps=25)
        tome_core.apply_patch(pipe, **{**REUSE, "reuse_plan": "every N"})
        assert np.array_equal(H.run(pipe, "txt2img", steps=25), off)
        assert last_run(pipe) is None
    finally:
        tome_core.remove_patch(pipe)
        pipe.scheduler = original


def test_the_step_range_limits_reuse(pipes):
    """end_percent 0.5: only calls at timesteps above 499.5 (DDIM's 901 ... 501, steps 0-4) may reuse: 2 and 4."""
    pipe = pipeline(pipes, "txt2img")
    tome_core.apply_patch(pipe, **REUSE, end_percent=0.5)
    try:
        H.run(pipe, "txt2img", steps=10)
        assert last_run(pipe).reused_calls == 2
    finally:
        tome_core.remove_patch(pipe)
