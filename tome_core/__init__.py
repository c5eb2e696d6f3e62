"""The token merging engine: pure PyTorch, no host imports.

``PatchSettings`` validates what the user chose; ``Reducer`` decides per transformer block how to reduce it;
the doors into the hosts, ``tome_core.hosts``, call it from their hook points.

For diffusers (``pip install`` of this repository gives this package)::

    import tome_core
    tome_core.apply_patch(pipe, ratio=0.5)   # a StableDiffusion(XL)/ControlNet/... pipeline or its UNet
    image = pipe(prompt).images[0]
    tome_core.apply_patch(pipe, reuse_interval=3)   # also reuse across steps (a pipeline only, not a bare UNet)
    tome_core.apply_patch(flux_pipe, downsample_factor=1, reuse_interval=6)   # Flux, SD3, Wan: reuse alone
    tome_core.remove_patch(pipe)
"""

from .joint_attention import ImageTokens, SequenceDownsample
from .levels import find_level, grid_at_level, reduced_levels
from .reducer import BlockMerge, BlockReduction, KeyValueDownsample, Reducer, TokenMerge
from .schedule import NoiseRange, timestep_of_percent
from .settings import SPECS, PatchSettings, Spec

__version__ = "0.1.0"


def apply_patch(pipe_or_unet, **settings):
    """Patch a diffusers pipeline (SD1.x/SD2.x/SDXL UNets; the DiTs of ``hosts.diffusers.dit_reuse.LAYOUTS``: Flux,
    Flux.2, SD3/SD3.5, Wan, Qwen-Image, Z-Image, HunyuanVideo 1.5, LTX-Video, LTX-2) or its denoiser in place with
    ``settings`` (see ``SPECS``).

    Raises ValueError for a bad setting, TypeError for a model it cannot patch (both name what is allowed),
    leaving the model unchanged. See ``tome_core.hosts.diffusers.patch.apply_patch``.
    """
    from .hosts.diffusers import patch  # imported here: hosts other than diffusers never load it

    return patch.apply_patch(pipe_or_unet, **settings)


def remove_patch(pipe_or_unet):
    """Undo ``apply_patch``: the UNet or transformer then computes bit-identically to one never patched."""
    from .hosts.diffusers import patch

    return patch.remove_patch(pipe_or_unet)


__all__ = [
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
    "find_level",
    "grid_at_level",
    "reduced_levels",
    "remove_patch",
    "timestep_of_percent",
]
