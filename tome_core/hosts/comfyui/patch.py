"""ComfyUI: how a MODEL is patched, always as a clone: a UNet through the ModelPatcher's attention hooks and
``layer_reuse``, a DiT through ``dit`` (ToDo) and ``dit_reuse`` (its blocks); anything else passes through with a
warning. docs/how-it-works.md, 'ComfyUI'."""

from __future__ import annotations

import logging

from ...reuse import REUSE_PLANS, NoiseSpacedSchedule, unet_schedule
from ...schedule import NoiseRange
from ...settings import SPECS
from ..shared import dit_families, model_patcher
from ..shared.unet_layout import attention_levels
from . import dit, dit_reuse, layer_reuse

log = logging.getLogger("tome_patch")


def patch_model(model, settings):
    """A patched clone of ``model`` for ``settings``, or ``model`` itself (with a warning) where it cannot be."""
    percent_to_sigma = model.get_model_object("model_sampling").percent_to_sigma
    diffusion_model = getattr(getattr(model, "model", None), "diffusion_model", None)
    if dit.token_layout_of(diffusion_model) is not None or dit_reuse.layout_of(diffusion_model) is not None:
        return _patch_dit(model, settings, percent_to_sigma)
    if dit_reuse.known_without_reuse(diffusion_model) or dit_reuse.unfit_record(diffusion_model) is not None:
        log.warning(
            "ToMe Patch: %s is passed through unchanged: %s.",
            dit.describe(diffusion_model),
            dit_reuse.why_not(diffusion_model),
        )
        return model
    try:
        return patched_unet(model, settings, percent_to_sigma)
    except model_patcher.NotAUNetError as err:
        log.warning(
            "ToMe Patch: this model (%s) is neither a UNet with attention blocks (SD1.x, SD2.x, SDXL) nor a DiT "
            "this patch supports (%s); it is passed through unchanged.",
            err,
            dit_reuse.SUPPORTED_WORDS,
        )
        return model


def patched_unet(patcher, settings, percent_to_sigma):
    """A clone of a UNet's ``patcher`` with the token reduction and the reuse across steps of ``settings``.
    Raises ``model_patcher.NotAUNetError`` (before cloning) for a model that is not a UNet with attention."""
    clone = model_patcher.patched_clone(patcher, settings, percent_to_sigma)
    layer_reuse.remove(clone)  # an earlier patch's, on the model it was given
    if not settings.is_noop and settings.reuse_interval > 1:
        noise_range = NoiseRange(settings.start_percent, settings.end_percent, percent_to_sigma)
        levels = attention_levels(clone.model.diffusion_model)
        layer_reuse.install(
            clone, settings, noise_range, unet_schedule(settings.reuse_interval, levels, settings.reuse_plan)
        )
    return clone


def _patch_dit(model, settings, percent_to_sigma):
    """A DiT: ToDo where its attention is known, reuse where its blocks are; ``dit_settings`` auto: its family's."""
    diffusion_model = model.model.diffusion_model
    tokens = dit.token_layout_of(diffusion_model)  # None: ToDo does not know this family's attention
    layout = dit_reuse.layout_of(diffusion_model)  # None: reuse does not know its blocks
    name = layout.family if layout is not None else tokens.family
    schedule = None
    if settings.dit_family_default:
        record = dit_families.family(name)
        schedule = dit_families.auto_schedule(name) if layout is not None and not record.unchanged_by_default else None
        log.info(
            "ToMe Patch: %s (%s) with dit_settings auto: %s, no ToDo (set dit_settings to 'as set' to use the "
            "other inputs).",
            name,
            dit.describe(diffusion_model),
            f"reuse across steps {schedule.describe()}"
            if schedule is not None
            else f"nothing to do ({record.unchanged_by_default or dit_reuse.why_not(diffusion_model)})",
        )
        settings = settings.replace(method="todo", downsample_factor=1.0)
        if record.unchanged_by_default:
            settings = settings.replace(reuse_interval=1)
    elif settings.method == "tome":
        log.warning(
            "ToMe Patch: method tome is not available for %s (DiT) models; choose method todo. The model is "
            "passed through unchanged.",
            name,
        )
        return model
    elif settings.max_downsample != SPECS["max_downsample"].default:
        log.warning(
            "ToMe Patch: max_downsample does not apply to %s (a DiT has one token grid, always reduced); ignored.",
            name,
        )
    if tokens is not None:
        try:
            clone = dit.patched_clone(model, settings, percent_to_sigma)
        except dit.NotADitError as err:  # a patcher without model wrappers (an older ComfyUI)
            log.warning("ToMe Patch: %s cannot be patched here (%s); it is passed through unchanged.", name, err)
            return model
    else:
        if not settings.reduces_nothing:
            log.info("ToMe Patch: ToDo is not available for %s yet (its attention is not mapped); reuse only.", name)
        clone = model.clone()
        dit.remove_patch(clone)
    dit_reuse.remove(clone)  # an earlier patch's, on the model it was given
    in_range = settings.start_percent < settings.end_percent
    installed = False
    if in_range and (schedule is not None or settings.reuse_interval > 1):
        noise_range = NoiseRange(settings.start_percent, settings.end_percent, percent_to_sigma)
        schedule = schedule if schedule is not None else NoiseSpacedSchedule(settings.reuse_interval)
        installed = dit_reuse.install(clone, settings, noise_range, schedule)
        if not installed:
            log.info(
                "ToMe Patch: reuse across steps (reuse_interval) is not available for %s (%s): %s.",
                name,
                dit.describe(diffusion_model),
                dit_reuse.why_not(diffusion_model),
            )
    if REUSE_PLANS[settings.reuse_plan].calibrates and not installed:
        log.info("ToMe Patch: reuse_plan calibrated has nothing to calibrate on %s: it reuses no step here.", name)
    return clone
