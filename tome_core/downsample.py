"""ToDo: self-attention keys and values downsampled on the token grid. Queries stay full: nothing to undo.

A grid of h x w tokens downsampled by ``factor`` keeps ceil(h / factor) x ceil(w / factor) tokens, so sizes that
do not divide by the factor keep their last row and column covered. ``nearest-exact`` picks the same tokens
as ``torch.nn.functional.interpolate(mode="nearest-exact")`` but as one cached row gather, without the two
layout copies that interpolate needs for a (batch, tokens, channels) tensor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def downsampled_size(h: int, w: int, factor: float) -> tuple[int, int]:
    return max(1, math.ceil(h / factor)), max(1, math.ceil(w / factor))


def _nearest_exact_index(size: int, out_size: int) -> torch.Tensor:
    scale = size / out_size
    return ((torch.arange(out_size, dtype=torch.float64) + 0.5) * scale).floor().clamp_max(size - 1).long()


class NearestIndexCache:
    """The flat token indices that nearest-exact keeps, built once per grid size and device."""

    def __init__(self) -> None:
        self._index: dict[tuple, torch.Tensor] = {}

    def get(self, h: int, w: int, out_h: int, out_w: int, device: torch.device) -> torch.Tensor:
        key = (h, w, out_h, out_w, str(device))
        index = self._index.get(key)
        if index is None:
            rows = _nearest_exact_index(h, out_h)
            cols = _nearest_exact_index(w, out_w)
            index = (rows.view(-1, 1) * w + cols.view(1, -1)).flatten().to(device)
            # No lock: dict get and set are atomic, and a lock would break torch.compile's graph here.
            if len(self._index) > 4096:
                self._index.clear()
            self._index[key] = index
        return index


def downsample_tokens(
    x: torch.Tensor, h: int, w: int, factor: float, method: str, index_cache: NearestIndexCache
) -> torch.Tensor:
    """Downsample (batch, h*w, c) tokens by ``factor`` on their h x w grid."""
    out_h, out_w = downsampled_size(h, w, factor)
    if (out_h, out_w) == (h, w):
        return x
    if method == "nearest-exact":
        return x.index_select(1, index_cache.get(h, w, out_h, out_w, x.device))
    batch, _, channels = x.shape
    grid = x.view(batch, h, w, channels).permute(0, 3, 1, 2)
    if method == "avg_pool":
        grid = F.adaptive_avg_pool2d(grid, (out_h, out_w))
    elif method == "bilinear":
        grid = F.interpolate(grid, size=(out_h, out_w), mode="bilinear", align_corners=False)
    else:
        raise ValueError(f"downsample_method must be one of nearest-exact, avg_pool, bilinear, got {method!r}")
    return grid.permute(0, 2, 3, 1).reshape(batch, out_h * out_w, channels)
