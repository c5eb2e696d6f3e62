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
# A run over part of a Karras schedule (denoise below 1, a later pass, split sigmas): no plan is measured there.
KARRAS_PART = "part of karras"
KARRAS_RHO = 7.0  # the exponent of Karras et al.'s noise schedule, as every host uses it


def _lower(name: str | None) -> str:
    return (name or "").strip().lower()


def sampler_kind(sampler: str | None) -> str | None:
    """The kind of the sampler a host calls ``sampler``; None for one no plan knows."""
    return SAMPLER_KINDS.get(_lower(sampler))


def on_karras(schedule: str | None) -> bool:
    """Whether a host's schedule name (e.g. "Karras"; None: the host's default) is Karras sigmas."""
    return _lower(schedule) == KARRAS


def karras_schedule(sigmas: torch.Tensor, sigma_min: float, sigma_max: float) -> str | None:
    """``KARRAS`` where ``sigmas`` (a run's noise levels, the final 0 included or not) are a whole Karras schedule
    from ``sigma_max`` to ``sigma_min``, ``KARRAS_PART`` where they are a stretch of one (evenly spaced in sigma to
    the 1/rho inside that range), else None: for a host that hands over the levels but not the schedule's name."""
    levels = sigmas.detach().double().cpu().flatten()
    if levels.numel() and levels[-1] == 0:
        levels = levels[:-1]
    if levels.numel() < 3 or sigma_min <= 0 or sigma_max <= sigma_min:
        return None
    ramp = torch.linspace(0.0, 1.0, levels.numel(), dtype=torch.float64)
    low, high = sigma_min ** (1 / KARRAS_RHO), sigma_max ** (1 / KARRAS_RHO)
    whole = (high + ramp * (low - high)) ** KARRAS_RHO
    if torch.allclose(levels, whole, rtol=1e-3, atol=0.0):
        return KARRAS
    first, last = float(levels[0]) ** (1 / KARRAS_RHO), float(levels[-1]) ** (1 / KARRAS_RHO)
    stretch = (first + ramp * (last - first)) ** KARRAS_RHO
    inside = sigma_min * (1 - 1e-3) <= float(levels[-1]) < float(levels[0]) <= sigma_max * (1 + 1e-3)
    return KARRAS_PART if inside and torch.allclose(levels, stretch, rtol=1e-3, atol=0.0) else None
