"""``reuse_plan``'s forecasts on a UNet: a skipped step runs nothing, its denoised image on the line through the
last two computed ones. docs/step-reuse.md, "A skipped step that runs nothing: the whole output along ours' line"."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .cache import LayerReuseRun, _spec_of
from .plans import WHOLE_STEP_REACH
from .schedules import IntervalSchedule, RunLengthSchedule


def _scales(x: torch.Tensor, sigma: float) -> tuple[torch.Tensor, float]:
    """(sqrt of alpha-bar, sigma) at noise level ``sigma`` (k-diffusion's sigma: alpha-bar = 1 / (1 + sigma^2))."""
    return torch.tensor(1.0 / (1.0 + sigma * sigma) ** 0.5, dtype=x.dtype, device=x.device), sigma


def denoised_of(output: torch.Tensor, x: torch.Tensor, sigma: float, v_prediction: bool = False) -> torch.Tensor:
    """The denoised image of a UNet's ``output`` (noise, or velocity) for its unit-variance input ``x`` at ``sigma``."""
    root, s = _scales(x, sigma)
    if v_prediction:
        return root * x - (s * root) * output
    return x / root - s * output


def output_of(denoised: torch.Tensor, x: torch.Tensor, sigma: float, v_prediction: bool = False) -> torch.Tensor:
    """The inverse of ``denoised_of``: what the UNet would return for ``denoised`` (``sigma`` above 0)."""
    root, s = _scales(x, sigma)
    if v_prediction:
        return (root * x - denoised) / (s * root)
    return (x / root - denoised) / s


def _same(out: torch.Tensor) -> torch.Tensor:
    return out


class WholeStepRun(LayerReuseRun):
    """One run of the whole-step forecast: per call ``begin_call`` (at the noise level), ``run_call``, ``end_call``."""

    def __init__(
        self,
        schedule: IntervalSchedule | RunLengthSchedule,
        steps: int,
        layers: int = 1,
        extrapolate: float = WHOLE_STEP_REACH,
        **guards,
    ):
        # ``layers`` and the guards: ``LayerReuse.new_run``'s arguments; the whole call is the one "layer", unguarded.
        super().__init__(schedule, steps, layers=1, extrapolate=extrapolate)
        self.outer_words, self.inner_words = "nothing", "output"

    def run_call(
        self,
        compute: Callable[[], torch.Tensor],
        denoised: Callable[[torch.Tensor], torch.Tensor] = _same,
        output: Callable[[torch.Tensor], torch.Tensor] = _same,
    ) -> torch.Tensor:
        """``compute()`` where the call is computed (recording ``denoised(out)``), else ``output(forecast)``."""
        call = self.current
        if call is None:
            return compute()
        if call.reuse:
            return output(self.predict(call.entry, call.position))
        out = compute()
        call.entry.shapes[0] = _spec_of(out)
        # A copy: a host may change the output in place after the call.
        call.entry.record(call.position, denoised(out).detach().clone(), keep=self.KEEP)
        call.entry.step = call.step
        return out

    def summary(self) -> str:
        return (
            f"{self.calls - self.reused_calls} of {self.calls} model calls computed; {self.reused_calls} ran "
            "nothing, their output forecast from the last two computed steps"
        )
