"""ComfyUI wiring of scope reuse (reuse across steps, token by token; the engine is ``tome_core.step_cache``).

Built on scope block's machinery in ``patcher_hooks``: every transformer block gets our ``forward`` through the
same injection (set when the patcher loads the model, removed when it unloads it), and calls the engine around
the block's own forward. Three more pieces, all per sampling run and none on the model:
- an OUTER_SAMPLE wrapper (comfy/patcher_extension.py ``WrappersMP.OUTER_SAMPLE``, the place ComfyUI's own
  EasyCache keeps its state) makes the run's ``ReuseRun`` from the sigma schedule, puts it into a copy of the
  guider's model options for the run, logs what it did and drops it when the run ends, however it ends;
- an APPLY_MODEL wrapper finds the step of each model call from its sigma, once per call, outside the
  diffusion model;
- an ``attn1_patch`` gives a block that runs on part of the tokens the keys and values of all of them.
The cache is keyed by block and by the call's batch layout (``uuids``: which conds, in which order), so cond and
uncond batched together or apart, area conds and several prompts each get their own entries.
"""

from __future__ import annotations

from ...levels import find_level, reduced_levels
from ...step_cache import ReuseRun, ReuseSchedule
from ..shared import model_patcher
from ..shared.unet_layout import attention_levels
from .sampling_run import sample_with_run

RUN_KEY = "tome_patch_reuse_run"  # transformer_options: the ReuseRun of the current sampling run
CALL_KEY = "tome_patch_reuse_call"  # transformer_options: the CallPlan of the current model call
KEYS_VALUES_KEY = "tome_patch_reuse_kv"  # transformer_options, during one block call: all tokens' attn1 input
WRAPPER_KEY = "tome_patch_reuse"
OUTER_SAMPLE = "outer_sample"  # comfy.patcher_extension.WrappersMP.OUTER_SAMPLE
APPLY_MODEL = "apply_model"  # comfy.patcher_extension.WrappersMP.APPLY_MODEL


class ReuseHooks:
    """Shared by every clone of one patch (like functions); all per-run state lives in the run's options."""

    def __init__(self, schedule: ReuseSchedule, levels: frozenset[int], noise_range):
        self.schedule = schedule
        self.levels = levels
        self.noise_range = noise_range
        self.last_run = None  # the last run, its cache dropped: what it computed (for the log and the tests)

    def __deepcopy__(self, memo):
        return self

    def outer_sample_wrapper(self, executor, *args, **kwargs):
        sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
        run = ReuseRun(self.schedule, sigmas)
        return sample_with_run(executor, args, kwargs, RUN_KEY, run, run, self._ended)

    def _ended(self, run) -> None:
        self.last_run = run

    def apply_model_wrapper(
        self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kwargs
    ):
        if transformer_options is not None:
            transformer_options.pop(CALL_KEY, None)
            run = transformer_options.get(RUN_KEY)
            if run is not None:
                sigma = float(t.max())
                plan = run.begin_call(sigma)
                if plan is not None and self.noise_range.contains(sigma):
                    transformer_options[CALL_KEY] = plan
        return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)

    def block_forward(self, forward, x, context, transformer_options, kwargs):
        """A transformer block's forward: the engine's ``run_block`` where the call is reduced, else the block."""
        options = transformer_options
        plan = options.get(CALL_KEY) if options is not None and options.get(model_patcher.OWNER_KEY) is self else None
        shape = options.get("original_shape") if plan is not None else None
        found = find_level((shape[2], shape[3]), x.shape[1]) if shape is not None and len(shape) == 4 else None
        if found is None or found[0] not in self.levels or x.dim() != 3 or self._foreign_attn1(options):
            return forward.original(x, context, options, kwargs)
        run = options[RUN_KEY]
        key = (id(forward.block), tuple(str(u) for u in options.get("uuids") or ()), tuple(x.shape))
        block = forward.block

        def body(tokens):
            return forward.original(tokens, context, options, kwargs)

        def with_keys_values(tokens, compute):
            options[KEYS_VALUES_KEY] = block.norm1(tokens)
            try:
                return compute()
            finally:
                options.pop(KEYS_VALUES_KEY, None)

        return run.run_block(key, plan, x, body, with_keys_values)

    @staticmethod
    def _foreign_attn1(options: dict) -> bool:
        """Another node changes self-attention's inputs: then a part of the tokens cannot be computed exactly."""
        hooks = options.get("patches", {}).get("attn1_patch", ())
        return any(getattr(h, "__self__", None) is None or not isinstance(h.__self__, ReuseHooks) for h in hooks)

    def attn1_patch(self, n, context, value, extra_options):
        keys_values = extra_options.get(KEYS_VALUES_KEY)
        if keys_values is None or context is not n or value is not n:
            return n, context, value
        return n, keys_values, keys_values


def install(clone, settings, noise_range, schedule: ReuseSchedule | None = None) -> bool:
    """Give ``clone`` (a patcher clone without our patch) scope reuse; False where it has nothing to reduce.

    ``settings.ratio`` is the share of tokens a reduced step reuses; ``schedule`` overrides the engine's other
    defaults (full steps, spread share)."""
    unet = clone.model.diffusion_model
    levels = reduced_levels(settings.max_downsample, attention_levels(unet) or ())
    if not levels or settings.ratio == 0.0 or not hasattr(clone, "add_wrapper_with_key"):
        return False  # nothing to reduce, or a patcher without wrappers (Forge): left unpatched
    schedule = ReuseSchedule(reuse=settings.ratio) if schedule is None else schedule
    hooks = ReuseHooks(schedule, levels, noise_range)
    clone.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY, hooks.outer_sample_wrapper)
    clone.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY, hooks.apply_model_wrapper)
    clone.set_model_attn1_patch(hooks.attn1_patch)
    model_patcher.install_block_forwards(clone, hooks)
    return True


def remove(patcher) -> None:
    """Remove everything scope reuse put on ``patcher`` (a clone); the block forwards go with scope block's."""
    if hasattr(patcher, "remove_wrappers_with_key"):  # Forge's patchers have no wrappers (and never get ours)
        for kind in (OUTER_SAMPLE, APPLY_MODEL):
            patcher.remove_wrappers_with_key(kind, WRAPPER_KEY)
    patches = patcher.model_options.get("transformer_options", {}).get("patches", {})
    if "attn1_patch" in patches:
        patches["attn1_patch"] = [
            h for h in patches["attn1_patch"] if not isinstance(getattr(h, "__self__", None), ReuseHooks)
        ]
        if not patches["attn1_patch"]:
            del patches["attn1_patch"]
