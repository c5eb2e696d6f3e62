"""What a UNet looks like (which levels have attention, which blocks to hook), found from the module tree by duck
typing. A model without ``input_blocks`` (a DiT) is not a UNet this patch can reduce."""

from __future__ import annotations

_TRANSFORMER_NAMES = ("SpatialTransformer", "SpatialVideoTransformer")
_BLOCK_CLASS_NAME = "BasicTransformerBlock"
_BLOCK_PARTS = ("attn1", "attn2", "ff", "norm1")


def _is_transformer(layer) -> bool:
    """A spatial transformer, or a subclass of one (hosts and other extensions subclass it)."""
    return any(c.__name__ in _TRANSFORMER_NAMES for c in type(layer).__mro__)


def _has_transformer(block) -> bool:
    return any(_is_transformer(layer) for layer in block.modules())


def attention_levels(unet) -> tuple[int, ...] | None:
    """The downsampling levels (1, 2, 4, ...) that have attention, or None if ``unet`` is not such a UNet."""
    input_blocks = getattr(unet, "input_blocks", None)
    if input_blocks is None:
        return None
    level = 1
    levels = set()
    try:
        for block in input_blocks:
            if any(type(layer).__name__ == "Downsample" for layer in block.modules()):
                level *= 2
            elif _has_transformer(block):
                levels.add(level)
        middle = getattr(unet, "middle_block", None)
        if middle is not None and _has_transformer(middle):
            levels.add(level)
    except TypeError:  # input_blocks that are not modules: some other architecture
        return None
    return tuple(sorted(levels)) or None


def basic_transformer_blocks(unet) -> list[tuple[str, object]]:
    """(name, module) of every spatial ``BasicTransformerBlock``; temporal blocks have other classes."""
    return [
        (name, module)
        for name, module in unet.named_modules()
        if any(c.__name__ == _BLOCK_CLASS_NAME for c in type(module).__mro__)
        and all(hasattr(module, part) for part in _BLOCK_PARTS)
    ]


def inner_layers(unet, outer: int = 1) -> list[tuple[str, object]]:
    """(name, module) of the layers that layer reuse skips, in call order: all but the ``outer`` first input and
    last output blocks, layer by layer (the last gives the feature the kept output blocks read); [] if too few."""
    inputs = list(getattr(unet, "input_blocks", ()))
    outputs = list(getattr(unet, "output_blocks", ()))
    middle = getattr(unet, "middle_block", None)
    if len(inputs) <= outer or len(outputs) <= outer:
        return []
    blocks = [(f"input_blocks.{i}", b) for i, b in enumerate(inputs) if i >= outer]
    if middle is not None:
        blocks.append(("middle_block", middle))
    blocks += [(f"output_blocks.{i}", b) for i, b in enumerate(outputs) if i < len(outputs) - outer]
    return [(f"{name}.{j}", layer) for name, block in blocks for j, layer in enumerate(block)]
