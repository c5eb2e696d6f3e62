"""ComfyUI: how a MODEL is patched. A UNet (SD1.x, SD2.x, SDXL) gets the token reduction through the ModelPatcher's
attention hooks (``shared.model_patcher``) and reuse across steps (``layer_reuse``); a DiT (Flux, SD3, Wan) gets
ToDo through its attention (``dit``) and reuse across steps through its block replacements (``dit_reuse``);
anything else is passed through unchanged with one warning.

Always a clone: the input MODEL is never changed, and applying the patch again replaces the earlier one.
"""

from __future__ import annotations

import logging

from ...schedule import NoiseRange
from ...settings import SPECS
from ..shared import model_patcher
from . import dit, dit_reuse, layer_reuse

log = logging.getLogger("tome_patch")


def patch_model(model, settings):
    """A patched clone of ``model`` for ``settings`` (a ``PatchSettings``), or ``model`` itself where it cannot
    be patched (with a warning that says why)."""
    percent_to_sigma = model.get_model_object("model_sampling").percent_to_sigma
    diffusion_model = getattr(getattr(model, "model", None), "diffusion_model", None)
    if dit.family_of(diffusion_model) is not None:
        return _patch_dit(model, settings, percent_to_sigma)
    try:
        return patched_unet(model, settings, percent_to_sigma)
    except model_patcher.NotAUNetError as err:
        log.warning(
            "ToMe Patch: this model (%s) is neither a UNet with attention blocks (SD1.x, SD2.x, SDXL) nor a DiT "
            "this patch supports (Flux, SD3/SD3.5, Wan 2.x); it is passed through unchanged.",
            err,
        )
        return model


def patched_unet(patcher, settings, percent_to_sigma):
    """A clone of a UNet's ``patcher`` with the token reduction and the reuse across steps of ``settings``.
    Raises ``model_patcher.NotAUNetError`` (before cloning) for a model that is not a UNet with attention."""
    clone = model_patcher.patched_clone(patcher, settings, percent_to_sigma)
    layer_reuse.remove(clone)  # an earlier patch's, on the model it was given
    if not settings.is_noop and settings.reuse_interval > 1:
        noise_range = NoiseRange(settings.start_percent, settings.end_percent, percent_to_sigma)
        layer_reuse.install(clone, settings, noise_range)
    return clone


def _patch_dit(model, settings, percent_to_sigma):
    """Flux, SD3 and Wan: ToDo on the image tokens' keys and values; ToMe is not offered on DiTs yet."""
    family = dit.family_of(model.model.diffusion_model)
    if settings.method == "tome":
        log.warning(
            "ToMe Patch: method tome is not available for %s (DiT) models; choose method todo. The model is "
            "passed through unchanged.",
            family.name,
        )
        return model
    if settings.max_downsample != SPECS["max_downsample"].default:
        log.warning(
            "ToMe Patch: max_downsample does not apply to %s (a DiT has one token grid, always reduced); ignored.",
            family.name,
        )
    try:
        clone = dit.patched_clone(model, settings, percent_to_sigma)
    except dit.NotADitError as err:  # a patcher without model wrappers (an older ComfyUI)
        log.warning("ToMe Patch: %s cannot be patched here (%s); it is passed through unchanged.", family.name, err)
        return model
    dit_reuse.remove(clone)  # an earlier patch's, on the model it was given
    if not settings.is_noop and settings.reuse_interval > 1:
        noise_range = NoiseRange(settings.start_percent, settings.end_percent, percent_to_sigma)
        if not dit_reuse.install(clone, settings, noise_range):
            log.info(
                "ToMe Patch: reuse across steps (reuse_interval) is not available for %s (%s); ToDo only.",
                family.name,
                dit.describe(model.model.diffusion_model),
            )
    return clone
