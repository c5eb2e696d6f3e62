"""ToDo's reference-style downsampling (from the paper's description), as a ComfyUI attn1 patch: the benchmark's
and the fidelity benchmark's "ToDo reference" row."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch.nn.functional as F


def todo_reference_patch(factor: float, max_level: int) -> Callable:
    """ToDo as the paper describes it: keys/values of self-attention resized by ``interpolate``.

    The level is guessed as the reference code does, from the token-count ratio to the latent
    (ceil(sqrt(latent tokens // tokens))), the grid size from the latent divided by that level, and the new
    size rounded down; blocks at ``max_level`` or finer are downsampled by ``factor``.
    """

    def attn1_patch(n, context, value, extra_options):
        _, _, height, width = extra_options["original_shape"]
        level = math.ceil(math.sqrt(height * width // n.shape[1]))
        if level > max_level:
            return n, context, value
        h, w = math.ceil(height / level), math.ceil(width / level)
        batch, _, channels = n.shape
        grid = n.reshape(batch, h, w, channels).permute(0, 3, 1, 2)
        small = F.interpolate(grid, size=(int(h / factor), int(w / factor)), mode="nearest-exact")
        kv = small.permute(0, 2, 3, 1).reshape(batch, -1, channels)
        return n, kv, kv

    return attn1_patch
