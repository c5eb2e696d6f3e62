"""Reuse across steps, layer by layer: between full steps only the UNet's outermost layers run.

A UNet's inner layers (the coarse levels, the middle block and most of the fine ones) change their output
slowly from one sampling step to the next, while the outermost layers (the first input block and the last
output block, at full resolution) carry the fine detail through the skip connection. So at a *reusing* step
the inner layers are not run at all: the last inner layer's output (the feature the outer output block
receives) is predicted from the steps at which it was last computed, and only the outer layers run on the
current input. *Full* steps run everything and record that feature: the first steps (the picture's layout),
the last four steps (its finest detail) and every ``interval``-th step in between; in a run of fewer than 25
steps every second step at least, and in a run of fewer than 10 steps every step. At the default interval (3) a
run of 25 steps or more follows its UNet family's plan (``UNET_LONG_RUN_PLANS``: 12 full steps of 25).

The prediction is the feature of the last full step, moved half way on along the line through the last two full
steps (a damped first-order extrapolation over the noise level, sigma), which follows the feature's drift over the
skipped steps without overshooting it (three quarters of the way in an SD1.x plan).

This module knows no host. An adapter lists the inner layers in the order a call runs them (the last one is
the *boundary*, whose output the outer layers read) and gives each a ``SkippableLayer`` as its forward; the
host's loop and skip connections stay as they are. At a reusing step every inner layer but the boundary
returns zeros of the shape it returned at the last full step (its output only feeds other inner layers), and
the boundary returns the predicted feature.

State: one ``LayerReuseRun`` per sampling run, made by the adapter when the run starts and dropped when it
ends. It holds per batch layout and input shape the boundary's last two outputs and every inner layer's
output shape. A call reuses only when that entry is complete and was made in this run; otherwise it runs in
full (and records).

What every host shares is ``LayerReuse``: the owner of the inner layers' forwards (``attach_forwards`` /
``detach_forwards``), which makes each run and knows the call in progress. A host door says only what differs:
when a run starts and ends, and which step, batch layout and noise level each model call is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# The engine's defaults, shared by every host adapter.
# How far along the line through the last two full steps the prediction moves (1: all the way). Half way, with
# the line drawn over the sigmas (``position``), kept the picture best on both reference models
# (docs/step-reuse.md: 0 and 1 each lose it on one of them).
DEFAULT_EXTRAPOLATE = 0.5
# On DiTs, per family where it was measured to differ: on ref-flux-deep the whole step kept more of the picture
# at every interval and sampler (28 Euler steps every 4: SSIM 0.986 against 0.973; Heun every 4: 0.990 against
# 0.978; docs/dit.md); on ref-qwen too (28 Euler steps every 3: 0.997 against 0.993, lowest 0.994 against 0.966;
# 50 steps every 4: 0.998 against 0.994); on ref-wan it kept the same mean and a lower lowest clip, so Wan keeps
# the half step, and the families without a reference model too.
DIT_EXTRAPOLATE = {"Flux": 1.0, "Qwen-Image": 1.0}
OUTER_BLOCKS = 1  # the first input block and the last output block run at every step of a UNet
# A DiT's blocks that run at every call: (at the start, at the end). The first block makes the span's input at
# each call; the last one is predicted with the others: running it too kept no more of the picture (ref-wan,
# reuse every 4 and 6: SSIM 0.997 and 0.994 either way; docs/dit.md) and costs a block per reusing call.
DIT_OUTER_BLOCKS = (1, 0)


def dit_extrapolate(family: str) -> float:
    """How far along the line a DiT family's prediction moves (``DIT_EXTRAPOLATE``, else the UNets')."""
    return DIT_EXTRAPOLATE.get(family, DEFAULT_EXTRAPOLATE)


@dataclass(frozen=True)
class FullSteps:
    """A run's full steps, planned when the run starts (``NoiseSpacedSchedule.for_run``)."""

    steps: int
    full: frozenset

    def is_full(self, step: int, steps: int) -> bool:
        return steps != self.steps or step in self.full

    def full_steps(self, steps: int) -> int:
        return sum(self.is_full(step, steps) for step in range(steps))


def _check_run_rules(schedule) -> None:
    """The rules both schedules share: ``interval`` from 1 up, ``short_run`` and ``min_steps`` from 0 up."""
    for name, lowest in (("interval", 1), ("short_run", 0), ("min_steps", 0)):
        if getattr(schedule, name) < lowest:
            raise ValueError(f"{name} must be an integer from {lowest} up, got {getattr(schedule, name)!r}")


@dataclass(frozen=True)
class IntervalSchedule:
    """Which steps run every layer: the first ones, the last ones and every ``interval``-th one in between."""

    interval: int  # between the start and the end, one step in ``interval`` is full (1: every step)
    full_start: float = 0.2  # the steps up to this share of the schedule are full (the picture's layout)
    # The last steps are full (the finest detail). Four: a reusing step right before the last two cost ref-sdxl's
    # SSIM 0.926 -> 0.866 at 20 steps and 0.916 -> 0.816 at 12 (ToDo 2, interval 3), and one right before the last
    # three its lowest image's SSIM 0.938 -> 0.842 at 25 steps (docs/step-reuse.md).
    full_end: int = 4
    # A run of fewer steps takes bigger steps, which the prediction misses more: there one step in two at most
    # reuses. On ref-sdxl with ToDo 2 at 20 steps that keeps SSIM at 0.970 where interval 3 gives 0.926, and at 12
    # steps 0.963 against 0.916 (docs/step-reuse.md). 0: no such rule.
    short_run: int = 25
    # A run of fewer steps (distilled models, Lightning/LCM LoRAs, Turbo) reuses nothing: each of its steps changes
    # the picture a lot, and there is little to gain. 0: no such rule.
    min_steps: int = 10
    # How far along the line this schedule's runs move (None: the owner's ``extrapolate``).
    extrapolate: float | None = None

    def __post_init__(self):
        _check_run_rules(self)
        if not 0.0 <= self.full_start <= 1.0:
            raise ValueError(f"full_start must be a number from 0 to 1, got {self.full_start!r}")
        if self.full_end < 0:
            raise ValueError(f"full_end must be an integer from 0 up, got {self.full_end!r}")

    def is_full(self, step: int, steps: int) -> bool:
        if steps < self.min_steps:
            return True
        interval = min(self.interval, 2) if steps < self.short_run else self.interval
        start = max(math.ceil(self.full_start * steps), 2)  # two full steps at least: a line to extrapolate on
        if interval == 1 or step < start or step >= steps - self.full_end:
            return True
        return (step - start) % interval == interval - 1

    def full_steps(self, steps: int) -> int:
        return sum(self.is_full(step, steps) for step in range(steps))

    def for_run(self, steps: int, noise_levels=None, full_below: float = 0.0) -> IntervalSchedule:
        """The schedule of a run of ``steps`` (the same at any noise levels)."""
        return self


# ``reuse_interval`` 3 (the default) on a UNet, in a run of ``UNET_LONG_RUN`` steps or more: 12 full steps of 25
# instead of 14, planned per family on its reference model (docs/step-reuse.md, "The default"), as
# (full_start, full_end, extrapolate). A UNet with attention at its full-resolution level (SD1.x, SD2.x; ref-sd1)
# kept its picture with the first three steps full and three quarters of the line (SSIM 0.963, lowest 0.872, where
# a start of two gave 0.930); one without (SDXL; ref-sdxl) with the last four full and half the line (0.963,
# lowest 0.924, where the last three gave 0.955). Shorter runs and the other intervals keep ``IntervalSchedule``'s
# defaults, as measured before.
UNET_LONG_RUN = 25
UNET_LONG_RUN_PLANS = {True: (0.12, 3, 0.75), False: (0.08, 4, 0.5)}  # by attention at full resolution
UNET_PLANNED_INTERVAL = 3


@dataclass(frozen=True)
class RunLengthSchedule:
    """One schedule for runs of fewer than ``long_run`` steps (``short``), another from there on (``long``)."""

    short: IntervalSchedule
    long: IntervalSchedule
    long_run: int = UNET_LONG_RUN

    @property
    def interval(self) -> int:
        return self.short.interval

    def for_run(self, steps: int, noise_levels=None, full_below: float = 0.0) -> IntervalSchedule:
        return self.long if steps >= self.long_run else self.short

    def is_full(self, step: int, steps: int) -> bool:
        return self.for_run(steps).is_full(step, steps)

    def full_steps(self, steps: int) -> int:
        return self.for_run(steps).full_steps(steps)


def unet_schedule(interval: int, attention_levels, plan: str = "auto") -> IntervalSchedule | RunLengthSchedule:
    """The schedule of ``reuse_interval`` ``interval`` on a UNet whose attention is at ``attention_levels`` (1, 2,
    4, ...: downsampling factors; None where unknown): with ``reuse_plan`` (``plan``) "auto", ``UNET_LONG_RUN_PLANS``
    at the planned interval, else (and with "every N") ``IntervalSchedule``'s defaults."""
    general = IntervalSchedule(interval)
    if plan != "auto" or interval != UNET_PLANNED_INTERVAL or not attention_levels:
        return general
    full_start, full_end, extrapolate = UNET_LONG_RUN_PLANS[1 in attention_levels]
    long = IntervalSchedule(interval, full_start=full_start, full_end=full_end, extrapolate=extrapolate)
    return RunLengthSchedule(general, long)


@dataclass(frozen=True)
class NoiseSpacedSchedule:
    """A DiT's full steps: one step in ``interval`` runs in full, spaced evenly in the logarithm of the noise.

    The first step is full, then a step each time the noise level has fallen by the same fraction since the last
    full one, the fraction chosen as the smallest that keeps the full steps at one in ``interval`` (the steps a
    host runs in full, below ``full_below``, come on top). A flow model's noise falls slowly over most of a run
    and fast over its last steps (Wan's shift 8 at 30 steps: from 1 to 0.90 over the first half, from 0.55 to 0
    over the last three), and its output changes with it: spaced by the noise, the full steps go where the
    output changes, few over the first steps and all of the last ones, where the details form. Spaced by the
    fraction (not by the noise itself), the last steps stay full whatever the model's shift, and only ratios
    count, whatever scale a model's noise levels have. On ref-wan (``uni_pc``, 30 steps) reuse every 8 then
    keeps SSIM 0.993 at 4.4x where fixed intervals kept 0.972 at 3.1x, and on ref-flux-deep (Euler, 28 steps)
    every 3 keeps 0.996 at 2.7x where fixed intervals kept 0.988 at the same speed (docs/dit.md). Spaced by
    the noise itself, the last steps of a weakly shifted run were reused and the picture lost (ref-flux-deep in
    diffusers, shift 1.65: 0.850 at every 3). The plan is made when the run starts, so its speed is known: no
    threshold on the features to tune per model or step count, as the caches that measure the change need. As
    on the UNets, a run of fewer than ``short_run`` steps runs one step in two at least and a run of fewer than
    ``min_steps`` every step."""

    interval: int
    short_run: int = 25
    min_steps: int = 10
    # Steps at the start and at the end that are always full, whatever the noise says. A DiT's first step alone
    # (its flow noise falls slowly at first); a UNet's first two (a line to extrapolate on from the first reusing
    # step) and its last ones (the finest detail: the steps whose error the sampler carries into the picture most,
    # their noise falling by the largest fractions). The end's steps come on top of the one in ``interval``.
    full_first: int = 1
    full_end: int = 0
    # The share of the run's first steps that run in full, counted against the one in ``interval`` (the later
    # full steps lie further apart for it). 0: ``full_first`` alone. Measured, not shipped: it lost the
    # references' picture (docs/dit.md, "How the references change from step to step").
    warm_up: float = 0.0

    def __post_init__(self):
        _check_run_rules(self)
        if self.full_first < 1 or self.full_end < 0:
            raise ValueError(
                f"full_first must be from 1 up and full_end from 0 up, got {self.full_first!r}, {self.full_end!r}"
            )
        if not 0.0 <= self.warm_up <= 1.0:
            raise ValueError(f"warm_up must be a number from 0 to 1, got {self.warm_up!r}")

    def for_run(self, steps: int, noise_levels=None, full_below: float = 0.0) -> FullSteps:
        """The full steps of a run of ``steps`` at ``noise_levels`` (one per step, falling; None or another count:
        evenly spaced)."""
        if steps < self.min_steps:
            return FullSteps(steps, frozenset(range(steps)))
        if noise_levels is None or len(noise_levels) != steps:
            noise_levels = [1.0 - step / steps for step in range(steps)]
        levels = [math.log(max(float(v), MIN_NOISE_LEVEL)) for v in noise_levels]
        interval = min(self.interval, 2) if steps < self.short_run else self.interval
        low_noise = {step for step, level in enumerate(noise_levels) if level < full_below}
        low_noise |= set(range(max(steps - self.full_end, 0), steps))
        # One in ``interval`` of the steps the host lets reuse; the ones it runs in full come on top (counted
        # against them, they left Wan's first 23 of 30 steps one full step with UniPC at shift 3: SSIM 0.862).
        budget = math.ceil((steps - len(low_noise)) / interval) + len(low_noise)
        first = max(self.full_first, math.ceil(self.warm_up * steps - 1e-9))
        forced = set(range(min(first, steps))) | low_noise
        tight, loose = 0.0, max(levels[0] - min(levels), 0.0) + 1.0  # loose: no step but the forced ones
        full = forced
        for _ in range(48):  # bisection: the fewest-noise spacing with at most ``budget`` full steps
            middle = (tight + loose) / 2
            spaced = spaced_by_noise(levels, middle, forced)
            if len(spaced) <= budget:
                loose, full = middle, spaced
            else:
                tight = middle
        return FullSteps(steps, frozenset(full))


# What ``dit_settings`` "auto" runs on each DiT family: reuse across steps at the interval measured to keep its
# picture, as (from this many steps, interval), and no ToDo (on every step it shifts a DiT's colours: same-seed
# SSIM 0.77-0.87 on the references; docs/dit.md). Measured (docs/dit.md, 16 images or clips each): Flux on
# ref-flux-deep, 28 Euler steps every 3 SSIM 0.999 (lowest 0.997) at 2.71x of the work at Flux.1's depth, 50 steps
# every 4 0.999 (0.997) at 3.66x; Wan on ref-wan, 30 uni_pc steps every 5 0.997 (0.971) at 3.44x; Qwen-Image on
# ref-qwen, 28 Euler steps every 3 0.997 (0.994) at 2.72x of the work at its 60 blocks, 50 steps every 4 0.998
# (0.995) at 3.67x. Not measured on a reference of their own, so set as the family they resemble most: SD3 and
# Lumina 2 / Z-Image (one joint stream, as Flux's single blocks) at Flux's intervals; the video families
# (HunyuanVideo, LTX-Video) at every 4, one step more often than Wan's own. Under 10 steps (distilled models)
# every step runs in full whatever the interval.
DIT_AUTO_INTERVALS = {
    "Flux": ((0, 3), (40, 4)),
    "SD3": ((0, 3), (40, 4)),
    "Qwen-Image": ((0, 3), (40, 4)),
    "Lumina 2": ((0, 3), (40, 4)),
    "Z-Image": ((0, 3), (40, 4)),  # diffusers' name of the family ComfyUI loads as Lumina 2's class
    "Wan": ((0, 5),),
    "HunyuanVideo": ((0, 4),),
    "LTX-Video": ((0, 4),),
}
DIT_AUTO_INTERVALS_OTHER = ((0, 3),)  # a family not in the table


@dataclass(frozen=True)
class StepCountSchedule:
    """``NoiseSpacedSchedule`` at an interval chosen by the run's step count: ``intervals`` is ((from this many
    steps, interval), ...), from the fewest steps up (``DIT_AUTO_INTERVALS``)."""

    intervals: tuple[tuple[int, int], ...]

    def __post_init__(self):
        if not self.intervals or self.intervals[0][0] != 0:
            raise ValueError(f"intervals must start at 0 steps, got {self.intervals!r}")

    def interval(self, steps: int) -> int:
        return [interval for start, interval in self.intervals if start <= steps][-1]

    def describe(self) -> str:
        """For the log: ``((0, 3), (40, 4))`` as "every 3 (every 4 from 40 steps)"."""
        later = [f"every {interval} from {start} steps" for start, interval in self.intervals[1:]]
        return f"every {self.intervals[0][1]}" + (f" ({', '.join(later)})" if later else "")

    def for_run(self, steps: int, noise_levels=None, full_below: float = 0.0) -> FullSteps:
        return NoiseSpacedSchedule(self.interval(steps)).for_run(steps, noise_levels, full_below)


def dit_auto_schedule(family: str) -> StepCountSchedule:
    """The schedule ``dit_settings`` "auto" runs on ``family`` (``DIT_AUTO_INTERVALS``)."""
    return StepCountSchedule(DIT_AUTO_INTERVALS.get(family, DIT_AUTO_INTERVALS_OTHER))


MIN_NOISE_LEVEL = 1e-4  # a last call at noise 0 (none of the hosts' schedules has one) counts as this


def spaced_by_noise(levels: list[float], spacing: float, forced: set[int]) -> set[int]:
    """The steps ``forced`` and, after each full step, the first step whose noise lies ``spacing`` below it."""
    full, last = set(), None
    for step, level in enumerate(levels):
        if step in forced or last is None or last - level >= spacing:
            full.add(step)
            last = level
    return full


# Samplers with which reuse across steps keeps the picture, measured on both reference models at 25 steps
# (docs/step-reuse.md, "The default"). With the others every step runs in full (the token reduction still
# applies): Euler ancestral adds fresh noise at every step, which changes the inner layers' input by more than a
# line through earlier steps follows, and DPM++ 2M builds each step on the last ones, so a predicted step's error
# carries on (ref-sdxl SSIM 0.906 and 0.916 with reuse every 3, against 0.973 with Euler and 0.980 with DPM++
# SDE). Unmeasured samplers run in full too. Names are the hosts' own, lower case: ComfyUI's sampler names, the
# WebUI's labels, diffusers' scheduler classes.
SAMPLERS_THAT_KEEP_THE_PICTURE = frozenset(
    {
        *("euler", "heun", "ddim", "dpmpp_sde"),  # ComfyUI
        *("dpm++ sde",),  # the WebUI's labels not already above ("Euler", "Heun", "DDIM")
        *("eulerdiscretescheduler", "heundiscretescheduler", "ddimscheduler", "dpmsolversdescheduler"),  # diffusers
        "flowmatcheulerdiscretescheduler",  # diffusers, flow models (Flux, SD3, Wan): Euler on their sigmas
    }
)


# Noise schedules with which reuse across steps loses the picture whatever the sampler: Karras sigmas (Euler on
# them: ref-sdxl SSIM 0.946, lowest image 0.860, at 25 steps with reuse every 3; docs/step-reuse.md). Their steps
# are spread otherwise than the ones the schedule's full start and end were measured on. Reuse stands down there.
SCHEDULES_THAT_LOSE_THE_PICTURE = frozenset({"karras"})
KARRAS_RHO = 7.0  # the exponent of Karras et al.'s noise schedule, as every host uses it


# Measured on DiTs only (on UNets the multistep DPM++ 2M lost the picture): UniPC, Wan's usual sampler, keeps
# ref-flux-deep's picture at 28 steps: diffusers' UniPCMultistepScheduler SSIM 0.996 / 0.993 / 0.975 at reuse
# every 3 / 4 / 6 (lowest 0.988 / 0.982 / 0.897), ComfyUI's uni_pc 0.995 / 0.982 at every 4 / 6 (lowest 0.986 /
# 0.951; docs/dit.md). ComfyUI's uni_pc_bh2 is not measured.
DIT_SAMPLERS_THAT_KEEP_THE_PICTURE = frozenset({"unipcmultistepscheduler", "uni_pc"})

# UniPC corrects each step with the model's output at the next one (its corrector, UniC), which multiplies a
# predicted output's error where the picture's details form. On ref-wan (diffusers' UniPC, flow shift 3 as Wan
# 2.1 at 480p, 30 steps) reusing the steps at noise 0.635 and 0.563 cost nothing (SSIM 0.9997), the steps at
# 0.478 and 0.376 cost 0.952 (lowest 0.78), and 0.987 with the corrector off; with ComfyUI's shift 8 those noise
# levels fall in the last four steps, which are full anyway. So with UniPC the calls below this noise level (the
# flow sigma, 0 to 1) run in full (docs/dit.md).
SAMPLERS_WITH_A_CORRECTOR = frozenset({"unipcmultistepscheduler", "uni_pc"})
FULL_BELOW_NOISE_WITH_A_CORRECTOR = 0.5


def full_below_noise(sampler: str | None) -> float:
    """The noise level below which every call of a run with ``sampler`` runs in full (0: none)."""
    return FULL_BELOW_NOISE_WITH_A_CORRECTOR if (sampler or "").lower() in SAMPLERS_WITH_A_CORRECTOR else 0.0


def keeps_the_picture_with(sampler: str | None, schedule: str | None = None, dit: bool = False) -> bool:
    """Whether reuse across steps may run with ``sampler`` (a host's name for it) on the noise schedule
    ``schedule`` (a host's name, e.g. "karras"; None: the host's default), on a UNet or (``dit``) a DiT; unknown
    sampler: no, in full."""
    if schedule and schedule.strip().lower() in SCHEDULES_THAT_LOSE_THE_PICTURE:
        return False
    name = (sampler or "").strip().lower()
    return bool(name) and (
        name in SAMPLERS_THAT_KEEP_THE_PICTURE or (dit and name in DIT_SAMPLERS_THAT_KEEP_THE_PICTURE)
    )


def is_karras(sigmas: torch.Tensor, sigma_min: float, sigma_max: float) -> bool:
    """Whether ``sigmas`` (a run's noise levels, the final 0 included or not) are Karras sigmas between
    ``sigma_min`` and ``sigma_max``: for a host that hands over the levels but not the schedule's name."""
    levels = sigmas.detach().double().cpu().flatten()
    if levels.numel() and levels[-1] == 0:
        levels = levels[:-1]
    if levels.numel() < 3 or sigma_min <= 0 or sigma_max <= sigma_min:
        return False
    ramp = torch.linspace(0.0, 1.0, levels.numel(), dtype=torch.float64)
    low, high = sigma_min ** (1 / KARRAS_RHO), sigma_max ** (1 / KARRAS_RHO)
    karras = (high + ramp * (low - high)) ** KARRAS_RHO
    return bool(torch.allclose(levels, karras, rtol=1e-3, atol=0.0))


# A DiT's residual of this size or more keeps the line's slope (the difference of its last two records) in 4
# bits per value, with a scale per token, instead of the record before the last: Wan 2.1 1.3B at 480x832, 81
# frames, with CFG then holds 251 MB (8.9% of its weights) where two records held 403 MB (14%). Smaller caches
# (Flux at 1024 px: 28 MB per record) keep both records whole. The slope moves the prediction by a fraction of
# itself, so its rounding (a fourteenth of a token's largest change at most) is a small part of a small part.
COMPACT_SLOPE_BYTES = 64 * 2**20


class _Entry:
    """One batch layout's record: the boundary's outputs at the last two full steps (or the last one and the
    slope between them, packed), every layer's output shape."""

    __slots__ = ("outputs", "shapes", "slope", "step")

    def __init__(self):
        self.outputs: list[tuple[int, torch.Tensor]] = []  # (step, boundary output), oldest first, at most two
        self.shapes: dict[int, object] = {}
        self.slope: _PackedSlope | None = None  # with one output: the line from the record before it
        self.step = -1  # the run's step of the last record

    # Both kept out of a compiled graph (torch.compile of the UNet): they compare and weigh the noise levels, which
    # a graph would take as constants and compile again at every step.
    @torch.compiler.disable
    def record(self, position: float, output: torch.Tensor, compact: bool = False, keep: int = 2) -> None:
        if self.outputs and self.outputs[-1][0] == position:  # the same step again (another call of this layout)
            self.outputs.pop()
            self.slope = None
        if compact and self.outputs and output.shape[-1] % 2 == 0:
            last_position, last = self.outputs[-1]
            self.slope = _PackedSlope.of(output - last, last_position)
            self.outputs = [(position, output)]
            return
        self.slope = None
        self.outputs = (self.outputs + [(position, output)])[-keep:]

    @torch.compiler.disable
    def predict(self, position: float, extrapolate: float, order: int = 1) -> torch.Tensor:
        last_position, last = self.outputs[-1]
        if order == 2 and extrapolate and len(self.outputs) >= 3 and self.slope is None:
            # The parabola through the last three records, moved ``extrapolate`` of the way from the last one.
            (xa, a), (xb, b), (xc, c) = self.outputs[-3:]
            x = position
            la = (x - xb) * (x - xc) / ((xa - xb) * (xa - xc))
            lb = (x - xa) * (x - xc) / ((xb - xa) * (xb - xc))
            lc = (x - xa) * (x - xb) / ((xc - xa) * (xc - xb))
            curve = a * la + b * lb + c * lc
            return torch.lerp(c, curve, extrapolate)
        if self.slope is not None:
            if not extrapolate:
                return last
            ahead = (position - last_position) / (last_position - self.slope.position)
            return last + self.slope.unpacked(last.dtype) * (extrapolate * ahead)
        if not extrapolate or len(self.outputs) < 2:
            return last
        first_position, first = self.outputs[-2]
        ahead = (position - last_position) / (last_position - first_position)
        return torch.lerp(first, last, 1.0 + extrapolate * ahead)

    def nbytes(self) -> int:
        held = sum(t.numel() * t.element_size() for _, t in self.outputs)
        return held + (self.slope.nbytes() if self.slope is not None else 0)


class _PackedSlope:
    """The difference of two records in 4 bits per value (two to a byte), with a float32 scale per token (the
    last axis), and the position of the earlier record."""

    __slots__ = ("packed", "scale", "position")
    ROWS = 4096  # tokens packed at a time: the float32 working copies stay small beside the cache itself

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, position: float):
        self.packed, self.scale, self.position = packed, scale, position

    @classmethod
    def of(cls, slope: torch.Tensor, position: float) -> _PackedSlope:
        rows = slope.reshape(-1, slope.shape[-1])
        packed = torch.empty(rows.shape[0], rows.shape[1] // 2, dtype=torch.uint8, device=slope.device)
        scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=slope.device)
        for start in range(0, rows.shape[0], cls.ROWS):
            wide = rows[start : start + cls.ROWS].float()
            step = wide.abs().amax(dim=-1, keepdim=True) / 7
            levels = torch.round(wide / step.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-7, 7)
            codes = (levels + 8).to(torch.uint8)  # 1 to 15
            packed[start : start + cls.ROWS] = codes[:, 0::2] | (codes[:, 1::2] << 4)
            scale[start : start + cls.ROWS] = step
        shape = slope.shape[:-1]
        return cls(packed.reshape(*shape, -1), scale.reshape(*shape, 1), position)

    def unpacked(self, dtype: torch.dtype) -> torch.Tensor:
        """The slope in ``dtype`` (the codes are small integers, exact in any float type)."""
        codes = torch.stack((self.packed & 15, self.packed >> 4), dim=-1).flatten(-2)
        return (codes.to(dtype) - 8) * self.scale.to(dtype)

    def nbytes(self) -> int:
        return self.packed.numel() + self.scale.numel() * self.scale.element_size()


@dataclass
class _Call:
    """The current model call: its step, whether it reuses, and its batch layout's entry."""

    step: int
    position: float
    reuse: bool
    entry: _Entry
    span_input: torch.Tensor | None = None  # a DiT's full call: the inner span's input (see ``start_span``)


class LayerReuseRun:
    """The cache of one sampling run (see the module docstring); also counts what it did, for the log."""

    def __init__(self, schedule: IntervalSchedule, steps: int, layers: int, extrapolate: float = DEFAULT_EXTRAPOLATE):
        self.schedule = schedule
        self.steps = steps
        self.layers = layers  # how many inner layers there are; the last one is the boundary
        self.extrapolate = extrapolate
        self.order = 1  # 2: the prediction follows the parabola through the last three full steps
        self.entries: dict[object, _Entry] = {}
        self.current: _Call | None = None
        self.last_step = -1
        # The latest step the schedule (or the user's step range) ran in full. A batch layout that missed it (the
        # host split or joined cond and uncond differently since, as ComfyUI does by its memory estimate) would
        # draw its line through the steps before: its call runs in full and records afresh instead.
        self.latest_full_step = -1
        self.calls = 0
        self.reused_calls = 0
        # The noise level below which the host runs every call in full (``full_below_noise``; 0: none).
        self.full_below = 0.0
        # What the log calls the layers that always run and the prediction (a DiT door says "blocks").
        self.outer_words = "the outer layers (the first input block and the last output block)"
        self.inner_words = "layers' output"

    def drop(self) -> None:
        self.entries.clear()
        self.current = None
        self.latest_full_step = -1

    def begin_call(self, step: int | None, key: object, allowed: bool = True, position: float | None = None) -> bool:
        """Start a model call at ``step`` (None: not on this run's schedule) for the batch layout ``key``;
        ``allowed`` False runs it in full whatever the schedule says (outside the user's step range).
        ``position`` is where the call lies on the line the prediction follows (default: the step).

        Returns True when the call reuses (its inner layers will not run)."""
        self.calls += 1
        if step is None:  # off the schedule: nothing cached may belong to it, and it records nothing
            self.drop()
            return False
        if step < self.last_step:  # going back: not the run the cache was made in; it starts anew here
            self.drop()
        self.last_step = step
        entry = self.entries.setdefault(key, _Entry())
        scheduled = allowed and not self.schedule.is_full(step, self.steps)
        if not scheduled:
            self.latest_full_step = step
        reuse = (
            scheduled
            and len(entry.shapes) == self.layers
            and bool(entry.outputs)
            and entry.step >= self.latest_full_step
        )
        self.current = _Call(step, float(step if position is None else position), reuse, entry)
        self.reused_calls += reuse
        return reuse

    def end_call(self) -> None:
        self.current = None

    def run_layer(self, index: int, forward: Callable, args: tuple, kwargs: dict):
        """The forward of inner layer ``index``: run and record (full call), or stand in for it (reusing call).

        The boundary's output is a tensor, or a tuple whose first item is the tensor (diffusers' blocks)."""
        call = self.current
        if call is None:
            return forward(*args, **kwargs)
        boundary = index == self.layers - 1
        if call.reuse:
            spec = call.entry.shapes[index]
            if not boundary:
                return _zeros_like_spec(spec)
            predicted = call.entry.predict(call.position, self.extrapolate, self.order)
            return predicted if isinstance(spec[0], tuple) else spec[0]((predicted,))
        out = forward(*args, **kwargs)
        call.entry.shapes[index] = _spec_of(out)
        if boundary:
            feature = out if isinstance(out, torch.Tensor) else _first_tensor(out)
            if feature is None:  # a boundary without a tensor to predict: this layout never reuses
                call.entry.shapes.pop(index)
            else:
                # A copy: the host may add to its output in place (ControlNet).
                call.entry.record(call.position, feature.detach().clone(), keep=self.order + 1)
                call.entry.step = call.step
        return out

    # A DiT's blocks run one after the other, with no skip connection around them: there the inner blocks are one
    # *span*, and what is predicted is the span's residual (its output minus its input), added at a reusing call
    # to the input the outer blocks give the span at that call. The host door calls ``start_span`` at the span's
    # first block and ``end_span`` / ``predicted_span_output`` at its last, with the streams joined into one tensor.

    def start_span(self, joined_input: torch.Tensor) -> bool:
        """The inner span's first block is about to run, on ``joined_input``. Returns True when the call reuses
        (the span's blocks are to be skipped). A reusing call whose input does not have the recorded residual's
        shape (another token layout) is turned into a full one here, before anything was skipped."""
        call = self.current
        if call is None:
            return False
        if call.reuse and tuple(joined_input.shape) != call.entry.shapes[0][0]:
            self.reused_calls -= 1
            call.reuse = False
            call.entry.outputs.clear()
            call.entry.shapes.clear()
        if not call.reuse:
            # A copy: the host may change its tensors in place later in the call (ControlNet residuals).
            call.span_input = joined_input.detach().clone()
        return call.reuse

    def compute_in_full(self) -> None:
        """The call in progress runs every block after all (asked before anything was skipped)."""
        call = self.current
        if call is not None and call.reuse:
            self.reused_calls -= 1
            call.reuse = False

    def end_span(self, joined_output: torch.Tensor) -> None:
        """A full call's span ended with ``joined_output``: record its residual."""
        call = self.current
        if call is None or call.span_input is None or joined_output.shape != call.span_input.shape:
            return
        residual = joined_output.detach() - call.span_input
        call.span_input = None
        call.entry.shapes[0] = _spec_of(residual)
        compact = residual.numel() * residual.element_size() >= COMPACT_SLOPE_BYTES
        call.entry.record(call.position, residual, compact)
        call.entry.step = call.step

    def predicted_span_output(self, joined_input: torch.Tensor) -> torch.Tensor:
        """A reusing call: the span's output, its input plus the residual predicted from the last full calls."""
        call = self.current
        return joined_input + call.entry.predict(call.position, self.extrapolate).to(joined_input.dtype)

    def span_block(
        self, first: bool, last: bool, streams: dict, run_block: Callable, streams_of: Callable, in_full=None, pack=None
    ):
        """One block of a DiT's inner span, at the call in progress (``current`` must be set).

        ``streams``: the block's input streams by name, in token order (None where absent); ``run_block()`` runs
        the block and returns what the host's block returns, ``streams_of(out)`` its output streams.
        ``in_full()`` (the span's first block only): True where this call must run every block after all.
        Returns the block's own output (it ran) or, where the span is skipped, the streams it passes on: its
        input, or at the span's last block the input plus the predicted residual (as ``pack(streams)`` where
        given: in the form the host's block returns)."""
        if first:
            if in_full is not None and in_full():
                self.compute_in_full()
            reuse = self.start_span(join_streams(streams))
        else:
            reuse = self.current.reuse
        if not reuse:
            out = run_block()
            if last:
                self.end_span(join_streams(streams_of(out)))
            return out
        passed = streams if not last else split_streams(self.predicted_span_output(join_streams(streams)), streams)
        return passed if pack is None else pack(passed)

    def cache_bytes(self) -> int:
        """What the cache holds now: the recorded boundary outputs of every batch layout."""
        return sum(entry.nbytes() for entry in self.entries.values())

    def summary(self) -> str:
        return (
            f"{self.calls - self.reused_calls} of {self.calls} model calls computed in full; {self.reused_calls} ran "
            f"only {self.outer_words}, with the inner {self.inner_words} predicted from earlier steps"
        )


def join_streams(streams: dict) -> torch.Tensor:
    """A DiT block's streams (e.g. text and image tokens) as one tensor, tokens after tokens in the dict's order;
    None entries are left out."""
    present = [t for t in streams.values() if t is not None]
    return present[0] if len(present) == 1 else torch.cat(present, 1)


def split_streams(joined: torch.Tensor, like: dict) -> dict:
    """The inverse of ``join_streams``, with the token counts of ``like`` (None entries stay None)."""
    names = [name for name, t in like.items() if t is not None]
    parts = [joined] if len(names) == 1 else torch.split(joined, [like[name].shape[1] for name in names], 1)
    out = dict.fromkeys(like)
    out.update(zip(names, parts, strict=True))
    return out


def _spec_of(out):
    """What a stand-in for ``out`` needs: shape, dtype and device of each tensor, the container's type."""
    if isinstance(out, torch.Tensor):
        return (tuple(out.shape), out.dtype, out.device)
    if isinstance(out, (tuple, list)):
        return (type(out), [_spec_of(item) for item in out])
    return ("value", out)


def _first_tensor(out):
    """The feature of a boundary that returns a one-item tuple (diffusers' ``return_dict=False``), else None."""
    if isinstance(out, tuple) and len(out) == 1 and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _zeros_like_spec(spec):
    if isinstance(spec[0], tuple):
        shape, dtype, device = spec
        return torch.zeros(shape, dtype=dtype, device=device)
    if spec[0] == "value":
        return spec[1]
    kind, items = spec
    return kind(_zeros_like_spec(item) for item in items)


class LayerReuse:
    """The owner of one patch's ``SkippableLayer`` forwards: makes each sampling run's ``LayerReuseRun`` and holds
    the run of the model call in progress (``layer_run``), which the forwards ask for. Hosts subclass it with
    their way of finding runs and steps, or hold one."""

    def __init__(self, schedule: IntervalSchedule, layers: int, extrapolate: float = DEFAULT_EXTRAPOLATE):
        self.schedule = schedule
        self.layers = layers  # how many inner layers there are; the last one is the boundary
        self.extrapolate = extrapolate
        self.order = 1  # see ``LayerReuseRun.order``
        self._current: LayerReuseRun | None = None

    def __deepcopy__(self, memo):
        return self  # shared by every copy of the model options that hold it, like a function

    def layer_run(self) -> LayerReuseRun | None:
        return self._current

    def new_run(self, steps: int, noise_levels=None, full_below: float = 0.0) -> LayerReuseRun:
        """A run of ``steps`` at ``noise_levels`` (one per step; what a DiT's schedule spaces its full steps by),
        whose calls below ``full_below`` run in full (``full_below_noise``)."""
        schedule = self.schedule.for_run(steps, noise_levels, full_below)
        reach = getattr(schedule, "extrapolate", None)  # a schedule's own reach (a UNet family's plan)
        run = LayerReuseRun(schedule, steps, self.layers, self.extrapolate if reach is None else reach)
        run.full_below = full_below
        run.order = self.order
        return run

    def begin_call(self, run: LayerReuseRun, step: int | None, key: object, allowed=True, position=None) -> bool:
        """A model call of ``run`` starts (see ``LayerReuseRun.begin_call``); the layers follow it until
        ``end_call``. Returns True when it reuses."""
        reuse = run.begin_call(step, key, allowed=allowed, position=position)
        self._current = run
        return reuse

    def end_call(self, failed: bool = False) -> LayerReuseRun | None:
        """The model call is over; ``failed``: it raised, so what it recorded may be half-made and the run's cache
        goes (the next calls run in full). Returns the call's run (None if no call was in progress)."""
        run, self._current = self._current, None
        if run is not None:
            run.end_call()
            if failed:
                run.drop()
        return run


def attach_forwards(owner, layers, forward_class=None) -> None:
    """Give every inner layer (in call order) a ``SkippableLayer`` (or ``forward_class``, a subclass) of ``owner``
    as its instance ``forward``. One left by another owner that was never detached (a clone's) is replaced,
    keeping what was there before it."""
    forward_class = forward_class or SkippableLayer
    for index, layer in enumerate(layers):
        current = layer.__dict__.get("forward")
        if isinstance(current, SkippableLayer):
            current = current.inner
        layer.__dict__["forward"] = forward_class(owner, index, layer, current)


def detach_forwards(modules, owned: Callable[[object], bool]) -> None:
    """Remove every ``SkippableLayer`` forward whose owner ``owned(owner)`` accepts from ``modules``, putting back
    what was there before it; the layers then compute exactly as before."""
    for module in modules:
        current = module.__dict__.get("forward")
        if isinstance(current, SkippableLayer) and owned(current.owner):
            if current.inner is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = current.inner


class SkippableLayer:
    """The ``forward`` of one inner layer while layer reuse is on (an instance attribute of the layer).

    ``owner.layer_run()`` gives the run of the current call, or None outside a sampling run."""

    def __init__(self, owner, index: int, layer, inner=None):
        self.owner = owner
        self.index = index
        self.layer = layer
        self.inner = inner  # an instance-level forward that was there before ours (None: the class's)

    def __deepcopy__(self, memo):
        return self

    def original(self, *args, **kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.layer).forward(self.layer, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        run = self.owner.layer_run()
        if run is None:
            return self.original(*args, **kwargs)
        return run.run_layer(self.index, self.original, args, kwargs)
