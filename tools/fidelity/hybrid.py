"""Three kinds of step in one run (issue #60; measured, not shipped): full steps, steps that run only the UNet's
outer layers with the inner layers' output predicted (``reuse_plan`` "auto"'s reusing step), and steps that run
nothing, their denoised image drawn along the line through the last two steps that ran the model, full or
reusing (``reuse_plan`` "forecast"'s skipped step). A reusing step costs a fraction of a full one and sees the
current input; a skipped one costs nothing.

``NamedSchedule`` names the full steps for the layers' reuse; ``SkipSteps`` is an APPLY_MODEL wrapper that
returns the skipped steps' forecast before the model (and the layers' reuse) sees the call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tome_core.schedule import step_of
from tools.fidelity.spectrum import line_through


@dataclass(frozen=True)
class NamedSchedule:
    """The layers' reuse with the full steps named one by one (a run of any other length: every step full)."""

    interval: int
    full: tuple[int, ...] = ()
    steps: int = 25
    extrapolate: float | None = None

    def is_full(self, step: int, steps: int) -> bool:
        return steps != self.steps or step in self.full

    def full_steps(self, steps: int) -> int:
        return sum(self.is_full(step, steps) for step in range(steps))

    def for_run(self, steps: int, noise_levels=None, full_below: float = 0.0):
        return self


class SkipSteps:
    """ComfyUI's APPLY_MODEL wrapper: at the steps ``skipped`` (of a 25-step run) the call returns the line through
    the layout's last two computed denoised images over the noise level, moved ``reach`` of the way."""

    def __init__(self, skipped: tuple[int, ...], reach: float = 0.75, steps: int = 25):
        self.skipped, self.reach, self.steps = set(skipped), reach, steps
        self.reset()

    def reset(self) -> None:
        self.history: dict = {}
        self.last_sigma = math.inf

    def __deepcopy__(self, memo):
        return self

    def __call__(self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kw):
        options = transformer_options or {}
        sigma = float(t.max())
        if sigma > self.last_sigma:
            self.reset()
        self.last_sigma = sigma
        sigmas = options.get("sample_sigmas")
        step = step_of([float(s) for s in sigmas], sigma) if sigmas is not None else None
        key = (tuple(str(u) for u in options.get("uuids") or ()), tuple(x.shape))
        kept = self.history.setdefault(key, [])
        if sigmas is not None and len(sigmas) - 1 == self.steps and step in self.skipped and len(kept) >= 2:
            positions, outputs = zip(*kept, strict=True)
            return line_through(positions, outputs, sigma, self.reach)
        out = executor(x, t, c_concat, c_crossattn, control, transformer_options, **kw)
        kept[:] = (kept + [(sigma, out.detach().clone())])[-2:]
        return out


def hybrid_patch(layers_patch, skipped: tuple[int, ...], reach: float = 0.75):
    """``patch(model)``: ``layers_patch`` (the layers' reuse on a ``NamedSchedule``) with ``skipped`` run as
    nothing."""

    def patch(model):
        clone = layers_patch(model)
        clone.add_wrapper_with_key("apply_model", "tome-lab-skip", SkipSteps(skipped, reach))
        return clone

    return patch
