"""Per transformer-block decisions: is this block reduced, and how. The one entry point of every host adapter.

A ``Reducer`` is built once per patch from validated settings and the UNet's attention levels. For each block
call the adapter asks ``start_block`` and gets either None (leave the block exactly as it is) or a
``BlockReduction``, one class per scope, whose methods it calls at its host's hook points:

    out = reduction.run_block(x, body)         # around the whole block: body(tokens) runs the block
    q, kv = reduction.self_attn_inputs(n)      # before self-attention
    out = reduction.self_attn_output(out)      # after self-attention
    q = reduction.cross_attn_query(n)          # before cross-attention (context untouched)
    out = reduction.cross_attn_output(out)
    y = reduction.mlp_input(n); out = reduction.mlp_output(out)

Every method is identity unless the scope reduces that point, so an adapter maps all of its hook points once and
never needs to know the scope; a hook point a host lacks (ComfyUI has none around the MLP) only matters to the
scopes that use it. The methods are pure functions of the plan, so the hooks hold no state between block calls.

Scopes (``PatchSettings.scope``, ToMe only; ToDo always reduces self-attention's keys and values):
- ``self-attention``: ``TokenMerge``, one plan per block call, merged around the sub-layers the merge_* switches
  name, each sub-layer's output unmerged into the full-size residual (ToMe for SD's way).
- ``block``: ``BlockMerge``, the block runs on the merged residual stream and only its total update is unmerged.
  One plan per level and UNet call, kept in a per-call ``plans`` dict that the adapter passes in (never on a
  module). For mean merging with one plan, merge(x + unmerge(a)) == merge(x) + a, so running every block of a
  level this way equals merging the residual once before the level's first block and unmerging once after its
  last: the per-block form is exact and needs no state between blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import matching
from .cost import worth_reducing
from .downsample import NearestIndexCache, downsample_tokens, downsampled_size
from .levels import find_level, grid_at_level, reduced_levels
from .patterns import PatternCache, stable_salt
from .settings import PatchSettings


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


class BlockReduction:
    """Identity at every hook point; subclasses reduce some of them."""

    def run_block(self, x: torch.Tensor, body: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return body(x)

    def self_attn_inputs(self, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return n, n

    self_attn_output = staticmethod(_same)
    cross_attn_query = staticmethod(_same)
    cross_attn_output = staticmethod(_same)
    mlp_input = staticmethod(_same)
    mlp_output = staticmethod(_same)


class TokenMerge(BlockReduction):
    """ToMe: one plan per block call, applied to the parts the settings name."""

    def __init__(self, plan: matching.MergePlan, settings: PatchSettings):
        self.plan = plan
        self.settings = settings

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        return matching.merge(self.plan, x)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        return matching.unmerge(self.plan, x)

    def self_attn_inputs(self, n):
        if not self.settings.merge_attn:
            return n, n
        merged = self.merge(n)
        return merged, merged

    def self_attn_output(self, out):
        return self.unmerge(out) if self.settings.merge_attn else out

    def cross_attn_query(self, n):
        return self.merge(n) if self.settings.merge_crossattn else n

    def cross_attn_output(self, out):
        return self.unmerge(out) if self.settings.merge_crossattn else out

    def mlp_input(self, n):
        return self.merge(n) if self.settings.merge_mlp else n

    def mlp_output(self, out):
        return self.unmerge(out) if self.settings.merge_mlp else out


class BlockMerge(BlockReduction):
    """ToMe over the whole block: the block runs on merged tokens, its update is unmerged into the residual.

    x -> x + unmerge(block(merge(x)) - merge(x)). Every sub-layer (self-attention, cross-attention queries, MLP)
    and the norms and residual additions between them see the merged tokens; cross-attention's context (the
    prompt) is untouched. Tokens that no other token merged into come back exactly as the block would make them.
    """

    def __init__(self, plan: matching.MergePlan):
        self.plan = plan

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        return matching.merge(self.plan, x)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        return matching.unmerge(self.plan, x)

    def run_block(self, x, body):
        start = self.merge(x)
        # The body gets its own copy: a host block may add to its input in place (Forge's ``x += n``).
        update = body(start.clone()) - start
        return x + self.unmerge(update)


class KeyValueDownsample(BlockReduction):
    """ToDo: self-attention keys and values downsampled, everything else untouched."""

    def __init__(self, h: int, w: int, settings: PatchSettings, index_cache: NearestIndexCache):
        self.h, self.w = h, w
        self.settings = settings
        self.index_cache = index_cache

    def downsample(self, x: torch.Tensor) -> torch.Tensor:
        s = self.settings
        return downsample_tokens(x, self.h, self.w, s.downsample_factor, s.downsample_method, self.index_cache)

    def self_attn_inputs(self, n):
        return n, self.downsample(n)


class Reducer:
    """Shared by every hook of one patched model; holds only caches that are safe to share between threads."""

    def __init__(self, settings: PatchSettings, attention_levels: tuple[int, ...]):
        self.settings = settings
        off = settings.is_noop or settings.reduces_nothing
        self.levels = frozenset() if off else reduced_levels(settings.max_downsample, attention_levels)
        self._patterns = PatternCache()
        self._nearest = NearestIndexCache()

    @property
    def does_nothing(self) -> bool:
        return not self.levels

    def acts_on(self, latent_hw: tuple[int, int], device_type: str = "cpu") -> bool:
        """Whether a UNet call on a latent of ``latent_hw`` may reduce a level at all. False where every level
        it would reduce is too small to pay (``skip_when_slower``): then every block is left as it is, and a host
        can keep its hooks out of the call, which costs each block a few Python calls (on a GPU at 512-768 px
        a step is a few milliseconds)."""
        return any(
            worth_reducing(self.settings, h * w, device_type)
            for h, w in (grid_at_level(latent_hw, level) for level in self.levels)
        )

    @property
    def merges_whole_block(self) -> bool:
        """The adapter must call ``run_block`` around the block (scope block); else sub-layer hooks suffice."""
        return bool(self.levels) and self.settings.merges_whole_block

    def start_block(
        self,
        x: torch.Tensor,
        latent_hw: tuple[int, int],
        block_key: object = None,
        metric: torch.Tensor | None = None,
        plans: dict | None = None,
    ) -> BlockReduction | None:
        """Decide how to reduce a block whose input tokens are ``x`` (batch, tokens, channels).

        ``latent_hw`` is the UNet input's latent size; ``block_key`` names the block (it salts the random
        dst pattern so blocks differ); ``metric`` is what ToMe compares tokens by (default ``x``). ``plans`` is a
        dict that lives for one UNet call (scope block shares one plan per level through it; without it each
        block makes its own). Returns None where the block must be left as it is.
        """
        if not self.levels or x.dim() != 3:
            return None
        found = find_level(latent_hw, x.shape[1])
        if found is None:
            return None
        level, h, w = found
        s = self.settings
        if level not in self.levels or not worth_reducing(s, h * w, x.device.type):
            return None
        if s.method == "todo":
            if downsampled_size(h, w, s.downsample_factor) == (h, w):  # e.g. a 2x2 grid at factor 1.5
                return None
            return KeyValueDownsample(h, w, s, self._nearest)
        r = int(h * w * s.ratio)
        if r <= 0:
            return None
        if s.scope == "block":
            return self._level_merge(x if metric is None else metric, level, h, w, r, plans)
        seed = stable_salt(s.seed, block_key) if s.use_rand else None
        pattern = self._patterns.get(h, w, s.sx, s.sy, seed, x.device)
        if pattern.n_dst == 0:  # grid smaller than one cell: nothing to merge into
            return None
        return TokenMerge(matching.make_plan(x if metric is None else metric, pattern, r), s)

    def _level_merge(
        self, metric: torch.Tensor, level: int, h: int, w: int, r: int, plans: dict | None
    ) -> BlockMerge | None:
        """Scope block: the level's plan of this UNet call, made from the first block that asks for it."""
        key = ("tome_plan", level, h, w)
        plan = None if plans is None else plans.get(key)
        # A plan of another batch size cannot be applied (a host that split the batch differently): make a new one.
        if plan is None or plan.batch != metric.shape[0]:
            s = self.settings
            seed = stable_salt(s.seed, ("level", level)) if s.use_rand else None
            pattern = self._patterns.get(h, w, s.sx, s.sy, seed, metric.device)
            if pattern.n_dst == 0:
                return None
            plan = matching.make_plan(metric, pattern, r)
            if plans is not None:
                plans[key] = plan
        return BlockMerge(plan)
