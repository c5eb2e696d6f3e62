"""The measured defaults of reuse across steps that hold for every model: what the hosts run unless told otherwise.

Each constant is chosen by measurement on the reference models; the figures are in docs/step-reuse.md (UNets) and
docs/dit.md (DiTs). What differs per DiT family lives in the family registry (``hosts.shared.dit_families``).
"""

from __future__ import annotations

from .schedules import IntervalSchedule, RunLengthSchedule

# How far along the line through the last two full steps the prediction moves (1: all the way). Half way, over the
# noise levels, kept the picture best on both UNet references (docs/step-reuse.md).
DEFAULT_EXTRAPOLATE = 0.5
OUTER_BLOCKS = 1  # the first input block and the last output block run at every step of a UNet
# A DiT's blocks that run at every call: (at the start, at the end). The first block makes the span's input; running
# the last one too kept no more of the picture and costs a block per reusing call (docs/dit.md).
DIT_OUTER_BLOCKS = (1, 0)

# ``reuse_interval`` 3 (the default) on a UNet, in a run of ``UNET_LONG_RUN`` steps or more: 12 full steps of 25
# instead of 14, planned per family on its reference model, as (full_start, full_end, extrapolate), keyed by
# whether the UNet has attention at full resolution (SD1.x, SD2.x) or not (SDXL) (docs/step-reuse.md, "The
# default"). Shorter runs and the other intervals keep ``IntervalSchedule``'s defaults.
UNET_LONG_RUN = 25
UNET_LONG_RUN_PLANS = {True: (0.12, 3, 0.75), False: (0.08, 4, 0.5)}
UNET_PLANNED_INTERVAL = 3


def unet_schedule(interval: int, attention_levels, plan: str = "auto") -> IntervalSchedule | RunLengthSchedule:
    """The schedule of ``reuse_interval`` ``interval`` on a UNet whose attention is at ``attention_levels`` (1, 2,
    4, ...: downsampling factors; None where unknown): with ``reuse_plan`` (``plan``) "auto" (and the forecasts, for
    the samplers they do not forecast), ``UNET_LONG_RUN_PLANS`` at the planned interval, else (and with "every N")
    ``IntervalSchedule``'s defaults."""
    general = IntervalSchedule(interval)
    if (plan != "auto" and plan not in WHOLE_STEP_PLANS) or interval != UNET_PLANNED_INTERVAL or not attention_levels:
        return general
    full_start, full_end, extrapolate = UNET_LONG_RUN_PLANS[1 in attention_levels]
    long = IntervalSchedule(interval, full_start=full_start, full_end=full_end, extrapolate=extrapolate)
    return RunLengthSchedule(general, long, UNET_LONG_RUN)


# ``reuse_plan`` "forecast v2" and "forecast" on a UNet: a skipped step runs no layer, and the whole call's output
# (the denoised image) follows the line through the last two computed steps over the noise level (``whole_step``).
# Planned per sampler, as (full_start, full_end, the most steps in a row that run nothing plus one), on the four UNet
# references (docs/step-reuse.md, "A skipped step that runs nothing"): Euler (and DDIM, Euler on other axes) the
# first 4 steps of 25, one in ``reuse_interval`` after, the last 3; DPM++ 2M on Karras sigmas, whose two-step update
# carries a forecast's error on, one in 2 after the first 10 ("forecast", the plan before: a job saved with it keeps
# its picture) or, from ``UNET_LONG_RUN`` steps on, after the first 4 ("forecast v2": 16 of 25; at 20 steps that
# spacing lost the picture, so shorter runs keep "forecast"'s). Each plan: {from this many steps on: plan}.
# Other samplers keep "auto"'s plan.
WHOLE_STEP_PLAN = "forecast v2"  # the default
WHOLE_STEP_REACH = 0.75  # how far along the line the forecast moves: three quarters kept the most on all four
_EULER, _DPMPP_2M_FIRST_10, _DPMPP_2M_FIRST_4 = (0.15, 3, None), (0.39, 3, 2), (0.15, 3, 2)
WHOLE_STEP_PLANS = {
    WHOLE_STEP_PLAN: {
        "euler": {0: _EULER},
        "dpmpp_2m_karras": {0: _DPMPP_2M_FIRST_10, UNET_LONG_RUN: _DPMPP_2M_FIRST_4},
    },
    "forecast": {"euler": {0: _EULER}, "dpmpp_2m_karras": {0: _DPMPP_2M_FIRST_10}},
}


def whole_step_schedule(
    interval: int, kind: str | None, plan: str = WHOLE_STEP_PLAN
) -> IntervalSchedule | RunLengthSchedule | None:
    """The schedule of ``reuse_plan`` ``plan`` (one of ``WHOLE_STEP_PLANS``) at ``reuse_interval`` ``interval``
    with a sampler of ``kind`` (``samplers.whole_step_kind``), or None where that sampler keeps "auto"'s plan."""
    if kind is None or interval <= 1:
        return None

    def schedule(full_start: float, full_end: int, most: int | None) -> IntervalSchedule:
        spacing = interval if most is None else min(interval, most)
        return IntervalSchedule(spacing, full_start=full_start, full_end=full_end, extrapolate=WHOLE_STEP_REACH)

    by_length = WHOLE_STEP_PLANS[plan][kind]
    short = schedule(*by_length[0])
    long_run = max(by_length)
    return short if long_run == 0 else RunLengthSchedule(short, schedule(*by_length[long_run]), long_run)
