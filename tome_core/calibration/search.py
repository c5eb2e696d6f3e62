"""The bounded search for the fewest computed steps that keep the target, and what it keeps. docs/calibration.md,
'The search'."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..reuse.plans import Spacing
from ..reuse.schedules import IntervalSchedule
from .candidates import Candidate, DitSchedule, dit_candidates, planned, unet_candidates, with_interval
from .metric import latent_ssim
from .report import draw_report, step_changes

DEFAULT_TARGET = 0.98
TARGET_RANGE = (0.8, 0.999)
MAX_RUNS = 6  # whole runs per calibration, the unpatched one included
# The calibration samples may lose this share of what the target lets the picture lose: one prompt's score
# overstates the others' (docs/calibration.md, 'The margin').
LOSS_SHARE = 0.25
# In every key: another search keeps nothing of this one.
SEARCH = f"nearest-shape spacings, loss share {LOSS_SHARE}, reduction decided against the unreduced run"


def check_target(target: float) -> float:
    low, high = TARGET_RANGE
    if not isinstance(target, int | float) or not low <= float(target) <= high:
        raise ValueError(f"calibration_target must be a number from {low} to {high}, got {target!r}")
    return float(target)


def asked_of_samples(target: float, share: float = LOSS_SHARE) -> float:
    """The score the calibration samples must keep for ``target`` on the prompts they stand for."""
    return 1.0 - (1.0 - target) * share


@dataclass(frozen=True)
class CalibrationResult:
    """What a calibration kept: a UNet's spacing or a DiT's interval (neither: every step), its computed steps and
    the worst sample's score."""

    steps: int
    target: float
    spacing: Spacing | None
    computed: int
    worst: float
    runs: int
    tried: tuple[tuple[int, float], ...] = field(default=())  # (computed steps, worst score) per candidate run
    changes: tuple[float, ...] = field(default=())  # the unpatched run's change per step (``report.step_changes``)
    asked: float | None = None  # the score asked of the calibration samples (``asked_of_samples``)
    interval: int | None = None  # a DiT's: its family's plan at this interval (``candidates.with_interval``)
    last_full: int = 0  # a DiT's: and its last steps in full
    reduce: bool = True  # whether ToDo or ToMe, where the patch sets them, runs at the kept plan's computed steps

    @property
    def kept(self) -> bool:
        """Whether a plan was kept (else every step runs in full)."""
        return self.spacing is not None or self.interval is not None

    def schedule(self) -> IntervalSchedule | None:
        """A UNet's kept forecast schedule (None: every step, or a DiT's, which ``dit_schedule`` makes)."""
        return None if self.spacing is None else self.spacing.schedule(self.spacing.every or 1)

    def dit_schedule(self, base: DitSchedule) -> DitSchedule | None:
        """A DiT's kept plan: its family's plan ``base`` at the kept interval and last full steps (None: every
        step)."""
        return None if self.interval is None else with_interval(base, self.interval, self.last_full)

    def as_dict(self) -> dict:
        spacing = self.spacing
        return {
            "steps": self.steps,
            "target": self.target,
            "spacing": None if spacing is None else [spacing.full_start, spacing.full_end, spacing.every],
            "interval": self.interval,
            "last_full": self.last_full,
            "reduce": self.reduce,
            "computed": self.computed,
            "worst": round(self.worst, 5),
            "runs": self.runs,
            "tried": [list(item) for item in self.tried],
            "changes": [round(change, 5) for change in self.changes],
            "asked": self.asked,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CalibrationResult:
        spacing, interval = data["spacing"], data.get("interval")
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
            interval=None if interval is None else int(interval),
            last_full=int(data.get("last_full", 0)),
            reduce=bool(data.get("reduce", True)),
        )

    def words(self) -> str:
        if not self.kept:
            return (
                f"no candidate kept the target {self.target}{self._asked()} (best tried: "
                f"{max((s for _, s in self.tried), default=0):.3f}): every step runs in full"
                f"{'' if self.reduce else ', without ToDo or ToMe'}"
            )
        last = f" and the last {self.last_full}" if self.last_full else ""
        plan = "" if self.interval is None else f" (the family's plan at one step in {self.interval}{last})"
        without = "" if self.reduce else ", without ToDo or ToMe"
        return (
            f"{self.computed} of {self.steps} steps computed{plan}{without}, worst sample {self.worst:.4f} (target "
            f"{self.target}{self._asked()})"
        )

    def _asked(self) -> str:
        return "" if self.asked is None else f", asked {self.asked:.4f} of the calibration samples"


class Calibration:
    """One calibration: ``run(sample)`` with ``sample(None)`` the unpatched run's final latent and ``sample(schedule)``
    the same job on a candidate's ``schedule``, on the same noise; at most ``max_runs`` runs in all. A UNet's
    candidates are forecasts of ``base`` (an ``IntervalSchedule``); ``for_dit`` makes a DiT's. ``reduces``: the
    patch sets ToDo or ToMe; then every run reads ``reducing`` (whether it runs them at its computed steps): the
    unpatched run never does, and the search decides them (docs/calibration.md, 'ToDo and ToMe')."""

    def __init__(
        self,
        base: IntervalSchedule | None,
        steps: int,
        target: float = DEFAULT_TARGET,
        max_runs: int = MAX_RUNS,
        share: float = LOSS_SHARE,
        tried: list[Candidate] | None = None,
        own: int | None = None,
        reduces: bool = False,
    ):
        self.target = check_target(target)
        self.asked = asked_of_samples(self.target, share)
        self.steps = steps
        self.max_runs = max_runs
        self.options = unet_candidates(base, steps) if tried is None else tried
        self.candidates = [candidate.kept for candidate in self.options]
        self.counts = [candidate.count for candidate in self.options]
        self.first = self._nearest(base.full_steps(steps) if own is None else own)
        self.dit = tried is not None
        self.reduces = reduces
        self.reducing = False  # what the next ``sample`` runs: ToDo or ToMe at its computed steps or not
        self.noise_levels, self.full_below = None, 0.0  # where a DiT's planned steps lie (``for_dit``)
        self.started_from: CalibrationResult | None = None
        self.reference: torch.Tensor | None = None
        self.kept: torch.Tensor | None = None  # the kept candidate's latent (the reference where none is kept)
        self.kept_schedule = None

    @classmethod
    def for_dit(
        cls, base: DitSchedule, steps: int, noise_levels=None, full_below: float = 0.0, **options
    ) -> Calibration:
        """A DiT's calibration: its family's plan ``base`` at other intervals (``candidates.dit_candidates``)."""
        tried = dit_candidates(base, steps, noise_levels, full_below)
        calibration = cls(None, steps, tried=tried, own=planned(base, steps, noise_levels, full_below), **options)
        calibration.noise_levels, calibration.full_below = noise_levels, full_below
        return calibration

    def start_from(self, other: CalibrationResult | None) -> None:
        """Start from the plan kept for another step count of this job (``KeptCalibrations.nearest``): its share of
        computed steps is tried first, then its neighbour, as a candidate like any other (docs/calibration.md,
        'Another step count')."""
        if other is None or not other.kept or other.steps == self.steps or not self.candidates:
            return
        self.first = self._nearest(other.computed / other.steps * self.steps)
        self.started_from = other

    def _nearest(self, count: float) -> int:
        """The index of the candidate whose computed steps are nearest ``count``."""
        return min(range(len(self.counts)), key=lambda i: abs(self.counts[i] - count)) if self.counts else 0

    def run(
        self,
        sample: Callable[[object], torch.Tensor],
        observed: Callable[[], list] | None = None,
        counted: Callable[[], int | None] | None = None,
    ) -> CalibrationResult:
        """The search: a candidate is kept where its worst sample keeps ``asked`` (``asked_of_samples``).
        ``observed()`` after the unpatched run gives its denoised image per step (the picture's chart);
        ``counted()`` after a candidate's run the steps it computed, where a guard may add some (None: as planned).
        Where the patch reduces tokens, the first candidate that misses runs again without the reduction: if that
        keeps more of the picture, the reduction lost it and the search goes on without it."""
        self.reducing = False
        self.reference = self.kept = sample(None)
        changes = ()
        if observed is not None:
            denoised = observed()
            if len(denoised) == self.steps:
                changes = tuple(step_changes(denoised))
        runs, tried, kept = 1, [], None
        reduce, decided = self.reduces, not self.reduces
        low, high, probe = 0, len(self.options) - 1, self.first
        while low <= high and runs < self.max_runs:
            candidate = self.options[probe]
            computed, worst, latent = self._try(sample, candidate, reduce, counted)
            runs += 1
            tried.append((computed, worst))
            if worst < self.asked and not decided and runs < self.max_runs:
                decided = True  # ToDo alone may lose the picture: the same plan once without it
                alone = self._try(sample, candidate, False, counted)
                runs += 1
                tried.append(alone[:2])
                if alone[1] > worst:  # the reduction lost more of the picture than the forecast: it goes
                    reduce, (computed, worst, latent) = False, alone
            if worst >= self.asked:
                decided, high = True, probe - 1
                if kept is None or computed <= kept[1]:  # a guard may compute more on a sparser plan
                    kept = (candidate, computed, worst)
                    self.kept, self.kept_schedule = latent, candidate.schedule
            else:
                low = probe + 1
            # From another step count's plan: its neighbour next, so a plan that transfers costs two runs.
            neighbour = len(tried) == 1 and self.started_from is not None
            probe = (high if kept else low) if neighbour else (low + high) // 2
        candidate, computed, worst = kept or (None, self.steps, 1.0)
        kept_as = None if candidate is None else candidate.kept
        return CalibrationResult(
            self.steps,
            self.target,
            None if self.dit else kept_as,
            computed,
            worst,
            runs,
            tuple(tried),
            changes,
            self.asked,
            interval=kept_as[0] if self.dit and kept_as else None,
            last_full=kept_as[1] if self.dit and kept_as else 0,
            reduce=not self.reduces or (reduce and kept is not None),  # no plan: every step unreduced
        )

    def _try(self, sample, candidate: Candidate, reduce: bool, counted) -> tuple[int, float, torch.Tensor]:
        """(computed steps, worst sample's score, latent) of one run of ``candidate``, reducing tokens or not."""
        self.reducing = reduce
        latent = sample(candidate.schedule)
        worst = float(latent_ssim(latent, self.reference).min())
        computed = counted() if counted is not None else None
        return (candidate.count if computed is None else computed), worst, latent

    def picture(self, result: CalibrationResult) -> torch.Tensor:
        """``report.draw_report`` of this calibration (after ``run``)."""
        computed = set(range(self.steps))
        if result.kept and self.kept_schedule is not None:
            plan = self.kept_schedule.for_run(self.steps, self.noise_levels, self.full_below)
            computed = {step for step in range(self.steps) if plan.is_full(step, self.steps)}
        return draw_report(self.reference, self.kept, list(result.changes) or [0.0] * self.steps, computed)
