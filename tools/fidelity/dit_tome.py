"""ToMe through a Flux model's attention, as a fidelity row: the measurement behind shipping ToDo only on DiTs.

Not a product path (the nodes refuse method tome on DiTs). In every attention call of a Flux-layout model the
image tokens' queries, keys and values are merged with the engine's bipartite matching (plan from the keys,
2x2 cells), attention runs on [text, merged image tokens] with proportional attention (log of each merged
token's size added to its key's logits, so merged keys keep their share of the softmax next to the text), and
the image part of the output is unmerged. ``docs/dit.md`` compares it with ToDo at the same picture.
"""

from __future__ import annotations

import math

import torch

from tome_core import matching
from tome_core.patterns import PatternCache

WRAPPER_KEY = "tome_attention_prototype"


class MergedAttention:
    """The ``optimized_attention_override`` of one model call with an image grid of ``h`` x ``w`` tokens."""

    def __init__(self, ratio: float, h: int, w: int, patterns: PatternCache):
        self.ratio, self.h, self.w, self.patterns = ratio, h, w, patterns

    def __call__(self, func, q, k, v, heads, *args, **kwargs):
        batch, n_heads, total, head_dim = q.shape  # Flux: skip_reshape, (batch, heads, tokens, head_dim)
        n = self.h * self.w
        text = total - n
        if k.shape[2] != total or text < 0 or kwargs.get("mask") is not None:
            return func(q, k, v, heads, *args, **kwargs)

        def image(x):
            return x[:, :, text:].transpose(1, 2).reshape(batch, n, n_heads * head_dim)

        def heads_first(x):
            return x.view(batch, -1, n_heads, head_dim).transpose(1, 2)

        pattern = self.patterns.get(self.h, self.w, 2, 2, None, q.device)
        plan = matching.make_plan(image(k), pattern, int(n * self.ratio))
        q, k, v = (torch.cat([x[:, :, :text], heads_first(matching.merge(plan, image(x)))], dim=2) for x in (q, k, v))
        sizes = plan.inv_group_size.view(batch, -1).reciprocal()
        bias = torch.cat([sizes.new_zeros(batch, text), sizes.log()], dim=1).to(q.dtype).view(batch, 1, 1, -1)
        out = func(q, k, v, heads, *args, **{**kwargs, "mask": bias})  # (batch, text + merged, heads * head_dim)
        return torch.cat([out[:, :text], matching.unmerge(plan, out[:, text:])], dim=1)


def patch(ratio: float, patch_size: int = 2):
    """``patch(model)`` for a fidelity row: a clone whose model calls merge through attention."""
    patterns = PatternCache()

    def apply(model):
        clone = model.clone()

        def wrapper(executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kw):
            h, w = math.ceil(x.shape[-2] / patch_size), math.ceil(x.shape[-1] / patch_size)
            options = {**transformer_options, "optimized_attention_override": MergedAttention(ratio, h, w, patterns)}
            return executor(x, t, c_concat, c_crossattn, control, options, **kw)

        clone.add_wrapper_with_key("apply_model", WRAPPER_KEY, wrapper)
        return clone

    return apply
