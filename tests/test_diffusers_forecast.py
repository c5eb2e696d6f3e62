"""diffusers: the forecasts of ``reuse_plan`` (the default) on a UNet, where a skipped step runs no layer and its
denoised image is drawn along the line through the last two computed steps (``tome_core.reuse.whole_step``).

The pipelines of diffusers_host (random weights, 32 px images, 16x16 latents) run end to end with the schedulers
the forecast has plans for (Euler, DDIM, DPM++ 2M on Karras sigmas) and some it has none for; the pipelines call
the UNet once per step with cond and uncond batched.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hosts import diffusers_host as H
from test_diffusers import module_snapshot, unet_inputs

import tome_core
from tome_core.hosts.diffusers import layer_reuse as diffusers_layer_reuse
from tome_core.hosts.diffusers import patch
from tome_core.hosts.diffusers import whole_step as diffusers_whole_step
from tome_core.reuse import LayerReuseRun, WholeStepRun, denoised_of, output_of

REUSE = {"reuse_interval": 3, "method": "tome", "ratio": 0.0}  # reuse alone, no token merging; plan: the default
EULER_COMPUTED = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 22, 23, 24]  # the first 4 of 25, one in 3, the last 3
DPMPP_2M_COMPUTED = [0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 22, 23, 24]  # the first 4, one in 2, the last 3
DPMPP_2M_BEFORE = [*range(10), 11, 13, 15, 17, 19, 21, 22, 23, 24]  # "forecast", the plan before: the first 10


@pytest.fixture(scope="module")
def pipes():
    return {}


def pipeline(pipes, kind):
    return H.cached_pipeline(pipes, kind)


@pytest.fixture
def scheduler_of(pipes):
    """Swap a pipeline's scheduler for the test (diffusers' class by name, the pipeline's config), unpatch after."""
    swapped = []

    def swap(pipe, name, **options):
        import diffusers

        swapped.append((pipe, pipe.scheduler))
        pipe.scheduler = getattr(diffusers, name).from_config(pipe.scheduler.config, **options)
        return pipe

    yield swap
    for pipe, original in reversed(swapped):
        tome_core.remove_patch(pipe)
        pipe.scheduler = original


def last_run(pipe):
    return diffusers_layer_reuse.installed(pipe.unet).run


def computed_steps(pipe, kind, steps=25, **extra):
    """The image, and the steps at which the UNet's layers ran: its first layer (conv_in) and one of its deepest
    (the mid block), counted apart."""
    first, deepest = [], []
    timesteps = []
    hooks = (
        pipe.unet.conv_in.register_forward_pre_hook(lambda *args: first.append(len(timesteps) - 1)),
        pipe.unet.mid_block.register_forward_pre_hook(lambda *args: deepest.append(len(timesteps) - 1)),
        pipe.unet.register_forward_pre_hook(lambda module, args: timesteps.append(args[1])),
    )
    try:
        image = H.run(pipe, kind, steps=steps, **extra)
    finally:
        for hook in hooks:
            hook.remove()
    assert first == deepest
    return image, first


def distance(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).mean())


def assert_close_to_unpatched(pipe, kind, image, plain, steps=25, **extra):
    """The forecast keeps the picture: within a twentieth of the distance between two seeds' pictures. A random
    tiny UNet changes its output less smoothly from step to step than a trained one, so the references' figures
    give no absolute bound here; measured, the forecast lies within about a seventieth."""
    other_seed = H.run(pipe, kind, steps=steps, seed=1, **extra)
    assert np.isfinite(image).all() and image.shape == plain.shape
    assert distance(image, plain) < 0.05 * distance(other_seed, plain)
    assert not np.array_equal(image, plain)


def test_euler_computes_13_of_25_steps_and_runs_no_layer_at_the_others(pipes, scheduler_of):
    pipe = scheduler_of(pipeline(pipes, "txt2img"), "EulerDiscreteScheduler")
    plain = H.run(pipe, "txt2img", steps=25)
    tome_core.apply_patch(pipe, **REUSE)
    image, computed = computed_steps(pipe, "txt2img")
    run = last_run(pipe)
    assert isinstance(run, WholeStepRun)
    assert computed == EULER_COMPUTED
    assert (run.calls, run.reused_calls, run.extrapolate) == (25, 12, 0.75)
    assert not run.entries  # dropped at the run's end
    assert_close_to_unpatched(pipe, "txt2img", image, plain)


@pytest.mark.parametrize(("plan", "expected"), [("forecast v2", DPMPP_2M_COMPUTED), ("forecast", DPMPP_2M_BEFORE)])
def test_dpm_solver_plus_plus_2m_on_karras_sigmas_computes_16_of_25(pipes, scheduler_of, plan, expected):
    """16 of 25 under the default, 19 under "forecast" (a job written with the plan before keeps it)."""
    pipe = scheduler_of(pipeline(pipes, "txt2img"), "DPMSolverMultistepScheduler", use_karras_sigmas=True)
    plain = H.run(pipe, "txt2img", steps=25)
    tome_core.apply_patch(pipe, **REUSE, reuse_plan=plan)
    image, computed = computed_steps(pipe, "txt2img")
    run = last_run(pipe)
    assert isinstance(run, WholeStepRun) and run.full_below == 0.0  # the plan's own low-noise steps
    assert computed == expected
    assert_close_to_unpatched(pipe, "txt2img", image, plain)


@pytest.mark.parametrize("kind", ["img2img", "inpaint", "controlnet", "sdxl"])
def test_other_pipelines_forecast_the_planned_steps(pipes, kind):
    """DDIM (Euler's plan; SDXL: Euler) on the other pipelines, 15 steps (a short run: one in two at most):
    image-to-image counts its run from its first call (strength 0.8: 12 steps), the inpainting UNet reads the
    latent from the first 4 of its 9 channels."""
    pipe = pipeline(pipes, kind)
    plain = H.run(pipe, kind, steps=15)
    tome_core.apply_patch(pipe, **REUSE)
    try:
        image, computed = computed_steps(pipe, kind, steps=15)
        run = last_run(pipe)
        assert isinstance(run, WholeStepRun)
        assert computed == [step for step in range(run.steps) if run.schedule.is_full(step, run.steps)]
        assert run.reused_calls == run.steps - len(computed) > 0
        assert_close_to_unpatched(pipe, kind, image, plain, steps=15)
    finally:
        tome_core.remove_patch(pipe)


@pytest.mark.parametrize(
    ("scheduler", "options"),
    [
        ("EulerAncestralDiscreteScheduler", {}),  # "auto": every step in full
        ("DEISMultistepScheduler", {}),  # no plan knows it: every step in full
        ("EulerDiscreteScheduler", {"prediction_type": "sample"}),  # nothing to convert: layer reuse
    ],
    ids=("euler-ancestral", "deis", "euler-sample"),
)
def test_a_scheduler_without_a_forecast_keeps_autos_behaviour(pipes, scheduler_of, scheduler, options):
    """12 steps: "auto" reuses layers with Euler predicting the sample (one step in two at most), none with the
    others (Heun under the default runs its calls below sigma 0.4 in full)."""
    pipe = scheduler_of(pipeline(pipes, "txt2img"), scheduler, **options)
    tome_core.apply_patch(pipe, **REUSE, reuse_plan="auto")
    auto = H.run(pipe, "txt2img", steps=12)
    auto_run = last_run(pipe)
    tome_core.apply_patch(pipe, **REUSE)
    assert np.array_equal(H.run(pipe, "txt2img", steps=12), auto)
    run = last_run(pipe)
    assert not isinstance(run, WholeStepRun)
    if auto_run is None:
        assert run is None
    else:
        assert type(run) is LayerReuseRun and (run.calls, run.reused_calls) == (auto_run.calls, auto_run.reused_calls)


@pytest.mark.parametrize(("plan", "computed"), [("auto", 12), ("every N", 14)])
def test_auto_and_every_n_keep_layer_reuse(pipes, scheduler_of, plan, computed):
    """With Euler, 25 steps: "auto" the SD1.x family's plan (12 full steps), "every N" one step in 3 (14); the
    UNet's own forward is left alone and its outer layers run at every step."""
    pipe = scheduler_of(pipeline(pipes, "txt2img"), "EulerDiscreteScheduler")
    tome_core.apply_patch(pipe, **REUSE, reuse_plan=plan)
    assert "forward" not in pipe.unet.__dict__
    _, ran = computed_steps(pipe, "txt2img")
    run = last_run(pipe)
    assert type(run) is LayerReuseRun
    assert (run.calls, run.calls - run.reused_calls) == (25, computed)
    assert len(ran) == 25  # conv_in and the mid block run at every step (the mid block's own forward is skipped)


def test_perturbed_attention_guidance_runs_every_step_with_one_line_and_calibrates_nothing(
    pipes, scheduler_of, caplog, kept_file
):
    """A PAG pipeline adds a perturbed batch to each UNet call: as ComfyUI's PAG node, no plan is measured with it,
    so every step runs in full (the unpatched picture), with one line; ``calibrated`` keeps nothing and says so in
    one more; at pag_scale 0 the plan runs as ever."""
    pipe = scheduler_of(pipeline(pipes, "pag"), "EulerDiscreteScheduler")
    plain = H.run(pipe, "pag", steps=25)
    for plan in ("forecast v3", "calibrated"):
        tome_core.apply_patch(pipe, **REUSE, reuse_plan=plan)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tome_patch"):
            image, computed = computed_steps(pipe, "pag")
            again, _ = computed_steps(pipe, "pag")
        assert computed == list(range(25)) and np.array_equal(image, plain) and np.array_equal(again, plain)
        assert caplog.text.count("perturbed-attention guidance (pag_scale above 0)") == (
            1 if plan != "calibrated" else 2
        )
        assert not kept_file.exists()
        tome_core.remove_patch(pipe)
    tome_core.apply_patch(pipe, **REUSE)
    _, computed = computed_steps(pipe, "pag", pag_scale=0.0)
    assert computed == EULER_COMPUTED


def test_removal_is_exact_and_leaves_nothing(pipes, scheduler_of):
    pipe = scheduler_of(pipeline(pipes, "txt2img"), "EulerDiscreteScheduler")
    before = module_snapshot(pipe.unet)
    plain = H.run(pipe, "txt2img", steps=25)
    tome_core.apply_patch(pipe, **REUSE)
    assert isinstance(pipe.unet.__dict__["forward"], diffusers_whole_step.WholeStepForward)
    H.run(pipe, "txt2img", steps=25)
    tome_core.apply_patch(pipe, **REUSE, reuse_plan="auto")  # applying again replaces the patch
    assert "forward" not in pipe.unet.__dict__
    tome_core.apply_patch(pipe, **REUSE)
    tome_core.remove_patch(pipe)
    assert not patch.is_patched(pipe)
    assert module_snapshot(pipe.unet) == before
    assert np.array_equal(H.run(pipe, "txt2img", steps=25), plain)


def test_v_prediction_is_read_from_the_scheduler():
    def scheduler(prediction_type):
        return H.euler().from_config(H.euler().config, prediction_type=prediction_type)

    assert diffusers_whole_step.v_prediction(scheduler("epsilon")) is False
    assert diffusers_whole_step.v_prediction(scheduler("v_prediction")) is True
    assert diffusers_whole_step.v_prediction(scheduler("sample")) is None
    x, out = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    for v in (False, True):
        denoised = denoised_of(out, x, 3.5, v_prediction=v)
        torch.testing.assert_close(output_of(denoised, x, 3.5, v_prediction=v), out)
    assert not torch.allclose(denoised_of(out, x, 3.5, True), denoised_of(out, x, 3.5, False))


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_a_skipped_call_returns_the_forecast_in_the_schedulers_prediction(pipes, scheduler_of, prediction_type):
    """Each skipped call returns exactly the UNet output of the denoised image moved three quarters of the way
    along the line through the last two computed calls' denoised images, over Euler's sigmas, converted with the
    scheduler's prediction type (noise or velocity); the other conversion would give another output."""
    pipe = scheduler_of(pipeline(pipes, "txt2img"), "EulerDiscreteScheduler", prediction_type=prediction_type)
    v = prediction_type == "v_prediction"
    tome_core.apply_patch(pipe, **REUSE)
    calls = []
    hook = pipe.unet.register_forward_hook(
        lambda module, args, kwargs, out: calls.append((args[0].clone(), out[0].clone())), with_kwargs=True
    )
    try:
        _, computed = computed_steps(pipe, "txt2img")
    finally:
        hook.remove()
    assert diffusers_layer_reuse.installed(pipe.unet).v_prediction is v
    sigmas = [float(s) for s in pipe.scheduler.sigmas]
    skipped = [step for step in range(25) if step not in computed]
    assert len(calls) == 25 and skipped
    for step in skipped:
        a, b = [i for i in computed if i < step][-2:]
        line = [denoised_of(calls[i][1], calls[i][0], sigmas[i], v) for i in (a, b)]
        ahead = (sigmas[step] - sigmas[b]) / (sigmas[b] - sigmas[a])
        forecast = torch.lerp(line[0], line[1], 1.0 + 0.75 * ahead)
        x, out = calls[step]
        torch.testing.assert_close(out, output_of(forecast, x, sigmas[step], v), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(out, output_of(forecast, x, sigmas[step], not v), rtol=1e-3, atol=1e-3)


def test_a_loop_of_ones_own_gets_the_unets_output_class(pipes, scheduler_of):
    """A sampling loop written by hand, reading ``unet(...).sample`` (``return_dict`` True): a skipped call
    returns a ``UNet2DConditionOutput`` like a computed one, and the loop ends where it ends with tuples."""
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

    pipe = scheduler_of(pipeline(pipes, "txt2img"), "EulerDiscreteScheduler")
    tome_core.apply_patch(pipe, **REUSE)
    _, kwargs = unet_inputs(pipe.unet, batch=1)

    def loop(return_dict: bool) -> torch.Tensor:
        scheduler = pipe.scheduler
        scheduler.set_timesteps(25)
        latents = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(5)) * scheduler.init_noise_sigma
        for t in scheduler.timesteps:
            with torch.no_grad():
                out = pipe.unet(scheduler.scale_model_input(latents, t), t, return_dict=return_dict, **kwargs)
            assert isinstance(out, UNet2DConditionOutput if return_dict else tuple)
            latents = scheduler.step(out.sample if return_dict else out[0], t, latents).prev_sample
        return latents

    assert torch.equal(loop(True), loop(False))
    assert last_run(pipe).reused_calls == 12


def test_the_step_range_limits_the_forecast(pipes, scheduler_of):
    """end_percent 0.5: only calls at timesteps above 499.5 (Euler's steps 0-11 of 25) may be skipped."""
    pipe = scheduler_of(pipeline(pipes, "txt2img"), "EulerDiscreteScheduler")
    tome_core.apply_patch(pipe, **REUSE, end_percent=0.5)
    _, computed = computed_steps(pipe, "txt2img")
    assert [step for step in range(25) if step not in computed] == [4, 5, 7, 8, 10, 11]


def test_an_interrupted_run_leaves_nothing_for_the_next(pipes, scheduler_of):
    pipe = scheduler_of(pipeline(pipes, "txt2img"), "EulerDiscreteScheduler")
    tome_core.apply_patch(pipe, **REUSE)

    def stop_at_step_8(pipeline, step, timestep, kwargs):
        if step == 8:
            raise KeyboardInterrupt
        return kwargs

    with pytest.raises(KeyboardInterrupt):
        H.run(pipe, "txt2img", steps=25, callback_on_step_end=stop_at_step_8)
    after = H.run(pipe, "txt2img", steps=25)
    tome_core.apply_patch(pipe, **REUSE)
    assert np.array_equal(H.run(pipe, "txt2img", steps=25), after)


def test_the_token_reduction_still_applies_at_the_computed_steps(pipes, scheduler_of):
    """ToDo with the forecast: the same steps skipped, another picture than the forecast alone (the computed
    steps ran reduced)."""
    pipe = scheduler_of(pipeline(pipes, "txt2img"), "EulerDiscreteScheduler")
    tome_core.apply_patch(pipe, **REUSE)
    alone, alone_computed = computed_steps(pipe, "txt2img", steps=15)
    tome_core.apply_patch(pipe, method="todo", downsample_factor=2, skip_when_slower=False, reuse_interval=3)
    reduced, computed = computed_steps(pipe, "txt2img", steps=15)
    assert isinstance(last_run(pipe), WholeStepRun) and computed == alone_computed
    assert np.isfinite(reduced).all() and not np.array_equal(reduced, alone)


@pytest.mark.parametrize("order", ["patch, then compile", "compile, then patch"])
def test_a_compiled_unet_forecasts_the_same_steps_and_picture(pipes, scheduler_of, order):
    """``pipe.unet = torch.compile(pipe.unet)`` before or after the patch: the forecast and the recording run
    outside the graph (``torch.compiler.disable``), so the compiled pipeline skips the same 12 of 25 steps and
    gives eager mode's picture bit for bit (Dynamo's "eager" backend: its graphs run the same kernels)."""
    pipe = scheduler_of(pipeline(pipes, "txt2img"), "EulerDiscreteScheduler")
    unet = pipe.unet
    tome_core.apply_patch(pipe, **REUSE)
    eager = H.run(pipe, "txt2img", steps=25)
    tome_core.remove_patch(pipe)
    torch._dynamo.reset()
    try:
        if order == "patch, then compile":
            tome_core.apply_patch(pipe, **REUSE)
            pipe.unet = torch.compile(unet, backend="eager")
        else:
            pipe.unet = torch.compile(unet, backend="eager")
            tome_core.apply_patch(pipe, **REUSE)
        compiled = H.run(pipe, "txt2img", steps=25)
        run = diffusers_layer_reuse.installed(unet).run
        assert isinstance(run, WholeStepRun) and (run.calls, run.reused_calls) == (25, 12)
        assert np.array_equal(compiled, eager)
    finally:
        tome_core.remove_patch(pipe)
        pipe.unet = unet
        torch._dynamo.reset()


def test_pndm_says_once_at_warning_how_to_get_the_default(pipes, scheduler_of, caplog):
    """SD1.5 ships PNDMScheduler, which no plan knows: every step runs in full and one WARNING (seen at the default
    logging level) says so and how to get the default's plan."""
    import logging

    pipe = scheduler_of(pipeline(pipes, "txt2img"), "PNDMScheduler")
    tome_core.apply_patch(pipe, **REUSE)
    with caplog.at_level(logging.WARNING, logger="tome_patch"):
        H.run(pipe, "txt2img", steps=12)
        H.run(pipe, "txt2img", steps=12)
    said = [r for r in caplog.records if "reuse across steps is off" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "sampler PNDMScheduler" in said[0].getMessage() and "EulerDiscreteScheduler" in said[0].getMessage()
    assert last_run(pipe) is None


def test_image_to_image_on_karras_sigmas_runs_every_step(pipes, scheduler_of, caplog):
    """Below strength 1 a pipeline samples part of its scheduler's sigmas; on Karras sigmas no plan is measured
    there, so DPM++ 2M runs every step in full (with a line that says why), as the picture unpatched."""
    import logging

    pipe = scheduler_of(pipeline(pipes, "img2img"), "DPMSolverMultistepScheduler", use_karras_sigmas=True)
    plain = H.run(pipe, "img2img", steps=15)
    tome_core.apply_patch(pipe, **REUSE)  # ToMe at ratio 0: reuse alone
    with caplog.at_level(logging.WARNING, logger="tome_patch"):
        image = H.run(pipe, "img2img", steps=15)
    assert np.array_equal(image, plain) and last_run(pipe) is None
    assert "on part of a Karras schedule" in caplog.text


def test_ddim_with_eta_above_0_runs_every_step_and_says_so_once(pipes, caplog):
    """``pipe(..., eta=0.3)`` hands DDIMScheduler.step its eta: DDIM then adds noise at each step, which no plan is
    measured with, so the call runs every step (the unpatched picture) with one WARNING naming eta; the next call
    at eta 0 forecasts."""
    import logging

    pipe = pipeline(pipes, "txt2img")  # DDIMScheduler
    plain = H.run(pipe, "txt2img", steps=25, eta=0.3)
    tome_core.apply_patch(pipe, **REUSE)
    try:
        with caplog.at_level(logging.WARNING, logger="tome_patch"):
            image, computed = computed_steps(pipe, "txt2img", eta=0.3)
            computed_steps(pipe, "txt2img", eta=0.3)
        assert computed == list(range(25)) and np.array_equal(image, plain)
        said = [r.getMessage() for r in caplog.records if "reuse across steps is off" in r.getMessage()]
        assert len(said) == 1 and "DDIMScheduler with eta 0.3 adds noise" in said[0] and "eta=0" in said[0]
        _, computed = computed_steps(pipe, "txt2img", eta=0.0)
        assert computed == EULER_COMPUTED
    finally:
        tome_core.remove_patch(pipe)


def test_a_unet_shared_by_two_pipelines_follows_each_ones_scheduler(pipes, scheduler_of, caplog):
    """``from_pipe`` shares the UNet (and our hooks) but not a scheduler passed to it: each call decides with the
    scheduler of the pipeline that runs it, not the patched one's. Euler a, with the timesteps of the patched
    pipeline's Euler, runs every step (its unpatched picture) with a line that says why; the patched pipeline then
    forecasts as before, and an image-to-image pipeline sharing its scheduler plans its own part of the schedule."""
    import logging

    from diffusers import EulerAncestralDiscreteScheduler, StableDiffusionImg2ImgPipeline, StableDiffusionPipeline

    pipe = scheduler_of(pipeline(pipes, "txt2img"), "EulerDiscreteScheduler")
    other = StableDiffusionPipeline.from_pipe(
        pipe, scheduler=EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config)
    )
    image_to_image = StableDiffusionImg2ImgPipeline.from_pipe(pipe)
    assert other.unet is pipe.unet and image_to_image.scheduler is pipe.scheduler
    plain_other = H.run(other, "txt2img", steps=25)
    tome_core.apply_patch(pipe, **REUSE)
    _, computed = computed_steps(pipe, "txt2img")
    assert computed == EULER_COMPUTED
    with caplog.at_level(logging.WARNING, logger="tome_patch"):
        image, computed = computed_steps(other, "txt2img")
    assert computed == list(range(25)) and np.array_equal(image, plain_other)
    assert "sampler EulerAncestralDiscreteScheduler is not one" in caplog.text
    _, computed = computed_steps(image_to_image, "img2img")  # strength 0.8: the last 20 of 25 steps
    run = last_run(pipe)
    assert isinstance(run, WholeStepRun) and run.steps == 20 and computed[:3] == [0, 1, 2] and len(computed) < 20
    _, computed = computed_steps(pipe, "txt2img")
    assert computed == EULER_COMPUTED
