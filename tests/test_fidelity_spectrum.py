"""The Spectrum peer row (``tools/fidelity/spectrum``): which steps it computes (Forge Neo's rule and its published
counts), what it forecasts (a line and a Chebyshev ridge fit of the computed outputs), and that in ComfyUI it runs
the model only at its computed steps."""

from __future__ import annotations

import math

import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

from tools.fidelity.spectrum import (
    Forecaster,
    SpectrumSettings,
    SpectrumWrapper,
    from_space,
    settings_computing,
    spectrum_patch,
    to_space,
)


def test_neos_defaults_compute_its_published_counts():
    """Six warm-up steps, then one in two, the last tenth in full: 14 of 20, 17 of 25, 30 of 50 computed."""
    neo = SpectrumSettings()
    assert [sum(neo.computed(steps)) for steps in (20, 25, 50)] == [14, 17, 30]
    plan = "".join("F" if c else "." for c in neo.computed(25))
    assert plan == "FFFFFF" + ".F" * 8 + "FFF"
    at_our_work = settings_computing(25, 12)
    assert sum(at_our_work.computed(25)) == 12 and at_our_work.window in (2, 3)


def test_the_forecast_is_the_line_and_the_fit_blended():
    """On outputs along a line: the line through the last two alone (blend 0) and a ridge-free fit of degree 1
    alone (blend 1) both forecast the line's value; Neo's blend of a degree 6 fit with ridge 0.5 lies between the
    line and the fit, which the ridge pulls toward zero."""

    def forecast(**settings) -> float:
        forecaster = Forecaster(SpectrumSettings(**settings), 25)
        for step in range(0, 12, 2):
            forecaster.add(step, torch.full((2, 3), 1.0 + 0.1 * step))
        out = forecaster.forecast(13, torch.float32)
        assert out.shape == (2, 3)
        return float(out[0, 0])

    assert abs(forecast(blend=0.0) - 2.3) < 1e-5
    assert abs(forecast(blend=1.0, degree=1, ridge=0.0) - 2.3) < 1e-4
    fit = forecast(blend=1.0)
    assert fit < forecast() < 2.3


def test_the_parabola_and_the_line_over_log_sigma_forecast_what_they_are_drawn_through():
    """``order=2`` on outputs along a parabola of the noise level forecasts its value (the line through the last two
    does not), moved ``reach`` of the way from the last output; with fewer than three kept it is the line.
    ``log_sigma`` on outputs along a line of log sigma forecasts that line's value."""

    def forecast(values, sigmas, at_sigma, **settings) -> float:
        forecaster = Forecaster(SpectrumSettings(blend=0.0, by_sigma=True, **settings), 25)
        for step, (value, sigma) in enumerate(zip(values, sigmas, strict=True)):
            forecaster.add(step, torch.full((2, 3), value), sigma)
        return float(forecaster.forecast(len(values), torch.float32, at_sigma)[0, 0])

    sigmas, here = [8.0, 5.0, 3.0], 1.5
    bent = [s * s for s in sigmas]
    assert abs(forecast(bent, sigmas, here, order=2) - here * here) < 1e-4
    line = 9.0 + (here - 3.0) * (9.0 - 25.0) / (3.0 - 5.0)
    assert abs(forecast(bent, sigmas, here) - line) < 1e-4 and abs(line - here * here) > 1.0
    assert abs(forecast(bent, sigmas, here, order=2, reach=0.5) - (9.0 + 0.5 * (here * here - 9.0))) < 1e-4
    assert abs(forecast(bent[1:], sigmas[1:], here, order=2) - line) < 1e-4
    logs = [2.0 * math.log(s) for s in sigmas]
    assert abs(forecast(logs, sigmas, here, log_sigma=True) - 2.0 * math.log(here)) < 1e-4


def test_the_error_share_returns_the_computed_output_moved_that_share_to_the_forecast():
    """``error_share``: a skipped step runs the model as well (every step calls it) and its output lies that share
    of the way from the computed output to the forecast; at 0 the run is the unpatched one, bit for bit."""
    model = host.tiny_model("sd15")
    plan = {"blend": 0.0, "window": 2, "warm_up": 2}
    calls = []
    handle = model.model.diffusion_model.register_forward_hook(lambda *_: calls.append(1))
    try:
        none = host.sample(spectrum_patch(SpectrumSettings(**plan, error_share=0.0))(model), steps=12, cfg=5.0)
        assert len(calls) == 12
        some = host.sample(spectrum_patch(SpectrumSettings(**plan, error_share=0.5))(model), steps=12, cfg=5.0)
        skipped = host.sample(spectrum_patch(SpectrumSettings(**plan))(model), steps=12, cfg=5.0)
    finally:
        handle.remove()
    plain = host.sample(model, steps=12, cfg=5.0)
    assert torch.equal(none, plain)
    assert not torch.equal(some, plain) and not torch.equal(some, skipped)


def test_the_velocity_variant_keeps_the_share_of_the_input_edms_c_skip_gives():
    """``space="v"``: the denoised image goes to EDM's preconditioned output and back exactly; a forecast of an
    unchanged velocity, at an input that moved by ``d``, moves the denoised image by c_skip * d
    (sigma_data^2 / (sigma^2 + sigma_data^2)): nearly none of it at high noise, most of it at low noise."""
    settings = SpectrumSettings(space="v", sigma_data=1.0)
    generator = torch.Generator().manual_seed(0)
    x, denoised, moved = (torch.randn(2, 4, 8, 8, generator=generator) for _ in range(3))
    for sigma in (14.6, 1.0, 0.03):
        v = to_space(denoised, x, sigma, settings)
        assert torch.allclose(from_space(v, x, sigma, settings), denoised, atol=1e-5)
        skip = 1.0 / (sigma * sigma + 1.0)
        shifted = from_space(v, x + moved, sigma, settings)
        assert torch.allclose(shifted - denoised, skip * moved, atol=1e-5)
    as_is = SpectrumSettings()
    assert to_space(denoised, x, 1.0, as_is) is denoised and from_space(denoised, x, 1.0, as_is) is denoised


def test_the_noise_variant_keeps_all_of_the_inputs_move():
    """``space="eps"``: the denoised image goes to the noise an SD UNet predicts ((x - denoised) / sigma) and back
    exactly; an unchanged noise forecast at an input that moved by ``d`` moves the denoised image by all of ``d``
    (the velocity's c_skip at an unbounded sigma_data)."""
    settings = SpectrumSettings(space="eps")
    generator = torch.Generator().manual_seed(0)
    x, denoised, moved = (torch.randn(2, 4, 8, 8, generator=generator) for _ in range(3))
    for sigma in (14.6, 1.0, 0.03):
        eps = to_space(denoised, x, sigma, settings)
        assert torch.allclose(x - sigma * eps, denoised, atol=1e-5)
        assert torch.allclose(from_space(eps, x, sigma, settings), denoised, atol=1e-4)
        assert torch.allclose(from_space(eps, x + moved, sigma, settings) - denoised, moved, atol=1e-4)


def test_eulers_corrector_puts_the_latent_back_on_the_full_runs_path():
    """``correct``: with a denoised image that moves along a line of the noise level and does not depend on the input
    (so the corrector's gain is 0), the line between two computed steps is exact for the skipped ones: after each
    computed step the latent Euler reaches is the full run's (float error), where three quarters of the extrapolated
    line leave it off the path; the steps that run the model are the plan's; none of the move is the line's run."""
    sigmas = [14.6 * (0.002 ** (i / 11)) for i in range(12)] + [0.0]
    generator = torch.Generator().manual_seed(0)
    start, slope = torch.randn(2, 4, 4, 4, generator=generator), torch.randn(2, 4, 4, 4, generator=generator)
    at = (0, 1, 4, 7, 10, 11)

    def run(settings):
        wrapper = SpectrumWrapper(settings) if settings else None
        x, seen, calls = torch.ones(2, 4, 4, 4) * sigmas[0], [], []

        def model(x, timestep, **_):
            calls.append(float(timestep.max()))
            return start + slope * float(timestep.max())

        for step, sigma in enumerate(sigmas[:-1]):
            seen.append(x)
            options = {"transformer_options": {"sample_sigmas": sigmas}}
            args = {"input": x, "timestep": torch.tensor([sigma]), "c": options}
            denoised = wrapper(model, args) if wrapper else model(x, args["timestep"])
            x = x + (x - denoised) / sigma * (sigmas[step + 1] - sigma)
        return seen, len(calls)

    full, _ = run(None)
    line = {"at": at, "blend": 0.0, "reach": 0.75, "by_sigma": True}
    corrected, calls = run(SpectrumSettings(**line, correct=True, correct_gain=0.0))
    plain, _ = run(SpectrumSettings(**line))
    none_of_it, _ = run(SpectrumSettings(**line, correct=True, correct_gain=0.0, correct_share=0.0))
    assert calls == len(at)
    assert all(torch.equal(a, b) for a, b in zip(none_of_it, plain, strict=True))  # a share of 0: the line's run
    for step in (5, 8, 11):  # the steps after the computed 4, 7 and 10, each at the end of a gap
        assert torch.allclose(corrected[step], full[step], rtol=1e-4, atol=1e-5)
        assert not torch.allclose(plain[step], full[step], rtol=1e-2)


def test_in_comfyui_it_runs_the_model_only_at_its_computed_steps():
    model = host.tiny_model("sd15")
    settings = SpectrumSettings()
    patched = spectrum_patch(settings)(model)
    calls = []
    handle = model.model.diffusion_model.register_forward_hook(lambda *_: calls.append(1))
    try:
        out = host.sample(patched, steps=12, cfg=5.0)
        plain = host.sample(model, steps=12, cfg=5.0)
    finally:
        handle.remove()
    # cond and uncond batched in one call: one model call per computed step, then 12 for the unpatched run.
    assert sum(settings.computed(12)) < 12 and len(calls) == sum(settings.computed(12)) + 12
    assert out.shape == plain.shape and torch.isfinite(out).all() and not torch.equal(out, plain)


def test_in_forge_neo_it_plans_for_the_jobs_own_step_count():
    """Neo's sampler hands the pass's sigmas over as ``sampling_sigmas`` (ComfyUI's: ``sample_sigmas``): at 12 steps
    Neo's defaults compute 10 (six warm-up steps, 7 and 9, the last two), not the first 12 of a 25-step plan (9)."""
    from hosts import neo_host, webui_host

    from tools.fidelity.spectrum import SpectrumWrapper

    model = neo_host.neo_model("flux", depth=1, depth_single_blocks=1)
    wrapper = SpectrumWrapper(SpectrumSettings())
    clone = model.clone()
    clone.set_model_unet_function_wrapper(wrapper)
    p = neo_host.processing(clone, webui_host.script_args(enabled=False), steps=12)
    neo_host.process_images(webui_host.Host(), p, "flux", shape=(1, 8, 8))
    assert sum(SpectrumSettings().computed(12)) == 10 and sum(SpectrumSettings().computed(25)[:12]) == 9
    assert (wrapper.calls, wrapper.computed_calls) == (12, 10)


def _count_calls(model):
    """(calls, batch entries) of the UNet's forward, as a list the hook appends to."""
    seen = []
    handle = model.model.diffusion_model.register_forward_hook(lambda _m, args, _o: seen.append(int(args[0].shape[0])))
    return seen, handle


def test_a_named_plan_computes_exactly_its_steps():
    at = (0, 1, 3, 6, 9, 12, 15, 18, 22, 23, 24)
    settings = SpectrumSettings(at=at, blend=0.0, reach=0.75, by_sigma=True)
    assert [step for step, c in enumerate(settings.computed(25)) if c] == list(at)
    assert settings.label(25).startswith("11 of 25: 0 1 3")
    model = host.tiny_model("sd15")
    seen, handle = _count_calls(model)
    try:
        host.sample(spectrum_patch(settings)(model), steps=25, cfg=5.0)
    finally:
        handle.remove()
    assert len(seen) == 11  # cond and uncond batched: one call per computed step
