"""Reuse across steps: between full steps only a model's outermost layers run, its inner ones are predicted.

A UNet's inner layers (the coarse levels, the middle block and most of the fine ones) change their output slowly
from one sampling step to the next, while the outermost layers (the first input block and the last output block,
at full resolution) carry the fine detail through the skip connection. A DiT's blocks after the first form one
*span*, whose residual (output minus input) changes slowly too. So at a *reusing* step the inner layers do not run:
their output is predicted from the steps at which it was last computed, and only the outer layers run on the
current input. This package knows no host; one module per idea:

- ``schedules``: which steps run in full (the first ones, the last ones, one in ``interval`` between; for a DiT,
  spaced by the noise level);
- ``plans``: the measured defaults that hold for every model (the UNet families' plans; a DiT family's own are in
  ``hosts.shared.dit_families``);
- ``samplers``: the samplers and noise schedules reuse may run with;
- ``cache``: one sampling run's records and the prediction from them (``LayerReuseRun``);
- ``hooks``: the skippable forwards every host door shares (``LayerReuse``, ``SkippableLayer``);
- ``whole_step``: ``reuse_plan``'s forecasts, where a skipped step runs no layer at all (``WholeStepRun``).
"""

from .cache import COMPACT_SLOPE_BYTES, LayerReuseRun, join_streams, split_streams
from .hooks import LayerReuse, SkippableLayer, attach_forwards, detach_forwards
from .plans import (
    DEFAULT_EXTRAPOLATE,
    DIT_OUTER_BLOCKS,
    OUTER_BLOCKS,
    UNET_LONG_RUN,
    UNET_LONG_RUN_PLANS,
    UNET_PLANNED_INTERVAL,
    WHOLE_STEP_PLAN,
    WHOLE_STEP_PLANS,
    WHOLE_STEP_REACH,
    unet_schedule,
    whole_step_schedule,
)
from .samplers import (
    DIT_SAMPLERS_THAT_KEEP_THE_PICTURE,
    FULL_BELOW_NOISE_WITH_A_CORRECTOR,
    FULL_BELOW_SIGMA_WITH_DPMPP_2M,
    KARRAS_RHO,
    SAMPLERS_THAT_KEEP_THE_PICTURE,
    SAMPLERS_WITH_A_CORRECTOR,
    SCHEDULES_THAT_LOSE_THE_PICTURE,
    UNET_SAMPLERS_WITH_LOW_NOISE_IN_FULL,
    full_below_noise,
    is_karras,
    keeps_the_picture_with,
    whole_step_kind,
)
from .schedules import (
    MIN_NOISE_LEVEL,
    FullSteps,
    IntervalSchedule,
    NoiseSpacedSchedule,
    RunLengthSchedule,
    StepChangeCurve,
    StepCountSchedule,
    spaced_by_noise,
)
from .whole_step import WholeStepRun, denoised_of, output_of

__all__ = [
    "COMPACT_SLOPE_BYTES",
    "DEFAULT_EXTRAPOLATE",
    "DIT_OUTER_BLOCKS",
    "DIT_SAMPLERS_THAT_KEEP_THE_PICTURE",
    "FULL_BELOW_NOISE_WITH_A_CORRECTOR",
    "FULL_BELOW_SIGMA_WITH_DPMPP_2M",
    "KARRAS_RHO",
    "MIN_NOISE_LEVEL",
    "OUTER_BLOCKS",
    "SAMPLERS_THAT_KEEP_THE_PICTURE",
    "SAMPLERS_WITH_A_CORRECTOR",
    "SCHEDULES_THAT_LOSE_THE_PICTURE",
    "UNET_SAMPLERS_WITH_LOW_NOISE_IN_FULL",
    "UNET_LONG_RUN",
    "UNET_LONG_RUN_PLANS",
    "UNET_PLANNED_INTERVAL",
    "WHOLE_STEP_PLAN",
    "WHOLE_STEP_PLANS",
    "WHOLE_STEP_REACH",
    "FullSteps",
    "IntervalSchedule",
    "LayerReuse",
    "LayerReuseRun",
    "NoiseSpacedSchedule",
    "RunLengthSchedule",
    "SkippableLayer",
    "StepChangeCurve",
    "StepCountSchedule",
    "WholeStepRun",
    "attach_forwards",
    "denoised_of",
    "detach_forwards",
    "full_below_noise",
    "is_karras",
    "join_streams",
    "keeps_the_picture_with",
    "output_of",
    "spaced_by_noise",
    "split_streams",
    "unet_schedule",
    "whole_step_kind",
    "whole_step_schedule",
]
