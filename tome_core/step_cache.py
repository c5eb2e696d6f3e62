"""Reuse across steps, token by token: at a reduced step a transformer block computes only part of its tokens.

Consecutive sampling steps feed a block nearly the same tokens, and most tokens' update (block output minus
block input) changes little from one step to the next. So at a reduced step each block computes:
- the tokens whose block input changed most since they were last computed, plus
- an evenly spread share that moves with every reduced step, so that no region goes stale,
and every other token adds its own update from the last step in which it was computed (never a neighbour's).
The computed tokens are exact: their queries attend to the keys and values of all tokens of the current step
(the block input is known for every token; only the block's work on it is skipped), and cross-attention and the
feed-forward layer work token by token. Full steps at the start, at the end and every ``full_every`` steps
compute everything and refresh every cached update.

This is token reduction in time, where ToMe and ToDo reduce in space.

State: one ``ReuseRun`` per sampling run, made by the host adapter when the run starts (it knows the sigma
schedule) and dropped when it ends. It holds per block and batch layout the last block input and update of each
token. Whenever it cannot be sure that cached data belongs to the current call (no run, a sigma that is not on
the schedule, a step that goes backwards, another batch layout or shape), the block is computed in full.
Nothing here knows a host: the adapter passes the block's body and its first norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .schedule import call_sigmas, step_of


@dataclass(frozen=True)
class ReuseSchedule:
    """Which steps are full and how many tokens a reduced step computes."""

    reuse: float  # share of a block's tokens that a reduced step does not compute (0: every step is full)
    full_every: int = 3  # every k-th step is full (counted from the last full start step); 1: every step
    full_start: float = 0.2  # the first steps up to this share of the schedule are full (the picture's layout)
    full_end: int = 2  # the last steps are full (the fine detail: one reduced step there shows in the picture)
    spread: float = 0.25  # share of the computed tokens taken evenly spread instead of by change

    def __post_init__(self):
        if not 0.0 <= self.reuse < 1.0:
            raise ValueError(f"reuse must be a number from 0 to below 1, got {self.reuse!r}")
        if self.full_every < 1:
            raise ValueError(f"full_every must be an integer from 1 up, got {self.full_every!r}")
        if not 0.0 <= self.spread <= 1.0:
            raise ValueError(f"spread must be a number from 0 to 1, got {self.spread!r}")

    def is_full(self, step: int, steps: int) -> bool:
        start = math.ceil(self.full_start * steps)
        if self.reuse == 0.0 or step < max(start, 1) or step >= steps - self.full_end:
            return True
        return (step - start) % self.full_every == self.full_every - 1


@dataclass(frozen=True)
class CallPlan:
    """What one model call does: its step, full or reduced, and the offset of the evenly spread tokens."""

    step: int
    full: bool
    spread_offset: int


class _Entry:
    """One block's cache for one batch layout: each token's block input when last computed, and its update."""

    __slots__ = ("x_seen", "update")

    def __init__(self, x_seen: torch.Tensor, update: torch.Tensor):
        self.x_seen = x_seen
        self.update = update


class ReuseRun:
    """The cache of one sampling run (see the module docstring). Also counts the work done, for the log."""

    def __init__(self, schedule: ReuseSchedule, sigmas: torch.Tensor):
        self.schedule = schedule
        self.sigmas = call_sigmas(sigmas)
        self.steps = len(self.sigmas)
        self.entries: dict[object, _Entry] = {}
        self.last_step = -1
        self.reduced_steps = 0
        self.tokens_total = 0
        self.tokens_computed = 0
        self.calls = 0
        self.full_calls = 0

    def drop(self) -> None:
        self.entries.clear()

    def step_of(self, sigma: float) -> int | None:
        return step_of(self.sigmas, sigma)

    def begin_call(self, sigma: float) -> CallPlan | None:
        """The plan of a model call at ``sigma``; None (compute in full, cache nothing) when off the schedule."""
        step = self.step_of(sigma)
        self.calls += 1
        if step is None:
            self.drop()
            return None
        if step < self.last_step:  # the steps went backwards: not the run the cache was made in
            self.drop()
        if step != self.last_step and not self.schedule.is_full(step, self.steps):
            self.reduced_steps += 1
        self.last_step = step
        full = self.schedule.is_full(step, self.steps)
        if full:
            self.full_calls += 1
        return CallPlan(step, full, self.reduced_steps)

    def run_block(
        self,
        key: object,
        plan: CallPlan,
        x: torch.Tensor,
        body: Callable[[torch.Tensor], torch.Tensor],
        with_keys_values: Callable[[torch.Tensor, Callable[[], torch.Tensor]], torch.Tensor],
    ) -> torch.Tensor:
        """One block call: ``body(tokens)`` runs the block on some tokens; ``with_keys_values(tokens, run)`` runs
        ``run`` with self-attention's keys and values taken from ``tokens`` (all tokens of the step)."""
        b, n, c = x.shape
        self.tokens_total += b * n
        entry = self.entries.get(key)
        usable = entry is not None and entry.update.shape == x.shape and entry.update.dtype == x.dtype
        n_compute = n - int(n * self.schedule.reuse)
        if plan.full or not usable or n_compute >= n:
            out = body(x)
            # Clones: the cache must not see later in-place changes of the host's tensors.
            self.entries[key] = _Entry(x.detach().clone(), (out - x).detach())
            self.tokens_computed += b * n
            return out
        index = self._choose(entry, x, n_compute, plan.spread_offset)
        gather = index.unsqueeze(-1).expand(-1, -1, c)
        x_part = x.gather(1, gather)
        out_part = with_keys_values(x, lambda: body(x_part))
        entry.update.scatter_(1, gather, out_part - x_part)
        entry.x_seen.scatter_(1, gather, x_part)
        out = x + entry.update
        out.scatter_(1, gather, out_part)  # computed tokens exactly as the block made them
        self.tokens_computed += b * n_compute
        return out

    def _choose(self, entry: _Entry, x: torch.Tensor, n_compute: int, offset: int) -> torch.Tensor:
        """Per batch row: the evenly spread tokens of this reduced step, then those whose input changed most."""
        b, n, _ = x.shape
        n_spread = min(n_compute, round(n_compute * self.schedule.spread))
        change = (x - entry.x_seen).float().norm(dim=-1)
        parts = []
        if n_spread:
            stride = n / n_spread
            spread = ((torch.arange(n_spread, device=x.device) * stride).long() + offset % max(int(stride), 1)) % n
            change[:, spread] = -1.0  # taken already: not again by change
            parts.append(spread.unsqueeze(0).expand(b, -1))
        if n_compute > n_spread:
            parts.append(change.topk(n_compute - n_spread, dim=1).indices)
        return torch.cat(parts, dim=1)

    def summary(self) -> str:
        share = self.tokens_computed / self.tokens_total if self.tokens_total else 1.0
        return (
            f"{self.calls - self.full_calls} of {self.calls} model calls reduced; the reduced levels' transformer "
            f"blocks computed {share:.0%} of their tokens ({self.tokens_computed} of {self.tokens_total})"
        )
