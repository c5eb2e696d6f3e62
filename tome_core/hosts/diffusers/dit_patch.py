"""The patch for diffusers' DiT pipelines (``SUPPORTED``): ToDo on the image tokens' attention (``dit_attention``,
Flux.1, SD3 and Wan) and reuse across steps (``dit_reuse``), for ``patch.apply_patch`` / ``remove_patch``.
docs/dit.md, 'diffusers: Flux, SD3 and Wan pipelines'."""

from __future__ import annotations

import logging

from ...reuse import REUSE_PLANS, NoiseSpacedSchedule
from ...settings import SPECS, PatchSettings
from ..shared import dit_families
from . import dit_attention, dit_reuse
from .step_range import StepRange, flow_timestep_of_percent

log = logging.getLogger("tome_patch")

SUPPORTED = (
    "diffusers' DiT pipelines whose transformer is a FluxTransformer2DModel (Flux.1 dev/schnell/Kontext and their "
    "image-to-image, inpainting and ControlNet pipelines), an SD3Transformer2DModel (SD3, SD3.5), a "
    "WanTransformer3DModel (Wan 2.1/2.2 text- and image-to-video), or, with reuse across steps only, a "
    "Flux2Transformer2DModel (Flux.2, Flux.2 Klein), a QwenImageTransformer2DModel (Qwen-Image and Qwen-Image "
    "Edit), a ZImageTransformer2DModel (Z-Image), a HunyuanVideo15Transformer3DModel (HunyuanVideo 1.5), an "
    "LTXVideoTransformer3DModel (LTX-Video) or an LTX2VideoTransformer3DModel (LTX-2, video and audio)"
)
TRANSFORMER_ATTRIBUTES = ("transformer", "transformer_2")  # Wan 2.2: the second one samples the low-noise part


def _unwrap(module):
    return getattr(module, "_orig_mod", module)  # a torch.compile wrapper keeps the module as ``_orig_mod``


def is_dit(module) -> bool:
    return module is not None and dit_reuse.layout_of(_unwrap(module)) is not None


def find_transformers(pipe_or_transformer) -> tuple[list, object | None] | None:
    """(the DiT transformers, the pipeline or None) of what the user passed, or None if it has none we support."""
    if is_dit(pipe_or_transformer):
        return [_unwrap(pipe_or_transformer)], None
    found = [_unwrap(getattr(pipe_or_transformer, name, None)) for name in TRANSFORMER_ATTRIBUTES]
    found = [t for t in found if is_dit(t)]
    return (found, pipe_or_transformer) if found else None


def family_settings(
    family: str, validated: PatchSettings, asked: dict, label: str | None = None
) -> tuple[PatchSettings, object]:
    """(settings, schedule or None) for ``family``: with ``dit_settings`` "auto" the settings the user did not name
    take the family's (no ToDo, reuse at its interval); ``label``: the family's name in the log line."""
    if not validated.dit_family_default:
        return validated, None
    if not {"method", "downsample_factor"} & set(asked):
        validated = validated.replace(downsample_factor=1.0)
    schedule = None if "reuse_interval" in asked else dit_families.auto_schedule(family)
    if schedule is not None:
        log.info(
            "ToMe Patch: %s with dit_settings 'auto': reuse across steps %s%s.",
            label or family,
            schedule.describe(),
            "" if validated.downsample_factor > 1 else ", no ToDo",
        )
    return validated, schedule


def apply_patch(found: tuple[list, object | None], validated: PatchSettings, asked: dict) -> bool:
    """Patch the transformers of ``found`` (from ``find_transformers``) with ``validated``; ``asked``: the
    settings the user named (a default that cannot apply is left out with a log line, a named one raises). Returns
    whether the pipeline's calls are to be calibrated (``reuse_plan`` "calibrated" and reuse installed)."""
    transformers, pipeline = found
    first = dit_reuse.layout_of(transformers[0])
    family = first.label
    if validated.method == "tome":
        raise ValueError(
            f"method 'tome' is not available for {family} (a DiT): use method 'todo' (ToDo on the image tokens' "
            "keys and values) and/or reuse_interval above 1"
        )
    if "max_downsample" in asked and validated.max_downsample != SPECS["max_downsample"].default:
        log.info("ToMe Patch: max_downsample does not apply to %s (a DiT has one token grid); ignored.", family)
    validated, schedule = family_settings(first.name, validated, asked, family)
    in_range = validated.start_percent < validated.end_percent
    reuse = in_range and (schedule is not None or validated.reuse_interval > 1)
    if reuse and pipeline is None:
        message = (
            "reuse_interval above 1 needs the pipeline, whose scheduler tells which step each transformer call is: "
            "pass the pipeline to apply_patch, not its transformer (or use reuse_interval=1)"
        )
        if "reuse_interval" in asked:
            raise ValueError(message)
        default = "the default reuse_interval 3" if schedule is None else "dit_settings auto's"
        log.info("ToMe Patch: reuse across steps (%s) is left out: %s", default, message)
        reuse = False
    for transformer in transformers:
        remove(transformer)
    allowed = StepRange(validated, pipeline, flow_timestep_of_percent)
    if reuse and schedule is None:  # "as set": one step in reuse_interval, spaced by the noise
        schedule = NoiseSpacedSchedule(validated.reuse_interval)
    for transformer in transformers:
        if reuse:
            if getattr(transformer, "is_cache_enabled", False):
                log.warning(
                    "ToMe Patch: diffusers' own cache is enabled on the %s transformer (enable_cache): reuse "
                    "across steps stands down while it is (ToDo still applies).",
                    family,
                )
            dit_reuse.install(transformer, pipeline, validated, allowed.contains, schedule)
        layout = dit_reuse.layout_of(transformer)
        if layout.todo:
            dit_attention.install(transformer, validated, allowed.contains, layout.name, layout.timestep_scale)
        elif validated.method == "todo" and validated.downsample_factor > 1 and in_range:
            log.info("ToMe Patch: ToDo is not available for %s yet; reuse only.", layout.label)
    return REUSE_PLANS[validated.reuse_plan].calibrates and calibrates(transformers, family)


def calibrates(transformers: list, family: str) -> bool:
    """Whether a calibration can follow the pipeline's reuse (one transformer reusing steps), else one log line."""
    reusing = [transformer for transformer in transformers if dit_reuse.installed(transformer) is not None]
    if not reusing:
        log.info("ToMe Patch: reuse_plan calibrated has nothing to calibrate on %s: it reuses no step here.", family)
        return False
    if len(transformers) > 1:
        log.info(
            "ToMe Patch: reuse_plan calibrated cannot calibrate %s's two transformers (each runs its part of the "
            "steps); they run the family's plan.",
            family,
        )
        return False
    return True


def remove(transformer) -> None:
    dit_reuse.remove(transformer)
    dit_attention.remove(transformer)


def is_patched(transformer) -> bool:
    return dit_reuse.installed(transformer) is not None or dit_attention.installed(transformer)
