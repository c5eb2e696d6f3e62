"""The candidates a calibration tries (forecast spacings, by their computed steps) and the bounded search for the
fewest computed steps that keep the target. docs/calibration.md, 'The search'."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..reuse.plans import Spacing
from ..reuse.schedules import IntervalSchedule
from .metric import latent_ssim
from .report import draw_report, step_changes

DEFAULT_TARGET = 0.98
TARGET_RANGE = (0.8, 0.999)
MAX_RUNS = 6  # whole runs per calibration, the unpatched one included
# The calibration samples may lose this share of what the target lets the picture lose: one prompt's score
# overstates the others' (docs/calibration.md, 'The margin').
LOSS_SHARE = 0.25
SEARCH = f"nearest-shape spacings, loss share {LOSS_SHARE}"  # in every key: another search keeps nothing of this one
MIN_STEPS = 10  # shorter runs forecast nothing (``IntervalSchedule.min_steps``)
EVERY = (2, 3, 4, 5, 6)
FULL_START = (0.1, 0.15, 0.2)
FULL_END = (1, 2, 3, 4, 6, 8, 12)

Candidate = Spacing


def check_target(target: float) -> float:
    low, high = TARGET_RANGE
    if not isinstance(target, int | float) or not low <= float(target) <= high:
        raise ValueError(f"calibration_target must be a number from {low} to {high}, got {target!r}")
    return float(target)


def asked_of_samples(target: float, share: float = LOSS_SHARE) -> float:
    """The score the calibration samples must keep for ``target`` on the prompts they stand for."""
    return 1.0 - (1.0 - target) * share


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


@dataclass(frozen=True)
class CalibrationResult:
    """What a calibration kept: the spacing (None: every step), its computed steps and the worst sample's score."""

    steps: int
    target: float
    spacing: Spacing | None
    computed: int
    worst: float
    runs: int
    tried: tuple[tuple[int, float], ...] = field(default=())  # (computed steps, worst score) per candidate run
    changes: tuple[float, ...] = field(default=())  # the unpatched run's change per step (``report.step_changes``)
    asked: float | None = None  # the score asked of the calibration samples (``asked_of_samples``)

    def schedule(self) -> IntervalSchedule | None:
        return None if self.spacing is None else self.spacing.schedule(self.spacing.every or 1)

    def as_dict(self) -> dict:
        spacing = self.spacing
        return {
            "steps": self.steps,
            "target": self.target,
            "spacing": None if spacing is None else [spacing.full_start, spacing.full_end, spacing.every],
            "computed": self.computed,
            "worst": round(self.worst, 5),
            "runs": self.runs,
            "tried": [list(item) for item in self.tried],
            "changes": [round(change, 5) for change in self.changes],
            "asked": self.asked,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CalibrationResult:
        spacing = data["spacing"]
        return cls(
            steps=int(data["steps"]),
            target=float(data["target"]),
            spacing=None if spacing is None else Spacing(float(spacing[0]), int(spacing[1]), every=int(spacing[2])),
            computed=int(data["computed"]),
            worst=float(data["worst"]),
            runs=int(data["runs"]),
            tried=tuple((int(c), float(s)) for c, s in data.get("tried", ())),
            changes=tuple(float(change) for change in data.get("changes", ())),
            asked=None if data.get("asked") is None else float(data["asked"]),
        )

    def words(self) -> str:
        if self.spacing is None:
            return (
                f"no candidate kept the target {self.target}{self._asked()} (best tried: "
                f"{max((s for _, s in self.tried), default=0):.3f}): every step runs in full"
            )
        return (
            f"{self.computed} of {self.steps} steps computed, worst sample {self.worst:.4f} (target "
            f"{self.target}{self._asked()})"
        )

    def _asked(self) -> str:
        return "" if self.asked is None else f", asked {self.asked:.4f} of the calibration samples"


class Calibration:
    """One calibration: ``run(sample)`` with ``sample(None)`` the unpatched run's final latent and ``sample(schedule)``
    the same job forecast on ``schedule``, on the same noise; at most ``max_runs`` runs in all."""

    def __init__(
        self,
        base: IntervalSchedule,
        steps: int,
        target: float = DEFAULT_TARGET,
        max_runs: int = MAX_RUNS,
        share: float = LOSS_SHARE,
    ):
        self.target = check_target(target)
        self.asked = asked_of_samples(self.target, share)
        self.steps = steps
        self.max_runs = max_runs
        self.candidates = candidates(base, steps) if steps >= MIN_STEPS else []
        self.counts = [spacing.schedule(spacing.every).full_steps(steps) for spacing in self.candidates]
        self.first = self._nearest(base.full_steps(steps))
        self.started_from: CalibrationResult | None = None
        self.reference: torch.Tensor | None = None
        self.kept: torch.Tensor | None = None  # the kept candidate's latent (the reference where none is kept)

    def start_from(self, other: CalibrationResult | None) -> None:
        """Start from the plan kept for another step count of this job (``KeptCalibrations.nearest``): its share of
        computed steps is tried first, then its neighbour, as a candidate like any other (docs/calibration.md,
        'Another step count')."""
        if other is None or other.spacing is None or other.steps == self.steps or not self.candidates:
            return
        self.first = self._nearest(other.computed / other.steps * self.steps)
        self.started_from = other

    def _nearest(self, count: float) -> int:
        """The index of the candidate whose computed steps are nearest ``count``."""
        return min(range(len(self.counts)), key=lambda i: abs(self.counts[i] - count)) if self.counts else 0

    def run(self, sample: Callable[[IntervalSchedule | None], torch.Tensor], observed=None) -> CalibrationResult:
        """The search: a candidate is kept where its worst sample keeps ``asked`` (``asked_of_samples``).
        ``observed()`` after the unpatched run gives its denoised image per step (the picture's chart)."""
        self.reference = self.kept = sample(None)
        changes = ()
        if observed is not None:
            denoised = observed()
            if len(denoised) == self.steps:
                changes = tuple(step_changes(denoised))
        runs, tried, kept = 1, [], None
        low, high, probe = 0, len(self.candidates) - 1, self.first
        while low <= high and runs < self.max_runs:
            spacing = self.candidates[probe]
            schedule = spacing.schedule(spacing.every)
            latent = sample(schedule)
            worst = float(latent_ssim(latent, self.reference).min())
            runs += 1
            tried.append((schedule.full_steps(self.steps), worst))
            if worst >= self.asked:
                kept, high = (spacing, schedule.full_steps(self.steps), worst), probe - 1
                self.kept = latent
            else:
                low = probe + 1
            # From another step count's plan: its neighbour next, so a plan that transfers costs two runs.
            neighbour = len(tried) == 1 and self.started_from is not None
            probe = (high if kept else low) if neighbour else (low + high) // 2
        spacing, computed, worst = kept or (None, self.steps, 1.0)
        return CalibrationResult(
            self.steps, self.target, spacing, computed, worst, runs, tuple(tried), changes, self.asked
        )

    def picture(self, result: CalibrationResult) -> torch.Tensor:
        """``report.draw_report`` of this calibration (after ``run``)."""
        schedule = result.schedule()
        computed = (
            set(range(self.steps))
            if schedule is None
            else {step for step in range(self.steps) if schedule.is_full(step, self.steps)}
        )
        return draw_report(self.reference, self.kept, list(result.changes) or [0.0] * self.steps, computed)
