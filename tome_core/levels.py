"""Which UNet level a block works at, found from the token grid against the latent size.

A UNet halves its grid at each downsampling with a stride-2 convolution (padding 1), so the grid at level
``d`` is the latent size divided by two, rounded up, log2(d) times. The level is therefore found from sizes
alone, never from channel counts (which differ between SD1, SD2 and SDXL), and sizes that do not divide by 8
work at every level.
"""

from __future__ import annotations

LEVELS = (1, 2, 4, 8)


def grid_at_level(latent_hw: tuple[int, int], level: int) -> tuple[int, int]:
    """Token grid (h, w) that a UNet block sees at ``level`` (1, 2, 4, 8) for a latent of ``latent_hw``."""
    h, w = latent_hw
    while level > 1:
        h, w = (h + 1) // 2, (w + 1) // 2
        level //= 2
    return h, w


def find_level(latent_hw: tuple[int, int], n_tokens: int) -> tuple[int, int, int] | None:
    """Return (level, h, w) of the finest level whose grid has ``n_tokens`` tokens, or None if none does.

    None means the block does not work on the latent's token grid (a temporal block, a model that resizes
    inside the UNet): the caller must leave it as it is.
    """
    for level in LEVELS:
        h, w = grid_at_level(latent_hw, level)
        if h * w == n_tokens:
            return level, h, w
    return None


def reduced_levels(max_downsample: int, attention_levels: tuple[int, ...]) -> frozenset[int]:
    """The levels to reduce: those at ``max_downsample`` or finer that have attention.

    ``max_downsample`` 0 is automatic: the finest level that has attention, so SDXL (no attention at level 1)
    is reduced at level 2 instead of not at all.
    """
    if not attention_levels:
        return frozenset()
    if max_downsample == 0:
        return frozenset({min(attention_levels)})
    return frozenset(level for level in attention_levels if level <= max_downsample)
