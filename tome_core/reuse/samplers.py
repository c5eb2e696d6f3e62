"""Which samplers and noise schedules reuse across steps may run with, measured (docs/step-reuse.md, docs/dit.md).

With the others every step runs in full; the token reduction still applies.
"""

from __future__ import annotations

import torch

# Samplers with which reuse across steps keeps the picture, measured on both reference models at 25 steps
# (docs/step-reuse.md, "The default"). With the others every step runs in full (the token reduction still
# applies): Euler ancestral adds fresh noise at every step, which changes the inner layers' input by more than a
# line through earlier steps follows, and DPM++ 2M builds each step on the last ones, so a predicted step's error
# carries on (ref-sdxl SSIM 0.906 and 0.916 with reuse every 3, against 0.973 with Euler and 0.980 with DPM++
# SDE). Unmeasured samplers run in full too. Names are the hosts' own, lower case: ComfyUI's sampler names, the
# WebUI's labels, diffusers' scheduler classes.
SAMPLERS_THAT_KEEP_THE_PICTURE = frozenset(
    {
        *("euler", "heun", "ddim", "dpmpp_sde"),  # ComfyUI
        *("dpm++ sde",),  # the WebUI's labels not already above ("Euler", "Heun", "DDIM")
        *("eulerdiscretescheduler", "heundiscretescheduler", "ddimscheduler", "dpmsolversdescheduler"),  # diffusers
        "flowmatcheulerdiscretescheduler",  # diffusers, flow models (Flux, SD3, Wan): Euler on their sigmas
    }
)


# Noise schedules with which reuse across steps loses the picture whatever the sampler: Karras sigmas (Euler on
# them: ref-sdxl SSIM 0.946, lowest image 0.860, at 25 steps with reuse every 3; docs/step-reuse.md). Their steps
# are spread otherwise than the ones the schedule's full start and end were measured on. Reuse stands down there.
SCHEDULES_THAT_LOSE_THE_PICTURE = frozenset({"karras"})
KARRAS_RHO = 7.0  # the exponent of Karras et al.'s noise schedule, as every host uses it


# Measured on DiTs only (on UNets the multistep DPM++ 2M lost the picture): UniPC, Wan's usual sampler, keeps
# ref-flux-deep's picture at 28 steps: diffusers' UniPCMultistepScheduler SSIM 0.996 / 0.993 / 0.975 at reuse
# every 3 / 4 / 6 (lowest 0.988 / 0.982 / 0.897), ComfyUI's uni_pc 0.995 / 0.982 at every 4 / 6 (lowest 0.986 /
# 0.951; docs/dit.md). ComfyUI's uni_pc_bh2 is not measured.
DIT_SAMPLERS_THAT_KEEP_THE_PICTURE = frozenset({"unipcmultistepscheduler", "uni_pc"})

# UniPC corrects each step with the model's output at the next one (its corrector, UniC), which multiplies a
# predicted output's error where the picture's details form. On ref-wan (diffusers' UniPC, flow shift 3 as Wan
# 2.1 at 480p, 30 steps) reusing the steps at noise 0.635 and 0.563 cost nothing (SSIM 0.9997), the steps at
# 0.478 and 0.376 cost 0.952 (lowest 0.78), and 0.987 with the corrector off; with ComfyUI's shift 8 those noise
# levels fall in the last four steps, which are full anyway. So with UniPC the calls below this noise level (the
# flow sigma, 0 to 1) run in full (docs/dit.md).
SAMPLERS_WITH_A_CORRECTOR = frozenset({"unipcmultistepscheduler", "uni_pc"})
FULL_BELOW_NOISE_WITH_A_CORRECTOR = 0.5


def full_below_noise(sampler: str | None) -> float:
    """The noise level below which every call of a run with ``sampler`` runs in full (0: none)."""
    return FULL_BELOW_NOISE_WITH_A_CORRECTOR if (sampler or "").lower() in SAMPLERS_WITH_A_CORRECTOR else 0.0


def keeps_the_picture_with(sampler: str | None, schedule: str | None = None, dit: bool = False) -> bool:
    """Whether reuse across steps may run with ``sampler`` (a host's name for it) on the noise schedule
    ``schedule`` (a host's name, e.g. "karras"; None: the host's default), on a UNet or (``dit``) a DiT; unknown
    sampler: no, in full."""
    if schedule and schedule.strip().lower() in SCHEDULES_THAT_LOSE_THE_PICTURE:
        return False
    name = (sampler or "").strip().lower()
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
