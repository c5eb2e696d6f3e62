"""The patch for the WebUI's UNets (``ldm``, ``sgm``): a class swap per transformer block overriding ``_forward``, so
whichever attention optimisation is active gets the reduced tokens. Our names differ from tomesd's, whose
``remove_patch`` reverts every class of its names. See docs/how-it-works.md, section 'AUTOMATIC1111 WebUI'."""

from __future__ import annotations

import weakref

import torch

from ...reducer import Reducer
from ...schedule import NoiseRange, timestep_of_percent
from ...settings import PatchSettings
from ..shared.class_swap import restore_classes
from ..shared.unet_layout import attention_levels
from . import layer_reuse as webui_layer_reuse

BLOCK_CLASS_NAME = "BasicTransformerBlock"
_STATE = "_tome_patch_state"  # on each patched block and on the UNet
_HOOK = "_tome_patch_hook"
_AFTER_HOOK = "_tome_patch_after_hook"
_PARENT = "_tome_patch_parent"  # on our block subclasses: the class they replace

_subclasses: dict[type, type] = {}
_patched_unets: weakref.WeakSet = weakref.WeakSet()


class UnsupportedModelError(Exception):
    """The model cannot be patched (no UNet transformer blocks, or another patch is in the way)."""


class _UNetState:
    """What the current UNet call looks like, set afresh by the pre-hook; ``plans`` is emptied after each call."""

    def __init__(self, reducer: Reducer, noise_range: NoiseRange):
        self.reducer = reducer
        self.noise_range = noise_range
        self.latent_hw: tuple[int, int] | None = None
        self.active = True
        self.plans: dict = {}

    def after_unet_call(self, module, args, output):
        self.plans = {}
        return None

    def before_unet_call(self, module, args, kwargs):
        self.plans = {}
        x = args[0] if args else kwargs.get("x")
        if x is None or x.dim() != 4:
            self.latent_hw = None
            return None
        self.latent_hw = (int(x.shape[2]), int(x.shape[3]))
        if self.noise_range.everywhere:
            self.active = True
        else:
            timesteps = args[1] if len(args) > 1 else kwargs.get("timesteps")
            # One host sync per UNet call; no timestep known means "inside the range".
            self.active = timesteps is None or self.noise_range.contains(float(torch.as_tensor(timesteps).max()))
        return None


class _BlockState:
    def __init__(self, unet_state: _UNetState, block_key: str):
        self.unet_state = unet_state
        self.block_key = block_key


def _extras_given(args: tuple, kwargs: dict) -> bool:
    """True when sgm's extra ``_forward`` arguments carry something: then the block runs unreduced."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) or value not in (None, 0):
            return True
    return False


def _reduced_forward(self, x, context=None, *args, **kwargs):
    """``_forward`` of a patched block: the original block body with the reductions of the engine around it."""
    parent = getattr(type(self), _PARENT)
    state = self.__dict__.get(_STATE)
    reduction = None
    if state is not None and not _extras_given(args, kwargs):
        unet_state = state.unet_state
        if unet_state.active and unet_state.latent_hw is not None:
            reduction = unet_state.reducer.start_block(x, unet_state.latent_hw, state.block_key, plans=unet_state.plans)
    if reduction is None:
        return parent._forward(self, x, context, *args, **kwargs)
    return reduction.run_block(x, lambda tokens: _block_body(self, tokens, context, reduction))


def _block_body(block, x, context, reduction):
    """ldm's block body (attention.py, BasicTransformerBlock._forward) with the engine's calls at each sub-layer."""
    if block.disable_self_attn:  # attn1 attends to the prompt: only its queries can be merged
        query, _ = reduction.self_attn_inputs(block.norm1(x))
        attn1_context = context
    else:
        query, keys_values = reduction.self_attn_inputs(block.norm1(x))
        attn1_context = None if keys_values is query else keys_values
    x = reduction.self_attn_output(block.attn1(query, context=attn1_context)) + x
    x = reduction.cross_attn_output(block.attn2(reduction.cross_attn_query(block.norm2(x)), context=context)) + x
    x = reduction.mlp_output(block.ff(reduction.mlp_input(block.norm3(x)))) + x
    return x


def _reduced_class(cls: type) -> type:
    """One subclass per original block class, made once, so patching twice never stacks subclasses."""
    sub = _subclasses.get(cls)
    if sub is None:
        sub = type("TomePatchReducedBlock", (cls,), {"_forward": _reduced_forward, _PARENT: cls})
        _subclasses[cls] = sub
    return sub


def _is_block(module) -> bool:
    return any(c.__name__ == BLOCK_CLASS_NAME for c in type(module).__mro__) and all(
        hasattr(module, name) for name in ("attn1", "attn2", "ff", "norm1", "norm2", "norm3", "_forward")
    )


def _original_class(module) -> type:
    cls = type(module)
    return getattr(cls, _PARENT) if _PARENT in cls.__dict__ else cls


def transformer_blocks(unet) -> list[tuple[str, torch.nn.Module]]:
    return [(name, module) for name, module in unet.named_modules() if _is_block(module)]


def find_conflict(unet) -> str | None:
    """Name another patch that would make ours wrong or crash, or None."""
    for _, block in transformer_blocks(unet):
        # ControlNet reference-only assigns an instance ``_forward``, which shadows any class swap.
        if "_forward" in block.__dict__:
            return "an instance-level _forward on a transformer block (ControlNet reference-only or similar)"
        # Hypertile wraps attn1.forward per instance and asserts the token count matches the image grid.
        params = getattr(block.attn1, "__webui_hypertile_params", None)
        if params is not None and getattr(params, "enabled", False):
            return "Hypertile (U-Net)"
    return None


def is_patched(unet) -> bool:
    return (
        _STATE in unet.__dict__
        or any(_PARENT in type(m).__dict__ for m in unet.modules())
        or webui_layer_reuse.is_installed_ldm(unet)
    )


def remove_patch(unet) -> None:
    """Undo ``install_patch`` and layer reuse on ``unet``; a no-op on a UNet that is not patched."""
    webui_layer_reuse.remove_ldm(unet)
    for key in (_HOOK, _AFTER_HOOK):
        handle = unet.__dict__.pop(key, None)
        if handle is not None:
            handle.remove()
    restore_classes(unet, _STATE, _PARENT)
    _patched_unets.discard(unet)


def remove_all() -> None:
    """Remove the patch from every UNet this process patched (job end, model load, script reload)."""
    for unet in list(_patched_unets):
        remove_patch(unet)
    webui_layer_reuse.remove_all_ldm()


def install_patch(unet, settings: PatchSettings, num_timesteps: int = 1000) -> bool:
    """Patch ``unet`` with ``settings`` (replacing an earlier patch of ours). Returns False if there is nothing
    to do (the settings can never change the output); raises UnsupportedModelError for a UNet it cannot patch."""
    remove_patch(unet)
    levels = attention_levels(unet)
    blocks = transformer_blocks(unet) if levels is not None else []
    if not blocks:
        name = type(unet).__name__
        raise UnsupportedModelError(f"{name} has no UNet transformer blocks (DiT models are not supported)")
    if any(type(block).__name__ == "ToMeBlock" for _, block in blocks):
        raise UnsupportedModelError("the built-in token merging (tomesd) is active on this model")
    conflict = find_conflict(unet)
    if conflict is not None:
        raise UnsupportedModelError(f"{conflict} is active on this model")
    reducer = Reducer(settings, levels)
    if reducer.does_nothing:
        return False
    # The WebUI's UNet receives the DDPM timestep (999 at the start of sampling, 0 at the end).
    noise_range = NoiseRange(
        settings.start_percent, settings.end_percent, lambda p: timestep_of_percent(p, num_timesteps)
    )
    unet_state = _UNetState(reducer, noise_range)
    for name, block in blocks:
        block.__dict__[_STATE] = _BlockState(unet_state, name)
        block.__class__ = _reduced_class(_original_class(block))
    unet.__dict__[_STATE] = unet_state
    unet.__dict__[_HOOK] = unet.register_forward_pre_hook(unet_state.before_unet_call, with_kwargs=True)
    unet.__dict__[_AFTER_HOOK] = unet.register_forward_hook(unet_state.after_unet_call, always_call=True)
    _patched_unets.add(unet)
    return True
