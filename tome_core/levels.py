"""Which UNet level a block works at, from its token count against the latent size (each halving rounds up)."""

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
    """(level, h, w) of the finest level whose grid has ``n_tokens`` tokens, or None: leave the block as it is."""
    for level in LEVELS:
        h, w = grid_at_level(latent_hw, level)
        if h * w == n_tokens:
            return level, h, w
    return None


def reduced_levels(max_downsample: int, attention_levels: tuple[int, ...]) -> frozenset[int]:
    """The levels to reduce: those at ``max_downsample`` or finer that have attention (0: the finest with attention)."""
    if not attention_levels:
        return frozenset()
    if max_downsample == 0:
        return frozenset({min(attention_levels)})
    return frozenset(level for level in attention_levels if level <= max_downsample)
