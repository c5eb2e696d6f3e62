"""Which steps of a sampling run run in full (the others reuse); the settings each host runs are in ``plans``.
Method: docs/step-reuse.md, 'What it does'."""

from __future__ import annotations

import math
from dataclasses import dataclass

SHORT_RUN = 25  # shorter runs reuse one step in two at most: docs/step-reuse.md, 'Fewer steps'


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
    for name, lowest in (("interval", 1), ("short_run", 0), ("min_steps", 0)):
        if getattr(schedule, name) < lowest:
            raise ValueError(f"{name} must be an integer from {lowest} up, got {getattr(schedule, name)!r}")


@dataclass(frozen=True)
class IntervalSchedule:
    """Which steps run every layer: the first ones, the last ones and every ``interval``-th one in between."""

    interval: int
    full_start: float = 0.2
    full_end: int = 4
    short_run: int = SHORT_RUN
    min_steps: int = 10  # shorter runs (distilled, Lightning/LCM, Turbo) reuse nothing
    extrapolate: float | None = None  # None: the owner's ``extrapolate``

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
        return self


@dataclass(frozen=True)
class RunLengthSchedule:
    """One schedule for runs of fewer than ``long_run`` steps (``short``), another from there on (``long``)."""

    short: IntervalSchedule
    long: IntervalSchedule
    long_run: int

    @property
    def interval(self) -> int:
        return self.short.interval

    def for_run(self, steps: int, noise_levels=None, full_below: float = 0.0) -> IntervalSchedule:
        # Low-noise calls in full: docs/step-reuse.md, 'DPM++ 2M on Karras sigmas: the low-noise calls in full'.
        if full_below > 0:
            return self.short
        return self.long if steps >= self.long_run else self.short

    def is_full(self, step: int, steps: int) -> bool:
        return self.for_run(steps).is_full(step, steps)

    def full_steps(self, steps: int) -> int:
        return self.for_run(steps).full_steps(steps)


@dataclass(frozen=True)
class NoiseSpacedSchedule:
    """A DiT's full steps: one in ``interval``, spaced evenly in the logarithm of the noise, planned when the run
    starts (docs/dit.md, 'Reuse across steps (`reuse_interval`)')."""

    interval: int
    short_run: int = SHORT_RUN
    min_steps: int = 10
    full_end: int = 0  # the last steps, full whatever the noise says (a calibration's denser candidates)

    def __post_init__(self):
        _check_run_rules(self)

    def for_run(self, steps: int, noise_levels=None, full_below: float = 0.0) -> FullSteps:
        """The full steps of a run at ``noise_levels`` (None: evenly spaced), the first step always full."""
        return self.plan(steps, noise_levels, full_below, first=1, end=self.full_end)

    def plan(self, steps: int, noise_levels, full_below: float, first: int, end: int) -> FullSteps:
        """``for_run`` with the first ``first`` and the last ``end`` steps full whatever the noise says."""
        if steps < self.min_steps:
            return FullSteps(steps, frozenset(range(steps)))
        if noise_levels is None or len(noise_levels) != steps:
            noise_levels = [1.0 - step / steps for step in range(steps)]
        levels = [math.log(max(float(v), MIN_NOISE_LEVEL)) for v in noise_levels]
        interval = min(self.interval, 2) if steps < self.short_run else self.interval
        low_noise = {step for step, level in enumerate(noise_levels) if level < full_below}
        low_noise |= set(range(max(steps - end, 0), steps))
        # The host's own full steps come on top, or the high-noise stretch would be left without full steps.
        budget = math.ceil((steps - len(low_noise)) / interval) + len(low_noise)
        forced = set(range(min(first, steps))) | low_noise
        tight, loose = 0.0, max(levels[0] - min(levels), 0.0) + 1.0
        full = forced
        for _ in range(48):  # bisection: the smallest spacing with at most ``budget`` full steps
            middle = (tight + loose) / 2
            spaced = spaced_by_noise(levels, middle, forced)
            if len(spaced) <= budget:
                loose, full = middle, spaced
            else:
                tight = middle
        return FullSteps(steps, frozenset(full))


@dataclass(frozen=True)
class StepChangeCurve:
    """A real model's step-to-step change (MagCache's calibrated ``ratios``, the first 1.0) and the error a reused
    stretch may accumulate (``threshold``, counted as MagCache counts it): keeps reuse where the model moves slowly."""

    ratios: tuple[float, ...]
    threshold: float

    def __post_init__(self):
        if len(self.ratios) < 2 or min(self.ratios) <= 0:
            raise ValueError(f"ratios must be two or more positive numbers, got {self.ratios!r}")
        if self.threshold <= 0:
            raise ValueError(f"threshold must be a positive number, got {self.threshold!r}")

    def at(self, steps: int) -> list[float]:
        last = len(self.ratios) - 1
        if steps < 2:
            return [1.0] * steps
        return [self.ratios[round(step * last / (steps - 1))] for step in range(steps)]

    def errors(self, full, steps: int) -> list[float]:
        """Each step's accumulated error where the steps ``full`` run in full (0 at a full step)."""
        acc, err, out = 1.0, 0.0, []
        for step, ratio in enumerate(self.at(steps)):
            if step in full:
                acc, err = 1.0, 0.0
            else:
                acc *= ratio
                err += abs(1.0 - acc)
            out.append(err)
        return out

    def guard(self, full, steps: int) -> frozenset:
        """``full`` and, from the start, every step that would take its stretch's error past the threshold."""
        guarded, acc, err = set(full), 1.0, 0.0
        for step, ratio in enumerate(self.at(steps)):
            if step not in guarded:
                acc *= ratio
                if err + abs(1.0 - acc) > self.threshold:
                    guarded.add(step)
                else:
                    err += abs(1.0 - acc)
                    continue
            acc, err = 1.0, 0.0
        return frozenset(guarded)


@dataclass(frozen=True)
class StepCountSchedule:
    """``NoiseSpacedSchedule`` at an interval by step count (``intervals``: ((from steps, interval), ...)),
    optionally guarded by the model's ``curve``."""

    intervals: tuple[tuple[int, int], ...]
    curve: StepChangeCurve | None = None
    first_block_guard: float | None = None  # see ``LayerReuseRun.first_block_guard``; read by ``LayerReuse.new_run``
    line_guard: float | None = None  # see ``LayerReuseRun.line_guard``
    short_run: int = SHORT_RUN
    full_end: int = 0  # see ``NoiseSpacedSchedule.full_end``

    def __post_init__(self):
        if not self.intervals or self.intervals[0][0] != 0:
            raise ValueError(f"intervals must start at 0 steps, got {self.intervals!r}")
        for name in ("first_block_guard", "line_guard"):
            value = getattr(self, name)
            if value is not None and not 0.0 < value:
                raise ValueError(f"{name} must be above 0 (or None), got {value!r}")
        if self.short_run < 0:
            raise ValueError(f"short_run must be an integer from 0 up, got {self.short_run!r}")

    def interval(self, steps: int) -> int:
        return [interval for start, interval in self.intervals if start <= steps][-1]

    def describe(self) -> str:
        """For the log: ``((0, 3), (40, 4))`` as "every 3 (every 4 from 40 steps)"."""
        later = [f"every {interval} from {start} steps" for start, interval in self.intervals[1:]]
        described = f"every {self.intervals[0][1]}" + (f" ({', '.join(later)})" if later else "")
        if self.full_end:
            described += f", the last {self.full_end} steps"
        if self.curve is not None:
            described += " and wherever the real model's published step-to-step change asks for a full step"
        guards = []
        if self.first_block_guard is not None:
            guards.append(f"moved more than {self.first_block_guard:g} since the last full one")
        if self.line_guard is not None:
            guards.append(f"lies more than {self.line_guard:g} off the line through the last two full ones")
        if guards:
            described += ", each reusing step in full where the first block's output " + " or ".join(guards)
        return described

    def for_run(self, steps: int, noise_levels=None, full_below: float = 0.0) -> FullSteps:
        spaced = NoiseSpacedSchedule(self.interval(steps), self.short_run, full_end=self.full_end)
        planned = spaced.for_run(steps, noise_levels, full_below)
        if self.curve is None:
            return planned
        return FullSteps(steps, self.curve.guard(planned.full, steps))


MIN_NOISE_LEVEL = 1e-4  # a last call at noise 0 (none of the hosts' schedules has one) counts as this


def spaced_by_noise(levels: list[float], spacing: float, forced: set[int]) -> set[int]:
    """The steps ``forced`` and, after each full step, the first step whose noise lies ``spacing`` below it."""
    full, last = set(), None
    for step, level in enumerate(levels):
        if step in forced or last is None or last - level >= spacing:
            full.add(step)
            last = level
    return full
