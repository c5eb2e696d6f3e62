"""What a calibration tries: one plan per count of computed steps, fewest first. On a UNet the forecast spacings
nearest the default's shape; on a DiT its family's plan at other intervals, its guards as they are (looser or
tighter ones were measured and dropped). docs/calibration.md, 'The candidates' and 'DiTs'."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..reuse.plans import Spacing
from ..reuse.schedules import IntervalSchedule, NoiseSpacedSchedule, StepCountSchedule

MIN_STEPS = 10  # shorter runs reuse nothing (``IntervalSchedule.min_steps``)
EVERY = (2, 3, 4, 5, 6)
FULL_START = (0.1, 0.15, 0.2)
FULL_END = (1, 2, 3, 4, 6, 8, 12)
DIT_INTERVALS = (2, 3, 4, 5, 6, 7, 8)
# The share of the last steps in full: the counts between one in 2 and every step.
DIT_FULL_END = (0.0, 0.1, 0.2, 0.3, 0.45, 0.6)


@dataclass(frozen=True)
class Candidate:
    """One plan to try: what a result keeps (a UNet's ``Spacing``; a DiT's interval and last full steps), the
    schedule a host runs, and the computed steps it plans at this run (a DiT's guards may compute more)."""

    kept: Spacing | tuple[int, int]
    schedule: object
    count: int


def as_spacing(schedule: IntervalSchedule, steps: int) -> Spacing:
    """``schedule`` at a run of ``steps`` as a fixed spacing (a short run's interval is at most 2)."""
    every = min(schedule.interval, 2) if steps < schedule.short_run else schedule.interval
    return Spacing(schedule.full_start, schedule.full_end, every=every)


def candidates(base: IntervalSchedule, steps: int) -> list[Spacing]:
    """One spacing per count of computed steps under ``steps`` (ascending): ``base`` (the plan's own at this run
    length) for its count, for the others the one nearest ``base`` in shape. (Placements ranked by the unpatched
    run's own line lost the picture on unseen prompts: docs/calibration.md, 'The search'.)"""
    own = as_spacing(base, steps)
    best: dict[int, tuple[float, Spacing]] = {}
    grid = [Spacing(start, end, every=every) for every in EVERY for start in FULL_START for end in FULL_END]
    for spacing in [own, *grid]:
        count = spacing.schedule(spacing.every).full_steps(steps)
        if count >= steps:
            continue
        rank = abs(spacing.every - own.every) + abs(spacing.full_end - own.full_end) / 4
        rank += abs(spacing.full_start - own.full_start) * 10
        if count not in best or rank < best[count][0]:
            best[count] = (rank, spacing)
    return [best[count][1] for count in sorted(best)]


def unet_candidates(base: IntervalSchedule, steps: int) -> list[Candidate]:
    if steps < MIN_STEPS:
        return []
    return [
        Candidate(spacing, schedule, schedule.full_steps(steps))
        for spacing in candidates(base, steps)
        for schedule in (spacing.schedule(spacing.every),)
    ]


DitSchedule = StepCountSchedule | NoiseSpacedSchedule


def own_interval(base: DitSchedule, steps: int) -> int:
    return base.interval(steps) if isinstance(base, StepCountSchedule) else base.interval


def with_interval(base: DitSchedule, interval: int, full_end: int = 0) -> DitSchedule:
    """A DiT's plan ``base`` at ``interval`` at any run length with its last ``full_end`` steps in full, its curve
    and guards as they are."""
    if isinstance(base, StepCountSchedule):
        return replace(base, intervals=((0, interval),), short_run=0, full_end=full_end)
    return replace(base, interval=interval, short_run=0, full_end=full_end)


def plan_words(schedule: DitSchedule) -> str:
    """A DiT patch's own plan, in its calibration key: a plan kept under one plan is never another's."""
    if isinstance(schedule, StepCountSchedule):
        return schedule.describe()
    return f"every {schedule.interval} by noise level"


def planned(schedule: DitSchedule, steps: int, noise_levels=None, full_below: float = 0.0) -> int:
    return schedule.for_run(steps, noise_levels, full_below).full_steps(steps)


def dit_candidates(base: DitSchedule, steps: int, noise_levels=None, full_below: float = 0.0) -> list[Candidate]:
    """One plan per count of planned computed steps under ``steps`` (ascending): an interval of ``DIT_INTERVALS``
    with a share ``DIT_FULL_END`` of the last steps in full, the one nearest ``base``'s own interval with the fewest
    last steps where two plan as many."""
    if steps < MIN_STEPS:
        return []
    own = own_interval(base, steps)
    best: dict[int, tuple[float, Candidate]] = {}
    for interval in DIT_INTERVALS:
        for full_end in sorted({round(share * steps) for share in DIT_FULL_END}):
            schedule = with_interval(base, interval, full_end)
            count = planned(schedule, steps, noise_levels, full_below)
            rank = abs(interval - own) + full_end / 4
            if count < steps and (count not in best or rank < best[count][0]):
                best[count] = (rank, Candidate((interval, full_end), schedule, count))
    return [best[count][1] for count in sorted(best)]
