"""diffusers' front door, ``apply_patch`` and ``remove_patch``: a pipeline whose denoiser is a known DiT goes to
``dit_patch``, a ``UNet2DConditionModel`` (alone or a pipeline's ``.unet``) to ``unet_patch``; anything else raises a
``TypeError``, the model left as it was. docs/diffusers.md, 'Use'."""

from __future__ import annotations

import logging

from ...reuse import REUSE_PLANS, unet_schedule
from ...settings import PatchSettings
from . import calibrate, dit_patch, unet_patch
from .unet_blocks import attention_levels, transformer_blocks
from .unet_patch import PatchConflictError, UnsupportedModelError

log = logging.getLogger("tome_patch")

SUPPORTED = (
    "a diffusers pipeline whose denoiser is a UNet2DConditionModel (Stable Diffusion 1.x/2.x, SDXL and their "
    "text-to-image, image-to-image, inpainting and ControlNet pipelines) or a UNet2DConditionModel itself, and "
    + dit_patch.SUPPORTED
)


def _unet(pipe_or_unet) -> tuple:
    found = unet_patch.find_unet(pipe_or_unet)
    if found is None:
        raise UnsupportedModelError(
            f"tome_core.apply_patch supports {SUPPORTED}; got {unet_patch.describe(pipe_or_unet)}"
        )
    return found


def is_patched(pipe_or_unet) -> bool:
    dits = dit_patch.find_transformers(pipe_or_unet)
    if dits is not None:
        return any(dit_patch.is_patched(t) for t in dits[0])
    found = unet_patch.find_unet(pipe_or_unet)
    return found is not None and unet_patch.installed(found[0])


def remove_patch(pipe_or_unet):
    """Undo ``apply_patch``; a no-op on anything not patched. Returns what it was given."""
    dits = dit_patch.find_transformers(pipe_or_unet)
    if dits is not None:
        for transformer in dits[0]:
            dit_patch.remove(transformer)
        calibrate.remove(pipe_or_unet)
        return pipe_or_unet
    found = unet_patch.find_unet(pipe_or_unet)
    if found is not None:
        unet_patch.remove(found[0])
    calibrate.remove(pipe_or_unet)
    return pipe_or_unet


def _needs_the_pipeline(plan: str, denoiser: str) -> str:
    """Why a calibrating plan refuses a bare denoiser: it calibrates the pipeline's calls."""
    return f"reuse_plan {plan!r} calibrates the pipeline's calls: pass the pipeline to apply_patch, not its {denoiser}"


def apply_patch(pipe_or_unet, **settings):
    """Patch a diffusers pipeline or its denoiser in place with ``settings`` (``tome_core.SPECS``); returns it.
    Raises ValueError (a bad value, a conflicting patch) or UnsupportedModelError, the model left as it was.
    ``reuse_interval`` above 1 needs a pipeline (by default it is then left out); a ``ratio`` without a ``method``
    means ToMe, as in tomesd. ``reuse_plan="calibrated"`` (with ``calibration_target``) needs the pipeline."""
    if "ratio" in settings and "method" not in settings:
        settings = {"method": "tome", **settings}
    validated = PatchSettings.from_values(**settings)
    calibrates = REUSE_PLANS[validated.reuse_plan].calibrates
    dits = dit_patch.find_transformers(pipe_or_unet)
    if dits is not None:
        if calibrates and dits[1] is None:
            raise ValueError(_needs_the_pipeline(validated.reuse_plan, "transformer"))
        calibrating = dit_patch.apply_patch(dits, validated, settings)
        if dits[1] is not None:
            calibrate.remove(dits[1])
            if calibrating:
                calibrate.install(dits[1], validated.calibration_target, validated, dit=True)
        return pipe_or_unet
    unet, pipeline = _unet(pipe_or_unet)
    if calibrates and pipeline is None:
        raise ValueError(_needs_the_pipeline(validated.reuse_plan, "UNet"))
    levels = attention_levels(unet)
    if not levels or not transformer_blocks(unet):
        raise UnsupportedModelError(
            f"tome_core.apply_patch supports {SUPPORTED}; this {type(unet).__name__} has no transformer blocks "
            "to reduce (pixel-space UNets such as DeepFloyd IF use another attention block)"
        )
    conflict = unet_patch.find_conflict(unet)
    if conflict is not None:
        raise PatchConflictError(conflict)
    reuse = validated.reuse_interval > 1 and not validated.is_noop
    if reuse:
        try:
            unet_patch.check_layer_reuse(unet, pipeline)
        except (ValueError, TypeError) as err:
            if "reuse_interval" in settings:  # asked for by name: say why it cannot be
                raise
            log.info("ToMe Patch: reuse across steps (the default reuse_interval 3) is left out: %s", err)
            reuse = False
            validated = validated.replace(reuse_interval=1)
    schedule = unet_schedule(validated.reuse_interval, levels, validated.reuse_plan) if reuse else None
    unet_patch.install(unet, pipeline, validated, schedule)
    if pipeline is not None:
        calibrate.remove(pipeline)
        if calibrates and schedule is not None:
            calibrate.install(pipeline, validated.calibration_target, validated)
    return pipe_or_unet
