"""Per transformer-block decisions, the one entry point of every host adapter.

``Reducer.start_block`` returns None (leave the block as it is) or a ``BlockReduction`` whose hook methods are
identity wherever its scope does not reduce. See docs/how-it-works.md, section 'Scope: the whole transformer block'."""

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
    """ToMe over the whole block: x -> x + unmerge(block(merge(x)) - merge(x))."""

    def __init__(self, plan: matching.MergePlan):
        self.plan = plan

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        return matching.merge(self.plan, x)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        return matching.unmerge(self.plan, x)

    def run_block(self, x, body):
        start = self.merge(x)
        # A copy: a host block may add to its input in place (Forge's ``x += n``).
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
        """Whether a UNet call on a latent of ``latent_hw`` may reduce any level; if not, a host can skip its hooks."""
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
        """How to reduce a block whose input tokens are ``x`` (batch, tokens, channels), or None to leave it.
        ``plans``: a dict living for one UNet call, through which scope block shares one plan per level."""
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
            if downsampled_size(h, w, s.downsample_factor) == (h, w):
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
        # A host may split the batch differently between blocks.
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
