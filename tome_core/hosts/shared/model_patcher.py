"""Hooks for model patchers with ComfyUI's list-hook signature: ComfyUI itself, Forge and reForge.

Only the list hooks are used (never the one-slot replace hooks), so other nodes' patches keep working. Scope block
sets an instance ``forward`` on each transformer block while the patcher has the model loaded. See
docs/how-it-works.md, section 'ComfyUI'."""

from __future__ import annotations

from ...reducer import Reducer
from ...schedule import NoiseRange
from .unet_layout import attention_levels, basic_transformer_blocks

_PLAN_KEY = "tome_patch_reduction"  # in extra_options: a fresh dict per block call, shared by the four hooks
_ACTIVE_KEY = "tome_patch_active"  # the step decision, made once per model call by the apply_model wrapper
OWNER_KEY = "tome_patch_owner"  # scope block: a BlockForward left by another clone is inert without it
_PLANS_KEY = "tome_patch_plans"
# In a run's transformer options: this run reduces no tokens (a calibration's unreduced run, docs/calibration.md).
REDUCTION_OFF_KEY = "tome_patch_reduction_off"
INJECTION_KEY = "tome_patch"
HOOK_NAMES = ("attn1_patch", "attn1_output_patch", "attn2_patch", "attn2_output_patch")
WRAPPER_TYPE = "apply_model"
WRAPPER_KEY = "tome_patch"


class PatcherHooks:
    """The four list hooks of one patch. Immutable apart from a one-entry cache of the step decision."""

    def __init__(self, reducer: Reducer, noise_range: NoiseRange):
        self.reducer = reducer
        self.noise_range = noise_range
        self._last_decision = (None, True)  # one host sync per UNet call, not per block

    def __deepcopy__(self, memo):
        # Patchers deep-copy model_options on clone(); the hooks are shared, like functions.
        return self

    def _is_active(self, extra_options: dict) -> bool:
        if extra_options.get(REDUCTION_OFF_KEY):
            return False
        if self.noise_range.everywhere:
            return True
        decided = extra_options.get(_ACTIVE_KEY)
        if decided is not None:
            return decided
        # Forge has no wrappers: decide at the first block of each call, and reuse it for the call's other blocks.
        sigmas = extra_options.get("sigmas")
        if sigmas is None:
            return not self.noise_range.empty
        last_sigmas, last_active = self._last_decision
        if last_sigmas is sigmas:
            return last_active
        active = self.noise_range.contains(float(sigmas.max()))
        self._last_decision = (sigmas, active)
        return active

    def apply_model_wrapper(
        self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kwargs
    ):
        """ComfyUI's APPLY_MODEL wrapper: takes the step decision once per call outside the (possibly compiled)
        model, and leaves our hooks out of a call that reduces nothing."""
        if transformer_options is not None:
            active = self.noise_range.everywhere or self.noise_range.contains(float(t.max()))
            active = active and not transformer_options.get(REDUCTION_OFF_KEY)
            if not active or (x.dim() == 4 and not self.reducer.acts_on(tuple(x.shape[-2:]), x.device.type)):
                leave_out_hooks(transformer_options)
            else:
                order_ours_innermost(transformer_options)
            if not self.noise_range.everywhere:
                transformer_options[_ACTIVE_KEY] = active
        return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)

    def block_forward(self, forward: BlockForward, x, context, transformer_options, kwargs):
        reduction = None
        if (
            transformer_options is not None
            and transformer_options.get(OWNER_KEY) is self
            and self._is_active(transformer_options)
        ):
            shape = transformer_options.get("original_shape")
            if shape is not None and len(shape) == 4:
                plans = _plans_of_call(transformer_options, shape)
                reduction = self.reducer.start_block(x, (shape[2], shape[3]), plans=plans)
        if reduction is None:
            return forward.original(x, context, transformer_options, kwargs)
        return reduction.run_block(x, lambda tokens: forward.original(tokens, context, transformer_options, kwargs))

    def attn1_patch(self, n, context, value, extra_options):
        if not self._is_active(extra_options):
            return n, context, value
        shape = extra_options.get("original_shape")
        if shape is None or len(shape) != 4:
            return n, context, value
        block_key = (extra_options.get("block"), extra_options.get("block_index"))
        reduction = self.reducer.start_block(n, (shape[2], shape[3]), block_key)
        if reduction is None:
            return n, context, value
        extra_options[_PLAN_KEY] = reduction
        query, reduced = reduction.self_attn_inputs(n)
        if context is n and value is n:
            return query, reduced, reduced
        # An earlier patch changed keys/values: reduce the queries only (ToMe), never foreign keys/values (ToDo).
        if reduced is not query:
            return n, context, value
        return query, context, value

    def attn1_output_patch(self, out, extra_options):
        reduction = extra_options.get(_PLAN_KEY)
        return out if reduction is None else reduction.self_attn_output(out)

    def attn2_patch(self, n, context, value, extra_options):
        reduction = extra_options.get(_PLAN_KEY)
        return (n, context, value) if reduction is None else (reduction.cross_attn_query(n), context, value)

    def attn2_output_patch(self, out, extra_options):
        reduction = extra_options.get(_PLAN_KEY)
        return out if reduction is None else reduction.cross_attn_output(out)


def _plans_of_call(transformer_options: dict, shape) -> dict:
    """This call's shared plans, tagged with the ``original_shape`` list the UNet writes anew at every call."""
    entry = transformer_options.get(_PLANS_KEY)
    if entry is None or entry[0] is not shape:
        entry = (shape, {})
        transformer_options[_PLANS_KEY] = entry
    return entry[1]


class BlockForward:
    """The ``forward`` of one transformer block while scope block is on (an instance attribute of the block)."""

    def __init__(self, hooks: PatcherHooks, block, inner=None):
        self.hooks = hooks
        self.block = block
        self.inner = inner  # an instance-level forward that was there before ours (None: the class's)

    def __deepcopy__(self, memo):
        return self

    def __call__(self, x, context=None, transformer_options=None, **kwargs):
        return self.hooks.block_forward(self, x, context, transformer_options, kwargs)

    def original(self, x, context, transformer_options, kwargs):
        if transformer_options is not None:
            kwargs = dict(kwargs, transformer_options=transformer_options)
        if self.inner is not None:
            return self.inner(x, context=context, **kwargs)
        return type(self.block).forward(self.block, x, context=context, **kwargs)


class BlockInjection:
    """ComfyUI's PatcherInjection for scope block: ``inject`` sets every block's ``forward``, ``eject`` removes it."""

    def __init__(self, hooks: PatcherHooks, blocks: list):
        self.hooks = hooks
        self.blocks = blocks

    def __deepcopy__(self, memo):
        return self

    def inject(self, patcher) -> None:
        for block in self.blocks:
            current = block.__dict__.get("forward")
            if isinstance(current, BlockForward):  # left by a clone that was never ejected: replace it
                current = current.inner
            block.__dict__["forward"] = BlockForward(self.hooks, block, current)

    def eject(self, patcher) -> None:
        for block in self.blocks:
            current = block.__dict__.get("forward")
            if isinstance(current, BlockForward) and current.hooks is self.hooks:
                if current.inner is None:
                    del block.__dict__["forward"]
                else:
                    block.__dict__["forward"] = current.inner


def _is_ours(hook) -> bool:
    return isinstance(getattr(hook, "__self__", None), PatcherHooks)


def order_ours_innermost(transformer_options: dict) -> None:
    """Make our hooks innermost in this call's options (copies): another merge running after ours would fail on
    the token count, while ours leaves a block that others reduced alone."""
    patches = transformer_options.get("patches")
    if not patches:
        return
    reordered = dict(patches)
    for name in HOOK_NAMES:
        hooks = patches.get(name)
        if hooks:
            ours = [h for h in hooks if _is_ours(h)]
            others = [h for h in hooks if not _is_ours(h)]
            reordered[name] = ours + others if "output" in name else others + ours
    transformer_options["patches"] = reordered


def leave_out_hooks(transformer_options: dict) -> None:
    """This call's options (ComfyUI copies them for each model call) without our hooks; others keep their order."""
    transformer_options.pop(OWNER_KEY, None)
    patches = transformer_options.get("patches")
    if not patches:
        return
    kept = dict(patches)
    for name in HOOK_NAMES:
        if name in kept:
            kept[name] = [hook for hook in kept[name] if not _is_ours(hook)]
            if not kept[name]:
                del kept[name]
    transformer_options["patches"] = kept


def remove_hooks(model_options: dict) -> None:
    """Drop every hook of ours from a patcher's model_options (a clone's copy), leaving others in order."""
    transformer_options = model_options.get("transformer_options", {})
    transformer_options.pop(OWNER_KEY, None)
    patches = transformer_options.get("patches", {})
    for name in HOOK_NAMES:
        if name in patches:
            patches[name] = [hook for hook in patches[name] if not _is_ours(hook)]
            if not patches[name]:
                del patches[name]


def remove_patch(patcher) -> None:
    """Remove everything of ours from ``patcher`` (a clone): hooks, wrapper, block forwards."""
    remove_hooks(patcher.model_options)
    if hasattr(patcher, "remove_wrappers_with_key"):
        patcher.remove_wrappers_with_key(WRAPPER_TYPE, WRAPPER_KEY)
    if hasattr(patcher, "remove_injections"):
        patcher.remove_injections(INJECTION_KEY)
    object_patches = getattr(patcher, "object_patches", None)
    if object_patches:
        for name in [name for name, value in object_patches.items() if isinstance(value, BlockForward)]:
            del object_patches[name]


class UnsupportedPatcherError(Exception):
    """The patcher offers no way to run whole blocks on merged tokens (neither injections nor object patches)."""


def install_block_forwards(patcher, hooks: PatcherHooks) -> None:
    """Scope block: give every transformer block our ``forward`` while ``patcher`` has the model loaded."""
    blocks = basic_transformer_blocks(patcher.model.diffusion_model)
    patcher.model_options.setdefault("transformer_options", {})[OWNER_KEY] = hooks
    if hasattr(patcher, "set_injections"):  # ComfyUI: set on inject, deleted on eject
        patcher.set_injections(INJECTION_KEY, [BlockInjection(hooks, [block for _, block in blocks])])
    elif hasattr(patcher, "add_object_patch"):  # Forge: restored on unload
        for name, block in blocks:
            patcher.add_object_patch(f"diffusion_model.{name}.forward", BlockForward(hooks, block))
    else:
        raise UnsupportedPatcherError(
            f"{type(patcher).__name__} has neither set_injections nor add_object_patch, which scope 'block' needs"
        )


def install_hooks(patcher, hooks: PatcherHooks, cross_attention: bool, whole_block: bool = False) -> None:
    """Register ``hooks`` on ``patcher``, a clone from which earlier hooks of ours were removed."""
    if hasattr(patcher, "add_wrapper_with_key"):  # ComfyUI; Forge has no wrappers and keeps registration order
        patcher.add_wrapper_with_key(WRAPPER_TYPE, WRAPPER_KEY, hooks.apply_model_wrapper)
    if whole_block:
        install_block_forwards(patcher, hooks)
        return
    patcher.set_model_attn1_patch(hooks.attn1_patch)
    patcher.set_model_attn1_output_patch(hooks.attn1_output_patch)
    if cross_attention:
        patcher.set_model_attn2_patch(hooks.attn2_patch)
        patcher.set_model_attn2_output_patch(hooks.attn2_output_patch)


class NotAUNetError(Exception):
    """The patcher's model is not a UNet with attention (a DiT such as Flux or SD3, or something unknown)."""


def patched_clone(patcher, settings, percent_to_sigma):
    """A clone of ``patcher`` with the token reduction of ``settings`` (``patcher`` is unchanged); raises
    NotAUNetError before cloning for a model it cannot reduce."""
    unet = getattr(getattr(patcher, "model", None), "diffusion_model", None)
    levels = attention_levels(unet) if unet is not None else None
    if levels is None:
        raise NotAUNetError(type(unet).__name__ if unet is not None else type(patcher).__name__)
    clone = patcher.clone()
    remove_patch(clone)
    if settings.is_noop:
        return clone
    reducer = Reducer(settings, levels)
    if reducer.does_nothing:
        return clone
    noise_range = NoiseRange(settings.start_percent, settings.end_percent, percent_to_sigma)
    install_hooks(
        clone,
        PatcherHooks(reducer, noise_range),
        cross_attention=settings.method == "tome" and settings.merge_crossattn,
        whole_block=reducer.merges_whole_block,
    )
    return clone
