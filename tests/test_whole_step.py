"""The engine of ``reuse_plan``'s forecasts (``tome_core.reuse.whole_step``): the plans, which samplers take them,
the forecast itself and the conversions between a UNet's output and the denoised image. No host."""

from __future__ import annotations

import pytest
import torch

from tome_core import PatchSettings
from tome_core.reuse import (
    DEFAULT_REUSE_PLAN,
    FORECAST,
    FULL,
    WHOLE_STEP_REACH,
    WholeStepRun,
    decide,
    denoised_of,
    output_of,
    unet_schedule,
)

# The sampler each forecast kind of these tests stands for.
KINDS = {
    "euler": ("euler", None),
    "dpmpp_2m_karras": ("dpmpp_2m", "karras"),
    "dpmpp_2m": ("dpmpp_2m", "normal"),
    None: ("euler_ancestral", None),
}
COMPUTED_AT_25 = {13: "euler", 16: "dpmpp_2m_karras", 20: "dpmpp_2m"}


def computed(schedule, steps):
    return [step for step in range(steps) if schedule.is_full(step, steps)]


def whole_step_schedule(interval, kind, plan=DEFAULT_REUSE_PLAN):
    """The forecast schedule ``decide`` gives a sampler of ``kind`` (None where the pass does not forecast)."""
    decision = decide(plan, *KINDS[kind], interval)
    return decision.schedule if decision.runs == FORECAST else None


def whole_step_kind(sampler, schedule):
    """Which forecast ``decide`` gives (by its computed steps at 25), or None where it gives none."""
    decision = decide(DEFAULT_REUSE_PLAN, sampler, schedule, 3)
    if decision.runs != FORECAST:
        return None
    return COMPUTED_AT_25[len(computed(decision.schedule, 25))]


def keeps_the_picture_with(sampler, schedule, plan):
    return decide(plan, sampler, schedule, 3).runs != FULL


def test_the_plans_at_25_steps_are_the_measured_ones():
    """docs/step-reuse.md, "The default": Euler 13 of 25 under every forecast; DPM++ 2M on Karras sigmas 16 of 25
    under "forecast v3" (the default) and "forecast v2", 19 of 25 under "forecast" (for the jobs saved with it)."""
    euler = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 22, 23, 24]
    assert computed(whole_step_schedule(3, "euler"), 25) == euler
    assert computed(whole_step_schedule(3, "euler", "forecast"), 25) == euler
    assert computed(whole_step_schedule(3, "euler", "forecast v2"), 25) == euler
    karras = computed(whole_step_schedule(3, "dpmpp_2m_karras"), 25)
    assert computed(whole_step_schedule(3, "dpmpp_2m_karras", "forecast v2"), 25) == karras
    assert karras == [0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 22, 23, 24]
    before = computed(whole_step_schedule(3, "dpmpp_2m_karras", "forecast"), 25)
    assert before == [*range(10), 11, 13, 15, 17, 19, 21, 22, 23, 24]
    # Under 25 steps "forecast v2" keeps "forecast"'s DPM++ 2M plan (its own spacing lost the picture at 20 steps).
    for steps in (10, 15, 20, 24):
        v2, forecast = (whole_step_schedule(3, "dpmpp_2m_karras", plan) for plan in ("forecast v2", "forecast"))
        assert computed(v2, steps) == computed(forecast, steps)
    assert len(computed(whole_step_schedule(3, "dpmpp_2m_karras"), 30)) == 19  # forecast: 22
    assert PatchSettings().reuse_plan == DEFAULT_REUSE_PLAN == "forecast v3"
    assert whole_step_schedule(3, "euler").extrapolate == WHOLE_STEP_REACH == 0.75
    assert whole_step_schedule(3, None) is None and whole_step_schedule(1, "euler") is None
    assert computed(whole_step_schedule(3, "euler"), 9) == list(range(9))  # under 10 steps: every step


def test_dpmpp_2m_off_karras_sigmas_forecasts_its_high_noise_steps_only_under_forecast_v3():
    """docs/step-reuse.md, "DPM++ 2M off Karras sigmas": the first 4 steps of 25, one in 2 up to step 12 and every
    step from 13 (20 of 25); the last 12 steps always run, so a shorter run computes a larger share and under 15
    steps every step. A job saved with "forecast v2" runs every step, as it did."""
    assert computed(whole_step_schedule(3, "dpmpp_2m"), 25) == [0, 1, 2, 3, 5, 7, 9, 11, *range(13, 25)]
    assert computed(whole_step_schedule(3, "dpmpp_2m"), 20) == [0, 1, 2, 4, 6, *range(8, 20)]
    assert len(computed(whole_step_schedule(3, "dpmpp_2m"), 30)) == 23
    assert computed(whole_step_schedule(3, "dpmpp_2m"), 14) == list(range(14))
    assert computed(whole_step_schedule(2, "dpmpp_2m"), 25) == computed(whole_step_schedule(4, "dpmpp_2m"), 25)
    for plan in ("forecast v2", "forecast", "auto", "every N"):
        assert decide(plan, "dpmpp_2m", None, 3).runs == FULL
    assert decide("forecast v3", "dpmpp_2m", None, 3).fallback.runs == FULL  # a host that cannot forecast


@pytest.mark.parametrize(
    ("sampler", "schedule", "kind"),
    [
        ("euler", None, "euler"),  # ComfyUI (its "ddim" runs Euler)
        ("Euler", "Automatic", "euler"),  # the WebUI
        ("DDIM", None, "euler"),
        ("EulerDiscreteScheduler", None, "euler"),  # diffusers
        ("DDIMScheduler", None, "euler"),
        ("euler", "karras", None),  # Euler on Karras sigmas: not measured
        ("dpmpp_2m", "karras", "dpmpp_2m_karras"),
        ("DPM++ 2M", "Karras", "dpmpp_2m_karras"),
        ("DPMSolverMultistepScheduler", "karras", "dpmpp_2m_karras"),
        ("dpmpp_2m", None, "dpmpp_2m"),  # ComfyUI's normal, simple, sgm_uniform ...: no name, not Karras
        ("DPM++ 2M", "SGM Uniform", "dpmpp_2m"),
        ("DPMSolverMultistepScheduler", None, "dpmpp_2m"),
        ("dpmpp_2m", "exponential", None),  # the UNet plans lose the picture on it
        ("dpmpp_2m", "beta", None),  # its rule loses the picture there (forecast v3 refuses it)
        ("DPM++ 2M", "Beta", None),
        ("euler", "beta", "euler"),
        ("euler_ancestral", None, None),
        ("heun", None, None),
        (None, None, None),
    ],
)
def test_which_samplers_forecast(sampler, schedule, kind):
    assert whole_step_kind(sampler, schedule) == kind


def test_forecast_keeps_autos_rules_for_the_other_samplers():
    """Under either forecast a sampler without a plan runs as under "auto": the same samplers, the same UNet
    plans."""
    for plan in ("forecast v3", "forecast v2", "forecast"):
        for sampler, schedule in (("heun", None), ("dpmpp_2m", "karras"), ("euler_ancestral", None), ("euler", None)):
            assert keeps_the_picture_with(sampler, schedule, plan=plan) == keeps_the_picture_with(
                sampler, schedule, plan="auto"
            )
        for levels in ((1, 2, 4), (2, 4)):
            forecast, auto = unet_schedule(3, levels, plan), unet_schedule(3, levels, "auto")
            assert computed(forecast.for_run(25), 25) == computed(auto.for_run(25), 25)


def run_of(steps=25):
    return WholeStepRun(whole_step_schedule(3, "euler"), steps)


def call(run, step, sigma, value, key="cond"):
    """One call of ``run`` whose model returns ``value``; returns (output, whether the model ran)."""
    ran = []

    def compute():
        ran.append(True)
        return value.clone()

    run.begin_call(step, key, position=sigma)
    try:
        return run.run_call(compute), bool(ran)
    finally:
        run.end_call()


def test_a_skipped_call_is_the_line_through_the_last_two_computed_moved_three_quarters():
    run = run_of()
    sigmas = [14.6 / (1 + step) for step in range(25)]
    outputs = [torch.full((2, 4, 3, 3), float(step) ** 1.5) for step in range(25)]
    for step in range(4):
        out, ran = call(run, step, sigmas[step], outputs[step])
        assert ran and torch.equal(out, outputs[step])
    out, ran = call(run, 4, sigmas[4], outputs[4])
    (s2, s3, s4), (d2, d3) = sigmas[2:5], outputs[2:4]
    assert not ran
    assert torch.equal(out, torch.lerp(d2, d3, 1.0 + 0.75 * (s4 - s3) / (s3 - s2)))
    assert (run.calls, run.reused_calls) == (5, 1)
    assert "1 ran nothing" in run.summary()


def test_a_layout_without_two_records_and_a_step_back_compute():
    """A batch layout first seen at a skipped step has nothing to forecast from: it computes. A step that goes
    back (another run on the same model) drops the records: it computes too."""
    run = run_of()
    value = torch.ones(1, 4, 2, 2)
    for step in range(4):
        call(run, step, 10.0 - step, value)
    assert call(run, 4, 6.0, value, key="uncond")[1]
    assert not call(run, 5, 5.0, value)[1]
    assert call(run, 4, 6.0, value)[1]  # back a step: a new run's call


def test_the_conversions_invert_each_other_and_match_k_diffusion():
    """eps: denoised = x - sigma * eps on the unscaled latent x (the UNet sees x / sqrt(sigma^2 + 1)); v: k-diffusion's
    c_skip / c_out. float64: exact up to rounding."""
    generator = torch.Generator().manual_seed(0)
    latent, prediction = (torch.randn(2, 4, 5, 5, dtype=torch.float64, generator=generator) for _ in range(2))
    for sigma in (0.03, 1.0, 14.6):
        scale = (sigma * sigma + 1) ** 0.5
        x = latent / scale
        assert torch.allclose(denoised_of(prediction, x, sigma), latent - sigma * prediction, atol=1e-12)
        v_denoised = latent / (sigma * sigma + 1) - prediction * sigma / scale
        assert torch.allclose(denoised_of(prediction, x, sigma, v_prediction=True), v_denoised, atol=1e-12)
        for v in (False, True):
            back = output_of(denoised_of(prediction, x, sigma, v), x, sigma, v)
            assert torch.allclose(back, prediction, atol=1e-9)
