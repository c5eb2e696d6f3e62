"""Step range: a step is inside when its noise is in (noise at end_percent, noise at start_percent]; 0 and 1 are
open ends. Percents map to noise as ComfyUI maps them."""

from __future__ import annotations

import math
from collections.abc import Callable


class NoiseRange:
    def __init__(self, start_percent: float, end_percent: float, percent_to_noise: Callable[[float], float]):
        self.empty = start_percent >= end_percent
        self.high = math.inf if start_percent <= 0.0 else float(percent_to_noise(start_percent))
        self.low = -math.inf if end_percent >= 1.0 else float(percent_to_noise(end_percent))
        self.everywhere = not self.empty and self.high == math.inf and self.low == -math.inf

    def contains(self, noise: float) -> bool:
        return not self.empty and self.low < noise <= self.high


def timestep_of_percent(percent: float, num_timesteps: int = 1000) -> float:
    """The DDPM timestep at ``percent`` of sampling, as ComfyUI's discrete model sampling maps it."""
    return (1.0 - percent) * (num_timesteps - 1)


def call_sigmas(sigmas) -> list[float]:
    """The sigma each step's model call gets, from a sampler's schedule (its last sigma is the end, not a call)."""
    return [float(s) for s in sigmas.flatten()[:-1]] if sigmas is not None else []


def step_of(call_sigmas: list[float], sigma: float) -> int | None:
    """The step whose model call gets ``sigma``, or None when it is not on the schedule."""
    for i, s in enumerate(call_sigmas):
        if math.isclose(s, sigma, rel_tol=1e-5, abs_tol=1e-7):
            return i
    return None
