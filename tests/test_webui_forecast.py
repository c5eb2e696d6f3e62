"""``reuse_plan``'s forecasts in the WebUI (ldm UNet) and on Forge: a skipped step runs no layer of the UNet, its
output is the forecast of the denoised image along the line through the last two computed steps, turned back into
the UNet's prediction (``tome_core.hosts.webui.whole_step``), in jobs run the way the hosts run them (webui_host.py).
"""

from __future__ import annotations

import types

import pytest
import torch
from hosts.webui_host import (
    SIGMAS,
    ControlNetUnit,
    ForgeSDModel,
    Host,
    Processing,
    SDModel,
    make_unet,
    process_images,
    run_job,
    script_args,
)
from test_webui_layer_reuse import assert_clean, runs_of, skippable_layers, unet_of

from tome_core.hosts.webui import layer_reuse as webui_layer_reuse
from tome_core.hosts.webui import ldm_patch
from tome_core.hosts.webui import whole_step as webui_whole_step
from tome_core.reuse import (
    WHOLE_STEP_REACH,
    LayerReuseRun,
    WholeStepRun,
    decide,
    denoised_of,
    output_of,
)
from tome_core.settings import PatchSettings

STEPS = tuple(range(999, 0, -40))  # 25 DDPM timesteps
EULER_COMPUTED = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 22, 23, 24]  # the plan at reuse_interval 3 (13 of 25)
FORECAST = {"method": "ToDo", "downsample_factor": 1.0, "reuse_interval": 3, "reuse_plan": "forecast v2"}  # no ToDo


@pytest.fixture(scope="module")
def host():
    return Host()


def job(host, sd_model, args, **kwargs):
    return run_job(host, sd_model, args, **{"steps": STEPS, **kwargs})


class UNetCalls:
    """Every call of ``unet`` in a job, as (input, sigma, output, whether its middle block ran), by hooks on the
    UNet (which run around its forward, ours included) and on its middle block."""

    def __init__(self, unet):
        self.calls: list[tuple[torch.Tensor, float, torch.Tensor, bool]] = []
        self.ran = False

        def before(module, args):
            self.ran = False

        def middle(module, args, output):
            self.ran = True

        def after(module, args, output):
            x, t = args[0], args[1]
            self.calls.append((x.clone(), float(SIGMAS[int(t.max())]), output.clone(), self.ran))

        self.handles = [
            unet.register_forward_pre_hook(before),
            unet.middle_block.register_forward_hook(middle),
            unet.register_forward_hook(after),
        ]

    def remove(self):
        for handle in self.handles:
            handle.remove()

    def computed(self) -> list[int]:
        return [i for i, call in enumerate(self.calls) if call[3]]


def expected_forecast(calls, i, v_prediction=False):
    """What skipped call ``i`` returns: ``output_of`` of the denoised image on the line through the last two computed
    calls, three quarters of the way (the host's single batch layout: every call is one)."""
    x, sigma, _, _ = calls[i]
    (x1, s1, o1, _), (x2, s2, o2, _) = [call for call in calls[:i] if call[3]][-2:]
    first = denoised_of(o1.float(), x1.float(), s1, v_prediction)
    last = denoised_of(o2.float(), x2.float(), s2, v_prediction)
    forecast = torch.lerp(first, last, 1.0 + WHOLE_STEP_REACH * ((sigma - s2) / (s2 - s1)))
    return output_of(forecast, x.float(), sigma, v_prediction)


def assert_no_forward_of_ours(unet):
    assert not isinstance(unet.__dict__.get("forward"), webui_whole_step.WholeStepCall)


@pytest.mark.parametrize(
    ("layout", "v_prediction"), [("sd1", False), ("sdxl", False), ("sd1", True)], ids=("sd1", "sdxl", "sd1-v")
)
def test_euler_runs_the_unet_only_at_its_planned_steps_and_forecasts_the_others(host, layout, v_prediction):
    """Euler at 25 steps, reuse_interval 3: the UNet's layers run at 13 calls of 25 (the first 4, one in 3, the last
    3); each other call runs no layer and returns the UNet prediction of the forecast denoised image, computed here
    from the recorded calls, bit for bit. On a v-prediction model (``parameterization`` "v") the conversions are
    v-prediction's (this host's sampler reads the output as noise either way: only the door's arithmetic is
    checked there)."""
    sd_model = SDModel(make_unet(layout))
    if v_prediction:
        sd_model.parameterization = "v"
    unet = unet_of(sd_model)
    baseline, _ = job(host, sd_model, script_args(enabled=False))
    seen = UNetCalls(unet)
    try:
        out, p = job(host, sd_model, script_args(**FORECAST))
    finally:
        seen.remove()
    (run,) = runs_of(p)
    assert isinstance(run, WholeStepRun) and (run.steps, run.calls, run.reused_calls) == (25, 25, 12)
    assert seen.computed() == EULER_COMPUTED
    for i, (_, _, output, ran) in enumerate(seen.calls):
        if not ran:
            assert torch.equal(output, expected_forecast(seen.calls, i, v_prediction)), i
    assert not run.entries and run.current is None  # the cache went with the pass
    assert_clean(sd_model)
    assert_no_forward_of_ours(unet)
    assert torch.isfinite(out).all() and not torch.equal(out, baseline)
    if not v_prediction:
        # This random-weight UNet's output follows the noise level less smoothly than a trained one's, so the
        # forecast moves the latent further than on real models: the bound leaves about twice what it moves (less
        # than "auto"'s layer reuse does here), where a lost picture would differ by the latent's own size.
        assert (out - baseline).abs().max().item() < 0.15 * baseline.abs().max().item()
    again, _ = job(host, sd_model, script_args(enabled=False))
    assert torch.equal(again, baseline)  # removal restores the exact computation
    assert not host.console


def test_cond_and_uncond_apart_each_take_the_plan(host):
    """With batch_cond_uncond off each step makes two UNet calls of the same shape: each is its own layout (its
    position in the denoiser call), 13 computed of 25 each, and the picture is that of the batched calls."""
    sd_model = SDModel(make_unet("sd1"))
    batched, _ = job(host, sd_model, script_args(**FORECAST))
    seen = UNetCalls(unet_of(sd_model))
    try:
        apart, p = job(host, sd_model, script_args(**FORECAST), batch_cond_uncond=False)
    finally:
        seen.remove()
    (run,) = runs_of(p)
    assert (run.calls, run.reused_calls) == (50, 24)
    assert seen.computed() == [2 * step + half for step in EULER_COMPUTED for half in (0, 1)]
    # Batched and separate calls round their sums in another order; calls that shared one record would differ by
    # the order of the latent itself.
    assert (apart - batched).abs().max().item() <= 1e-3 * batched.abs().max().item()
    assert_clean(sd_model)


@pytest.mark.parametrize(
    ("job_of", "plan", "computed"),
    [
        ({"sampler": "DPM++ 2M", "scheduler": "Karras"}, "forecast v2", 16),
        ({"sampler": "DPM++ 2M"}, "forecast v2", 16),  # "Automatic": Karras sigmas for it
        ({"sampler": "DPM++ 2M Karras"}, "forecast v2", 16),  # the label before v1.9
        ({"sampler": "DPM++ 2M", "scheduler": "Karras"}, "forecast", 19),  # an infotext saved with the plan before
        ({"sampler": "DDIM"}, "forecast v2", 13),
        ({"sampler": "DDIM"}, "forecast", 13),
        ({"sampler": "DPM++ 2M", "scheduler": "Uniform"}, "forecast v3", 20),
        ({"sampler": "DPM++ 2M", "scheduler": "SGM Uniform"}, "forecast v3", 20),
    ],
    ids=(
        "dpmpp-2m-karras",
        "dpmpp-2m-automatic",
        "dpmpp-2m-karras-label",
        "dpmpp-2m-before",
        "ddim",
        "ddim-before",
        "dpmpp-2m-uniform",
        "dpmpp-2m-sgm-uniform",
    ),
)
def test_each_sampler_with_a_forecast_plan_takes_it(host, job_of, plan, computed):
    """DPM++ 2M on Karras sigmas: the first 4 steps, one in 2, the last 3 (16 of 25; under "forecast", the plan
    before, the first 10: 19 of 25); DDIM: Euler's plan; DPM++ 2M off Karras sigmas under "forecast v3" the first 4,
    one in 2 and the last 12 (20 of 25). (This host's loop steps as Euler whatever the label: the
    door's choice of plan is what is checked.)"""
    sd_model = SDModel(make_unet("sd1"))
    seen = UNetCalls(unet_of(sd_model))
    try:
        _, p = job(host, sd_model, script_args(**{**FORECAST, "reuse_plan": plan}), **job_of)
    finally:
        seen.remove()
    (run,) = runs_of(p)
    assert isinstance(run, WholeStepRun) and run.calls - run.reused_calls == computed == len(seen.computed())
    assert run.full_below == 0.0  # the forecast's plan has no low-noise calls in full of its own
    assert_clean(sd_model)


def test_euler_a_keeps_autos_behaviour_every_step_in_full(host, capsys):
    """A sampler without a forecast plan keeps what "auto" does with it: Euler a reuses nothing (the output that
    of reuse off, with one console line), Heun reuses its inner layers as under "auto"."""
    sd_model = SDModel(make_unet("sd1"))
    off, _ = job(host, sd_model, script_args(**{**FORECAST, "reuse_interval": 1}), sampler="Euler a")
    capsys.readouterr()
    out, p = job(host, sd_model, script_args(**FORECAST), sampler="Euler a")
    assert not runs_of(p) and torch.equal(out, off)
    assert capsys.readouterr().out.count("reuse across steps is off: sampler Euler a is not one") == 1
    heun, p = job(host, sd_model, script_args(**FORECAST), sampler="Heun")
    (run,) = runs_of(p)
    assert type(run) is LayerReuseRun and run.reused_calls > 0
    auto, _ = job(host, sd_model, script_args(**{**FORECAST, "reuse_plan": "auto"}), sampler="Heun")
    assert torch.equal(heun, auto)
    assert_clean(sd_model)


@pytest.mark.parametrize("plan", ["auto", "every N"])
def test_the_other_plans_reuse_the_layers_as_before(host, plan):
    sd_model = SDModel(make_unet("sd1"))
    _, p = job(host, sd_model, script_args(**{**FORECAST, "reuse_plan": plan}))
    (run,) = runs_of(p)
    assert type(run) is LayerReuseRun and run.reused_calls == 25 - (12 if plan == "auto" else 14)
    assert_clean(sd_model)


def test_the_step_range_and_the_highres_pass(host):
    """Calls outside the user's step range (end_percent) are computed (and recorded); the highres pass is a pass
    of its own, with its own plan."""
    sd_model = SDModel(make_unet("sd1"))
    _, p = job(host, sd_model, script_args(**FORECAST, end_percent=0.6))
    (run,) = runs_of(p)
    low = (1.0 - 0.6) * 999  # the timestep where the range ends
    assert run.reused_calls == sum(1 for i, t in enumerate(STEPS) if i not in EULER_COMPUTED and t > low) == 8
    hr_steps = tuple(range(599, 0, -50))  # 12 steps
    _, p = job(host, sd_model, script_args(**FORECAST), enable_hr=True, hr_steps=hr_steps)
    first, second = runs_of(p)
    assert (first.steps, first.reused_calls) == (25, 12)
    full = decide("forecast v2", "euler", None, 3).schedule.full_steps(12)
    assert isinstance(second, WholeStepRun) and (second.steps, second.reused_calls) == (12, 12 - full) and full < 12
    assert_clean(sd_model)


def test_removal_keeps_a_forward_that_was_there_and_restores_the_unet(host):
    """The adapter's own API: an instance forward set before ours (as ControlNet sets one) is called by ours and
    put back by every removal; a call outside a denoiser call runs in full."""
    sd_model = SDModel(make_unet("sd1"))
    unet = unet_of(sd_model)
    x, t, context = torch.randn(2, 4, 8, 8), torch.full((2,), 500.0), torch.randn(2, 5, 32)
    calls = []

    def theirs(*args, **kwargs):
        calls.append(1)
        return type(unet).forward(unet, *args, **kwargs)

    settings = PatchSettings(method="todo", downsample_factor=1.0, reuse_interval=3)
    euler = types.SimpleNamespace(sampler_name="Euler", scheduler="Automatic")
    schedule = webui_layer_reuse.decision_for(settings, euler).schedule
    with torch.no_grad():
        plain = unet(x, t, context=context)
        for remove in (lambda: ldm_patch.remove_patch(unet), ldm_patch.remove_all, lambda: None):
            unet.__dict__["forward"] = theirs
            assert webui_whole_step.install_ldm(unet, settings, euler, schedule, False) is not None
            assert ldm_patch.is_patched(unet) and unet.__dict__["forward"].inner is theirs
            assert torch.equal(unet(x, t, context=context), plain) and calls
            remove()
            # The next pass's install takes ours away first (the front door's ``remove_everywhere`` too).
            webui_layer_reuse.remove_ldm(unet)
            webui_layer_reuse.end_pass()
            assert unet.__dict__["forward"] is theirs and not ldm_patch.is_patched(unet)
            del unet.__dict__["forward"]
            assert_clean(sd_model)
            assert torch.equal(unet(x, t, context=context), plain)


def test_an_exception_mid_sampling_leaves_nothing_for_the_next_job(host):
    sd_model = SDModel(make_unet("sd1"))
    baseline, _ = job(host, sd_model, script_args(enabled=False))

    def fail(p, step):
        if step == 8:  # after forecasting steps 4, 5 and 7
            assert isinstance(unet_of(sd_model).__dict__.get("forward"), webui_whole_step.WholeStepCall)
            assert webui_layer_reuse.active_pass().run.reused_calls == 3
            raise RuntimeError("out of memory")

    p = Processing(sd_model, script_args(**FORECAST))
    p.steps, p.on_step = STEPS, fail
    with pytest.raises(RuntimeError), torch.no_grad():
        process_images(host, p)  # postprocess is skipped, as in the WebUI
    out, _ = job(host, sd_model, script_args(enabled=False))
    assert torch.equal(out, baseline)
    assert_clean(sd_model)
    assert_no_forward_of_ours(unet_of(sd_model))


# --- which prediction the model makes -------------------------------------------------------------------------------


def test_the_webui_reads_the_models_parameterization():
    assert webui_whole_step.ldm_v_prediction(types.SimpleNamespace(parameterization="v")) is True
    assert webui_whole_step.ldm_v_prediction(types.SimpleNamespace(parameterization="eps")) is False
    assert webui_whole_step.ldm_v_prediction(types.SimpleNamespace()) is False  # ldm's default
    assert webui_whole_step.ldm_v_prediction(types.SimpleNamespace(parameterization="x0")) is None


def test_a_model_whose_prediction_it_cannot_convert_keeps_layer_reuse(host):
    sd_model = SDModel(make_unet("sd1"))
    sd_model.parameterization = "x0"
    _, p = job(host, sd_model, script_args(**FORECAST))
    (run,) = runs_of(p)
    assert type(run) is LayerReuseRun
    assert_clean(sd_model)


def _comfy_sampling(kind: str):
    """ComfyUI's model sampling as reForge and Forge Neo build it: the discrete schedule mixed with a prediction
    class (comfy/model_sampling.py: V_PREDICTION and EDM derive from EPS)."""
    eps = type("EPS", (), {"calculate_denoised": lambda self, *a: None})
    classes = {"EPS": eps}
    classes["V_PREDICTION"] = type("V_PREDICTION", (eps,), {"calculate_denoised": lambda self, *a: None})
    classes["EDM"] = type("EDM", (classes["V_PREDICTION"],), {"calculate_denoised": lambda self, *a: None})
    discrete = type("ModelSamplingDiscrete", (), {"sigma_data": 1.0})
    return type("ModelSampling", (discrete, classes[kind]), {})()


def test_forge_reads_its_predictor_or_model_sampling():
    def forge(**predictor):
        return types.SimpleNamespace(model=types.SimpleNamespace(predictor=types.SimpleNamespace(**predictor)))

    assert webui_whole_step.forge_v_prediction(forge(prediction_type="v_prediction")) is True
    assert webui_whole_step.forge_v_prediction(forge(prediction_type="epsilon")) is False
    assert webui_whole_step.forge_v_prediction(forge(prediction_type="edm")) is None
    assert webui_whole_step.forge_v_prediction(forge(prediction_type="const")) is None  # flow models
    assert webui_whole_step.forge_v_prediction(forge(prediction_type="epsilon", sigma_data=0.5)) is None

    def comfy(kind):
        return types.SimpleNamespace(model=types.SimpleNamespace(), get_model_object=lambda name: _comfy_sampling(kind))

    assert webui_whole_step.forge_v_prediction(comfy("V_PREDICTION")) is True
    assert webui_whole_step.forge_v_prediction(comfy("EPS")) is False
    assert webui_whole_step.forge_v_prediction(comfy("EDM")) is None
    assert webui_whole_step.forge_v_prediction(ForgeSDModel(make_unet("sd1")).forge_unet_original) is None


def test_a_timestep_samplers_noise_level_is_its_timesteps_sigma():
    """The WebUI's DDIM hands the denoiser DDPM timesteps, and its denoiser holds the model's ``alphas``."""
    alphas = 1.0 / (1.0 + SIGMAS.double() ** 2)
    denoiser = types.SimpleNamespace(alphas=alphas)
    params = types.SimpleNamespace(sigma=torch.full((2,), 501.0), denoiser=denoiser)
    assert webui_whole_step._call_sigma(params) == pytest.approx(float(SIGMAS[501]), rel=1e-6)
    kdiffusion = types.SimpleNamespace(sigma=torch.full((2,), 3.5), denoiser=types.SimpleNamespace())
    assert webui_whole_step._call_sigma(kdiffusion) == 3.5


# --- Forge ----------------------------------------------------------------------------------------------------------


def _forge_and_ldm(layout="sd1"):
    forge = ForgeSDModel(make_unet(layout, seed=5))
    forge.forge_unet_original.model.predictor.prediction_type = "epsilon"  # Forge's KModel predictor (SD1.x)
    return forge, SDModel(make_unet(layout, seed=5))


def test_forge_forecasts_through_an_object_patch_and_gives_the_ldm_result(host):
    forge, ldm = _forge_and_ldm()
    unet = unet_of(forge)
    never, _ = job(host, forge, script_args(enabled=False))
    seen = []

    def probe(p, step):
        patches = p.sd_model.forge_objects.unet.object_patches
        seen.append(
            (
                isinstance(patches.get("diffusion_model.forward"), webui_whole_step.WholeStepCall),
                isinstance(unet.__dict__.get("forward"), webui_whole_step.WholeStepCall),
                len(skippable_layers(unet)),
            )
        )

    middle = []
    handle = unet.middle_block.register_forward_hook(lambda *args: middle.append(1))
    try:
        forge_out, forge_p = job(host, forge, script_args(**FORECAST), on_step=probe)
    finally:
        handle.remove()
    ldm_out, ldm_p = job(host, ldm, script_args(**FORECAST))
    assert seen == [(True, True, 0)] * 25 and len(middle) == 13
    assert forge.forge_unet_original.object_patches == {}
    torch.testing.assert_close(forge_out, ldm_out, rtol=0, atol=1e-6)
    for p in (forge_p, ldm_p):
        (run,) = runs_of(p)
        assert isinstance(run, WholeStepRun) and (run.calls, run.reused_calls) == (25, 12)
    again, _ = job(host, forge, script_args(enabled=False))  # Forge unloads our clone: its patch is undone
    assert torch.equal(again, never) and not torch.equal(forge_out, never)
    assert_clean(forge)
    assert not host.console


def test_forge_without_a_known_prediction_keeps_layer_reuse(host):
    forge = ForgeSDModel(make_unet("sd1", seed=5))  # the stand-in's predictor names no prediction type
    _, p = job(host, forge, script_args(**FORECAST))
    (run,) = runs_of(p)
    assert type(run) is LayerReuseRun
    job(host, forge, script_args(enabled=False))
    assert_clean(forge)


def test_forge_stands_down_for_a_whole_model_wrapper(host, capsys):
    """Neo's Spectrum (``model_function_wrapper`` on the clone) forecasts whole steps: ours stands down, with one
    line, and every call runs the UNet (this stand-in does not call the wrapper: the output is reuse off's)."""
    forge, _ = _forge_and_ldm()
    forge.forge_unet_original.model_options["model_function_wrapper"] = lambda function, call: None
    off, _ = job(host, forge, script_args(**{**FORECAST, "reuse_interval": 1}))
    capsys.readouterr()
    on, p = job(host, forge, script_args(**FORECAST))
    assert torch.equal(on, off) and not runs_of(p)
    assert capsys.readouterr().out.count("another whole-model wrapper (Neo's Spectrum) decides the steps") == 1
    job(host, forge, script_args(enabled=False))
    assert_clean(forge)


def test_forge_exception_mid_sampling_leaves_nothing_for_the_next_job(host):
    forge, _ = _forge_and_ldm()
    never, _ = job(host, forge, script_args(enabled=False))

    def fail(p, step):
        if step == 6:
            raise RuntimeError("out of memory")

    p = Processing(forge, script_args(**FORECAST))
    p.steps, p.on_step = STEPS, fail
    with pytest.raises(RuntimeError), torch.no_grad():
        process_images(host, p)
    out, _ = job(host, forge, script_args(enabled=False))
    assert torch.equal(out, never)
    assert_clean(forge)


@pytest.mark.parametrize(
    ("first", "hires", "hires_runs"),
    [
        ("Euler", "Euler a", False),  # the default stands down for Euler a: not the first pass's forecast
        ("Euler a", "Euler", True),  # and the other way round, the highres pass forecasts
        ("Euler", "Use same sampler", True),  # the UI's word for the first pass's sampler
    ],
)
def test_the_highres_pass_runs_the_plan_of_its_own_sampler(host, capsys, first, hires, hires_runs):
    """The highres pass samples with ``hr_sampler_name`` where one is set: the plan is that sampler's, and a
    stand-down says so once."""
    sd_model = SDModel(make_unet("sd1"))
    capsys.readouterr()
    _, p = job(
        host, sd_model, script_args(**FORECAST), enable_hr=True, sampler=first, hr_sampler_name=hires, hr_steps=STEPS
    )
    expected = [True] * (first == "Euler") + [True] * hires_runs  # a forecast run per pass that reuses
    assert [isinstance(run, WholeStepRun) for run in runs_of(p)] == expected
    said = capsys.readouterr().out
    assert ("reuse across steps is off: sampler Euler a is not one" in said) == ("Euler a" in (first, hires))
    assert_clean(sd_model)


def test_an_api_request_without_a_scheduler_runs_automatic(host):
    """An API request that names no schedule type leaves ``p.scheduler`` None, which the WebUI runs as "Automatic":
    Karras sigmas for DPM++ 2M, so its forecast (16 of 25), as with "Automatic" itself."""
    sd_model = SDModel(make_unet("sd1"))
    for scheduler in (None, "Automatic"):
        _, p = job(host, sd_model, script_args(**FORECAST), sampler="DPM++ 2M", scheduler=scheduler)
        (run,) = runs_of(p)
        assert isinstance(run, WholeStepRun) and run.reused_calls == 25 - 16, scheduler
    assert_clean(sd_model)


def test_a_highres_pass_on_karras_sigmas_runs_every_step(host, capsys):
    """The highres pass runs over part of its schedule; on Karras sigmas no plan is measured there, so it runs
    every step in full and says why (the first pass keeps its forecast)."""
    sd_model = SDModel(make_unet("sd1"))
    capsys.readouterr()
    _, p = job(host, sd_model, script_args(**FORECAST), enable_hr=True, sampler="DPM++ 2M", hr_steps=STEPS)
    (run,) = runs_of(p)
    assert isinstance(run, WholeStepRun) and run.steps == 25
    assert "sampler DPM++ 2M on part of a Karras schedule" in capsys.readouterr().out
    assert_clean(sd_model)


def test_prompt_editing_drops_what_was_recorded_for_the_prompt_before(host):
    """Prompt editing ("[a:b:10]") switches the prompt at step 10: what the steps before recorded belongs to the old
    prompt, so the first call after the switch computes (a skipped step on the plan) and records afresh, instead of
    forecasting the old prompt's line; the picture differs from the run without the switch."""
    sd_model = SDModel(make_unet("sd1"))
    unet = unet_of(sd_model)
    new_prompt = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(9))
    counted = []
    handle = unet.middle_block.register_forward_pre_hook(lambda module, args: counted.append(1))  # computed calls
    try:
        plain, _ = job(host, sd_model, script_args(**FORECAST))
        computed = len(counted)
        counted.clear()
        edited, p = job(host, sd_model, script_args(**FORECAST), prompt_edit=(10, new_prompt))
    finally:
        handle.remove()
    assert computed == len(EULER_COMPUTED)
    assert len(counted) == computed + 1  # step 10, skipped on the plan, computes after the switch
    assert not torch.equal(plain, edited)
    assert_clean(sd_model)


@pytest.mark.parametrize(
    ("sampler", "request_values", "setting", "said"),
    [
        ("DDIM", {"eta": 0.3}, {}, "sampler DDIM with eta 0.3"),  # the request's eta
        ("DDIM", {}, {"eta_ddim": 0.5}, "sampler DDIM with eta 0.5"),  # Settings > Sampler parameters
        ("Euler", {"s_churn": 0.4}, {}, "sampler Euler with s_churn 0.4"),
        ("Euler", {}, {"s_churn": 0.2}, "sampler Euler with s_churn 0.2"),
        ("DDIM", {"eta": 0.0}, {"eta_ddim": 0.5}, None),  # the request's 0 wins over the setting
        ("Euler", {}, {"eta_ddim": 0.5}, None),  # DDIM's eta is not Euler's
    ],
)
def test_a_sampler_that_adds_noise_runs_every_step(host, capsys, sampler, request_values, setting, said):
    """DDIM with eta above 0 and Euler with s_churn above 0 add noise at each step (A1111's and Forge's
    ``Sampler.initialize``): the forecast of the deterministic sampler would draw a line through noise, so the pass
    runs every step with one line naming the option; at 0 the forecast runs."""
    sd_model = SDModel(make_unet("sd1"))
    saved = vars(host.opts).copy()
    vars(host.opts).update(setting)
    capsys.readouterr()
    try:
        _, p = job(host, sd_model, script_args(**FORECAST), sampler=sampler, **request_values)
    finally:
        vars(host.opts).update(saved)
    out = capsys.readouterr().out
    if said is None:
        (run,) = runs_of(p)
        assert isinstance(run, WholeStepRun) and run.reused_calls == 25 - len(EULER_COMPUTED)
        assert "adds noise" not in out
    else:
        assert runs_of(p) == []
        assert out.count("adds noise at each step") == 1 and said in out
    assert_clean(sd_model)


@pytest.mark.parametrize("scheduler", ["Polyexponential", "polyexponential", "KL Optimal", "kl_optimal", "Exponential"])
def test_schedules_that_lose_the_picture_run_every_step_by_label_or_name(host, capsys, scheduler):
    """The UI sends the schedule's label, an API request its label or name (sd_schedulers.py ``schedulers_map``):
    either way the pass runs every step. Polyexponential at its default rho 1 is the exponential schedule."""
    sd_model = SDModel(make_unet("sd1"))
    capsys.readouterr()
    _, p = job(host, sd_model, script_args(**FORECAST), scheduler=scheduler)
    assert runs_of(p) == []
    assert f"sampler Euler on {scheduler} sigmas: the plans lose the picture" in capsys.readouterr().out
    assert_clean(sd_model)


def _job_with(host, sd_model, args, legacy=False, **attributes):
    """A job whose processing object gets ``attributes``; ``legacy``: a WebUI before v1.9, without ``p.scheduler``."""
    p = Processing(sd_model, args)
    p.steps = STEPS
    for name, value in attributes.items():
        setattr(p, name, value)
    if legacy:
        del p.scheduler
    with torch.no_grad():
        process_images(host, p)
    return p


def _assert_full_or_forecast(p, out, said, computed):
    """The pass ran every step with one line containing ``said``, or (``said`` None) its forecast of ``computed``
    steps with no line that reuse is off."""
    if said is None:
        (run,) = runs_of(p)
        assert isinstance(run, WholeStepRun) and run.calls - run.reused_calls == computed
        assert "reuse across steps is off" not in out
    else:
        assert runs_of(p) == []
        assert out.count("reuse across steps is off") == 1 and said in out, out


@pytest.mark.parametrize(
    ("job_of", "setting", "said"),
    [
        ({"sampler": "DPM++ 2M", "scheduler": "Karras"}, {"rho": 5.0}, "on Karras sigmas with rho 5"),
        ({"sampler": "DPM++ 2M"}, {"rho": 5.0}, "on karras sigmas with rho 5"),  # "Automatic": its Karras
        ({"sampler": "DPM++ 2M", "scheduler": "Karras"}, {"sigma_max": 20.0}, "with sigma_max 20"),
        ({"sampler": "DPM++ 2M", "scheduler": "Karras"}, {"sigma_min": 0.1}, "with sigma_min 0.1"),
        ({"sampler": "DPM++ 2M", "scheduler": "Karras"}, {"use_old_karras_scheduler_sigmas": True},
         "with use_old_karras_scheduler_sigmas (sigmas 0.1 to 10)"),  # fmt: skip
        ({"sampler": "DPM++ 2M", "scheduler": "Karras", "override_settings": {"rho": 3.0}}, {}, "with rho 3"),
        ({"sampler": "Euler", "scheduler": "SGM Uniform"}, {"sigma_max": 20.0}, "on SGM Uniform sigmas with sigma_max"),
        ({"sampler": "DPM++ 2M", "scheduler": "Karras"}, {"rho": 7.0}, None),  # the default, named
        ({"sampler": "Euler"}, {"rho": 5.0, "sigma_max": 20.0}, None),  # "Automatic" for Euler: the model's levels
        ({"sampler": "Euler", "scheduler": "Uniform"}, {"sigma_min": 0.1}, None),  # the model's levels
        ({"sampler": "Euler", "scheduler": "Align Your Steps"}, {"sigma_max": 20.0}, None),  # fixed levels
        ({"sampler": "Euler", "scheduler": "SGM Uniform"}, {"rho": 5.0}, None),  # rho is Karras' alone
        ({"sampler": "DDIM", "scheduler": "SGM Uniform"}, {"sigma_max": 20.0}, None),  # DDIM steps by timesteps
    ],
    ids=(
        "rho", "rho-automatic", "sigma-max", "sigma-min", "old-karras-sigmas", "rho-request", "sgm-uniform-range",
        "rho-7", "euler-automatic", "uniform", "align-your-steps", "rho-off-karras", "ddim",
    ),
)  # fmt: skip
def test_sampler_parameters_that_move_the_sigmas_run_every_step(host, capsys, job_of, setting, said):
    """Settings > Sampler parameters (``opts.rho``, ``sigma_min``, ``sigma_max``, ``use_old_karras_scheduler_sigmas``),
    or an API request's ``override_settings`` of them, move the sigmas of a schedule that reads them (A1111's and
    Forge's ``KDiffusionSampler.get_sigmas``) off those the plans were measured on (the model's own range, Karras'
    rho 7): such a pass runs every step with one line naming the option. Schedules that read none of them, and DDIM
    (timesteps), keep their plan. The request's options are the job's alone."""
    sd_model = SDModel(make_unet("sd1"))
    saved = vars(host.opts).copy()
    vars(host.opts).update(setting)
    capsys.readouterr()
    try:
        _, p = job(host, sd_model, script_args(**{**FORECAST, "reuse_plan": "forecast v3"}), **job_of)
    finally:
        vars(host.opts).update(saved)
    assert vars(host.opts) == saved  # override_settings restored after the job
    karras = job_of.get("scheduler", "Karras" if job_of["sampler"] == "DPM++ 2M" else None) == "Karras"
    _assert_full_or_forecast(p, capsys.readouterr().out, said, 16 if karras else len(EULER_COMPUTED))
    assert_clean(sd_model)


@pytest.mark.parametrize(
    ("label", "setting", "said", "computed"),
    [
        ("DPM++ 2M Karras", {"k_sched_type": "Automatic", "rho": 5.0}, None, 16),  # rho unread without a type
        ("DPM++ 2M Karras", {"k_sched_type": "karras", "rho": 5.0}, "on karras sigmas with rho 5", None),
        (
            "DPM++ 2M Karras",
            {"k_sched_type": "Automatic", "use_old_karras_scheduler_sigmas": True},
            "with use_old_karras_scheduler_sigmas",
            None,
        ),  # fmt: skip
        ("DPM++ 2M Karras", {"k_sched_type": "exponential"}, "on exponential sigmas: the plans lose the picture", None),
        ("Euler", {"k_sched_type": "polyexponential"}, "on polyexponential sigmas: the plans lose the picture", None),
        ("Euler", {"k_sched_type": "karras"}, "sampler Euler on karras sigmas is not one", None),
        ("DDIM", {"k_sched_type": "exponential"}, None, len(EULER_COMPUTED)),  # DDIM steps by timesteps
    ],
)
def test_before_v1_9_the_scheduler_type_setting_sets_every_samplers_sigmas(host, capsys, label, setting, said,
                                                                          computed):  # fmt: skip
    """A1111 v1.6-v1.8 have no ``p.scheduler``: Settings' "Scheduler type" (``opts.k_sched_type``) gives every
    k-diffusion sampler its sigmas, over a label's "Karras", and only under it do rho and the sigma range apply
    (``KDiffusionSampler.get_sigmas`` of those versions)."""
    sd_model = SDModel(make_unet("sd1"))
    saved = vars(host.opts).copy()
    vars(host.opts).update(setting)
    capsys.readouterr()
    try:
        p = _job_with(host, sd_model, script_args(**FORECAST), legacy=True, sampler=label)
    finally:
        vars(host.opts).clear()
        vars(host.opts).update(saved)
    _assert_full_or_forecast(p, capsys.readouterr().out, said, computed)
    assert_clean(sd_model)


@pytest.mark.parametrize(
    "scheduler", ["Karras Exponential", "karras_exponential", "Turbo", "Karras Dynamic", "Align Your Steps GITS"]
)
@pytest.mark.parametrize("sampler", ["Euler", "DPM++ 2M"])
def test_a_schedule_no_plan_is_measured_on_runs_every_step(host, capsys, sampler, scheduler):
    """A WebUI fork's "Karras Exponential" (A1111 pull request 16506, not merged; Simple KES) blends Karras and
    exponential sigmas over another range; A1111's Turbo, reForge's Karras Dynamic and Forge's AYS variants are
    other levels again: no plan is measured there (``samplers.MEASURED_SCHEDULES``), so the pass runs every step with
    a line."""
    sd_model = SDModel(make_unet("sd1"))
    capsys.readouterr()
    _, p = job(host, sd_model, script_args(**{**FORECAST, "reuse_plan": "forecast v3"}), sampler=sampler,
               scheduler=scheduler)  # fmt: skip
    said = f"sampler {sampler} on {scheduler} sigmas: no plan is measured there"
    _assert_full_or_forecast(p, capsys.readouterr().out, said, None)
    assert_clean(sd_model)


@pytest.mark.parametrize(
    ("units", "attributes", "said"),
    [
        ([ControlNetUnit(guidance_start=0.2)], {}, "guidance start-end 0.2-1 switches"),
        ([ControlNetUnit(), ControlNetUnit(guidance_end=0.6)], {}, "guidance start-end 0-0.6 switches"),
        ([{"enabled": True, "module": "ip-adapter_clip_sd15", "guidance_end": 0.5}], {}, "start-end 0-0.5"),  # API
        ([], {"control_net_guidance_end": [1.0, 0.4]}, "guidance start-end 0-0.4"),  # X/Y/Z plot, per unit
        ([ControlNetUnit()], {}, None),  # the whole pass
        ([ControlNetUnit(enabled=False, guidance_start=0.5)], {}, None),
        ([{"enabled": False, "guidance_end": 0.5}], {}, None),
    ],
    ids=("start", "end", "api-ip-adapter", "xyz", "whole", "off", "api-off"),
)
def test_a_controlnet_unit_switched_mid_pass_runs_every_step(host, capsys, units, attributes, said):
    """sd-webui-controlnet (and Forge's built-in ControlNet) switch a unit on at ``guidance_start`` and off after
    ``guidance_end`` of the pass (hook.py ``guidance_schedule_handler``); a skipped step after the switch would be
    drawn from the steps before it, so an enabled unit (IP-Adapter's too) that guides part of the pass only makes
    it run every step, with a line. The units are read where ControlNet reads them, ``p.script_args``."""
    sd_model = SDModel(make_unet("sd1"))
    capsys.readouterr()
    p = _job_with(host, sd_model, [*script_args(**FORECAST), *units], **attributes)
    _assert_full_or_forecast(p, capsys.readouterr().out, said, len(EULER_COMPUTED))
    assert_clean(sd_model)


@pytest.mark.parametrize(("plan", "said"), [("forecast v3", "loses the picture there"), ("forecast v2", "is not one")])
def test_dpmpp_2m_on_beta_sigmas_runs_every_step(host, capsys, plan, said):
    """DPM++ 2M's rule off Karras sigmas loses the picture on Beta (docs/step-reuse.md, 'DPM++ 2M off Karras sigmas'):
    the pass runs every step with one line."""
    sd_model = SDModel(make_unet("sd1"))
    capsys.readouterr()
    _, p = job(host, sd_model, script_args(**{**FORECAST, "reuse_plan": plan}), sampler="DPM++ 2M", scheduler="Beta")
    _assert_full_or_forecast(p, capsys.readouterr().out, said, None)
    assert_clean(sd_model)
