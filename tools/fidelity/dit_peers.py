"""Published step-cache ideas for DiTs that ComfyUI does not ship, as fidelity rows on the DiT references
(measured, not offered): so that the front shows where reuse across steps stands against them.

- **First Block Cache** (the idea of ParaAttention's and diffusers' ``FirstBlockCacheConfig``): the first block
  runs at every call; when its residual (output minus input) changed by less than ``threshold`` (mean absolute
  difference over mean absolute value) since the last call that computed everything, the other blocks are
  skipped and their cached residual is added to the first block's output; otherwise every block runs and the
  caches are renewed. Written here on ComfyUI's ``patches_replace["dit"]`` block replacements, one state per
  batch layout (``uuids``), dropped when the noise level goes up (a new sampling run).
- **MagCache, calibrated on the reference** (the idea of Ma et al.'s MagCache and diffusers' ``MagCacheConfig``):
  every block is skipped at a call where the residual of the whole stack (last block's output minus first block's
  input) is predicted well enough by the last computed one: along the run the calibrated step-to-step ratios of
  that residual's norm are multiplied up since the last computed call, their distance from 1 summed, and a call is
  skipped while that sum stays under ``threshold`` and fewer than ``max_skips`` calls in a row were skipped; the
  first ``retention`` of the steps run in full (diffusers' defaults: 3 and 0.2). The ratios come from an unpatched
  run of the reference at the benchmark's own settings on prompts the benchmark does not report
  (``magcache_ratios``), as MagCache's authors calibrate each model; the real models' published ratios would make
  it a straw man on a reference whose curve differs.
- **cache-dit's fixed plans** (``steps_mask``'s ``mask_policy`` slow, medium, fast and ultra: 18, 15, 11 and 8
  computed steps of 28, the first 4 to 8 among them, stretched or cut to other step counts as cache-dit does,
  the last step always computed): at a step the plan caches, the first block runs and the other blocks' cached
  residual is added (cache-dit's DBCache with one front block, F1B0; its default F8B0 runs 8 blocks there).
- **TaylorSeer-style forecast** (diffusers' ``TaylorSeerCacheConfig`` defaults: every 5th call computed, the
  first 3 too, first order): every block is forecast at the other calls, from the last two computed ones, one
  whole step along the line (no damping, no block kept running, no call kept full at low noise). Built from
  this project's span machinery with those settings (``dit_reuse.install`` with no outer blocks), so it differs
  from TaylorSeer in that the line is drawn over the noise level rather than the step index.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PATCH_NAME = "dit"


def _joined(state: dict, streams: tuple[str, ...]) -> torch.Tensor:
    present = [state[k] for k in streams if state.get(k) is not None]
    return present[0] if len(present) == 1 else torch.cat(present, 1)


def _split(joined: torch.Tensor, args: dict, streams: tuple[str, ...]) -> dict:
    """The last block's outputs from the joined streams: Flux's and Wan's last block passes one stream on
    (``img``), Qwen-Image's every block passes both on (``txt``, ``img``), split at the lengths it was given."""
    present = [k for k in streams if args.get(k) is not None]
    if len(present) < 2:
        return {"img": joined}
    return dict(zip(present, joined.split([args[k].shape[1] for k in present], 1), strict=True))


def _skipped(args: dict, position: int, last: int, output: Callable, streams: tuple[str, ...]) -> dict:
    """A skipped block's result: an inner one passes its input on, the last gives the stack's predicted output
    (``output()``, the joined streams)."""
    if position < last:
        return {k: args[k] for k in ("img", "txt") if k in args}
    return _split(output(), args, streams)


def _replace_every_block(model, make_cache: Callable):
    """A clone of ``model`` whose every block is replaced by ``make_cache(keys, streams)``'s replacements."""
    from tome_core.hosts.comfyui import dit_reuse

    clone = model.clone()
    diffusion_model = clone.model.diffusion_model
    keys = dit_reuse.block_keys(diffusion_model)
    cache = make_cache(keys, dit_reuse.block_streams(diffusion_model))
    for position, (block_type, index) in enumerate(keys):
        clone.set_model_patch_replace(cache.replacement(position), PATCH_NAME, block_type, index)
    return clone


class BlockCache:
    """What a whole-stack step cache keeps for one patched clone: one state per batch layout (``uuids``), all
    dropped when the noise level goes up (a new sampling run)."""

    def __init__(self, keys: list, threshold: float, streams: tuple[str, ...] = ("txt", "img")):
        self.keys = keys
        self.streams = streams  # what the blocks pass on (Wan: ``img`` only; its ``txt`` is the prompt it reads)
        self.threshold = threshold
        self.states: dict = {}
        self.last_sigma = None

    def __deepcopy__(self, memo):
        return self

    def _layout_state(self, args, fresh: dict) -> tuple[dict, dict, float | None]:
        """(this call's batch layout's state, a copy of ``fresh`` where new; the call's options; its sigma)."""
        options = args.get("transformer_options") or {}
        sigmas = options.get("sigmas")
        sigma = float(sigmas.max()) if sigmas is not None else None
        if sigma is not None and self.last_sigma is not None and sigma > self.last_sigma:
            self.states.clear()  # the noise went up: another sampling run
        self.last_sigma = sigma
        layout = tuple(str(u) for u in options.get("uuids") or ())
        return self.states.setdefault(layout, dict(fresh)), options, sigma


def _step_of(options: dict, sigma: float | None) -> tuple[int | None, int | None]:
    """(this call's step, the run's steps) from the sampler's sigmas ComfyUI passes in the options; Nones where
    they are missing."""
    schedule = options.get("sample_sigmas")
    if sigma is None or schedule is None:
        return None, None
    return int((schedule[:-1].float() - sigma).abs().argmin()), len(schedule) - 1


class FirstBlockCache(BlockCache):
    """The block replacements of one patched clone (see the module docstring)."""

    def _state(self, args) -> dict:
        state, options, sigma = self._layout_state(args, {"head": None, "rest": None, "skip": False})
        state["step"], state["steps"] = _step_of(options, sigma)
        return state

    def _reuses(self, state: dict, head: torch.Tensor, previous: torch.Tensor) -> bool:
        """Whether this call takes the cached rest: its first block's residual moved less than the threshold."""
        return float((head - previous).abs().mean() / previous.abs().mean()) < self.threshold

    def replacement(self, position: int) -> Callable:
        last = len(self.keys) - 1

        def block(args, extra):
            state = self._state(args)
            if position == 0:
                before = _joined(args, self.streams).clone()  # ComfyUI's blocks may add to their input in place
                out = extra["original_block"](args)
                head = _joined(out, self.streams) - before
                previous = state["head"]
                state["skip"] = (
                    previous is not None
                    and state["rest"] is not None
                    and previous.shape == head.shape
                    and self._reuses(state, head, previous)
                )
                if not state["skip"]:
                    state["head"] = head
                state["out"] = _joined(out, self.streams)
                return out
            if state["skip"]:
                return _skipped(args, position, last, lambda: state["out"] + state["rest"], self.streams)
            out = extra["original_block"](args)
            if position == last:
                state["rest"] = _joined(out, self.streams) - state["out"]
            return out

        return block


def first_block_cache_patch(threshold: float) -> Callable:
    """A fidelity row's patch: First Block Cache at ``threshold`` on a Flux or Wan model (every block replaced)."""

    def patch(model):
        return _replace_every_block(model, lambda keys, streams: FirstBlockCache(keys, threshold, streams))

    return patch


class MagCache(BlockCache):
    """The block replacements of one patched clone (see the module docstring)."""

    def __init__(self, keys: list, ratios: list[float], threshold: float, streams: tuple[str, ...] = ("txt", "img")):
        super().__init__(keys, threshold, streams)
        self.ratios = ratios  # calibrated, one per step of a run of len(ratios) steps; the first is 1
        self.max_skips = 3
        self.retention = 0.2

    def ratio_at(self, step: int, steps: int) -> float:
        """The calibrated ratio at ``step`` of a run of ``steps``, read at the same share of the run."""
        if steps == len(self.ratios):
            return self.ratios[step]
        where = step * (len(self.ratios) - 1) / max(1, steps - 1)
        low = min(int(where), len(self.ratios) - 2)
        return self.ratios[low] + (where - low) * (self.ratios[low + 1] - self.ratios[low])

    def _state(self, args) -> dict:
        fresh = {"residual": None, "ratio": 1.0, "error": 0.0, "skips": 0}
        state, options, sigma = self._layout_state(args, fresh)
        state["step"], state["steps"] = _step_of(options, sigma)
        return state

    def _decide(self, state: dict, shape) -> bool:
        step = state["step"]
        usable = (
            step is not None
            and step >= self.retention * state["steps"]
            and state["residual"] is not None
            and state["residual"].shape == shape
        )
        if usable:
            state["ratio"] *= self.ratio_at(step, state["steps"])
            state["error"] += abs(1.0 - state["ratio"])
            state["skips"] += 1
            if state["error"] < self.threshold and state["skips"] <= self.max_skips:
                return True
        state.update(ratio=1.0, error=0.0, skips=0)
        return False

    def replacement(self, position: int) -> Callable:
        last = len(self.keys) - 1

        def block(args, extra):
            state = self.states_for(args) if position == 0 else self._current
            if position == 0:
                state["input"] = _joined(args, self.streams).clone()  # blocks may add to their input in place
                state["skip"] = self._decide(state, state["input"].shape)
            if state["skip"]:
                return _skipped(args, position, last, lambda: state["input"] + state["residual"], self.streams)
            out = extra["original_block"](args)
            if position == last:
                state["residual"] = _joined(out, self.streams) - state["input"]
            return out

        return block

    def states_for(self, args) -> dict:
        self._current = self._state(args)
        return self._current


# cache-dit's fixed 28-step plans (``steps_mask``'s ``mask_policy``): runs of computed and of cached steps, in turn
# from step 0 (CALIBRATIONS.md section 5).
CACHE_DIT_PLANS = {
    "slow": ((8, 3, 3, 2, 1, 1), (1, 2, 2, 2, 3)),
    "medium": ((6, 2, 2, 2, 2, 1), (1, 3, 3, 3, 3)),
    "fast": ((6, 1, 1, 1, 1, 1), (1, 3, 4, 5, 4)),
    "ultra": ((4, 1, 1, 1, 1), (2, 5, 6, 7)),
}
# Its plans for runs of 10 to 15 steps (distilled models), cut to the run's length.
CACHE_DIT_SHORT_PLANS = {
    "slow": ((4, 2, 2, 2, 1), (1, 1, 1, 1)),
    "medium": ((4, 2, 1, 1, 1), (1, 1, 2, 2)),
    "fast": ((3, 1, 1, 1, 1), (1, 2, 2, 3)),
    "ultra": ((2, 1, 1, 1, 1), (1, 2, 3, 3)),
}
PLAN_STEPS = 28


def _plan_length(runs: list[list[int]]) -> int:
    return sum(runs[0]) + sum(runs[1])


def _stretched(runs: list[list[int]], steps: int) -> None:
    """Longer runs for more than 28 steps, as cache-dit stretches its plans: round after round, each pair of runs
    grows by half its 28-step length times steps / 28 (at least 1), the computed one first, and the last computed
    run by one, until the plan covers ``steps``."""
    base = [list(runs[0]), list(runs[1])]
    grow = steps / PLAN_STEPS * 0.5
    while _plan_length(runs) < steps:
        for i in range(min(len(runs[0]), len(runs[1]))):
            for kind in (0, 1):
                runs[kind][i] += max(int(base[kind][i] * grow), 1)
                if _plan_length(runs) >= steps:
                    return
        runs[0][-1] += 1


def _shortened(runs: list[list[int]], steps: int) -> None:
    """Shorter runs, as cache-dit cuts its plans: one step off the last cached run, then off the last computed one,
    in turn, until the plan is ``steps`` long."""
    while _plan_length(runs) > steps:
        for kind in (1, 0):
            if runs[kind]:
                runs[kind][-1] -= 1
                if runs[kind][-1] == 0:
                    runs[kind].pop()
            if _plan_length(runs) <= steps:
                return


def cache_dit_plan(policy: str, steps: int) -> list[bool]:
    """Which of ``steps`` steps cache-dit's fixed plan ``policy`` computes (True): from 16 steps the 28-step plan
    stretched or cut to ``steps``, from 10 its short plan cut, the last step always computed."""
    if steps < 10:
        raise ValueError(f"cache-dit's fixed plans are measured here from 10 steps, not {steps}")
    runs = [list(run) for run in (CACHE_DIT_PLANS if steps >= 16 else CACHE_DIT_SHORT_PLANS)[policy]]
    if steps > PLAN_STEPS:
        _stretched(runs, steps)
    _shortened(runs, steps)
    plan: list[bool] = []
    for i in range(max(len(runs[0]), len(runs[1]))):  # a cut plan may end in cached runs only
        plan += [True] * (runs[0][i] if i < len(runs[0]) else 0) + [False] * (runs[1][i] if i < len(runs[1]) else 0)
    plan = plan[:steps]
    plan[-1] = True
    return plan


class FixedPlanCache(FirstBlockCache):
    """cache-dit's fixed plans on its DBCache (F1B0): the first block runs at every call; at a step the plan
    caches, the other blocks are skipped and their cached residual added, whatever the first block says."""

    def __init__(self, keys: list, policy: str, streams: tuple[str, ...] = ("txt", "img")):
        super().__init__(keys, 0.0, streams)
        self.policy = policy
        self.plans: dict[int, list[bool]] = {}  # by the run's step count: made once, read at every call

    def _reuses(self, state: dict, head: torch.Tensor, previous: torch.Tensor) -> bool:
        if state["step"] is None:
            return False
        steps = state["steps"]
        if steps not in self.plans:
            self.plans[steps] = cache_dit_plan(self.policy, steps)
        return not self.plans[steps][state["step"]]


def cache_dit_plan_patch(policy: str) -> Callable:
    """A fidelity row's patch: cache-dit's fixed plan ``policy`` (every block replaced)."""

    def patch(model):
        return _replace_every_block(model, lambda keys, streams: FixedPlanCache(keys, policy, streams))

    return patch


def magcache_patch(threshold: float, ratios_of: Callable) -> Callable:
    """A fidelity row's patch: MagCache at ``threshold`` with the ratios ``ratios_of(model)`` calibrates."""

    def patch(model):
        return _replace_every_block(model, lambda keys, streams: MagCache(keys, ratios_of(model), threshold, streams))

    return patch


def taylorseer_style_patch(interval: int = 5, first: int = 3) -> Callable:
    """A fidelity row's patch: every ``interval``-th call and the first ``first`` computed, the others forecast
    whole (first order, one full step along the line)."""
    from tome_core.reuse import IntervalSchedule
    from tome_core.schedule import NoiseRange
    from tome_core.settings import PatchSettings
    from tools.fidelity.lab import ReuseVariant, install_dit_variant

    def patch(model):
        clone = model.clone()
        settings = PatchSettings(method="todo", downsample_factor=1.0, reuse_interval=interval)

        class FromStep(IntervalSchedule):
            def is_full(self, step: int, steps: int) -> bool:  # the first ``first`` steps, then every interval-th
                return step < first or (step - first) % interval == interval - 1

        schedule = FromStep(interval, full_start=0.0, full_end=0, short_run=0, min_steps=0)
        variant = ReuseVariant(schedule, extrapolate=1.0, outer=(0, 0))
        install_dit_variant(clone, settings, NoiseRange(0.0, 1.0, lambda p: p), variant)
        return with_full_below(clone, 0.0)  # TaylorSeer has no low-noise rule of its own

    return patch


def with_full_below(clone, full_below: float):
    """``clone`` (patched by ``dit_reuse.install``) with every run's calls below ``full_below`` in full, in
    place of the sampler's rule (``layer_reuse.full_below_noise``); returns it."""
    from tome_core.hosts.comfyui import dit_reuse

    replaced = dit_reuse._replacements(clone).values()
    hooks = next(block.hooks for block in replaced if isinstance(block, dit_reuse.SpanBlock))
    new_run = hooks.new_run
    hooks.new_run = lambda steps, levels=None, _rule=0.0: new_run(steps, levels, full_below)
    return clone
