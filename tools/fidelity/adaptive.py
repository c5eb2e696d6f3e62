"""The whole-step forecast with its plan decided per image (issue #60; measured, not shipped).

As ``reuse_plan`` "forecast": a skipped step runs nothing and its denoised image is the line through the image's
last two computed steps over the noise level, moved ``reach`` of the way. Which steps are computed is decided per
image, as an ODE solver sets its step size: the first ``warm_up`` and the last ``tail`` steps are computed; at
every computed step the line drawn before it is checked against what the model returned (its miss, relative to
the output's size), and the next gap is the last one scaled by sqrt(tolerance / miss) (a line's miss grows with the
square of the gap), at most ``max_gap``, and wide enough that the image computes at most ``budget`` steps.

Each image of the batch keeps its own plan (the fidelity benchmark samples 16 prompts as one batch, where a user
samples one): the images that compute at a step run as a smaller batch, the others are forecast. Installed as
ComfyUI's model function wrapper, as ``spectrum`` is; a run starts again when the noise level goes up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tools.fidelity.spectrum import line_through, wrapper_patch


@dataclass(frozen=True)
class AdaptiveSettings:
    budget: int = 11
    warm_up: int = 4
    tail: int = 1
    tolerance: float = 0.1
    max_gap: int = 4
    reach: float = 0.75

    def label(self, steps: int) -> str:
        return (
            f"at most {self.budget} of {steps} per image; warm-up {self.warm_up} tail {self.tail} "
            f"tolerance {self.tolerance} gap {self.max_gap}"
        )


class ImagePlan:
    """One image's computed outputs (its rows in the batch: cond and uncond) and its plan."""

    def __init__(self):
        self.sigmas: list[float] = []
        self.outputs: list[torch.Tensor] = []
        self.last_at, self.next_at, self.count = -1, 0, 0

    def line(self, sigma: float, reach: float) -> torch.Tensor:
        return line_through(self.sigmas, self.outputs, sigma, reach)


def _rows(tensor, rows: list[int], batch: int):
    return tensor[rows] if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[0] == batch else tensor


def _sliced(c: dict, rows: list[int], batch: int) -> dict:
    """The model call's keyword arguments for the batch rows ``rows`` (every batch-sized tensor sliced)."""
    out = {key: _rows(value, rows, batch) for key, value in c.items()}
    options = c.get("transformer_options")
    if isinstance(options, dict):
        out["transformer_options"] = {key: _rows(value, rows, batch) for key, value in options.items()}
    return out


class AdaptiveWrapper:
    """ComfyUI's unet function wrapper of one patched clone: each image's plan and outputs."""

    def __init__(self, settings: AdaptiveSettings):
        self.settings = settings
        self.reset()

    def reset(self) -> None:
        self.images: dict = {}
        self.last_sigma = math.inf
        self.step = -1
        self.steps = 25

    def __deepcopy__(self, memo):
        return self

    def _plan_next(self, image: ImagePlan, miss: float | None) -> None:
        settings, step = self.settings, self.step
        tail_from = self.steps - settings.tail
        gap = step - image.last_at if image.last_at >= 0 else 1
        wanted = gap if miss is None else gap * math.sqrt(settings.tolerance / max(miss, 1e-12))
        gap = int(min(max(round(wanted), 1), settings.max_gap))
        left = settings.budget - image.count - settings.tail
        middle = tail_from - step - 1
        if middle > 0:
            gap = max(gap, math.ceil((middle + 1) / (max(left, 0) + 1)))
        image.last_at, image.next_at = step, step + gap

    def __call__(self, model_function, args: dict):
        x, timestep, c = args["input"], args["timestep"], args["c"]
        sigma = float(timestep.max())
        if sigma > self.last_sigma:  # the noise went up: a new run
            self.reset()
        if sigma != self.last_sigma:
            self.last_sigma = sigma
            self.step += 1
            if self.step == 0:
                sigmas = c.get("transformer_options", {}).get("sample_sigmas")
                self.steps = len(sigmas) - 1 if sigmas is not None else 25
        settings, step = self.settings, self.step
        layout = tuple(args.get("cond_or_uncond") or (0,))
        chunks = len(layout)
        batch = x.shape[0]
        count = batch // chunks
        plans = []
        for index in range(count):
            image = self.images.get((layout, index, tuple(x.shape)))
            if image is None:
                image = self.images[(layout, index, tuple(x.shape))] = ImagePlan()
            plans.append(image)
        fixed = step < settings.warm_up or step >= self.steps - settings.tail
        computing = [i for i, image in enumerate(plans) if fixed or len(image.outputs) < 2 or step >= image.next_at]
        out = torch.empty_like(x)
        if computing:
            rows = [chunk * count + i for chunk in range(chunks) for i in computing]
            if len(rows) == batch:
                out = model_function(x, timestep, **c)
            else:
                out[rows] = model_function(x[rows], timestep[rows], **_sliced(c, rows, batch))
        for i, image in enumerate(plans):
            rows = [chunk * count + i for chunk in range(chunks)]
            if i in computing:
                here = out[rows].detach().float().clone()
                miss = None
                if len(image.outputs) >= 2:
                    missed = image.line(sigma, settings.reach) - here
                    miss = float(missed.norm() / here.norm().clamp_min(1e-12))
                image.count += 1
                self._plan_next(image, miss)
                image.sigmas = (image.sigmas + [sigma])[-2:]
                image.outputs = (image.outputs + [here])[-2:]
            else:
                out[rows] = image.line(sigma, settings.reach).to(x.dtype)
        return out


def adaptive_patch(settings: AdaptiveSettings):
    """``patch(model)``: a clone of the ModelPatcher with the per-image plan as its model function wrapper."""
    return wrapper_patch(lambda: AdaptiveWrapper(settings))
