"""The benchmark's rows: one UNet evaluation each, all on the same weights and inputs.

A ``Row`` is a callable ``run(x, timesteps, context, y)`` plus ``enter``/``leave`` for rows that patch a
module in place (tomesd swaps block classes), so rows can be interleaved: each row is entered before its
call and left after it, outside the timed region.

Rows: the unpatched UNet; this project (through the same ``patched_unet`` that the ComfyUI node calls);
ComfyUI's built-in TomePatchModel; tomesd 0.1.3 on the WebUI's ldm UNet; a ToDo reference-style downsampling
(written here from the paper's description: a plain ``interpolate`` of keys/values in an attn1 patch, with the
reference code's level guess); and the ceiling, whose self-attention at the reduced levels is an oracle that
returns zeros, so no method that only shrinks self-attention can be faster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tome_core import PatchSettings, find_level, grid_at_level
from tome_core.hosts.comfyui.patch import patched_unet
from tools.common.todo_reference import todo_reference_patch


def _nothing() -> None:
    return None


@dataclass
class Row:
    name: str
    group: str  # "unpatched", "ours", "peer" or "ceiling"
    host: str  # "comfy" or "ldm": which unpatched row is this row's baseline
    run: Callable
    enter: Callable[[], None] = _nothing
    leave: Callable[[], None] = _nothing
    settings: dict = field(default_factory=dict)


def comfy_runner(patcher, sigma_of: Callable) -> Callable:
    """Call the patcher's UNet the way ComfyUI's sampler does, with its transformer_options (copied per call)."""
    unet = patcher.model.diffusion_model
    options = patcher.model_options.get("transformer_options", {})

    def run(x, timesteps, context, y=None):
        transformer_options = dict(options)
        transformer_options["sigmas"] = sigma_of(timesteps)
        return unet(x, timesteps, context=context, y=y, transformer_options=transformer_options)

    return run


def ours(patcher, sigma_of, **values) -> Callable:
    """This project's patch, exactly as the ComfyUI node applies it (reuse across steps off unless named: these
    rows time single model calls, which the token reduction alone changes)."""
    settings = PatchSettings.from_values(**{"reuse_interval": 1, **values})
    ms = patcher.get_model_object("model_sampling")
    return comfy_runner(patched_unet(patcher, settings, ms.percent_to_sigma), sigma_of)


def ours_loaded(name: str, patcher, sigma_of, **values) -> Row:
    """This project's patch as a row whose clone is loaded around each call, as ComfyUI's sampler loads it.

    Scope block gives the transformer blocks their forward when the patcher injects its model
    (``ModelPatcher.patch_model`` -> ``inject_model``) and takes it away on ejection (``unpatch_model``); the other
    rows need no loading (their hooks travel in ``transformer_options``). Loading is outside the timed call.
    """
    settings = PatchSettings.from_values(**{"reuse_interval": 1, **values})
    ms = patcher.get_model_object("model_sampling")
    clone = patched_unet(patcher, settings, ms.percent_to_sigma)
    return Row(
        name,
        "ours",
        "comfy",
        comfy_runner(clone, sigma_of),
        enter=lambda: clone.patch_model(load_weights=False),
        leave=lambda: clone.unpatch_model(unpatch_weights=False),
        settings=dict(values),
    )


def block_scope_rows(patcher, sigma_of, max_downsample: int, ratio: float, force: dict) -> list[Row]:
    """ToMe at the two finest attention levels (SD1.x: 1 and 2, SDXL: 2 and 4): the whole block on merged tokens
    (scope block), and today's self-attention-only merging at the same levels and ratio for comparison."""
    levels = f"levels<={max_downsample}"
    common = {"method": "tome", "ratio": ratio, "max_downsample": max_downsample, **force}
    suffix = " forced" if force else ""
    return [
        ours_loaded(f"ours ToMe block {ratio:g} {levels}{suffix}", patcher, sigma_of, scope="block", **common),
        ours_loaded(f"ours ToMe {ratio:g} {levels}{suffix}", patcher, sigma_of, scope="self-attention", **common),
    ]


def comfy_builtin(patcher, sigma_of, ratio: float) -> Callable:
    """ComfyUI's own TomePatchModel node (comfy_extras/nodes_tomesd.py), applied through its node API."""
    from comfy_extras.nodes_tomesd import TomePatchModel

    return comfy_runner(TomePatchModel.execute(patcher, ratio).result[0], sigma_of)


def tomesd_row(name: str, holder, ratio: float, level: int, **options) -> Row:
    """tomesd 0.1.3 on the ldm UNet, as the WebUI's built-in token merging applies it (use_rand off); ``options``
    are further ``apply_patch`` arguments (``merge_crossattn=True, merge_mlp=True``: its whole-block merging)."""
    import tomesd

    unet = holder.model.diffusion_model

    def run(x, timesteps, context, y=None):
        return unet(x, timesteps, context)

    settings = {"ratio": ratio, "max_downsample": level, "use_rand": False, **options}
    return Row(
        name,
        "peer",
        "ldm",
        run,
        enter=lambda: tomesd.apply_patch(holder, **settings),
        leave=lambda: tomesd.remove_patch(holder),
        settings=settings,
    )


def ldm_unpatched(holder) -> Row:
    unet = holder.model.diffusion_model
    return Row(
        "unpatched (ldm UNet)", "unpatched", "ldm", lambda x, timesteps, context, y=None: unet(x, timesteps, context)
    )


def todo_reference(patcher, sigma_of, factor: float, max_level: int) -> Callable:
    clone = patcher.clone()
    clone.set_model_attn1_patch(todo_reference_patch(factor, max_level))
    return comfy_runner(clone, sigma_of)


def _transformer_keys(unet) -> list[tuple[str, int, int]]:
    """ComfyUI's replace-patch keys (block name, block number, transformer index) of every attention block."""
    keys = []
    for name, module in unet.named_modules():
        if type(module).__name__ != "SpatialTransformer":
            continue
        parts = name.split(".")
        block = {"input_blocks": "input", "middle_block": "middle", "output_blocks": "output"}[parts[0]]
        number = 0 if block == "middle" else int(parts[1])
        keys += [(block, number, i) for i in range(len(module.transformer_blocks))]
    return keys


def ceiling(patcher, sigma_of, levels: frozenset[int]) -> Callable:
    """The UNet with self-attention's core (QK^T, softmax, AV) at ``levels`` replaced by zeros.

    The projections still run (ComfyUI computes them before calling a replace patch), so this is the bound of
    methods that shrink the attention itself; the other levels call ComfyUI's own attention.
    """
    from comfy.ldm.modules.attention import optimized_attention

    def oracle(q, k, v, extra_options):
        _, _, height, width = extra_options["original_shape"]
        found = find_level((height, width), q.shape[1])
        if found is not None and found[0] in levels:
            return torch.zeros_like(q)
        return optimized_attention(q, k, v, extra_options["n_heads"])

    clone = patcher.clone()
    for block, number, index in _transformer_keys(clone.model.diffusion_model):
        clone.set_model_attn1_replace(oracle, block, number, index)
    return comfy_runner(clone, sigma_of)


def level_tokens(latent_hw: tuple[int, int], level: int) -> int:
    h, w = grid_at_level(latent_hw, level)
    return h * w
