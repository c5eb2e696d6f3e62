"""Which sampler kind a host's name stands for (the plans' rules use the kinds), and whether sigmas are Karras."""

from __future__ import annotations

import torch

# ComfyUI's "ddim" runs Euler, and DDIM without noise is Euler's step on other axes.
SAMPLER_KINDS = {
    **dict.fromkeys(("euler", "ddim", "eulerdiscretescheduler", "ddimscheduler"), "euler"),
    **dict.fromkeys(("heun", "heundiscretescheduler"), "heun"),
    **dict.fromkeys(("dpmpp_sde", "dpm++ sde", "dpmsolversdescheduler"), "dpmpp_sde"),
    **dict.fromkeys(("dpmpp_2m", "dpm++ 2m", "dpmsolvermultistepscheduler"), "dpmpp_2m"),
    "flowmatcheulerdiscretescheduler": "flow_euler",
    **dict.fromkeys(("uni_pc", "unipc", "unipcmultistepscheduler"), "unipc"),
}
KARRAS = "karras"
KARRAS_PART = "part of karras"  # denoise below 1, a later pass, split sigmas: no plan is measured there
KARRAS_RHO = 7.0
EXPONENTIAL, KL_OPTIMAL, BETA = "exponential", "kl_optimal", "beta"
# Schedules on which the UNet plans lose the picture: docs/step-reuse.md, 'The workflows around the sampler'.
# The WebUI's "Polyexponential" is the exponential schedule at its default rho 1 (and unmeasured at any other).
LOSING_SCHEDULES = frozenset({EXPONENTIAL, KL_OPTIMAL, "kl optimal", "polyexponential"})
# The schedule names (the WebUI's labels and names, ComfyUI's) the plans are measured on; a pass on a schedule a
# host names otherwise (Turbo, a fork's "Karras Exponential" or "Cosine", ...) runs every step.
MEASURED_SCHEDULES = frozenset(
    {KARRAS, KARRAS_PART, "uniform", "normal", "simple", "sgm uniform", "sgm_uniform", "ddim", "ddim_uniform", "beta"}
    | {"linear_quadratic", "linear quadratic", "align your steps", "align_your_steps"}
    | LOSING_SCHEDULES
)
# The options with which the deterministic kinds add noise at each step (k-diffusion's churn, DDIM's eta).
NOISE_OPTIONS = ("s_churn", "eta")


def _lower(name: str | None) -> str:
    return (name or "").strip().lower()


def sampler_kind(sampler: str | None) -> str | None:
    """The kind of the sampler a host calls ``sampler``; None for one no plan knows."""
    return SAMPLER_KINDS.get(_lower(sampler))


def noise_added(sampler: str | None, options) -> str | None:
    """The option (as "s_churn 0.5") with which ``sampler``, a kind the plans take for deterministic, adds noise at
    each step: no plan is measured with it; None where it adds none."""
    if sampler_kind(sampler) not in ("euler", "heun"):
        return None
    for name in NOISE_OPTIONS:
        try:
            value = float(options.get(name) or 0.0)
        except (TypeError, ValueError):
            return f"{name} {options.get(name)!r}"
        if value != 0.0:
            return f"{name} {value:g}"
    return None


def on_karras(schedule: str | None) -> bool:
    return _lower(schedule) == KARRAS


def loses_the_picture_on(schedule: str | None) -> bool:
    return _lower(schedule) in LOSING_SCHEDULES


def unmeasured_on(schedule: str | None) -> bool:
    """Whether a host names ``schedule`` and no plan is measured on it (None: the host names none)."""
    return schedule is not None and _lower(schedule) not in MEASURED_SCHEDULES


def schedule_of(sigmas: torch.Tensor, sigma_min: float, sigma_max: float) -> str | None:
    """The schedule a run's levels are (for a host that hands over the levels, not the name): ``karras_schedule``'s
    answer, or ``EXPONENTIAL`` / ``KL_OPTIMAL`` where they lie evenly spaced in log sigma / arctan sigma (whole or a
    stretch over more than a factor 2 of noise), else None."""
    karras = karras_schedule(sigmas, sigma_min, sigma_max)
    levels = sigmas.detach().double().cpu().flatten()
    levels = levels[levels > 0]
    if karras is not None or levels.numel() < 3 or float(levels[0]) < 2 * float(levels[-1]):
        return karras
    ramp = torch.linspace(0.0, 1.0, levels.numel(), dtype=torch.float64)
    for name, warp in ((EXPONENTIAL, torch.log), (KL_OPTIMAL, torch.atan)):
        warped = warp(levels)
        if torch.allclose(warped, warped[0] + ramp * (warped[-1] - warped[0]), rtol=0.0, atol=1e-4):
            return name
    return None


def karras_schedule(sigmas: torch.Tensor, sigma_min: float, sigma_max: float) -> str | None:
    """``KARRAS`` if ``sigmas`` are a whole Karras schedule, ``KARRAS_PART`` if part of one, else None."""
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
