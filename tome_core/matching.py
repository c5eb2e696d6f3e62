"""ToMe: bipartite soft matching on the token grid, merge by mean and unmerge by copy.

A ``MergePlan`` stores, per original token, the merged row it went to (``slot``), so merging is one
``index_add`` and unmerging one gather, and one plan serves every part of a block."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .patterns import DstPattern

# Past this many similarity scores the matrix is computed in slices of src tokens, to bound peak memory.
_MAX_SCORES_PER_SLICE = 1 << 26


@dataclass(frozen=True)
class MergePlan:
    slot: torch.Tensor  # (batch * n_tokens,) row of the flattened merged tensor per original token
    inv_group_size: torch.Tensor
    batch: int
    n_tokens: int
    n_merged: int


def _best_dst(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each src token, the highest cosine similarity to any dst token and that dst token's index."""
    dst_t = dst.transpose(1, 2)
    per_slice = max(1, _MAX_SCORES_PER_SLICE // max(1, src.shape[0] * dst.shape[1]))
    if per_slice >= src.shape[1]:
        return (src @ dst_t).max(dim=-1)
    best, index = [], []
    for start in range(0, src.shape[1], per_slice):
        b, i = (src[:, start : start + per_slice] @ dst_t).max(dim=-1)
        best.append(b)
        index.append(i)
    return torch.cat(best, dim=1), torch.cat(index, dim=1)


def make_plan(metric: torch.Tensor, pattern: DstPattern, r: int) -> MergePlan:
    """Plan the merge of ``r`` src tokens of ``metric`` (batch, tokens, channels) into their best dst."""
    batch, n_tokens, _ = metric.shape
    device = metric.device
    n_src, n_dst = pattern.n_src, pattern.n_dst
    r = max(0, min(r, n_src))

    unit = metric / metric.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    best_score, best_dst = _best_dst(unit[:, pattern.src_idx], unit[:, pattern.dst_idx])

    order = best_score.argsort(dim=-1, descending=True)
    merged_src, kept_src = order[:, :r], order[:, r:]
    n_kept = n_src - r
    n_merged = n_kept + n_dst

    src_slot = torch.empty(batch, n_src, dtype=torch.int64, device=device)
    src_slot.scatter_(1, kept_src, torch.arange(n_kept, device=device).expand(batch, -1))
    src_slot.scatter_(1, merged_src, best_dst.gather(1, merged_src) + n_kept)

    slot = torch.empty(batch, n_tokens, dtype=torch.int64, device=device)
    slot[:, pattern.src_idx] = src_slot
    slot[:, pattern.dst_idx] = torch.arange(n_kept, n_merged, device=device)
    slot += torch.arange(batch, device=device).view(-1, 1) * n_merged
    slot = slot.flatten()

    group_size = torch.zeros(batch * n_merged, 1, dtype=torch.float32, device=device)
    group_size.index_add_(0, slot, torch.ones(batch * n_tokens, 1, dtype=torch.float32, device=device))
    return MergePlan(slot, group_size.reciprocal(), batch, n_tokens, n_merged)


def merge(plan: MergePlan, x: torch.Tensor) -> torch.Tensor:
    """(batch, n_tokens, c) -> (batch, n_merged, c): each merged row is the mean of the tokens sent to it."""
    channels = x.shape[-1]
    summed = x.new_zeros(plan.batch * plan.n_merged, channels)
    summed.index_add_(0, plan.slot, x.reshape(-1, channels))
    return (summed * plan.inv_group_size.to(x.dtype)).view(plan.batch, plan.n_merged, channels)


def unmerge(plan: MergePlan, x: torch.Tensor) -> torch.Tensor:
    """(batch, n_merged, c) -> (batch, n_tokens, c): every original token gets a copy of its merged row."""
    channels = x.shape[-1]
    return x.reshape(-1, channels).index_select(0, plan.slot).view(plan.batch, plan.n_tokens, channels)
