"""The reuse plans as records and ``decide``, what a sampling pass runs. A shipped plan never changes, so saved jobs
keep their picture: docs/how-it-works.md, 'Adding a plan or a sampler'. The constants are measured:
docs/step-reuse.md, 'The default'."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .samplers import BETA, KARRAS_PART, loses_the_picture_on, on_karras, sampler_kind
from .schedules import IntervalSchedule, RunLengthSchedule

DEFAULT_EXTRAPOLATE = 0.5
OUTER_BLOCKS = 1  # the first input block and the last output block run at every step of a UNet
DIT_OUTER_BLOCKS = (1, 0)  # a DiT's blocks that run at every call: (at the start, at the end)

# (full_start, full_end, extrapolate), keyed by whether the UNet has attention at full resolution (SD1.x/2.x).
UNET_LONG_RUN = 25
UNET_LONG_RUN_PLANS = {True: (0.12, 3, 0.75), False: (0.08, 4, 0.5)}
UNET_PLANNED_INTERVAL = 3

WHOLE_STEP_REACH = 0.75

FORECAST, LAYERS, FULL = "forecast", "layers", "full"


@dataclass(frozen=True)
class Spacing:
    """A forecast's computed steps: the first ``full_start`` share, the last ``full_end``, one in N between."""

    full_start: float
    full_end: int
    most: int | None = None
    every: int | None = None  # a calibrated spacing: one in ``every`` at any run length, whatever the interval

    def schedule(self, interval: int) -> IntervalSchedule:
        if self.every is not None:
            return IntervalSchedule(self.every, self.full_start, self.full_end, short_run=0,
                                    extrapolate=WHOLE_STEP_REACH)  # fmt: skip
        spacing = interval if self.most is None else min(interval, self.most)
        return IntervalSchedule(spacing, self.full_start, self.full_end, extrapolate=WHOLE_STEP_REACH)


@dataclass(frozen=True)
class Rule:
    """What a plan runs with one sampler kind on one kind of schedule."""

    runs: str  # FORECAST or LAYERS (a kind without a rule runs every step)
    spacings: tuple[tuple[int, Spacing], ...] = ()  # FORECAST: (from this many steps on, spacing)
    full_below: float = 0.0  # LAYERS: the calls below this noise level run in full
    fallback: Rule | None = None  # FORECAST: what runs where the host cannot forecast the output
    refused_on: frozenset[str] = frozenset()  # schedules on which the rule loses the picture: every step runs there


# (sampler kind, on Karras sigmas) -> Rule
Rules = Mapping[tuple[str, bool], Rule]


@dataclass(frozen=True)
class ReusePlan:
    """One value of ``reuse_plan``: its rules, whether layer reuse takes the family's measured plan, its tooltip."""

    name: str
    rules: Rules
    measured_layers: bool
    tooltip: str
    default: bool = field(default=False)
    calibrates: bool = field(default=False)  # a host calibrates its forecasts per job (``tome_core.calibration``)

    def samplers(self) -> str:
        off = sorted(kind for kind, karras in self.rules if not karras)
        on = sorted(kind for kind, karras in self.rules if karras)
        words = ", ".join(off)
        return words + (f", and {', '.join(on)} on Karras sigmas" if on else "") if words else "none"


@dataclass(frozen=True)
class Decision:
    """What one sampling pass runs (FORECAST, LAYERS or FULL) and the one log line that says why."""

    runs: str
    why: str
    schedule: IntervalSchedule | RunLengthSchedule | None = None
    full_below: float = 0.0
    fallback: Decision | None = None


_LAYERS = Rule(LAYERS)
_DPMPP_2M_LOW_NOISE = Rule(LAYERS, full_below=1.0)  # its two-step update carries a miss into the next step
_EULER = Spacing(0.15, 3)
_DPMPP_2M_FIRST_10 = Spacing(0.39, 3, 2)
_DPMPP_2M_FIRST_4 = Spacing(0.15, 3, 2)
_DPMPP_2M_HIGH_NOISE = Spacing(0.15, 12, 2)  # off Karras its low-noise steps carry a miss on: they all run
_EULER_FORECAST = Rule(FORECAST, ((0, _EULER),), fallback=_LAYERS)
_OFF_KARRAS_LAYERS: Rules = {(kind, False): _LAYERS for kind in ("euler", "heun", "dpmpp_sde", "flow_euler")}
_AUTO_RULES: Rules = {**_OFF_KARRAS_LAYERS, ("dpmpp_2m", True): _DPMPP_2M_LOW_NOISE}


def _forecast_rules(*dpmpp_2m: tuple[int, Spacing]) -> Rules:
    return {
        **_AUTO_RULES,
        ("euler", False): _EULER_FORECAST,
        ("dpmpp_2m", True): Rule(FORECAST, dpmpp_2m, fallback=_DPMPP_2M_LOW_NOISE),
    }


_FORECAST_V2_RULES = _forecast_rules((0, _DPMPP_2M_FIRST_10), (UNET_LONG_RUN, _DPMPP_2M_FIRST_4))
# Heun's calls below this noise level run in full: docs/step-reuse.md, 'Heun under forecast v3'.
HEUN_FULL_BELOW = 0.4
_FORECAST_V3_RULES = {
    **_FORECAST_V2_RULES,
    ("dpmpp_2m", False): Rule(FORECAST, ((0, _DPMPP_2M_HIGH_NOISE),), refused_on=frozenset({BETA})),
    ("heun", False): Rule(LAYERS, full_below=HEUN_FULL_BELOW),
}
CALIBRATED = "calibrated"

_PLAN_LIST = (
    ReusePlan(
        "forecast v3",
        _FORECAST_V3_RULES,
        measured_layers=True,
        default=True,
        tooltip="forecast v3 (the default): with Euler or DDIM the first 4 steps of 25, one in reuse_interval after "
        "and the last 3 run the model (13 of 25 at 3), with DPM++ 2M on Karras sigmas the first 4, one in 2 and the "
        "last 3 (16 of 25; under 25 steps as forecast), with DPM++ 2M on other sigmas the first 4, one in 2 and the "
        "last 12 (20 of 25); the other steps run nothing, their output drawn along the line through the last two "
        "computed steps; Heun as auto with its calls below sigma 0.4 in full; other samplers as auto.",
    ),
    ReusePlan(
        "forecast v2",
        _FORECAST_V2_RULES,
        measured_layers=True,
        tooltip="forecast v2: the same, but DPM++ 2M off Karras sigmas runs every step and Heun as auto.",
    ),
    ReusePlan(
        "forecast",
        _forecast_rules((0, _DPMPP_2M_FIRST_10)),
        measured_layers=True,
        tooltip="forecast: the same, but DPM++ 2M on Karras sigmas runs its first 10 steps (19 of 25).",
    ),
    ReusePlan(
        "auto",
        _AUTO_RULES,
        measured_layers=True,
        tooltip="auto: at reuse_interval 3 from 25 steps, the plan measured for the UNet's family (SD1.x/SD2.x or "
        "SDXL: 12 full steps of 25), otherwise as every N, the steps between running the outermost layers; DPM++ 2M "
        "on Karras sigmas: as every N with every call below sigma 1 in full.",
    ),
    ReusePlan(
        "every N",
        _OFF_KARRAS_LAYERS,
        measured_layers=False,
        tooltip="every N: the first fifth of the steps, the last four and one in N in between (14 of 25 at 3), and "
        "DPM++ 2M on Karras sigmas every step in full, as workflows saved before this input existed run.",
    ),
    ReusePlan(
        CALIBRATED,
        _FORECAST_V3_RULES,
        measured_layers=True,
        calibrates=True,
        tooltip="calibrated (ComfyUI, the A1111 WebUI, diffusers): the first job with a model, its LoRAs, sampler, "
        "noise levels, CFG and size runs unpatched, then a few forecasts on the same noise, and keeps the fewest "
        "computed steps whose latent stays at calibration_target (SSIM, 0.98) or more; later jobs with all of these "
        "the same run that plan; other samplers as forecast v3. On a DiT the candidates are its family's plan at one "
        "step in 2 to 8 (and a share of the last steps in full).",
    ),
)
REUSE_PLANS: dict[str, ReusePlan] = {plan.name: plan for plan in _PLAN_LIST}
DEFAULT_REUSE_PLAN = next(plan.name for plan in _PLAN_LIST if plan.default)

# UniPC's corrector multiplies a miss where the details form, so its low-noise calls run in full.
FULL_BELOW_NOISE_WITH_A_CORRECTOR = 0.5
DIT_PLAN = ReusePlan(
    "DiT",
    {
        **_OFF_KARRAS_LAYERS,
        ("unipc", False): Rule(LAYERS, full_below=FULL_BELOW_NOISE_WITH_A_CORRECTOR),
    },
    measured_layers=False,
    tooltip="",
)


def kept_plan(plan: str, sampler: str | None, schedule: str | None, spacing: Spacing | None) -> ReusePlan:
    """``plan``'s record with a calibration's ``spacing`` for this sampler (None: every step in full)."""
    record = REUSE_PLANS[plan]
    rules = dict(record.rules)
    key = (sampler_kind(sampler), on_karras(schedule))
    if spacing is None:
        rules.pop(key, None)
    else:
        rules[key] = Rule(FORECAST, ((0, spacing),))
    return ReusePlan(f"{plan} (kept)", rules, record.measured_layers, tooltip="")


def may_forecast(plan: str) -> bool:
    """Whether ``plan`` forecasts whole steps with any sampler (a host then wires the whole-step forward too)."""
    return any(rule.runs == FORECAST for rule in REUSE_PLANS[plan].rules.values())


def unet_schedule(interval: int, attention_levels, plan: str = "auto") -> IntervalSchedule | RunLengthSchedule:
    """The layer-reuse schedule of ``plan`` at ``interval`` on a UNet with attention at ``attention_levels``."""
    general = IntervalSchedule(interval)
    if not REUSE_PLANS[plan].measured_layers or interval != UNET_PLANNED_INTERVAL or not attention_levels:
        return general
    full_start, full_end, extrapolate = UNET_LONG_RUN_PLANS[1 in attention_levels]
    long = IntervalSchedule(interval, full_start=full_start, full_end=full_end, extrapolate=extrapolate)
    return RunLengthSchedule(general, long, UNET_LONG_RUN)


def _forecast_schedule(spacings, interval: int) -> IntervalSchedule | RunLengthSchedule:
    by_length = dict(spacings)
    short = by_length[0].schedule(interval)
    long_run = max(by_length)
    return short if long_run == 0 else RunLengthSchedule(short, by_length[long_run].schedule(interval), long_run)


def _decision(rule: Rule, interval: int, why: str) -> Decision:
    if rule.runs == LAYERS:
        return Decision(LAYERS, why, full_below=rule.full_below)
    fallback = _decision(rule.fallback, interval, why) if rule.fallback is not None else Decision(FULL, why)
    if interval is None:  # a DiT's full steps are its family's: no forecast plan applies
        return fallback or Decision(FULL, why)
    return Decision(FORECAST, why, _forecast_schedule(rule.spacings, interval), fallback=fallback)


def decide(
    plan: str | ReusePlan, sampler: str | None, schedule: str | None, interval: int | None = None, dit: bool = False
) -> Decision:
    """What a pass of ``sampler`` on ``schedule`` (host names) runs under ``plan`` (a name or a kept record) at
    ``interval`` (None: a DiT family's own)."""
    record = DIT_PLAN if dit else plan if isinstance(plan, ReusePlan) else REUSE_PLANS[plan]
    karras = on_karras(schedule)
    on = f"sampler {sampler or '(unknown)'}{' on karras sigmas' if karras else ''}"
    if interval is not None and interval <= 1:
        return Decision(FULL, "reuse_interval 1")
    if schedule == KARRAS_PART:
        return Decision(
            FULL,
            f"sampler {sampler or '(unknown)'} on part of a Karras schedule (denoise below 1, a "
            "later pass or split sigmas): no plan is measured there",
        )
    if not dit and loses_the_picture_on(schedule):
        return Decision(FULL, f"sampler {sampler or '(unknown)'} on {schedule} sigmas: the plans lose the picture")
    rule = record.rules.get((sampler_kind(sampler), karras))
    if rule is None:
        return Decision(FULL, f"{on} is not one it keeps the picture with ({_with(record, dit)})")
    if (schedule or "").strip().lower() in rule.refused_on:
        return Decision(FULL, f"{on} on {schedule} sigmas: reuse_plan {record.name!r} loses the picture there")
    words = "forecast" if rule.runs == FORECAST else "layer reuse"
    return _decision(rule, interval, f"{on}: {words} under reuse_plan {record.name!r}")


def _with(record: ReusePlan, dit: bool) -> str:
    return f"{record.samplers()}{'' if dit else f' under reuse_plan {record.name!r}'}"
