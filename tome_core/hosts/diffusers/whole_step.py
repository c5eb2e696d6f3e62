"""diffusers wiring of ``reuse_plan``'s forecasts on a UNet: a skipped step runs no layer (the engine is
``tome_core.reuse.whole_step``).

The owner is layer reuse's (``layer_reuse.PipelineReuse``: runs, steps, batch layouts and the step range found from
the pipeline's scheduler), and the UNet gets an instance ``forward`` of its own as well. Each run takes its plan
from the scheduler it starts with: Euler, DDIM and DPM++ 2M on Karras sigmas (``plans.decide``), predicting the
noise or the velocity, make a ``WholeStepRun``, whose skipped calls return the forecast without calling the UNet's
own forward; any other run is layer reuse's, as under "auto", and the UNet's forward then runs as it is.

What is forecast is the denoised image. The UNet's input is the noisy latent in the variance-preserving form with
these schedulers (Euler's ``scale_model_input`` divides by sqrt(sigma^2 + 1), DDIM and DPM-Solver step on it as it
is), so ``denoised_of`` / ``output_of`` convert at the scheduler's sigma of the step. A UNet whose input carries
more channels than its output (inpainting, instruct-pix2pix) reads the latent from its first channels; one that
returns more than it reads (a learned variance) keeps layer reuse.

Removal deletes the forward with the layers' ones (``layer_reuse.remove``): the UNet then computes bit-identically
to one never patched.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ...reuse import FORECAST, LayerReuseRun, SkippableLayer, WholeStepRun, attach_forwards, denoised_of, output_of
from . import layer_reuse
from .layer_reuse import PipelineReuse

# The scheduler's ``prediction_type`` -> whether the UNet predicts the velocity; others are not forecast.
PREDICTIONS = {"epsilon": False, "v_prediction": True}


def v_prediction(scheduler) -> bool | None:
    """Whether the UNet the scheduler steps with predicts the velocity (True) or the noise (False); None for any
    other prediction (the sample itself, a flow), which the forecast does not convert."""
    config = getattr(scheduler, "config", None)
    return PREDICTIONS.get(getattr(config, "prediction_type", "epsilon"))


def forecasts(unet) -> bool:
    """Whether the UNet's output has a denoised image to forecast: it returns no more channels than it reads."""
    config = getattr(unet, "config", None)
    outputs, inputs = getattr(config, "out_channels", None), getattr(config, "in_channels", None)
    return isinstance(outputs, int) and isinstance(inputs, int) and outputs <= inputs


def _sample_of(out) -> torch.Tensor:
    """The predicted tensor of a UNet call's output: ``UNet2DConditionOutput.sample`` or a tuple's first item."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[0]
    return out.sample


def _latent(x: torch.Tensor, channels: int) -> torch.Tensor:
    """The noisy latent in the UNet's input: its first ``channels`` (the rest: a mask, an image's latent)."""
    return x if x.shape[1] == channels else x[:, :channels]


class WholeStepReuse(PipelineReuse):
    """``PipelineReuse`` whose runs are ``WholeStepRun``s where the scheduler has a forecast plan; the UNet's
    ``WholeStepForward`` asks it, around the UNet's own forward, for a skipped call's output and records a
    computed one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.v_prediction = False  # of the run in progress
        self._output_class: Callable | None = None  # what the UNet returns with ``return_dict`` (its output class)

    def run_for(self, scheduler, steps: int, levels: list[float] | None) -> LayerReuseRun:
        planned, predicts_v = None, v_prediction(scheduler)
        # Every sigma known and above 0: the conversions divide by it.
        known = levels is not None and all(math.isfinite(level) and level > 0 for level in levels)
        decision = self.decision(scheduler)
        if decision.runs == FORECAST and known and predicts_v is not None:
            planned = decision.schedule
        if planned is None:
            return super().run_for(scheduler, steps, levels)
        self.v_prediction = predicts_v
        return WholeStepRun(planned, steps)

    def layer_run(self) -> LayerReuseRun | None:
        run = self._current
        return None if isinstance(run, WholeStepRun) else run  # the layers run as they are: the whole call is

    def _whole_step(self) -> WholeStepRun | None:
        run = self._current
        return run if isinstance(run, WholeStepRun) and run.current is not None else None

    # Both kept out of a compiled graph: they read the run's state and the call's sigma, which a graph would take
    # as constants; the UNet's own forward between them compiles as it would unpatched.
    @torch.compiler.disable
    def forecast(self, args: tuple, kwargs: dict):
        """A skipped call's output, as the UNet would return it; None where the UNet is to run."""
        run = self._whole_step()
        if run is None or not run.current.reuse:
            return None
        x, sigma, v = args[0] if args else kwargs[self.SAMPLE], run.current.position, self.v_prediction
        predicted = run.run_call(
            _never, output=lambda denoised: output_of(denoised, _latent(x, denoised.shape[1]), sigma, v)
        )
        if not kwargs.get("return_dict", True):
            return (predicted,)
        return (self._output_class or _unet_output_class())(sample=predicted)

    @torch.compiler.disable
    def record(self, args: tuple, kwargs: dict, out) -> None:
        """A computed call's output: its denoised image recorded for the forecasts."""
        run = self._whole_step()
        if run is None:
            return
        if not isinstance(out, (tuple, torch.Tensor)):
            self._output_class = type(out)
        sample = _sample_of(out)
        x, sigma, v = args[0] if args else kwargs[self.SAMPLE], run.current.position, self.v_prediction
        run.run_call(lambda: sample, denoised=lambda pred: denoised_of(pred, _latent(x, pred.shape[1]), sigma, v))


def _unet_output_class():
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

    return UNet2DConditionOutput


def _never() -> torch.Tensor:
    raise AssertionError("a skipped call computes nothing")


class WholeStepForward(SkippableLayer):
    """The UNet's ``forward`` (an instance attribute) under a forecast plan: a skipped call's output without running
    the UNet, else the UNet's own forward (and its output recorded)."""

    def __call__(self, *args, **kwargs):
        skipped = self.owner.forecast(args, kwargs)
        if skipped is not None:
            return skipped
        out = self.original(*args, **kwargs)
        self.owner.record(args, kwargs, out)
        return out


def install(unet, pipeline, settings, allowed: Callable[[float], bool], schedule) -> bool:
    """Reuse across steps on ``unet`` under ``reuse_plan``'s forecasts: layer reuse on ``schedule`` (the runs whose
    scheduler has no forecast plan), and the whole-step forecast on the runs whose scheduler has one. A UNet with
    nothing to forecast (``forecasts``) gets layer reuse alone. False where ``layer_reuse.install`` is."""
    if not forecasts(unet):
        return layer_reuse.install(unet, pipeline, settings, allowed, schedule)
    if not layer_reuse.install(unet, pipeline, settings, allowed, schedule, owner_class=WholeStepReuse):
        return False
    attach_forwards(layer_reuse.installed(unet), [unet], WholeStepForward)
    return True
