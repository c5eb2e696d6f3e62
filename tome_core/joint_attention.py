"""ToDo for the attention of DiT models: the keys and values of the image (video) tokens are downsampled on
their own token grid; every query, and every text or reference token, stays whole.

A DiT attends over one sequence per call. Joint attention (Flux, SD3, Qwen-Image, Lumina 2) concatenates text
and image tokens, HunyuanVideo the video before the text, and Flux Kontext appends the tokens of reference images
after the image; video models (Wan, LTX-Video) attend over frames x h x w tokens. ``ImageTokens`` says where the
image grid lies in such a sequence, from what the host adapter knows of the model's input;
``SequenceDownsample`` reduces the keys and values of one attention call with the engine's grid downsampling
(``downsample.py``, shared with the UNets). Where keys carry rotary position embeddings, the adapter calls this
after the rotation, so every kept key keeps its own position.

Joint attention needs one correction that a UNet's self-attention does not: the text (and reference) keys share
the softmax with the image keys, so keeping a quarter of the image keys would hand the text about four times its
share of the attention. Each kept image key stands for ``kept / grid`` of the grid, so it gets that weight back:
``log(grid tokens / kept tokens)`` is added to its logits through the call's additive attention mask
(proportional attention, as ToMe does for merged tokens); without it the picture is lost (docs/dit.md). A
sequence that is all grid (Wan, SD3.5's x-only self-attention) needs no bias: the same constant on every key
changes nothing, and no mask is added there.
"""

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
    """Where the image grid lies in an attention call's sequence.

    ``after``: tokens after the grid (reference images), kept whole. ``before``: the exact count of tokens
    before it, or None where it varies (text of any length in joint attention: whatever precedes the grid).
    """

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
        """``min_tokens``: the image tokens of a call from which ``skip_when_slower`` lets it be reduced, where the
        model's own break-even is known (None: the ToDo threshold of ``cost.MIN_TOKENS``)."""
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
        """Downsampled keys, values and attention mask of one call (tokens along ``dim`` of ``k`` and ``v``, along
        the last axis of ``mask``), or None: leave the call as it is.

        None where the sequence does not have the expected layout (a cross-attention, a model variant that
        adds tokens of its own), where the grid is too small for the reduction to pay off, or where a mask would
        have to be resampled by averaging (only nearest-exact keeps a mask exact: it drops whole keys).
        """
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
    """(1, keys) additive mask: ``log(grid_tokens / kept)`` on the ``kept`` grid keys at ``start``, 0 elsewhere.

    Broadcasts over batch, heads and queries in every attention function of the hosts (a 2D mask is read as
    (queries or 1, keys))."""
    bias = torch.zeros(1, kept + others, dtype=dtype, device=device)
    bias[:, start : start + kept] = math.log(grid_tokens / kept)
    return bias
