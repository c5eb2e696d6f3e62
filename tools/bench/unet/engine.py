"""Engine sub-benchmark: the engine's own work versus the attention it replaces, per level and resolution.

For each reduced level's token grid: the time of the full self-attention core (SDPA on queries, keys, values
of that grid), of the reduced one (ToMe: merged tokens; ToDo: downsampled keys/values), and of the engine's
work around it: building a ToMe plan, merging, unmerging, downsampling. Shapes follow the model's attention
(heads, head width) at that level; inputs are random, timings are medians of repeats.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from tome_core import matching
from tome_core.downsample import NearestIndexCache, downsample_tokens
from tome_core.patterns import PatternCache
from tools.common.measure import timed


def _median_time(call, device: torch.device, repeats: int) -> float:
    """Median of ``repeats`` timed calls after one untimed (caches, kernel selection); CUDA events on a GPU."""
    call()
    return statistics.median(timed(call, device)[0] for _ in range(repeats))


def _attention(tokens: torch.Tensor, kv: torch.Tensor, heads: int) -> torch.Tensor:
    batch, n, channels = tokens.shape
    q = tokens.view(batch, n, heads, -1).transpose(1, 2)
    k = kv.view(batch, kv.shape[1], heads, -1).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, k)


def engine_rows(
    grid: tuple[int, int],
    channels: int,
    heads: int,
    batch: int,
    ratio: float,
    factor: float,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int = 5,
) -> dict:
    """Times (seconds, median) of the attention and of each engine step on one level's grid."""
    h, w = grid
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, h * w, channels, generator=generator).to(device=device, dtype=dtype)
    pattern = PatternCache().get(h, w, 2, 2, None, device)
    r = int(h * w * ratio)
    plan = matching.make_plan(x, pattern, r)
    merged = matching.merge(plan, x)
    cache = NearestIndexCache()
    with torch.inference_mode():
        result = {
            "grid": [h, w],
            "tokens": h * w,
            "attention_s": _median_time(lambda: _attention(x, x, heads), device, repeats),
            "attention_tome_s": _median_time(lambda: _attention(merged, merged, heads), device, repeats),
            "plan_s": _median_time(lambda: matching.make_plan(x, pattern, r), device, repeats),
            "merge_s": _median_time(lambda: matching.merge(plan, x), device, repeats),
            "unmerge_s": _median_time(lambda: matching.unmerge(plan, merged), device, repeats),
        }
        kv = downsample_tokens(x, h, w, factor, "nearest-exact", cache)
        result["attention_todo_s"] = _median_time(lambda: _attention(x, kv, heads), device, repeats)
        result["downsample_s"] = _median_time(
            lambda: downsample_tokens(x, h, w, factor, "nearest-exact", cache), device, repeats
        )
    result["tome_work_s"] = result["plan_s"] + result["merge_s"] + result["unmerge_s"]
    return result
