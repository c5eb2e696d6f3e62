"""The token merging engine: pure PyTorch, no host imports; ``tome_core.hosts`` call it from their hook points.
For diffusers: ``tome_core.apply_patch(pipe, ratio=0.5)``, ``tome_core.remove_patch(pipe)`` (docs/diffusers.md)."""

from .joint_attention import ImageTokens, SequenceDownsample
from .levels import find_level, grid_at_level, reduced_levels
from .reducer import BlockMerge, BlockReduction, KeyValueDownsample, Reducer, TokenMerge
from .schedule import NoiseRange, timestep_of_percent
from .settings import SPECS, PatchSettings, Spec
from .version import __version__


def apply_patch(pipe_or_unet, **settings):
    """Patch a diffusers pipeline or its denoiser in place with ``settings`` (see ``SPECS``); raises ValueError
    for a bad setting, TypeError for a model it cannot patch, leaving the model unchanged."""
    from .hosts.diffusers import patch  # lazy: other hosts never load diffusers

    return patch.apply_patch(pipe_or_unet, **settings)


def remove_patch(pipe_or_unet):
    """Undo ``apply_patch``: the UNet or transformer then computes bit-identically to one never patched."""
    from .hosts.diffusers import patch

    return patch.remove_patch(pipe_or_unet)


def calibrate(pipe, *args, **kwargs):
    """Run ``pipe(*args, **kwargs)`` unpatched and calibrate its job anew on the same noise (a pipeline patched with
    ``apply_patch(pipe, reuse_plan="calibrated")``); returns a ``CalibrationReport``: the ``result``, the file it is
    kept in (``path``) and the unpatched run's ``output`` (docs/calibration.md, 'diffusers')."""
    from .hosts.diffusers import calibrate as door

    return door.calibrate(pipe, args, kwargs)


__all__ = [
    "__version__",
    "SPECS",
    "BlockMerge",
    "BlockReduction",
    "ImageTokens",
    "KeyValueDownsample",
    "NoiseRange",
    "PatchSettings",
    "Reducer",
    "SequenceDownsample",
    "Spec",
    "TokenMerge",
    "apply_patch",
    "calibrate",
    "find_level",
    "grid_at_level",
    "reduced_levels",
    "remove_patch",
    "timestep_of_percent",
]
