"""diffusers: a UNet's transformer blocks and their levels, read from its module tree by class name."""

from __future__ import annotations

import torch

BLOCK_CLASS_NAME = "BasicTransformerBlock"


def class_names(obj) -> list[str]:
    return [cls.__name__ for cls in type(obj).__mro__]


def is_block(module) -> bool:
    return BLOCK_CLASS_NAME in class_names(module) and all(
        hasattr(module, name) for name in ("attn1", "attn2", "ff", "norm1", "norm3", "norm_type")
    )


def transformer_blocks(unet) -> list[tuple[str, torch.nn.Module]]:
    return [(name, module) for name, module in unet.named_modules() if is_block(module)]


def has_blocks(module) -> bool:
    return module is not None and any(is_block(m) for m in module.modules())


def attention_levels(unet) -> tuple[int, ...]:
    """The downsampling levels (1, 2, 4, ...) that have transformer blocks (the mid block at the coarsest)."""
    level, levels = 1, set()
    for block in getattr(unet, "down_blocks", ()):
        if has_blocks(getattr(block, "attentions", None)):
            levels.add(level)
        if getattr(block, "downsamplers", None) is not None:
            level *= 2
    if has_blocks(getattr(unet, "mid_block", None)):
        levels.add(level)
    return tuple(sorted(levels))
