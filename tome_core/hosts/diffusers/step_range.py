"""diffusers: the step range of a call, from the timestep the pipeline gives the denoiser, mapped through the
pipeline's current scheduler; shared by the UNet and the DiT patch."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch

from ...schedule import NoiseRange, timestep_of_percent
from ...settings import PatchSettings


def percent_to_unet_timestep(scheduler) -> Callable[[float], float]:
    """Map a sampling percent to the ``timestep`` the pipeline gives the UNet (higher: noisier), as ComfyUI maps
    percents to noise, for DDPM, EDM-style and continuous-timestep schedulers alike."""
    config = getattr(scheduler, "config", None) or {}
    get = config.get if hasattr(config, "get") else lambda key, default=None: getattr(config, key, default)
    precondition = getattr(scheduler, "precondition_noise", None)
    if callable(precondition) and get("sigma_min") is not None and get("sigma_max") is not None:
        log_min, log_max = math.log(get("sigma_min")), math.log(get("sigma_max"))

        def edm(percent: float) -> float:
            sigma = math.exp(log_min + (1.0 - percent) * (log_max - log_min))
            return float(precondition(torch.tensor([sigma], dtype=torch.float64)).reshape(-1)[0])

        return edm
    steps = int(get("num_train_timesteps", None) or 1000)
    alphas_cumprod = getattr(scheduler, "alphas_cumprod", None)
    if get("timestep_type") == "continuous" and alphas_cumprod is not None:
        log_sigmas = (((1 - alphas_cumprod) / alphas_cumprod) ** 0.5).double().log()

        def continuous(percent: float) -> float:
            t = timestep_of_percent(percent, steps)
            low = min(int(t), len(log_sigmas) - 2)
            frac = t - low
            return 0.25 * float((1 - frac) * log_sigmas[low] + frac * log_sigmas[low + 1])

        return continuous
    return lambda percent: timestep_of_percent(percent, steps)


def unet_timestep_of_percent(scheduler) -> Callable[[float], float]:
    """``percent_to_unet_timestep`` of a pipeline's scheduler; without one (a bare UNet) the DDPM timestep."""
    return percent_to_unet_timestep(scheduler) if scheduler is not None else timestep_of_percent


def flow_timestep_of_percent(scheduler) -> Callable[[float], float]:
    """Percent of sampling -> a flow-matching scheduler's timestep (sigma 1 - p, before any shift)."""
    config = getattr(scheduler, "config", None) or {}
    steps = float(config.get("num_train_timesteps", 1000) if hasattr(config, "get") else 1000)
    return lambda percent: (1.0 - percent) * steps


class StepRange:
    """Whether a call is inside the range, mapped by ``mapping_for(scheduler)``; the pipeline is held weakly and its
    scheduler looked up at each call, so a scheduler swapped after ``apply_patch`` is followed."""

    def __init__(self, settings: PatchSettings, pipeline, mapping_for: Callable):
        self.settings = settings
        self.mapping_for = mapping_for
        self._pipeline = weakref.ref(pipeline) if pipeline is not None else None
        self._scheduler = None
        self.noise_range = self._range_for(None)
        self.everywhere = self.noise_range.everywhere

    def _range_for(self, scheduler) -> NoiseRange:
        s = self.settings
        return NoiseRange(s.start_percent, s.end_percent, self.mapping_for(scheduler))

    def contains(self, timestep: float) -> bool:
        if self.everywhere:
            return True
        pipeline = self._pipeline() if self._pipeline is not None else None
        scheduler = getattr(pipeline, "scheduler", None)
        if scheduler is not self._scheduler:
            self._scheduler = scheduler
            self.noise_range = self._range_for(scheduler)
        return self.noise_range.contains(timestep)
