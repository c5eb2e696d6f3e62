"""diffusers wiring of ``reuse_plan``'s forecasts on a UNet: a run whose scheduler has a forecast plan is a
``WholeStepRun``, its skipped calls returning the forecast without running the UNet; other runs are layer reuse's.
docs/step-reuse.md, "A skipped step that runs nothing: the whole output along ours' line"."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ...reuse import FORECAST, LayerReuseRun, SkippableLayer, WholeStepRun, attach_forwards, denoised_of, output_of
from . import layer_reuse
from .layer_reuse import PipelineReuse

PREDICTIONS = {"epsilon": False, "v_prediction": True}


def v_prediction(scheduler) -> bool | None:
    """Whether the scheduler's UNet predicts the velocity (True) or the noise (False); None: not forecast."""
    config = getattr(scheduler, "config", None)
    return PREDICTIONS.get(getattr(config, "prediction_type", "epsilon"))


def forecasts(unet) -> bool:
    """Whether the UNet's output has a denoised image to forecast: it returns no more channels than it reads."""
    config = getattr(unet, "config", None)
    outputs, inputs = getattr(config, "out_channels", None), getattr(config, "in_channels", None)
    return isinstance(outputs, int) and isinstance(inputs, int) and outputs <= inputs


def _sample_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[0]
    return out.sample


def _latent(x: torch.Tensor, channels: int) -> torch.Tensor:
    """The noisy latent in the UNet's input: its first ``channels`` (the rest: a mask, an image's latent)."""
    return x if x.shape[1] == channels else x[:, :channels]


class WholeStepReuse(PipelineReuse):
    """``PipelineReuse`` whose runs are ``WholeStepRun``s where the scheduler has a forecast plan."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.v_prediction = False
        self._output_class: Callable | None = None

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

    # Kept out of a compiled graph, which would take the run's state and the call's sigma as constants.
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
    """The UNet's ``forward`` under a forecast plan: the forecast at a skipped call, else the UNet's own forward."""

    def __call__(self, *args, **kwargs):
        skipped = self.owner.forecast(args, kwargs)
        if skipped is not None:
            return skipped
        out = self.original(*args, **kwargs)
        self.owner.record(args, kwargs, out)
        return out


def install(unet, pipeline, settings, allowed: Callable[[float], bool], schedule) -> bool:
    """The forecast on ``unet`` where a run's scheduler has a plan, else layer reuse on ``schedule``; False as
    ``layer_reuse.install``."""
    if not forecasts(unet):
        return layer_reuse.install(unet, pipeline, settings, allowed, schedule)
    if not layer_reuse.install(unet, pipeline, settings, allowed, schedule, owner_class=WholeStepReuse):
        return False
    attach_forwards(layer_reuse.installed(unet), [unet], WholeStepForward)
    return True
