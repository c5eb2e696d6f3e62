"""What each DiT family is, once for every host: its measured defaults and the real model's step-to-step change.

A record per family, keyed by the family's name as the hosts' doors call it (ComfyUI's "Lumina 2" is diffusers'
"Z-Image": one record, two names). Every host reads the same record, so a family's default changes everywhere at
once; the engine keeps no family names. Adding a family is a record here and its tests.

The measurements behind each value are in docs/dit.md ("The default per family", "What the default computes on
the real models' curves").
"""

from __future__ import annotations

from dataclasses import dataclass

from ...reuse.plans import DEFAULT_EXTRAPOLATE
from ...reuse.schedules import StepChangeCurve, StepCountSchedule
from . import step_change_curves as published


@dataclass(frozen=True)
class DitFamily:
    name: str  # the family's name in messages and docs
    aliases: tuple[str, ...] = ()  # other hosts' names for it
    # ``dit_settings`` "auto": reuse across steps at this interval, as ((from this many steps, interval), ...).
    auto_intervals: tuple[tuple[int, int], ...] = ((0, 3),)
    # How far along the line through the last two full steps the prediction moves (1: a whole step).
    extrapolate: float = DEFAULT_EXTRAPOLATE
    # ToDo's break-even with ``skip_when_slower``: it runs from this many image tokens (None: the engine's rule).
    todo_min_image_tokens: int | None = None
    # The real model's published step-to-step change and the threshold published with it: the default runs in
    # full wherever reuse would accumulate more error on it (None: the noise-spaced plan alone).
    curve: StepChangeCurve | None = None
    curve_of: str = ""  # whose curve it is, for the log and the docs

    def auto_schedule(self) -> StepCountSchedule:
        """The schedule ``dit_settings`` "auto" runs on this family."""
        return StepCountSchedule(self.auto_intervals, self.curve)


# MagCache's thresholds for each model are the ones its authors publish with the ratios (``step_change_curves``).
FLUX_CURVE = StepChangeCurve(published.FLUX1_DEV, 0.24)
QWEN_IMAGE_CURVE = StepChangeCurve(published.QWEN_IMAGE, 0.10)
HUNYUAN_VIDEO_CURVE = StepChangeCurve(published.HUNYUAN_VIDEO, 0.24)
WAN_CURVE = StepChangeCurve(published.WAN21_T2V_14B, 0.24)

# Intervals: measured on the references (Flux on ref-flux-deep, Qwen-Image on ref-qwen, Wan on ref-wan); SD3 and
# Lumina 2 / Z-Image (one joint stream, as Flux's single blocks) take Flux's, the video families without a reference
# one step more often than Wan's. A family without a published curve takes the nearest family's (docs/dit.md).
# Flux and Qwen-Image predict a whole step along the line (it kept more of their references' picture); the others
# half a step.
FAMILIES = (
    DitFamily(
        "Flux", auto_intervals=((0, 3), (40, 4)), extrapolate=1.0, todo_min_image_tokens=4096,
        curve=FLUX_CURVE, curve_of="FLUX.1-dev",
    ),
    DitFamily("SD3", auto_intervals=((0, 3), (40, 4)), curve=FLUX_CURVE, curve_of="FLUX.1-dev (nearest family)"),
    DitFamily(
        "Qwen-Image", auto_intervals=((0, 3), (40, 4)), extrapolate=1.0, curve=QWEN_IMAGE_CURVE, curve_of="Qwen-Image"
    ),
    DitFamily(
        "Lumina 2", aliases=("Z-Image",), auto_intervals=((0, 3), (40, 4)), todo_min_image_tokens=2304,
        curve=FLUX_CURVE, curve_of="FLUX.1-dev (nearest family)",
    ),
    DitFamily("Wan", auto_intervals=((0, 5),), curve=WAN_CURVE, curve_of="Wan 2.1 T2V 14B"),
    DitFamily("HunyuanVideo", auto_intervals=((0, 4),), curve=HUNYUAN_VIDEO_CURVE, curve_of="HunyuanVideo"),
    DitFamily(
        "LTX-Video", auto_intervals=((0, 4),), todo_min_image_tokens=4096,
        curve=HUNYUAN_VIDEO_CURVE, curve_of="HunyuanVideo (nearest family)",
    ),
)  # fmt: skip
# A DiT no record names (a family a host door knows before it has a record): Flux's interval and curve.
OTHER = DitFamily("other", curve=FLUX_CURVE, curve_of="FLUX.1-dev (nearest family)")

_BY_NAME = {name: family for family in FAMILIES for name in (family.name, *family.aliases)}


def family(name: str) -> DitFamily:
    """The record of the family a host door calls ``name`` (``OTHER`` for a name no record has)."""
    return _BY_NAME.get(name, OTHER)


def auto_schedule(name: str) -> StepCountSchedule:
    """The schedule ``dit_settings`` "auto" runs on the family a host calls ``name``."""
    return family(name).auto_schedule()
