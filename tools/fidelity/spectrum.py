"""Spectrum (CVPR 2026, arXiv 2603.01623) as a peer in the benchmarks: the step cache Forge Neo ships built in
("Spectrum Integrated", ``extensions-builtin/sd_forge_spectrum``), written here from the paper's description and
Neo's settings (measured, not offered).

At a computed step the whole model runs and its output is kept (the last ``max(degree + 2, 8)`` per batch layout);
at a skipped step nothing of the model runs and its output is forecast: a ridge fit of Chebyshev polynomials of
degree ``degree`` over the kept outputs against the step (mapped to [-1, 1] over the run), blended with the line
through the last two (``blend`` of the fit, the rest the line). Which steps are computed: the first ``warm_up``,
then one in ``window`` (the others skipped), and every step from ``stop`` of the run on. Neo's defaults: blend
0.25, degree 6, ridge 0.5, window 2, warm-up 6, stop 0.9: 17 of 25 steps computed.

Installed as ComfyUI's model function wrapper (what Neo installs it as: ``set_model_unet_function_wrapper``), on a
clone; the run's state lives in the wrapper and starts again when the noise level goes up (a new run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NEO_DEFAULTS = {"blend": 0.25, "degree": 6, "ridge": 0.5, "window": 2, "warm_up": 6, "stop": 0.9}


@dataclass(frozen=True)
class SpectrumSettings:
    blend: float = 0.25
    degree: int = 6
    ridge: float = 0.5
    window: int = 2
    warm_up: int = 6
    stop: float = 0.9
    # How far along the line through the last two the forecast's line moves (1: Spectrum's; a variant's below).
    reach: float = 1.0
    # The line drawn over the noise level in place of the step (a variant's; the fit stays over the step).
    by_sigma: bool = False
    # What is forecast (a variant's): "denoised", the model call's output as ComfyUI returns it, or "v", the
    # velocity (EDM's preconditioned output at ``sigma_data``), so that a skipped step's denoised image follows the
    # current input by EDM's c_skip: the fresh noise of an ancestral or SDE step is partly kept, as the model keeps it;
    # or "eps", the noise an SD UNet predicts (the velocity's limit at a large ``sigma_data``).
    space: str = "denoised"
    sigma_data: float = 1.0
    # The computed steps named one by one (a variant's; empty: Neo's rule).
    at: tuple[int, ...] = ()
    # The line drawn over log sigma (with ``by_sigma``; a variant's), and the curve's order: 2 draws the parabola
    # through the last three kept outputs in place of the line (a variant's).
    log_sigma: bool = False
    order: int = 1
    # A diagnosis (a variant's): below 1, a skipped step runs the model too and returns its output moved this share
    # of the way to the forecast, so that the forecast's error is scaled by it (how a sampler carries that error on).
    error_share: float = 1.0
    # Euler's corrector (a variant's): at a computed step, the skipped steps since the last computed one are redrawn
    # on the line between the two (interpolated, no longer extrapolated), and the sampler's latent is moved to where
    # Euler would have taken it with them, through the output this step returns; the model's output at the moved
    # latent is taken as its output plus c_skip (at ``sigma_data``) times the move.
    correct: bool = False
    # The corrector's gain of the model's output on the latent's move (negative: c_skip), and the noise level under
    # which it stands down (a variant's).
    correct_gain: float = -1.0
    correct_above: float = 0.0
    correct_at: tuple[int, ...] = ()  # the computed steps that correct (empty: every one)
    correct_after: int = 1  # the fewest skipped steps in a row before a computed step that corrects
    correct_share: float = 1.0  # the share of the latent's move taken

    def computed(self, steps: int) -> list[bool]:
        """Which of a run's ``steps`` run the model (Neo's rule: a skipped step counts toward the window)."""
        if self.at:
            return [step in self.at for step in range(steps)]
        out, skipped = [], 0
        for step in range(steps):
            if step < self.warm_up or step >= int(steps * self.stop):
                out.append(True)
                continue
            compute = (skipped + 1) % max(self.window, 1) == 0
            skipped = 0 if compute else skipped + 1
            out.append(compute)
        return out

    def label(self, steps: int) -> str:
        if self.at:
            return f"{sum(self.computed(steps))} of {steps}: " + " ".join(map(str, self.at))
        return f"{sum(self.computed(steps))} of {steps}"


def settings_computing(steps: int, target: int) -> SpectrumSettings:
    """Neo's forecaster with the fewest warm-up steps whose plan computes ``target`` of ``steps`` (window 2 or 3):
    Spectrum at another method's work."""
    for warm_up in range(1, steps):
        for window in (2, 3):
            settings = SpectrumSettings(window=window, warm_up=warm_up)
            if sum(settings.computed(steps)) == target:
                return settings
    raise ValueError(f"no window 2 or 3 plan computes {target} of {steps} steps")


def line_through(positions, outputs, here: float, reach: float) -> torch.Tensor:
    """The line through the last two ``outputs`` at ``positions`` (steps or noise levels), at ``here``, moved
    ``reach`` of the way from the last one."""
    (a, before), (b, last) = zip(positions[-2:], outputs[-2:], strict=True)
    ahead = (here - b) / (b - a) if b != a else 0.0
    return last + reach * ahead * (last - before)


def parabola_through(positions, outputs, here: float, reach: float) -> torch.Tensor:
    """The parabola through the last three ``outputs`` (Newton's divided differences), at ``here``, moved ``reach``
    of the way from the last one; the line where fewer than three are kept or two positions meet."""
    if len(outputs) < 3 or len(set(positions[-3:])) < 3:
        return line_through(positions, outputs, here, reach)
    (a, first), (b, second), (c, last) = zip(positions[-3:], outputs[-3:], strict=True)
    slope = (last - second) / (c - b)
    bend = (slope - (second - first) / (b - a)) / (c - a)
    return last + reach * (here - c) * (slope + (here - b) * bend)


class Forecaster:
    """The kept outputs of one batch layout and the forecast from them."""

    def __init__(self, settings: SpectrumSettings, steps: int):
        self.settings = settings
        self.steps = steps
        self.keep = max(settings.degree + 2, 8)
        self.outputs: list[torch.Tensor] = []
        self.at: list[int] = []
        self.sigmas: list[float] = []
        self.shape: torch.Size | None = None
        # The skipped steps since the last computed one and what they returned (for ``correct``).
        self.pending: list[tuple[int, torch.Tensor]] = []

    def _tau(self, step: float) -> float:
        return 2.0 * step / self.steps - 1.0

    def _chebyshev(self, taus: torch.Tensor) -> torch.Tensor:
        columns = [torch.ones_like(taus), taus]
        while len(columns) <= self.settings.degree:
            columns.append(2 * taus * columns[-1] - columns[-2])
        return torch.stack(columns[: self.settings.degree + 1], dim=1)

    def add(self, step: int, output: torch.Tensor, sigma: float = 0.0) -> None:
        if self.shape != output.shape:
            self.outputs, self.at, self.sigmas, self.shape = [], [], [], output.shape
        self.pending = []
        self.outputs = (self.outputs + [output.detach().flatten().float()])[-self.keep :]
        self.at = (self.at + [step])[-self.keep :]
        self.sigmas = (self.sigmas + [sigma])[-self.keep :]

    def forecast(self, step: int, dtype: torch.dtype, sigma: float = 0.0) -> torch.Tensor:
        history = torch.stack(self.outputs)
        on = {"dtype": torch.float32, "device": history.device}
        design = self._chebyshev(torch.tensor([self._tau(s) for s in self.at], **on))
        gram = design.T @ design + self.settings.ridge * torch.eye(design.shape[1], device=history.device)
        coefficients = torch.linalg.solve(gram, design.T @ history)
        fit = (self._chebyshev(torch.tensor([self._tau(step)], **on)) @ coefficients)[0]
        if len(self.outputs) >= 2:
            positions, here = (self.sigmas, sigma) if self.settings.by_sigma else (self.at, step)
            if self.settings.by_sigma and self.settings.log_sigma:
                positions, here = [math.log(max(s, 1e-6)) for s in positions], math.log(max(here, 1e-6))
            curve = parabola_through if self.settings.order == 2 else line_through
            line = curve(positions, self.outputs, here, self.settings.reach)
        else:
            line = self.outputs[-1]
        forecast = (1 - self.settings.blend) * line + self.settings.blend * fit
        return forecast.view(self.shape).to(dtype)


def euler_correction(forecaster: Forecaster, output: torch.Tensor, step: int, sigmas: list[float], settings):
    """(what to return, what to keep) at a computed ``step`` whose model ``output`` (flat, float) follows skipped
    steps: the latent's move that the skipped steps' interpolated outputs would have made under Euler
    (x' = r x + (1 - r) denoised, r = the next noise level over this one), carried into this step's output."""
    first, low = forecaster.outputs[-1], forecaster.sigmas[-1]
    here = sigmas[step]
    move = torch.zeros_like(output)
    for skipped, returned in forecaster.pending:
        share = (sigmas[skipped] - low) / (here - low)
        ratio = sigmas[skipped + 1] / sigmas[skipped]
        move = ratio * move + (1 - ratio) * (first + share * (output - first) - returned)
    skip = _preconditioning(here, settings.sigma_data)[0] if settings.correct_gain < 0 else settings.correct_gain
    ratio = sigmas[step + 1] / here
    move = settings.correct_share * move
    kept = output + skip * move
    return kept + ratio / (1 - ratio) * move, kept


def _preconditioning(sigma: float, sigma_data: float) -> tuple[float, float]:
    """EDM's (c_skip, c_out) at noise level ``sigma``: denoised = c_skip * x + c_out * F."""
    total = sigma * sigma + sigma_data * sigma_data
    return sigma_data * sigma_data / total, sigma * sigma_data / math.sqrt(total)


def to_space(denoised: torch.Tensor, x: torch.Tensor, sigma: float, settings: SpectrumSettings) -> torch.Tensor:
    if settings.space == "denoised" or sigma <= 0:
        return denoised
    if settings.space == "eps":
        return (x - denoised) / sigma
    skip, out = _preconditioning(sigma, settings.sigma_data)
    return (denoised - skip * x) / out


def from_space(forecast: torch.Tensor, x: torch.Tensor, sigma: float, settings: SpectrumSettings) -> torch.Tensor:
    if settings.space == "denoised" or sigma <= 0:
        return forecast
    if settings.space == "eps":
        return x - sigma * forecast
    skip, out = _preconditioning(sigma, settings.sigma_data)
    return skip * x + out * forecast


class SpectrumWrapper:
    """ComfyUI's unet function wrapper of one patched clone: the run's plan and each layout's forecaster."""

    def __init__(self, settings: SpectrumSettings):
        self.settings = settings
        self.reset()
        self.computed_calls = 0
        self.calls = 0

    def reset(self) -> None:
        self.forecasters: dict = {}
        self.last_sigma = math.inf
        self.step = -1
        self.plan: list[bool] = []
        self.sigma_list: list[float] = []

    def __deepcopy__(self, memo):
        return self

    def __call__(self, model_function, args: dict):
        x, timestep, c = args["input"], args["timestep"], args["c"]
        sigma = float(timestep.max())
        options = c.get("transformer_options", {})
        if sigma > self.last_sigma:  # the noise went up: a new run
            self.reset()
        if sigma != self.last_sigma:  # a new step (cond and uncond may come as several calls)
            self.last_sigma = sigma
            self.step += 1
            if not self.plan:
                sigmas = options.get("sample_sigmas")  # ComfyUI's; Forge Neo's sampler sets "sampling_sigmas"
                sigmas = options.get("sampling_sigmas") if sigmas is None else sigmas
                steps = len(sigmas) - 1 if sigmas is not None else 25
                self.plan = self.settings.computed(steps)
                self.steps = steps
                self.sigma_list = [float(s) for s in sigmas] if sigmas is not None else []
        compute = self.step >= len(self.plan) or self.plan[self.step]
        key = (tuple(args.get("cond_or_uncond") or ()), tuple(x.shape))
        forecaster = self.forecasters.get(key)
        self.calls += 1
        if compute or forecaster is None:
            out = model_function(x, timestep, **c)
            self.computed_calls += 1
            if forecaster is None:
                forecaster = self.forecasters[key] = Forecaster(self.settings, self.steps)
            correct = self.settings.correct and bool(self.sigma_list) and sigma > self.settings.correct_above
            correct = correct and (not self.settings.correct_at or self.step in self.settings.correct_at)
            correct = correct and len(forecaster.pending) >= max(self.settings.correct_after, 1)
            if correct and forecaster.shape == out.shape:
                returned, kept = euler_correction(
                    forecaster, out.detach().flatten().float(), self.step, self.sigma_list, self.settings
                )
                forecaster.add(self.step, kept.view(out.shape), sigma)
                return returned.view(out.shape).to(out.dtype)
            forecaster.add(self.step, to_space(out, x, sigma, self.settings), sigma)
            return out
        forecast = from_space(forecaster.forecast(self.step, x.dtype, sigma), x, sigma, self.settings)
        if self.settings.correct:
            forecaster.pending.append((self.step, forecast.detach().flatten().float()))
        if self.settings.error_share < 1.0:
            return torch.lerp(model_function(x, timestep, **c), forecast, self.settings.error_share)
        return forecast


def wrapper_patch(make_wrapper):
    """``patch(model)``: a clone of the ModelPatcher with ``make_wrapper()`` as its model function wrapper (a new
    one per clone: it holds the run's state)."""

    def patch(model):
        clone = model.clone()
        clone.set_model_unet_function_wrapper(make_wrapper())
        return clone

    return patch


def spectrum_patch(settings: SpectrumSettings):
    """``patch(model)``: a clone of the ModelPatcher with Spectrum as its model function wrapper."""
    return wrapper_patch(lambda: SpectrumWrapper(settings))
