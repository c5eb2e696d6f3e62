"""ToDo for DiT attention: the image (video) keys and values are downsampled on their own grid; queries, text
and reference tokens stay whole. Joint attention gets a proportional bias so the text keeps its softmax share.
See docs/dit.md, section 'How it works'."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .cost import worth_reducing
from .downsample import Grid, NearestIndexCache, downsample_segment
from .settings import PatchSettings

TIME_FACTORS = (1.0, 2.0, 4.0)


@dataclass(frozen=True)
class ImageTokens:
    """Where the image grid lies in an attention call's sequence (``before`` None: any count of text tokens)."""

    grid: Grid
    after: int = 0
    before: int | None = None

    @property
    def count(self) -> int:
        return math.prod(self.grid)

    def start_in(self, total: int) -> int | None:
        """The grid's first token in a sequence of ``total`` tokens, or None if the sequence has another layout."""
        start = total - self.after - self.count if self.before is None else self.before
        if start < 0 or start + self.count + self.after != total:
            return None
        return start


class SequenceDownsample:
    """Shared by every attention call of one patched DiT; holds only a cache that is safe to share."""

    def __init__(self, settings: PatchSettings, time_factor: float = 1.0, min_tokens: int | None = None):
        """``min_tokens``: the family's own ``skip_when_slower`` threshold (None: ``cost.MIN_TOKENS``)."""
        if time_factor not in TIME_FACTORS:
            raise ValueError(
                f"time_factor must be one of {', '.join(f'{f:g}' for f in TIME_FACTORS)}, got {time_factor!r}"
            )
        self.settings = settings
        self.time_factor = float(time_factor)
        self.min_tokens = min_tokens
        self._nearest = NearestIndexCache()

    @property
    def does_nothing(self) -> bool:
        return self.settings.method != "todo" or self.settings.is_noop or self.settings.reduces_nothing

    def worth_reducing(self, n_image_tokens: int) -> bool:
        if self.min_tokens is None or not self.settings.skip_when_slower:
            return worth_reducing(self.settings, n_image_tokens)
        return n_image_tokens >= self.min_tokens

    def keys_values(
        self, k: torch.Tensor, v: torch.Tensor, tokens: ImageTokens, dim: int, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """Downsampled keys, values and mask of one call, or None: leave the call as it is (another layout, too
        small, or a mask that only nearest-exact can keep exact)."""
        total = k.shape[dim]
        if v.shape[dim] != total or self.does_nothing:
            return None
        start = tokens.start_in(total)
        if start is None or not self.worth_reducing(tokens.count):
            return None
        s = self.settings
        if mask is not None:
            if s.downsample_method != "nearest-exact" or mask.shape[-1] != total:
                return None
            mask = downsample_segment(
                _additive(mask, k.dtype),
                start,
                tokens.grid,
                s.downsample_factor,
                self.time_factor,
                s.downsample_method,
                self._nearest,
                mask.dim() - 1,
            )
        k, v = (
            downsample_segment(
                x, start, tokens.grid, s.downsample_factor, self.time_factor, s.downsample_method, self._nearest, dim
            )
            for x in (k, v)
        )
        others = total - tokens.count  # text and reference keys in the same softmax
        if others > 0:
            bias = proportional_bias(start, tokens.count, k.shape[dim] - others, others, k.dtype, k.device)
            mask = bias if mask is None else mask + bias
        return k, v, mask


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: attend) as the additive float mask it means."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def proportional_bias(
    start: int, grid_tokens: int, kept: int, others: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """(1, keys) additive mask: ``log(grid_tokens / kept)`` on the ``kept`` grid keys at ``start``, 0 elsewhere."""
    bias = torch.zeros(1, kept + others, dtype=dtype, device=device)
    bias[:, start : start + kept] = math.log(grid_tokens / kept)
    return bias
