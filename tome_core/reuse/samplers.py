"""Which samplers and noise schedules reuse across steps may run with, measured (docs/step-reuse.md, docs/dit.md).

With the others every step runs in full; the token reduction still applies.
"""

from __future__ import annotations

import torch

from .plans import WHOLE_STEP_PLANS

# Samplers with which reuse across steps keeps the picture (docs/step-reuse.md, "The default"). Euler ancestral's
# fresh noise and DPM++ 2M's multistep update carry a predicted step's error on, so they and unmeasured samplers run
# every step in full. Names are the hosts' own, lower case: ComfyUI's sampler names, the WebUI's labels, diffusers'
# scheduler classes.
SAMPLERS_THAT_KEEP_THE_PICTURE = frozenset(
    {
        *("euler", "heun", "ddim", "dpmpp_sde"),  # ComfyUI
        *("dpm++ sde",),  # the WebUI's labels not already above ("Euler", "Heun", "DDIM")
        *("eulerdiscretescheduler", "heundiscretescheduler", "ddimscheduler", "dpmsolversdescheduler"),  # diffusers
        "flowmatcheulerdiscretescheduler",  # diffusers, flow models (Flux, SD3, Wan): Euler on their sigmas
    }
)


# Noise schedules with which reuse across steps loses the picture whatever the sampler (Karras sigmas spread the
# steps otherwise than the plans were measured on; docs/step-reuse.md). Reuse stands down there.
SCHEDULES_THAT_LOSE_THE_PICTURE = frozenset({"karras"})
KARRAS_RHO = 7.0  # the exponent of Karras et al.'s noise schedule, as every host uses it


# On DiTs only: UniPC, Wan's usual sampler, kept the DiT references' picture (docs/dit-measurements.md);
# uni_pc_bh2 is not measured.
DIT_SAMPLERS_THAT_KEEP_THE_PICTURE = frozenset({"unipcmultistepscheduler", "uni_pc", "unipc"})  # "UniPC": WebUI

# UniPC's corrector multiplies a predicted output's error where the details form: with it, the calls below this
# noise level (the flow sigma, 0 to 1) run in full (docs/dit.md).
SAMPLERS_WITH_A_CORRECTOR = frozenset({"unipcmultistepscheduler", "uni_pc", "unipc"})
FULL_BELOW_NOISE_WITH_A_CORRECTOR = 0.5


# On UNets only: DPM++ 2M (the WebUI's default sampler) on Karras sigmas (its default schedule there). Its two-step
# update carries a reused call's error into the next step, most where the details form; with every call below this
# sigma in full, on the general plan (``RunLengthSchedule.for_run``), it kept the picture (docs/step-reuse.md, "DPM++
# 2M on Karras sigmas"). Only ``reuse_plan`` "auto" (the measured setting; the forecasts too, with the samplers they
# do not forecast) runs it: a job saved with "every N", or
# before that input existed, ran every step in full with this sampler and keeps its picture. diffusers' name stands
# for DPMSolverMultistepScheduler as DPM++ 2M (the host checks its algorithm and order).
UNET_SAMPLERS_WITH_LOW_NOISE_IN_FULL = frozenset({"dpmpp_2m", "dpm++ 2m", "dpmsolvermultistepscheduler"})
LOW_NOISE_SCHEDULE = "karras"
FULL_BELOW_SIGMA_WITH_DPMPP_2M = 1.0
LOW_NOISE_PLAN = "auto"
LOW_NOISE_PLANS = frozenset({LOW_NOISE_PLAN, *WHOLE_STEP_PLANS})


def _lower(name: str | None) -> str:
    return (name or "").strip().lower()


def _low_noise_in_full(sampler: str | None, schedule: str | None, dit: bool, plan: str) -> bool:
    on_its_schedule = _lower(schedule) == LOW_NOISE_SCHEDULE
    measured = plan in LOW_NOISE_PLANS and not dit
    return measured and on_its_schedule and _lower(sampler) in UNET_SAMPLERS_WITH_LOW_NOISE_IN_FULL


def full_below_noise(
    sampler: str | None, schedule: str | None = None, dit: bool = True, plan: str = LOW_NOISE_PLAN
) -> float:
    """The noise level below which every call of a run with ``sampler`` on ``schedule`` runs in full, on a DiT
    (``dit``: a flow sigma, 0 to 1) or a UNet (a sigma of its table) under ``reuse_plan`` ``plan``; 0: none."""
    if dit and _lower(sampler) in SAMPLERS_WITH_A_CORRECTOR:
        return FULL_BELOW_NOISE_WITH_A_CORRECTOR
    return FULL_BELOW_SIGMA_WITH_DPMPP_2M if _low_noise_in_full(sampler, schedule, dit, plan) else 0.0


def keeps_the_picture_with(
    sampler: str | None, schedule: str | None = None, dit: bool = False, plan: str = LOW_NOISE_PLAN
) -> bool:
    """Whether reuse across steps may run with ``sampler`` (a host's name for it) on the noise schedule
    ``schedule`` (a host's name, e.g. "karras"; None: the host's default), on a UNet or (``dit``) a DiT, under
    ``reuse_plan`` ``plan`` (UNets; "every N" keeps DPM++ 2M on Karras sigmas in full); unknown sampler: no, in
    full. Where it may only with the low-noise calls in full, ``full_below_noise`` says so."""
    if _low_noise_in_full(sampler, schedule, dit, plan):
        return True
    if _lower(schedule) in SCHEDULES_THAT_LOSE_THE_PICTURE:
        return False
    name = _lower(sampler)
    return bool(name) and (
        name in SAMPLERS_THAT_KEEP_THE_PICTURE or (dit and name in DIT_SAMPLERS_THAT_KEEP_THE_PICTURE)
    )


def is_karras(sigmas: torch.Tensor, sigma_min: float, sigma_max: float) -> bool:
    """Whether ``sigmas`` (a run's noise levels, the final 0 included or not) are Karras sigmas between
    ``sigma_min`` and ``sigma_max``: for a host that hands over the levels but not the schedule's name."""
    levels = sigmas.detach().double().cpu().flatten()
    if levels.numel() and levels[-1] == 0:
        levels = levels[:-1]
    if levels.numel() < 3 or sigma_min <= 0 or sigma_max <= sigma_min:
        return False
    ramp = torch.linspace(0.0, 1.0, levels.numel(), dtype=torch.float64)
    low, high = sigma_min ** (1 / KARRAS_RHO), sigma_max ** (1 / KARRAS_RHO)
    karras = (high + ramp * (low - high)) ** KARRAS_RHO
    return bool(torch.allclose(levels, karras, rtol=1e-3, atol=0.0))


# The forecasts of ``reuse_plan`` (``plans.WHOLE_STEP_PLANS``): the samplers their whole-step forecast was measured
# with, by the plan they take. DDIM without its noise is Euler's step on other axes (and ComfyUI's "ddim" runs Euler).
# The others (Euler ancestral, the SDE samplers, Heun, UniPC, ...) keep "auto"'s plan (docs/step-reuse.md).
WHOLE_STEP_EULER = frozenset({"euler", "ddim", "eulerdiscretescheduler", "ddimscheduler"})


def whole_step_kind(sampler: str | None, schedule: str | None = None) -> str | None:
    """Which of ``plans.WHOLE_STEP_PLANS`` a UNet run with ``sampler`` on ``schedule`` (hosts' names) takes under
    the forecasts of ``reuse_plan``: "euler", "dpmpp_2m_karras", or None (it keeps "auto"'s plan)."""
    name, karras = _lower(sampler), _lower(schedule) == LOW_NOISE_SCHEDULE
    if name in UNET_SAMPLERS_WITH_LOW_NOISE_IN_FULL and karras:
        return "dpmpp_2m_karras"
    if name in WHOLE_STEP_EULER and not karras:
        return "euler"
    return None
