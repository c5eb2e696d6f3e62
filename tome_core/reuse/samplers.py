"""Which sampler a host's name stands for, and whether a run's noise levels are Karras sigmas.

The plans' rules (``plans.REUSE_PLANS``) are keyed by the kinds named here, never by a host's own name.
"""

from __future__ import annotations

import torch

# A host's name for a sampler (lower case: ComfyUI's names, the WebUI's labels, diffusers' scheduler classes) -> its
# kind. ComfyUI's "ddim" runs Euler, and DDIM without noise is Euler's step on other axes.
SAMPLER_KINDS = {
    **dict.fromkeys(("euler", "ddim", "eulerdiscretescheduler", "ddimscheduler"), "euler"),
    **dict.fromkeys(("heun", "heundiscretescheduler"), "heun"),
    **dict.fromkeys(("dpmpp_sde", "dpm++ sde", "dpmsolversdescheduler"), "dpmpp_sde"),
    # diffusers' DPMSolverMultistepScheduler counts only as DPM-Solver++ of order 2 (its host door checks).
    **dict.fromkeys(("dpmpp_2m", "dpm++ 2m", "dpmsolvermultistepscheduler"), "dpmpp_2m"),
    "flowmatcheulerdiscretescheduler": "flow_euler",
    **dict.fromkeys(("uni_pc", "unipc", "unipcmultistepscheduler"), "unipc"),
}
KARRAS = "karras"
KARRAS_RHO = 7.0  # the exponent of Karras et al.'s noise schedule, as every host uses it


def _lower(name: str | None) -> str:
    return (name or "").strip().lower()


def sampler_kind(sampler: str | None) -> str | None:
    """The kind of the sampler a host calls ``sampler``; None for one no plan knows."""
    return SAMPLER_KINDS.get(_lower(sampler))


def on_karras(schedule: str | None) -> bool:
    """Whether a host's schedule name (e.g. "Karras"; None: the host's default) is Karras sigmas."""
    return _lower(schedule) == KARRAS


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
