"""The variants of reuse across steps that the benchmarks measure and the product does not run.

Each is built here from the product's own parts, by subclassing or by a schedule this module builds, and given to
the product's ComfyUI doors after they installed: the product's code holds no rejected variant (docs/step-reuse.md
and docs/dit.md hold their figures).

- ``ReuseVariant``: what a fidelity row changes around the shipped choices;
- ``install_unet_variant`` / ``install_dit_variant``: the product's ``install`` with those changes;
- ``EdgeSchedule``: the noise-spaced schedule with more of its first and last steps in full;
- ``GuardedSchedule``: any schedule with the first-block guards a DiT family's own schedule carries;
- ``ParabolaRun``: the prediction along the parabola through the last three full steps;
- ``RateGuardRun``: a UNet's reusing call in full once the boundary's predicted change passes a threshold.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch

from tome_core.reuse import LayerReuseRun, NoiseSpacedSchedule
from tome_core.reuse.schedules import MIN_NOISE_LEVEL


@dataclass(frozen=True)
class ReuseVariant:
    # Which steps run in full (a variant always names one: the product's front door picks the shipped one).
    schedule: object | None = None
    # How far along the line the prediction moves (None: the schedule's own, else the model's shipped one).
    extrapolate: float | None = None
    # The blocks that run at every call (None: the shipped ones): a UNet's outer blocks (an int), a DiT's
    # (at the start, at the end).
    outer: int | tuple[int, int] | None = None
    # Where the line is drawn: over the noise level (True, shipped), over its logarithm ("log") or the step (False).
    by_sigma: bool | str = True
    # 2: the prediction follows the parabola through the last three full steps (``ParabolaRun``).
    order: int = 1
    # The first-block guards (``LayerReuseRun``), on a schedule that carries none.
    first_block_guard: float | None = None
    line_guard: float | None = None
    # A UNet's reusing call runs in full once the boundary's predicted change passes this (``RateGuardRun``).
    rate_guard: float | None = None


@dataclass(frozen=True)
class EdgeSchedule(NoiseSpacedSchedule):
    """``NoiseSpacedSchedule`` with more of its edges in full: the first ``full_first`` steps (a UNet's first two: a
    line to extrapolate on), the last ``full_end`` (on top of the one in ``interval``), and the first ``warm_up``
    share of the steps (counted against the one in ``interval``, so the later full steps lie further apart)."""

    full_first: int = 1
    full_end: int = 0
    warm_up: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.full_first < 1 or self.full_end < 0:
            raise ValueError(
                f"full_first must be from 1 up and full_end from 0 up, got {self.full_first!r}, {self.full_end!r}"
            )
        if not 0.0 <= self.warm_up <= 1.0:
            raise ValueError(f"warm_up must be a number from 0 to 1, got {self.warm_up!r}")

    def for_run(self, steps: int, noise_levels=None, full_below: float = 0.0):
        first = max(self.full_first, math.ceil(self.warm_up * steps - 1e-9))
        return self.plan(steps, noise_levels, full_below, first, self.full_end)


@dataclass(frozen=True)
class GuardedSchedule:
    """``schedule`` with first-block guards (read by ``LayerReuse.new_run`` as a DiT family's schedule's)."""

    schedule: object
    first_block_guard: float | None = None
    line_guard: float | None = None

    @property
    def interval(self):
        return self.schedule.interval

    @property
    def extrapolate(self):
        return getattr(self.schedule, "extrapolate", None)

    def for_run(self, steps: int, noise_levels=None, full_below: float = 0.0):
        return self.schedule.for_run(steps, noise_levels, full_below)

    def is_full(self, step: int, steps: int) -> bool:
        return self.schedule.is_full(step, steps)

    def full_steps(self, steps: int) -> int:
        return self.schedule.full_steps(steps)


class ParabolaRun(LayerReuseRun):
    """The prediction along the parabola through the last three full steps' records, moved ``extrapolate`` of the
    way from the last one (exact on a feature quadratic in the position); the line while fewer are recorded."""

    KEEP = 3

    def predict(self, entry, position: float) -> torch.Tensor:
        if not self.extrapolate or len(entry.outputs) < 3 or entry.slope is not None:
            return super().predict(entry, position)
        (xa, a), (xb, b), (xc, c) = entry.outputs[-3:]
        x = position
        la = (x - xb) * (x - xc) / ((xa - xb) * (xa - xc))
        lb = (x - xa) * (x - xc) / ((xb - xa) * (xb - xc))
        lc = (x - xa) * (x - xb) / ((xc - xa) * (xc - xb))
        return torch.lerp(c, a * la + b * lb + c * lc, self.extrapolate)


class RateGuardRun(LayerReuseRun):
    """A UNet's reusing call runs in full once the boundary's change since the last full call, predicted from how
    far the first inner layer's input moved (each call's move times the boundary's change per unit of input change
    between the last two full calls), passes ``rate_guard``."""

    rate_guard = 0.1

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.watched: dict[int, dict] = {}  # per entry: its input at the last two full calls, at the last call

    def _watch_first_input(self, call, first_input: torch.Tensor) -> None:
        super()._watch_first_input(call, first_input)
        seen = self.watched.setdefault(id(call.entry), {"full": [], "last": None, "moved": 0.0})
        if call.reuse and self._passes(call.entry, seen, first_input):
            self.compute_in_full()
            self.guarded_calls += 1
        kept = first_input.detach().clone()
        if not call.reuse:
            seen["full"] = (seen["full"] + [kept])[-2:]
            seen["moved"] = 0.0
        seen["last"] = kept

    def _passes(self, entry, seen: dict, first_input: torch.Tensor) -> bool:
        if len(seen["full"]) < 2 or len(entry.outputs) < 2 or seen["last"] is None:
            return False
        (_, before), (_, last) = entry.outputs[-2:]
        input_before, input_last = seen["full"]
        if first_input.shape != input_last.shape or seen["last"].shape != first_input.shape:
            return False
        rate = _relative_change(last, before) / max(_relative_change(input_last, input_before), 1e-12)
        seen["moved"] += rate * _relative_change(first_input.detach(), seen["last"])
        return seen["moved"] > self.rate_guard


def _relative_change(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float((x - reference).abs().mean() / reference.abs().mean().clamp_min(1e-12))


def _run_class(variant: ReuseVariant) -> type:
    """The run class of ``variant``'s prediction and guard."""
    if variant.order == 2 and variant.rate_guard is not None:
        raise ValueError("the parabola and the rate guard are measured one at a time")
    if variant.order == 2:
        return ParabolaRun
    if variant.rate_guard is not None:
        return type("RateGuardRunAt", (RateGuardRun,), {"rate_guard": variant.rate_guard})
    return LayerReuseRun


def _position(by_sigma):
    """Where a call at ``sigma`` lies on the prediction's line, by ``ReuseVariant.by_sigma`` (None: the shipped)."""
    if by_sigma is True:
        return None
    if by_sigma == "log":
        return lambda sigma: math.log(max(sigma, MIN_NOISE_LEVEL))
    return lambda sigma: None  # the step


def _guarded(variant: ReuseVariant, schedule):
    if schedule is None:
        raise ValueError("a variant names its schedule (the product's front door picks the shipped one)")
    if variant.first_block_guard is None and variant.line_guard is None:
        return schedule
    return GuardedSchedule(schedule, variant.first_block_guard, variant.line_guard)


@contextmanager
def _outer_blocks(module, name: str, outer):
    """The product module's outer-block constant replaced by ``outer`` while it installs (None: as shipped)."""
    if outer is None:
        yield
        return
    with mock.patch.object(module, name, outer):
        yield


def installed_hooks(clone):
    """The reuse hooks a ComfyUI door's ``install`` put on ``clone`` (the owner of its APPLY_MODEL wrapper)."""
    from tome_core.hosts.comfyui import layer_reuse

    wrappers = clone.wrappers.get(layer_reuse.APPLY_MODEL, {}).get(layer_reuse.WRAPPER_KEY, [])
    return wrappers[0].__self__


def _install(door, outer_name: str, clone, settings, noise_range, variant: ReuseVariant) -> bool:
    """``door.install`` (a ComfyUI reuse door) with ``variant``'s changes."""
    with _outer_blocks(door, outer_name, variant.outer):
        installed = door.install(clone, settings, noise_range, _guarded(variant, variant.schedule))
    if installed:
        hooks = installed_hooks(clone)
        if variant.extrapolate is not None:
            hooks.extrapolate = variant.extrapolate
        hooks.run_class = _run_class(variant)
        position = _position(variant.by_sigma)
        if position is not None:
            hooks.position = position
    return installed


def install_unet_variant(clone, settings, noise_range, variant: ReuseVariant) -> bool:
    """``layer_reuse.install`` with ``variant``'s changes (a schedule's own ``extrapolate`` still wins)."""
    from tome_core.hosts.comfyui import layer_reuse

    return _install(layer_reuse, "OUTER_BLOCKS", clone, settings, noise_range, variant)


def install_dit_variant(clone, settings, noise_range, variant: ReuseVariant) -> bool:
    """``dit_reuse.install`` with ``variant``'s changes."""
    from tome_core.hosts.comfyui import dit_reuse

    return _install(dit_reuse, "DIT_OUTER_BLOCKS", clone, settings, noise_range, variant)


def with_warm_up(schedule: NoiseSpacedSchedule, warm_up: float) -> NoiseSpacedSchedule:
    """``schedule`` with its first ``warm_up`` share of the steps in full (0: itself)."""
    if not warm_up:
        return schedule
    return EdgeSchedule(schedule.interval, schedule.short_run, schedule.min_steps, warm_up=warm_up)


__all__ = [
    "GuardedSchedule",
    "ParabolaRun",
    "RateGuardRun",
    "EdgeSchedule",
    "ReuseVariant",
    "install_dit_variant",
    "install_unet_variant",
    "installed_hooks",
    "with_warm_up",
]
