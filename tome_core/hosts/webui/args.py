"""The WebUI script's arguments: order, casting and range checks, infotext and paste-back. The UI and the API
(``alwayson_scripts["ToMe Patch"]["args"]``, uncoerced JSON) fill the same positional slots, so ``ARGS`` is
append-only; engine settings take defaults, ranges and tooltips from ``settings.SPECS``.
docs/how-it-works.md, 'API values and generation parameters'."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ...reuse import REUSE_PLANS
from ...settings import IMPLIED_WHEN_ABSENT, METHOD_LABELS, SPECS, PatchSettings

MAX_DOWNSAMPLE_LABELS = ("auto", "1", "2", "4", "8")  # "auto" is the engine's 0


@dataclass(frozen=True)
class Arg:
    name: str  # attribute of ScriptArgs
    label: str  # UI label, also used in error messages
    kind: str  # "bool", "float", "int", "method", "max_downsample", "choice"
    default: Any
    tooltip: str
    minimum: float | None = None
    maximum: float | None = None
    step: float | None = None
    choices: tuple = ()
    # When the value acts (``controls_shown``): with this method and this ToMe scope (None: any), and for a highres
    # pass value while "same as first pass" is unticked.
    method: str | None = None
    scope: str | None = None
    own_hr: bool = False


def _from_spec(
    name: str, label: str, spec_name: str | None = None, tooltip: str | None = None, own_hr: bool = False
) -> Arg:
    spec = SPECS[spec_name or name]
    kind = "choice" if spec.kind == "choice" else spec.kind
    return Arg(
        name,
        label,
        kind,
        spec.default,
        tooltip or spec.tooltip,
        spec.minimum,
        spec.maximum,
        spec.step,
        spec.choices,
        spec.method,
        spec.scope,
        own_hr,
    )


# The positional order of ui() and of the API's args. Append only.
ARGS: tuple[Arg, ...] = (
    Arg("enabled", "Enable", "bool", False, "Turn ToMe Patch on for this generation."),
    Arg(
        "method",
        "Method",
        "method",
        METHOD_LABELS[SPECS["method"].default],
        SPECS["method"].tooltip,
        choices=tuple(METHOD_LABELS.values()),
    ),
    _from_spec("ratio", "Ratio (ToMe)"),
    _from_spec("downsample_factor", "Downsample factor (ToDo)"),
    Arg(
        "hr_same",
        "Highres pass: same as first pass",
        "bool",
        True,
        "With highres fix, use the values above for the second pass too. Untick to give it its own value.",
    ),
    _from_spec(
        "hr_ratio", "Highres pass ratio (ToMe)", "ratio", "ToMe ratio for the highres (second) pass.", own_hr=True
    ),
    _from_spec(
        "hr_downsample_factor",
        "Highres pass downsample factor (ToDo)",
        "downsample_factor",
        "ToDo downsample factor for the highres (second) pass.",
        own_hr=True,
    ),
    Arg(
        "hr_only",
        "Highres pass only",
        "bool",
        False,
        "Leave the first pass unpatched and reduce only the large highres pass (where the speed-up is biggest "
        "and the composition is already fixed). Without highres fix nothing is reduced.",
    ),
    Arg(
        "max_downsample",
        "Max downsample",
        "max_downsample",
        "auto",
        SPECS["max_downsample"].tooltip.replace("0 = automatic", "auto"),
        choices=MAX_DOWNSAMPLE_LABELS,
    ),
    _from_spec("sx", "Stride x (ToMe)"),
    _from_spec("sy", "Stride y (ToMe)"),
    _from_spec(
        "use_rand",
        "Random destinations (ToMe)",
        tooltip="ToMe: pick the destination token of each cell at random, seeded from the job's seed (same seed, "
        "same picture), instead of the top-left one. Never touches the sampler's random numbers.",
    ),
    _from_spec("merge_attn", "Merge self-attention (ToMe)"),
    _from_spec("merge_crossattn", "Merge cross-attention (ToMe)"),
    _from_spec("merge_mlp", "Merge MLP (ToMe)"),
    _from_spec("downsample_method", "Downsample method (ToDo)"),
    _from_spec(
        "end_percent",
        "Stop after (fraction of steps)",
        tooltip="Stop reducing after this fraction of the sampling schedule (1 = until the last step); the later "
        "steps, which refine details, then run unreduced.",
    ),
    _from_spec("skip_when_slower", "Skip where slower"),
    _from_spec("scope", "Scope (ToMe)"),
    _from_spec("reuse_interval", "Reuse interval (across steps)"),
    _from_spec("reuse_plan", "Reuse plan (across steps)"),
    _from_spec(
        "calibration_target",
        "Calibration target (same-seed SSIM)",
        tooltip="ToMe and ToDo: with reuse plan calibrated, the same-seed SSIM of the final latent against the "
        "unpatched one that the calibration of a new job keeps at the fewest computed steps (0.8 to 0.999; higher "
        "keeps more steps). Another target is another kept plan: the next job calibrates again.",
    ),
    Arg(
        "calibration_picture",
        "Show the calibration's picture",
        "bool",
        False,
        "ToMe and ToDo: with reuse plan calibrated, the job that calibrates adds the calibration's picture to the "
        "gallery (the unpatched and the calibrated latent, their difference amplified, the change per step with the "
        "computed steps in orange). It is saved beside the kept file in any case (reports/<key>.png).",
    ),
)
ARG_NAMES = tuple(arg.name for arg in ARGS)
_BY_NAME = {arg.name: arg for arg in ARGS}

# The controls whose values decide which other controls act, and those others (in ARGS order).
VISIBILITY_INPUTS = ("method", "hr_same", "scope")
CONDITIONAL = tuple(arg.name for arg in ARGS if arg.method or arg.scope or arg.own_hr)


# What acts on a DiT (Forge Neo), which runs its family's default; reuse_interval 1 turns reuse off.
DIT_CONTROLS = ("hr_only", "end_percent", "reuse_interval")


def controls_shown_on(dit: bool, *choices: Any) -> dict[str, bool]:
    """For every control but the enable box: does it act on the loaded model (``dit``: a DiT family's default
    runs) with these choices (the values of ``VISIBILITY_INPUTS``)?"""
    shown = dict.fromkeys(ARG_NAMES[1:], True)
    shown.update(controls_shown(*choices))
    if dit:
        shown = {name: name in DIT_CONTROLS for name in shown}
    return shown


def controls_shown(*choices: Any) -> dict[str, bool]:
    """For each control of ``CONDITIONAL``: does it act with these values of ``VISIBILITY_INPUTS`` as the UI holds
    them? A value that does not read counts as the default."""
    method, hr_same, scope = (
        _read_or_default(name, value) for name, value in zip(VISIBILITY_INPUTS, choices, strict=True)
    )
    shown = {}
    for name in CONDITIONAL:
        arg = _BY_NAME[name]
        shown[name] = (
            (arg.method is None or arg.method == method)
            and (arg.scope is None or (method == "tome" and arg.scope == scope))
            and not (arg.own_hr and hr_same)
        )
    return shown


@dataclass(frozen=True)
class ScriptArgs:
    """The script's arguments after casting and range checks (see ``parse_args``)."""

    enabled: bool
    method: str  # engine name: "tome" or "todo"
    ratio: float
    downsample_factor: float
    hr_same: bool
    hr_ratio: float
    hr_downsample_factor: float
    hr_only: bool
    max_downsample: int  # engine value: 0 is auto
    sx: int
    sy: int
    use_rand: bool
    merge_attn: bool
    merge_crossattn: bool
    merge_mlp: bool
    downsample_method: str
    end_percent: float
    skip_when_slower: bool
    scope: str
    reuse_interval: int
    reuse_plan: str
    calibration_target: float
    calibration_picture: bool  # the host's: the gallery gets the calibration's picture (not an engine setting)

    def settings_for_pass(self, is_hr_pass: bool, seed: int = 0) -> PatchSettings | None:
        """The engine settings for one sampling pass, or None where this pass must stay unpatched."""
        if not self.enabled or (self.hr_only and not is_hr_pass):
            return None
        use_hr_values = is_hr_pass and not self.hr_same
        values = {
            "method": self.method,
            "ratio": self.hr_ratio if use_hr_values else self.ratio,
            "downsample_factor": self.hr_downsample_factor if use_hr_values else self.downsample_factor,
            "max_downsample": self.max_downsample,
            "end_percent": self.end_percent,
            "skip_when_slower": self.skip_when_slower,
            "sx": self.sx,
            "sy": self.sy,
            "use_rand": self.use_rand,
            "seed": int(seed) % (int(SPECS["seed"].maximum) + 1),
            "merge_attn": self.merge_attn,
            "merge_crossattn": self.merge_crossattn,
            "merge_mlp": self.merge_mlp,
            "downsample_method": self.downsample_method,
            "scope": self.scope,
            "reuse_interval": self.reuse_interval,
            "reuse_plan": self.reuse_plan,
            "calibration_target": self.calibration_target,
        }
        settings = PatchSettings.from_values(**values)
        return None if settings.is_noop else settings


def _problem(arg: Arg, index: int, expected: str, value: Any) -> ValueError:
    return ValueError(f'ToMe Patch argument {index} "{arg.label}" ({arg.name}) must be {expected}, got {value!r}')


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off", "")


def _cast(arg: Arg, index: int, value: Any) -> Any:
    if arg.kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise _problem(arg, index, "true or false", value)
    if arg.kind == "method":
        text = str(value).strip().lower() if isinstance(value, str) else None
        if text in METHOD_LABELS:
            return text
        raise _problem(arg, index, "one of " + ", ".join(repr(label) for label in METHOD_LABELS.values()), value)
    if arg.kind == "max_downsample":
        text = str(value).strip().lower() if not isinstance(value, bool) else None
        if text in ("auto", "0", "0.0"):
            return 0
        for label in MAX_DOWNSAMPLE_LABELS[1:]:
            if text in (label, label + ".0"):
                return int(label)
        raise _problem(arg, index, "one of " + ", ".join(repr(label) for label in MAX_DOWNSAMPLE_LABELS), value)
    if arg.kind == "choice":
        if isinstance(value, str) and value in arg.choices:
            return value
        raise _problem(arg, index, "one of " + ", ".join(repr(c) for c in arg.choices), value)
    # Numbers: JSON may send them as strings ("0.5"); never booleans.
    number = value
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise _problem(arg, index, f"a number from {arg.minimum:g} to {arg.maximum:g}", value) from None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or math.isnan(number):
        raise _problem(arg, index, f"a number from {arg.minimum:g} to {arg.maximum:g}", value)
    if not arg.minimum <= number <= arg.maximum:
        raise _problem(arg, index, f"a number from {arg.minimum:g} to {arg.maximum:g}", value)
    if arg.kind == "int":
        if number != int(number):
            raise _problem(arg, index, f"a whole number from {arg.minimum:g} to {arg.maximum:g}", value)
        return int(number)
    return float(number)


def parse_args(args) -> ScriptArgs:
    """Cast and range-check the positional args (missing or None: the default), combinations included; raises
    ValueError naming the first bad one and its range."""
    args = list(args or ())
    if len(args) > len(ARGS):
        raise ValueError(f"ToMe Patch takes at most {len(ARGS)} arguments ({', '.join(ARG_NAMES)}), got {len(args)}")
    values = {}
    for index, arg in enumerate(ARGS):
        raw = args[index] if index < len(args) else None
        values[arg.name] = _cast(arg, index, arg.default if raw is None else raw)
    parsed = ScriptArgs(**values)
    if parsed.enabled:
        both_passes = dataclasses.replace(parsed, hr_only=False)
        for is_hr_pass in (False, True):
            try:
                both_passes.settings_for_pass(is_hr_pass)
            except ValueError as err:
                raise ValueError(f"ToMe Patch: {err}") from None
    return parsed


def with_overrides(parsed: ScriptArgs, overrides: dict) -> ScriptArgs:
    """``parsed`` with some values replaced by name (X/Y/Z plot axes), cast and checked like the args; an
    override turns the patch on, since a plot axis of ours is meaningless with the patch off."""
    if not overrides:
        return parsed
    values = {name: _cast(_BY_NAME[name], ARG_NAMES.index(name), value) for name, value in overrides.items()}
    return parse_args([getattr(dataclasses.replace(parsed, **values, enabled=True), name) for name in ARG_NAMES])


def as_list(parsed: ScriptArgs) -> list:
    """The positional args (UI/API form) that ``parse_args`` turns back into ``parsed``."""
    values = []
    for name in ARG_NAMES:
        value = getattr(parsed, name)
        if name == "method":
            value = METHOD_LABELS[value]
        elif name == "max_downsample":
            value = _max_downsample_label(value)
        values.append(value)
    return values


def defaults() -> ScriptArgs:
    return parse_args([])


# --- infotext -------------------------------------------------------------------------------------------------
# Keys of our own (never the WebUI's "Token merging ratio"), written only for a pass that was really patched.
KEY_METHOD = "ToMe method"
KEY_RATIO = "ToMe ratio"
KEY_FACTOR = "ToMe downsample"
KEY_HR_RATIO = "ToMe hr ratio"
KEY_HR_FACTOR = "ToMe hr downsample"
KEY_HR_ONLY = "ToMe hr only"
KEY_MAX_DOWNSAMPLE = "ToMe max downsample"
KEY_STRIDE = "ToMe stride"
KEY_RANDOM = "ToMe random"
KEY_MERGE = "ToMe merge"
KEY_DOWNSAMPLE_METHOD = "ToMe downsample method"
KEY_STOP = "ToMe stop at"
KEY_SKIP = "ToMe skip when slower"
KEY_SCOPE = "ToMe scope"
KEY_REUSE = "ToMe reuse interval"
KEY_REUSE_PLAN = "ToMe reuse plan"
KEY_CALIBRATION_TARGET = "ToMe calibration target"
# What an infotext with reuse plan calibrated and no target meant: the default when the key came (the picture it
# describes was calibrated at it).
TARGET_WHEN_ABSENT = 0.98
# On a DiT (Forge Neo): the family whose default ran (reuse across steps at its measured setting, no ToDo). Not a
# control's value: pasting the other keys gives the same job, which runs the loaded family's default again.
KEY_DIT = "ToMe DiT"
INFOTEXT_KEYS = (
    KEY_METHOD,
    KEY_RATIO,
    KEY_FACTOR,
    KEY_HR_RATIO,
    KEY_HR_FACTOR,
    KEY_HR_ONLY,
    KEY_MAX_DOWNSAMPLE,
    KEY_STRIDE,
    KEY_RANDOM,
    KEY_MERGE,
    KEY_DOWNSAMPLE_METHOD,
    KEY_STOP,
    KEY_SKIP,
    KEY_SCOPE,
    KEY_REUSE,
    KEY_REUSE_PLAN,
    KEY_CALIBRATION_TARGET,
)
_MERGE_PARTS = (("attn", "merge_attn"), ("crossattn", "merge_crossattn"), ("mlp", "merge_mlp"))


def infotext_params(args: ScriptArgs) -> dict[str, Any]:
    """Generation parameters describing ``args``: the method and its value always, the rest where not default."""
    d = defaults()
    tome = args.method == "tome"
    params: dict[str, Any] = {KEY_METHOD: METHOD_LABELS[args.method]}
    if tome:
        params[KEY_RATIO] = args.ratio
        if not args.hr_same:
            params[KEY_HR_RATIO] = args.hr_ratio
    else:
        params[KEY_FACTOR] = args.downsample_factor
        if not args.hr_same:
            params[KEY_HR_FACTOR] = args.hr_downsample_factor
    if args.hr_only:
        params[KEY_HR_ONLY] = True
    if args.max_downsample != d.max_downsample:
        params[KEY_MAX_DOWNSAMPLE] = args.max_downsample
    if tome:
        if (args.sx, args.sy) != (d.sx, d.sy):
            params[KEY_STRIDE] = f"{args.sx}x{args.sy}"
        if args.use_rand:
            params[KEY_RANDOM] = True
        merged = [part for part, name in _MERGE_PARTS if getattr(args, name)]
        if merged != [part for part, name in _MERGE_PARTS if getattr(d, name)]:
            params[KEY_MERGE] = "+".join(merged) or "none"
        if args.scope != d.scope:
            params[KEY_SCOPE] = args.scope
    elif args.downsample_method != d.downsample_method:
        params[KEY_DOWNSAMPLE_METHOD] = args.downsample_method
    if args.end_percent != d.end_percent:
        params[KEY_STOP] = args.end_percent
    if args.skip_when_slower != d.skip_when_slower:
        params[KEY_SKIP] = args.skip_when_slower
    # Written unless it is what an infotext without it means.
    if args.reuse_interval != IMPLIED_WHEN_ABSENT["reuse_interval"]:
        params[KEY_REUSE] = args.reuse_interval
    # Written where it acts, unless it is what an infotext without it means.
    if args.reuse_interval > 1 and args.reuse_plan != IMPLIED_WHEN_ABSENT["reuse_plan"]:
        params[KEY_REUSE_PLAN] = args.reuse_plan
    # Written where a calibration reads it, unless it is what an infotext without it means.
    if _calibrates(args) and args.calibration_target != TARGET_WHEN_ABSENT:
        params[KEY_CALIBRATION_TARGET] = args.calibration_target
    return params


def _calibrates(args: ScriptArgs) -> bool:
    return args.reuse_interval > 1 and REUSE_PLANS[args.reuse_plan].calibrates


def dit_infotext_params(args: ScriptArgs, family: str) -> dict[str, Any]:
    """Generation parameters of a DiT pass: the controls' values as on a UNet (so that pasting them gives the same
    job) and the family whose plan ran, its default or (reuse plan calibrated) at a calibrated interval."""
    return {**infotext_params(args), KEY_DIT: f"{family} {'calibrated' if _calibrates(args) else 'default'}"}


def ui_values_from_infotext(params: dict) -> dict[str, Any]:
    """What pasting ``params`` (parsed generation parameters) sets each control to (None: unchanged). Without our
    method key the patch turns off; an absent key means ``IMPLIED_WHEN_ABSENT``'s value or the default."""
    if KEY_METHOD not in params:
        return {"enabled": False}
    d = defaults()

    def read(key: str, name: str, fallback: Any) -> Any:
        return _read_value(name, params[key]) if key in params else fallback

    values: dict[str, Any] = {"enabled": True}
    method = read(KEY_METHOD, "method", None)
    values["method"] = METHOD_LABELS.get(method) if method else None
    values["ratio"] = read(KEY_RATIO, "ratio", d.ratio)
    values["downsample_factor"] = read(KEY_FACTOR, "downsample_factor", d.downsample_factor)
    hr_given = KEY_HR_RATIO in params or KEY_HR_FACTOR in params
    values["hr_same"] = not hr_given
    values["hr_ratio"] = read(KEY_HR_RATIO, "hr_ratio", d.hr_ratio)
    values["hr_downsample_factor"] = read(KEY_HR_FACTOR, "hr_downsample_factor", d.hr_downsample_factor)
    values["hr_only"] = read(KEY_HR_ONLY, "hr_only", False)
    max_downsample = read(KEY_MAX_DOWNSAMPLE, "max_downsample", d.max_downsample)
    values["max_downsample"] = None if max_downsample is None else _max_downsample_label(max_downsample)
    values["sx"], values["sy"] = d.sx, d.sy
    if KEY_STRIDE in params:
        sx, _, sy = str(params[KEY_STRIDE]).partition("x")
        values["sx"] = _read_value("sx", sx)
        values["sy"] = _read_value("sy", sy)
    values["use_rand"] = read(KEY_RANDOM, "use_rand", False)
    for _, name in _MERGE_PARTS:
        values[name] = getattr(d, name)
    if KEY_MERGE in params:
        parts = set(str(params[KEY_MERGE]).replace(" ", "").split("+"))
        for part, name in _MERGE_PARTS:
            values[name] = part in parts
    values["downsample_method"] = read(KEY_DOWNSAMPLE_METHOD, "downsample_method", d.downsample_method)
    values["end_percent"] = read(KEY_STOP, "end_percent", d.end_percent)
    values["skip_when_slower"] = read(KEY_SKIP, "skip_when_slower", d.skip_when_slower)
    values["scope"] = read(KEY_SCOPE, "scope", d.scope)
    # Absent: what an infotext without it meant, not today's default, so it gives the picture it describes.
    values["reuse_interval"] = read(KEY_REUSE, "reuse_interval", IMPLIED_WHEN_ABSENT["reuse_interval"])
    # With reuse off the plan does not act, and the control keeps today's default for the next reuse.
    plan_absent = IMPLIED_WHEN_ABSENT["reuse_plan"] if KEY_REUSE in params else d.reuse_plan
    values["reuse_plan"] = read(KEY_REUSE_PLAN, "reuse_plan", plan_absent)
    # Where no calibration reads it, the control keeps today's default for the next calibration.
    plan = REUSE_PLANS.get(values["reuse_plan"])
    calibrated = (values["reuse_interval"] or 1) > 1 and plan is not None and plan.calibrates
    target_absent = TARGET_WHEN_ABSENT if calibrated else d.calibration_target
    values["calibration_target"] = read(KEY_CALIBRATION_TARGET, "calibration_target", target_absent)
    values["calibration_picture"] = None  # not a parameter of the picture: a paste leaves the box as it is
    return values


def _read_or_default(name: str, text: Any) -> Any:
    value = _read_value(name, text)
    return _read_value(name, _BY_NAME[name].default) if value is None else value


def _max_downsample_label(value: int) -> str:
    return "auto" if value == 0 else str(value)


def _read_value(name: str, text: Any) -> Any:
    """The cast value of one infotext field, or None (leave the control unchanged) if it does not parse."""
    try:
        return _cast(_BY_NAME[name], ARG_NAMES.index(name), text)
    except ValueError:
        return None
