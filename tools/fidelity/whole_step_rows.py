"""A skipped step that runs nothing (issue #60; measured, ``--variants``): the whole output along a line or a
curve through the computed steps, on plans of Spectrum's kind and plans named step by step, with full, reusing and
skipped steps in one run, and plans decided per image."""

from __future__ import annotations

import math

from tools.fidelity.row import FidelityRow
from tools.fidelity.unet_rows import layer_reuse_variant


def forecast_row(name: str, settings) -> FidelityRow:
    """The lab's whole-step forecast with ``settings`` (``spectrum.SpectrumSettings``) as one of our rows."""
    from tools.fidelity import spectrum

    return FidelityRow(name, "ours", spectrum.spectrum_patch(settings), settings=vars(settings))


def whole_step_rows(steps: int) -> list[FidelityRow]:
    """A skipped step that runs nothing (issue #60): the whole output forecast along the line through the last two
    computed steps alone (no Chebyshev fit), over the step (Spectrum's line) or over the noise level (ours), moved
    all the way or three quarters of it; computed: the first 2, 3 or 4 steps, one in three after, the last tenth
    (11, 12, 13 of 25), Spectrum's plan of about three quarters of the steps (DPM++ 2M's low-noise share) and
    Neo's own (17 of 25)."""
    from tools.fidelity import spectrum

    plans = [spectrum.SpectrumSettings(window=3, warm_up=warm_up) for warm_up in (2, 3, 4)]
    plans.append(spectrum.settings_computing(steps, round(0.56 * steps)))  # DPM++ 2M's 1.7x target (14 of 25)
    plans.append(spectrum.settings_computing(steps, math.ceil(0.64 * steps)))  # the stochastic samplers' 1.5x
    plans.append(spectrum.settings_computing(steps, math.ceil(0.76 * steps)))
    plans.append(spectrum.SpectrumSettings())  # Neo's own plan (17 of 25)
    rows = []
    for plan in plans:
        for reach in (1.0, 0.75):
            for by_sigma in (False, True):
                settings = spectrum.SpectrumSettings(
                    blend=0.0, window=plan.window, warm_up=plan.warm_up, reach=reach, by_sigma=by_sigma
                )
                over = " over sigma" if by_sigma else ""
                name = f"whole-step line {reach}{over} ({settings.label(steps)} computed)"
                rows.append(forecast_row(name, settings))
            # The velocity forecast in place of the denoised image (``spectrum.SpectrumSettings.space``).
            for sigma_data in (1.0, 0.5):
                settings = spectrum.SpectrumSettings(
                    blend=0.0,
                    window=plan.window,
                    warm_up=plan.warm_up,
                    reach=reach,
                    by_sigma=True,
                    space="v",
                    sigma_data=sigma_data,
                )
                name = f"whole-step line {reach} over sigma in v {sigma_data} ({settings.label(steps)} computed)"
                rows.append(forecast_row(name, settings))
            # The predicted noise (an SD UNet's own output) in place of either.
            settings = spectrum.SpectrumSettings(
                blend=0.0, window=plan.window, warm_up=plan.warm_up, reach=reach, by_sigma=True, space="eps"
            )
            name = f"whole-step line {reach} over sigma in eps ({settings.label(steps)} computed)"
            rows.append(forecast_row(name, settings))
    return rows + whole_step_plan_rows(steps)


# Issue #60: the default's 13 of 25 computed steps (Euler), and each of them dropped in turn (12 of 25): what
# each computed step is worth, for the plans of 11 of 25 (2.27x).
THIRTEEN_OF_25 = (0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 22, 23, 24)


DROPPED_ONE = tuple(tuple(s for s in THIRTEEN_OF_25 if s != dropped) for dropped in THIRTEEN_OF_25[2:])


# 11 of 25: two of the 13 dropped, the pairs whose single drops cost least on `ref-sd1` and `ref-sdxl`.
DROPPED_TWO = tuple(
    tuple(s for s in THIRTEEN_OF_25 if s not in pair) for pair in ((2, 15), (2, 21), (2, 9), (15, 21), (9, 15), (2, 18))
)


# The same for DPM++ 2M on Karras sigmas: its 19 of 25 (the first ten, one in two, the last three), for 14 (1.79x).
NINETEEN_OF_25 = (*range(10), 11, 13, 15, 17, 19, 21, 22, 23, 24)


DROPPED_ONE_OF_19 = tuple(tuple(s for s in NINETEEN_OF_25 if s != dropped) for dropped in NINETEEN_OF_25[2:])


# 14 of 25 with DPM++ 2M on Karras sigmas: the ten first steps' single drops cost least on `ref-sdxl`.
FOURTEEN_OF_25 = (
    (0, 1, 4, 7, 9, 11, 13, 15, 17, 19, 21, 22, 23, 24),
    (0, 1, 3, 6, 9, 11, 13, 15, 17, 19, 21, 22, 23, 24),
    (0, 1, 2, 5, 9, 11, 13, 15, 17, 19, 21, 22, 23, 24),
    (0, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 22, 23, 24),
    (0, 1, 5, 8, 9, 11, 13, 15, 17, 19, 21, 22, 23, 24),
    # Steps 15, 17, 23 and 24 each cost nothing alone on `ref-sdxl`: left out with some of the first ten.
    (0, 1, 2, 3, 4, 6, 7, 8, 9, 11, 13, 19, 21, 22),
    (0, 1, 2, 3, 4, 6, 8, 9, 11, 13, 19, 21, 22, 24),
    (0, 1, 3, 4, 6, 8, 9, 11, 13, 15, 19, 21, 22, 24),
)


# 16 of 25 with DPM++ 2M on Karras sigmas: "forecast v2"'s (the first 4, one in 2, the last 3), then other warm-ups
# and tails of the same count, and two that keep steps 11-13 and 19-22 (the dearest single drops of the 19).
SIXTEEN_OF_25 = (
    (0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 22, 23, 24),
    (0, 1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 23, 24),
    (0, 1, 2, 3, 4, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 24),
    (0, 1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 21, 22, 23, 24),
    (0, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 20, 21, 22, 23, 24),
    (0, 1, 2, 3, 5, 7, 9, 11, 12, 13, 15, 17, 19, 20, 21, 22),
    (0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 20, 21, 22, 24),
)
# Fewer with the last six or seven in full (the shape that kept the most at 16 of 25): 13, 14 and 15 of 25.
LONG_TAIL_OF_25 = (
    (0, 1, 4, 7, 10, 13, 16, 19, 20, 21, 22, 23, 24),
    (0, 1, 3, 6, 9, 12, 15, 18, 19, 20, 21, 22, 23, 24),
    (0, 1, 3, 5, 7, 10, 13, 16, 19, 20, 21, 22, 23, 24),
    (0, 1, 2, 4, 7, 10, 13, 16, 19, 20, 21, 22, 23, 24),
    (0, 1, 3, 5, 7, 9, 11, 14, 17, 19, 20, 21, 22, 23, 24),
)


# Euler's corrector (``spectrum.SpectrumSettings.correct``): the default's 13 and the two best 11 of 25; then plans
# with one long gap, corrected after it alone.
CORRECTED = (THIRTEEN_OF_25, *DROPPED_TWO[:2])
LONG_GAP = (
    (0, 1, 2, 3, 6, 9, 12, 18, 21, 22, 23, 24),
    (0, 1, 3, 6, 12, 18, 21, 22, 23, 24),
    (0, 1, 3, 6, 9, 12, 18, 22, 23, 24),
    (0, 1, 3, 6, 9, 14, 19, 22, 23, 24),
)


NAMED_PLANS = (
    THIRTEEN_OF_25,
    *DROPPED_ONE,
    *DROPPED_TWO,
    NINETEEN_OF_25,
    *DROPPED_ONE_OF_19,
    *FOURTEEN_OF_25,
    *SIXTEEN_OF_25,
    *LONG_TAIL_OF_25,
    *LONG_GAP[1:],  # the first is one of DROPPED_ONE
)


# The computed steps and, of them, those that run the prompt's half alone (``guidance``).
GUIDANCE_PLANS = (
    (THIRTEEN_OF_25, (3, 9, 15, 21)),
    (THIRTEEN_OF_25, (21, 22, 23, 24)),
    (THIRTEEN_OF_25, (9, 12, 15, 18)),
    (tuple(range(25)), tuple(s for s in range(25) if s not in (0, 1, 2, 4, 7, 11, 16, 21))),
)


# Full steps and reusing steps (the outer layers only) of 25; the others run nothing (``hybrid``).
HYBRIDS = (
    ((0, 1, 3, 6, 12, 18, 21, 22, 23, 24), (2, 9, 15)),
    ((0, 1, 2, 3, 6, 12, 18, 21, 22, 23, 24), (9, 15)),
    ((0, 1, 3, 6, 12, 18, 22, 23, 24), (2, 9, 15, 21)),
    ((0, 1, 3, 6, 12, 18, 21, 22, 23, 24), (2, 4, 5, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 19, 20)),
)


def whole_step_plan_rows(steps: int) -> list[FidelityRow]:
    """The whole step along ours' line (three quarters, over the noise level) on plans named step by step (25
    steps), with full, reusing and skipped steps in one run (``hybrid``), and on plans decided per image
    (``adaptive``)."""
    from tools.fidelity import adaptive, guidance, hybrid, spectrum

    line = {"blend": 0.0, "reach": 0.75, "by_sigma": True}
    rows = []
    for at in NAMED_PLANS if steps == 25 else ():
        settings = spectrum.SpectrumSettings(at=at, **line)
        name = f"whole-step plan ({settings.label(steps)})"
        rows.append(forecast_row(name, settings))
    # The two 11-of-25 plans that kept the most on both first references, forecasting the velocity or the noise.
    # And 16 of 25 (the stochastic samplers' 1.5x), "forecast v2"'s DPM++ 2M plan and those with the last six in full.
    for at in DROPPED_TWO[:1] + DROPPED_TWO[2:3] + SIXTEEN_OF_25[:1] + SIXTEEN_OF_25[4:5] if steps == 25 else ():
        for space in ("v", "eps"):
            settings = spectrum.SpectrumSettings(at=at, space=space, **line)
            name = f"whole-step plan ({settings.label(steps)}) in {space}"
            rows.append(forecast_row(name, settings))
    # Other curves through the computed steps (the best 11 of 25 by each first reference, the default's 13 and
    # DPM++ 2M's best 14): the line over log sigma, the parabola through the last three.
    curves = {
        "line over log sigma": ({"log_sigma": True}, (0.5, 0.75, 1.0)),
        "parabola": ({"order": 2}, (0.5, 0.65, 0.75, 0.85, 1.0)),
        "parabola over log sigma": ({"order": 2, "log_sigma": True}, (0.5, 0.75, 1.0)),
        "parabola in eps": ({"order": 2, "space": "eps"}, (0.65, 0.75, 0.85)),
    }
    for at in (THIRTEEN_OF_25, *DROPPED_TWO[:2], FOURTEEN_OF_25[1]) if steps == 25 else ():
        for curve, (shape, reaches) in curves.items():
            for reach in reaches:
                settings = spectrum.SpectrumSettings(at=at, **{**line, "reach": reach, **shape})
                name = f"whole-step plan ({settings.label(steps)}) {curve} {reach}"
                rows.append(forecast_row(name, settings))
    # Euler's corrector: the skipped steps redrawn between the computed steps around them, the latent moved to match.
    for at in CORRECTED if steps == 25 else ():
        for above in (0.0, 0.5, 1.0):
            settings = spectrum.SpectrumSettings(at=at, **line, correct=True, correct_above=above)
            name = f"whole-step plan ({settings.label(steps)}) corrected above {above}"
            rows.append(forecast_row(name, settings))
    # Each computed step after a gap corrected alone (the default's 13 and the best 11 of 25).
    for at in CORRECTED[:2] if steps == 25 else ():
        for step in [s for s in at if s > 0 and s - 1 not in at]:
            settings = spectrum.SpectrumSettings(at=at, **line, correct=True, correct_at=(step,))
            name = f"whole-step plan ({settings.label(steps)}) corrected at {step}"
            rows.append(forecast_row(name, settings))
    # A share of the latent's move taken (above noise level 0.5, and at every computed step).
    for at in CORRECTED[:2] if steps == 25 else ():
        for share, above in ((0.25, 0.5), (0.5, 0.5), (0.5, 0.0)):
            settings = spectrum.SpectrumSettings(at=at, **line, correct=True, correct_share=share, correct_above=above)
            name = f"whole-step plan ({settings.label(steps)}) corrected above {above} share {share}"
            rows.append(forecast_row(name, settings))
    # Corrected only after three skipped steps in a row or more, above noise level 0.5.
    for at in (CORRECTED[1], *LONG_GAP) if steps == 25 else ():
        settings = spectrum.SpectrumSettings(at=at, **line, correct=True, correct_after=3, correct_above=0.5)
        name = f"whole-step plan ({settings.label(steps)}) corrected after 3 above 0.5"
        rows.append(forecast_row(name, settings))
    # How a sampler carries a skipped step's error on: the forecast's error scaled down (the model runs at every step).
    for plan in (spectrum.settings_computing(steps, math.ceil(0.76 * steps)),):
        for share in (0.03, 0.1, 0.3):
            settings = spectrum.SpectrumSettings(window=plan.window, warm_up=plan.warm_up, **line, error_share=share)
            name = f"whole-step line 0.75 over sigma ({settings.label(steps)} computed) error share {share}"
            rows.append(forecast_row(name, settings))
    # The prompt's half alone at some computed steps, the unconditional output from the guidance's line (``guidance``):
    # four of the default's 13 (11 of 25 in calls), and with Euler a every step's prompt half, both halves at eight.
    for at, cond_only in GUIDANCE_PLANS if steps == 25 else ():
        for guidance_reach in (0.0, 0.75):
            settings = guidance.GuidanceSettings(at, cond_only, guidance_reach=guidance_reach)
            name = f"guidance forecast ({settings.label(steps)}) reach {guidance_reach}"
            rows.append(FidelityRow(name, "ours", guidance.guidance_patch(settings), settings=vars(settings)))
    for full, reused in HYBRIDS if steps == 25 else ():
        for layer_reach in (0.5, 0.75):
            schedule = {"kind": "named", "full": full, "extrapolate": layer_reach}
            patch = hybrid.hybrid_patch(
                layer_reuse_variant(3, **schedule), tuple(s for s in range(25) if s not in full + reused)
            )
            name = f"hybrid full {' '.join(map(str, full))} reuse {' '.join(map(str, reused))} (reach {layer_reach})"
            rows.append(FidelityRow(name, "ours", patch, settings={"full": full, "reused": reused}))
    for tail in (1, 3):
        for tolerance in (0.1, 0.2, 0.3):
            settings = adaptive.AdaptiveSettings(budget=11, warm_up=4, tail=tail, tolerance=tolerance)
            name = f"whole-step per image ({settings.label(steps)})"
            rows.append(FidelityRow(name, "ours", adaptive.adaptive_patch(settings), settings=vars(settings)))
    return rows
