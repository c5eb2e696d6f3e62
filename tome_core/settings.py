"""Every setting's default, allowed range and tooltip (``SPECS``), and ``PatchSettings``, the validated, immutable
set the hosts build with ``PatchSettings.from_values`` before sampling starts."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from .calibration import search as calibration_search
from .reuse import plans

METHODS = ("tome", "todo")
METHOD_LABELS = {"tome": "ToMe", "todo": "ToDo"}
DOWNSAMPLE_METHODS = ("nearest-exact", "avg_pool", "bilinear")
# What of a transformer block ToMe runs on merged tokens (see reducer.py): only self-attention, or the whole block.
SCOPES = ("self-attention", "block")
# Removed choices a saved workflow may still hold: each runs as its replacement, with a warning that says why.
RETIRED_CHOICES = {
    "scope": {
        "reuse": (
            "self-attention",
            "scope 'reuse' was removed (reuse_interval reuses across steps with less work for the same picture)",
        )
    }
}
# 0 means "automatic": the finest level of the UNet that has attention (see levels.reduced_levels).
MAX_DOWNSAMPLE_CHOICES = (0, 1, 2, 4, 8)


@dataclass(frozen=True)
class Spec:
    """Describes one setting for validation and for the UI of either host."""

    name: str
    kind: str  # "float", "int", "bool" or "choice"
    default: Any
    tooltip: str
    minimum: float | None = None
    maximum: float | None = None
    step: float | None = None
    choices: tuple = ()
    # Who reads the setting: the one method (None: both), and within ToMe the one scope (None: every scope). The
    # tooltip starts with the same words (see ``applies_to``); the WebUI shows its control only for them.
    method: str | None = None
    scope: str | None = None

    @property
    def applies_to(self) -> str:
        """Who reads the setting, in the words its tooltip starts with: "ToMe", "ToDo", "ToMe, scope
        self-attention" or "ToMe and ToDo"."""
        if self.method is None:
            return "ToMe and ToDo"
        label = METHOD_LABELS[self.method]
        return f"{label}, scope {self.scope}" if self.scope else label

    def describe_range(self) -> str:
        if self.kind == "choice":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.kind == "bool":
            return "true or false"
        return f"a number from {self.minimum} to {self.maximum}"


_SPEC_LIST = (
    Spec(
        "method",
        "choice",
        # measured: docs/fidelity.md, 'Which setting to use, in full'
        "todo",
        choices=METHODS,
        tooltip="tome: merge similar tokens and copy the result back (ToMe); with scope block the fastest, with "
        "a slightly different picture. todo (the default): keep every query but downsample self-attention's "
        "keys and values (ToDo); the same picture, sooner.",
    ),
    Spec(
        "ratio",
        "float",
        0.5,
        minimum=0.0,
        maximum=0.75,
        step=0.01,
        method="tome",
        tooltip="ToMe: fraction of the tokens merged away at each reduced level. 0 turns merging off. "
        "The stride limits it: at most 1 - 1/(sx*sy), 0.75 for the default 2x2.",
    ),
    Spec(
        "downsample_factor",
        "float",
        2.0,
        minimum=1.0,
        maximum=8.0,
        step=0.5,
        method="todo",
        tooltip="ToDo: keys and values are downsampled by this factor along each side of the token grid "
        "(2 keeps a quarter of them). 1 turns downsampling off.",
    ),
    Spec(
        "max_downsample",
        "choice",
        0,
        choices=MAX_DOWNSAMPLE_CHOICES,
        tooltip="ToMe and ToDo: reduce the UNet levels at this downsampling or finer (1 = only the full-size level). "
        "0 = automatic: the finest level that has attention (1 on SD1/SD2, 2 on SDXL).",
    ),
    Spec(
        "start_percent",
        "float",
        0.0,
        minimum=0.0,
        maximum=1.0,
        step=0.01,
        tooltip="ToMe and ToDo: start reducing at this fraction of the sampling schedule (0 = first step; sigma "
        "based).",
    ),
    Spec(
        "end_percent",
        "float",
        1.0,
        minimum=0.0,
        maximum=1.0,
        step=0.01,
        tooltip="ToMe and ToDo: stop reducing at this fraction of the sampling schedule (1 = last step).",
    ),
    Spec(
        "skip_when_slower",
        "bool",
        True,
        tooltip="ToMe and ToDo: leave a level unreduced where its token grid is too small for the reduction to pay for "
        "itself, so the patch is never slower than off. Turn off to force the reduction everywhere.",
    ),
    Spec(
        "sx",
        "int",
        2,
        minimum=1,
        maximum=8,
        step=1,
        method="tome",
        tooltip="ToMe: width of the cell that keeps one destination token.",
    ),
    Spec(
        "sy",
        "int",
        2,
        minimum=1,
        maximum=8,
        step=1,
        method="tome",
        tooltip="ToMe: height of the cell that keeps one destination token.",
    ),
    Spec(
        "use_rand",
        "bool",
        False,
        method="tome",
        tooltip="ToMe: pick the destination token of each cell at random (from the seed below) "
        "instead of the top-left one. Never touches the sampler's random numbers.",
    ),
    Spec(
        "seed",
        "int",
        0,
        minimum=0,
        maximum=2**63 - 1,
        step=1,
        method="tome",
        tooltip="ToMe: seed of the destination pattern when use_rand is on. Same seed, same picture.",
    ),
    Spec(
        "merge_attn",
        "bool",
        True,
        method="tome",
        scope="self-attention",
        tooltip="ToMe, scope self-attention: merge the tokens that self-attention sees (queries, keys and values).",
    ),
    Spec(
        "merge_crossattn",
        "bool",
        False,
        method="tome",
        scope="self-attention",
        tooltip="ToMe, scope self-attention: also merge the queries of cross-attention (the text prompt is never "
        "merged).",
    ),
    Spec(
        "merge_mlp",
        "bool",
        False,
        method="tome",
        scope="self-attention",
        tooltip="ToMe, scope self-attention: also merge the tokens of the feed-forward layer (WebUI only; ComfyUI "
        "has no hook there). Scope block merges it anyway.",
    ),
    Spec(
        "downsample_method",
        "choice",
        "nearest-exact",
        choices=DOWNSAMPLE_METHODS,
        method="todo",
        tooltip="ToDo: how keys and values are downsampled. nearest-exact is the fastest.",
    ),
    Spec(
        "scope",
        "choice",
        "self-attention",
        choices=SCOPES,
        method="tome",
        tooltip="ToMe: what runs on the merged tokens. self-attention: only self-attention, each block with its "
        "own merge. block: the whole transformer block (self-attention, cross-attention and feed-forward) runs "
        "on the merged tokens and only its update is copied back, with one merge shared by all blocks of a "
        "level; much faster on SDXL and at 512-768 px, and a larger change to the picture. ToDo ignores it "
        "(it always reduces self-attention's keys and values).",
    ),
)

_SPEC_LIST += (
    Spec(
        "reuse_interval",
        "int",
        3,
        minimum=1,
        maximum=16,
        step=1,
        tooltip="ToMe and ToDo: reuse across steps. 1 = off. N (default 3): on SD1.x, SD2.x and SDXL the model "
        "runs at the first steps, one step in N after them and the last steps (one in 2 at most under 25 steps, "
        "where the steps lie further apart; every step under 10 steps); reuse_plan says which steps and what the "
        "others run: by default (forecast) nothing, their output drawn along the line through the last two "
        "computed steps (13 of 25 Euler steps computed at 3); with auto or every N the UNet's outermost layers, "
        "the inner layers' output carried over from the steps that ran them. On DiTs (Flux, SD3, "
        "Wan) one step in N runs every block, spaced by the noise "
        "level (the last steps full), and the others only the first block; video keeps the picture up to 16.",
    ),
)

# What a DiT runs: the setting measured for its family, or the inputs as they are set.
DIT_SETTINGS = ("auto", "as set")
_SPEC_LIST += (
    Spec(
        "dit_settings",
        "choice",
        "auto",
        choices=DIT_SETTINGS,
        tooltip="DiTs: what a DiT (Flux, SD3, Wan, Qwen-Image, HunyuanVideo, LTX-Video, Z-Image) runs. auto (the "
        "default): the setting measured to keep each family's picture, whatever method, downsample_factor and "
        "reuse_interval say: reuse across steps every 3 on Flux, SD3 and Z-Image / Lumina 2 (every 4 from 40 "
        "steps), every 6 on Qwen-Image and Wan with each reused step run in full where the first block's output "
        "leaves its course, every 4 on the other video models, and no ToDo (on a DiT it shifts the colours). "
        "as set: the inputs as "
        "they are set. UNets (SD1.x, SD2.x, SDXL) ignore it.",
    ),
)

REUSE_PLANS = tuple(plans.REUSE_PLANS)
_SPEC_LIST += (
    Spec(
        "reuse_plan",
        "choice",
        plans.DEFAULT_REUSE_PLAN,
        choices=REUSE_PLANS,
        tooltip="ToMe and ToDo: with reuse_interval above 1, which steps of a UNet run and what the others run. "
        + " ".join(plan.tooltip for plan in plans.REUSE_PLANS.values())
        + " DiTs ignore it but for calibrated (their full steps are spaced by the noise).",
    ),
    Spec(
        "calibration_target",
        "float",
        calibration_search.DEFAULT_TARGET,
        tooltip="ToMe and ToDo: with reuse_plan calibrated, the same-seed SSIM of the final latent against the "
        "unpatched one that a calibration keeps at the fewest computed steps (docs/calibration.md).",
        minimum=calibration_search.TARGET_RANGE[0],
        maximum=calibration_search.TARGET_RANGE[1],
        step=0.001,
    ),
)

SPECS: dict[str, Spec] = {spec.name: spec for spec in _SPEC_LIST}

# A saved prompt or infotext that does not name a setting meant the default of its time: the value here keeps its
# picture.
IMPLIED_WHEN_ABSENT = {"reuse_interval": 1, "dit_settings": "as set", "reuse_plan": "every N"}

log = logging.getLogger("tome_patch")


def _coerce(spec: Spec, value: Any) -> Any:
    """Return the value as the setting's type, or raise a ValueError naming the setting and its range."""
    problem = f"{spec.name} must be {spec.describe_range()}, got {value!r}"
    if spec.kind == "bool":
        if isinstance(value, bool):
            return value
        raise ValueError(problem)
    if spec.kind == "choice":
        for choice in spec.choices:
            if type(choice) is type(value) and choice == value:
                return choice
            # Integer choices may arrive as floats (JSON) or numeric strings (UI combo boxes).
            if isinstance(choice, int) and not isinstance(value, bool):
                try:
                    if float(value) == choice:
                        return choice
                except (TypeError, ValueError):
                    pass
        raise ValueError(problem)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(problem)
    if math.isnan(value) or not (spec.minimum <= value <= spec.maximum):
        raise ValueError(problem)
    if spec.kind == "int":
        if value != int(value):
            raise ValueError(problem)
        return int(value)
    return float(value)


@dataclass(frozen=True)
class PatchSettings:
    """A validated, immutable set of patch settings. Build it with ``from_values``."""

    method: str = SPECS["method"].default
    ratio: float = SPECS["ratio"].default
    downsample_factor: float = SPECS["downsample_factor"].default
    max_downsample: int = SPECS["max_downsample"].default
    start_percent: float = SPECS["start_percent"].default
    end_percent: float = SPECS["end_percent"].default
    skip_when_slower: bool = SPECS["skip_when_slower"].default
    sx: int = SPECS["sx"].default
    sy: int = SPECS["sy"].default
    use_rand: bool = SPECS["use_rand"].default
    seed: int = SPECS["seed"].default
    merge_attn: bool = SPECS["merge_attn"].default
    merge_crossattn: bool = SPECS["merge_crossattn"].default
    merge_mlp: bool = SPECS["merge_mlp"].default
    downsample_method: str = SPECS["downsample_method"].default
    scope: str = SPECS["scope"].default
    reuse_interval: int = SPECS["reuse_interval"].default
    dit_settings: str = SPECS["dit_settings"].default
    reuse_plan: str = SPECS["reuse_plan"].default
    calibration_target: float = SPECS["calibration_target"].default

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, _coerce(SPECS[field.name], getattr(self, field.name)))
        if self.sx * self.sy < 2:
            raise ValueError(f"sx and sy must not both be 1 (a cell needs a source token), got {self.sx}x{self.sy}")
        max_ratio = 1.0 - 1.0 / (self.sx * self.sy)
        if self.ratio > max_ratio + 1e-9:
            raise ValueError(
                f"ratio must be a number from 0 to {max_ratio:g} for a {self.sx}x{self.sy} stride "
                f"(one token of each cell is kept), got {self.ratio!r}"
            )
        if self.start_percent > self.end_percent:
            raise ValueError(
                f"start_percent must not be above end_percent, got start_percent={self.start_percent} "
                f"and end_percent={self.end_percent}"
            )

    @classmethod
    def from_values(cls, **values: Any) -> PatchSettings:
        """Validate settings given by name; unknown names are an error, missing ones take their default."""
        unknown = sorted(set(values) - set(SPECS))
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(SPECS)}")
        return cls(**retire(values))

    @property
    def is_noop(self) -> bool:
        """True when these settings can never change the model's output."""
        if self.start_percent >= self.end_percent:
            return True
        return self.reduces_nothing and self.reuse_interval == 1

    @property
    def reduces_nothing(self) -> bool:
        """True when the token reduction (ToMe or ToDo, not reuse_interval) can never change the output."""
        if self.method == "tome":
            if self.ratio == 0.0:
                return True
            # Scope block merges the whole block whatever the merge_* switches say.
            return self.scope == "self-attention" and not (self.merge_attn or self.merge_crossattn or self.merge_mlp)
        return self.downsample_factor == 1.0

    @property
    def dit_family_default(self) -> bool:
        """Whether a DiT runs its family's measured setting (``dit_settings`` auto), not the inputs as set."""
        return self.dit_settings == DIT_SETTINGS[0]

    @property
    def merges_whole_block(self) -> bool:
        """True for ToMe with scope block: the block runs on merged tokens and only its update is unmerged."""
        return self.method == "tome" and self.scope == "block"

    def replace(self, **changes: Any) -> PatchSettings:
        return dataclasses.replace(self, **changes)


def retire(values: dict) -> dict:
    """``values`` with every retired choice (``RETIRED_CHOICES``) replaced, each with one warning saying why."""
    values = dict(values)
    for name, retired in RETIRED_CHOICES.items():
        value = values.get(name)
        if isinstance(value, str) and value in retired:
            replacement, why = retired[value]
            log.warning("ToMe Patch: %s; running with %s %r instead.", why, name, replacement)
            values[name] = replacement
    return values
