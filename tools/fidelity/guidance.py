"""The guidance forecast (issue #60; measured, ``--variants``, not offered): at some computed steps only the
prompt's half of the batch runs, and the unconditional output is the prompt's output less the guidance (the
conditional output minus the unconditional one) drawn along its line over the noise level through the last two
steps that ran both halves. The steps that run neither are the whole-step forecast of ``spectrum`` (each half along
its own line, over the noise level).

A step that runs the prompt's half alone costs half a call (the work counter counts batch entries) and sees the
step's real input, fresh noise included: where the guidance changes slowly, its error is the guidance's miss times
(CFG - 1). Installed as ComfyUI's ``sampler_calc_cond_batch_function`` on a clone, where both halves are known
whether ComfyUI batches them or not; the run's state lives in the hook and starts again when the noise level goes
up (a new run) or the batch's shape changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tome_core.schedule import step_of
from tools.fidelity.spectrum import line_through


@dataclass(frozen=True)
class GuidanceSettings:
    computed: tuple[int, ...]  # the steps that run the model (the others run nothing)
    cond_only: tuple[int, ...] = ()  # of those, the steps that run the prompt's half alone
    reach: float = 0.75  # how far a skipped step's line moves (ours' three quarters)
    guidance_reach: float = 0.75  # how far the guidance's line moves (0: the last measured guidance, held)

    def label(self, steps: int) -> str:
        work = len(self.computed) - len(self.cond_only) / 2
        full = " ".join(str(s) for s in self.computed if s not in self.cond_only)
        half = " ".join(map(str, self.cond_only))
        return f"{work:g} of {steps}: full {full}; prompt only {half}"


class GuidanceForecast:
    """ComfyUI's cond-batch hook of one patched clone: the run's computed outputs and the guidance's."""

    def __init__(self, settings: GuidanceSettings):
        self.settings = settings
        self.reset()

    def reset(self) -> None:
        self.last_sigma = math.inf
        self.shape: tuple | None = None
        self.sigmas: list[float] = []  # of the computed steps
        self.outputs: list[list[torch.Tensor]] = []  # each computed step's outputs, one per cond
        self.guidance_sigmas: list[float] = []  # of the steps that ran both halves
        self.guidance: list[torch.Tensor] = []

    def __deepcopy__(self, memo):
        return self

    def uncond_from(self, cond: torch.Tensor, sigma: float) -> torch.Tensor:
        """The unconditional output at noise level ``sigma``: the prompt's output less the guidance's forecast."""
        if len(self.guidance) < 2:
            return cond - self.guidance[-1]
        return cond - line_through(self.guidance_sigmas, self.guidance, sigma, self.settings.guidance_reach)

    def __call__(self, args: dict) -> list:
        import comfy.samplers

        conds, x, timestep, model, options = (args[k] for k in ("conds", "input", "sigma", "model", "model_options"))
        sigma = float(timestep.max())
        if sigma > self.last_sigma or tuple(x.shape) != self.shape:
            self.reset()
        self.last_sigma, self.shape = sigma, tuple(x.shape)
        sigmas = options.get("transformer_options", {}).get("sample_sigmas")
        step = step_of([float(s) for s in sigmas], sigma) if sigmas is not None else None  # None: run in full
        both = len(conds) == 2 and conds[1] is not None
        if step is not None and step not in self.settings.computed and len(self.outputs) >= 2:
            return [
                line_through(self.sigmas, [o[i] for o in self.outputs], sigma, self.settings.reach)
                for i in range(len(conds))
            ]
        run = comfy.samplers.calc_cond_batch  # ComfyUI's own, without this hook
        if both and step in self.settings.cond_only and self.guidance:
            cond = run(model, [conds[0], None], x, timestep, options)[0]
            outputs = [cond, self.uncond_from(cond, sigma)]
        else:
            outputs = run(model, conds, x, timestep, options)
            if both:
                self.guidance_sigmas = (self.guidance_sigmas + [sigma])[-2:]
                self.guidance = (self.guidance + [outputs[0] - outputs[1]])[-2:]
        self.sigmas = (self.sigmas + [sigma])[-2:]
        self.outputs = (self.outputs + [list(outputs)])[-2:]
        return outputs


def guidance_patch(settings: GuidanceSettings):
    """``patch(model)``: a clone of the ModelPatcher with the guidance forecast as its cond-batch hook."""

    def patch(model):
        clone = model.clone()
        clone.model_options["sampler_calc_cond_batch_function"] = GuidanceForecast(settings)
        return clone

    return patch
