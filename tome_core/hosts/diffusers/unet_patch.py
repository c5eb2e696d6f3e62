"""The token reduction on diffusers' UNets (``install`` / ``remove``): each ``BasicTransformerBlock``'s class is
swapped for a subclass whose ``forward`` calls the block's sub-layers as diffusers does, with the engine's reductions
around each (a class swap, since torch.compile guards on a class but not on module hooks). Blocks it cannot reduce
run diffusers' forward unchanged; classes are recognised by name. docs/how-it-works.md, 'diffusers'."""

from __future__ import annotations

import logging

import torch

from ...reducer import Reducer
from ...reuse import may_forecast
from ...settings import PatchSettings
from ..shared.class_swap import restore_classes
from . import layer_reuse as diffusers_layer_reuse
from . import whole_step as diffusers_whole_step
from .step_range import StepRange, unet_timestep_of_percent
from .unet_blocks import attention_levels, class_names, transformer_blocks

UNET_CLASS_NAME = "UNet2DConditionModel"
_STATE = "_tome_patch_diffusers_state"  # on each patched block and on the UNet
_HOOK = "_tome_patch_diffusers_hook"  # the UNet's forward pre-hook handle
_PARENT = "_tome_patch_diffusers_parent"  # on our block subclasses: the class they replace
# The replaced forward as a plain function: Dynamo cannot trace it through the "allowed in graph" class.
_PARENT_FORWARD = "_tome_patch_diffusers_parent_forward"

_subclasses: dict[type, type] = {}

log = logging.getLogger("tome_patch")


class UnsupportedModelError(TypeError):
    """Not something this patch can reduce."""


class PatchConflictError(ValueError):
    """Another patch on the UNet's blocks would make ours wrong or be bypassed by it."""


def _unwrap(module):
    """The module inside a ``torch.compile`` wrapper (OptimizedModule keeps it as ``_orig_mod``)."""
    return getattr(module, "_orig_mod", module)


def find_unet(pipe_or_unet) -> tuple[torch.nn.Module, object | None] | None:
    """(unet, pipeline or None) for what the user passed, or None where it is no UNet nor holds one."""
    if UNET_CLASS_NAME in class_names(_unwrap(pipe_or_unet)):
        return _unwrap(pipe_or_unet), None
    unet = getattr(pipe_or_unet, "unet", None)
    if unet is not None and UNET_CLASS_NAME in class_names(_unwrap(unet)):
        return _unwrap(unet), pipe_or_unet
    return None


def describe(pipe_or_unet) -> str:
    """What the user passed, and its denoiser where it has one (for the error)."""
    what = type(pipe_or_unet).__name__
    denoiser = (
        getattr(pipe_or_unet, "transformer", None)
        or getattr(pipe_or_unet, "prior", None)
        or getattr(pipe_or_unet, "unet", None)
    )
    if denoiser is not None:
        what += f" (its denoiser is {type(_unwrap(denoiser)).__name__})"
    return what


class _UNetState:
    """Shared by the UNet's pre-hook and all of its patched blocks: what the current UNet call looks like."""

    def __init__(self, reducer: Reducer, step_range: StepRange):
        self.reducer = reducer
        self.step_range = step_range
        self.latent_hw: tuple[int, int] | None = None
        self.active = True
        self.suspended = False  # a calibration's run without the reduction (``calibrate.Job``): no block reduces

    def before_unet_call(self, module, args, kwargs):
        sample = args[0] if args else kwargs.get("sample")
        if not isinstance(sample, torch.Tensor) or sample.dim() != 4:
            self.latent_hw = None
            return None
        self.latent_hw = (int(sample.shape[2]), int(sample.shape[3]))
        if self.suspended:
            self.active = False
        elif self.step_range.everywhere:
            self.active = True
        else:
            timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
            self.active = _in_step_range(self.step_range, timestep)
        return None


@torch.compiler.disable
def _in_step_range(step_range: StepRange, timestep) -> bool:
    """One host read per UNet call, out of torch.compile's graph (no timestep: inside the range)."""
    return timestep is None or step_range.contains(float(torch.as_tensor(timestep).max()))


class _BlockState:
    def __init__(self, unet_state: _UNetState, block_key: str):
        self.unet_state = unet_state
        self.block_key = block_key


def _feed_forward(block, x: torch.Tensor) -> torch.Tensor:
    """``block.ff`` honouring ``set_chunk_feed_forward`` (memory saving): the MLP applied chunk by chunk."""
    if block._chunk_size is None:
        return block.ff(x)
    parts = x.split(block._chunk_size, dim=block._chunk_dim)
    return torch.cat([block.ff(part) for part in parts], dim=block._chunk_dim)


def _start(block, hidden_states, attention_mask):
    """The block's reduction for this call, or None where the block must run as diffusers wrote it."""
    state = block.__dict__.get(_STATE)
    if state is None or attention_mask is not None:  # a mask over the image tokens would not fit fewer tokens
        return None
    if block.norm_type != "layer_norm" or block.pos_embed is not None:
        return None
    unet_state = state.unet_state
    if not unet_state.active or unet_state.latent_hw is None:
        return None
    return unet_state.reducer.start_block(hidden_states, unet_state.latent_hw, state.block_key)


def _reduced_forward(
    self,
    hidden_states,
    attention_mask=None,
    encoder_hidden_states=None,
    encoder_attention_mask=None,
    timestep=None,
    cross_attention_kwargs=None,
    class_labels=None,
    added_cond_kwargs=None,
):
    """``forward`` of a patched block: the block's sub-layers with the engine's reductions around each."""
    reduction = _start(self, hidden_states, attention_mask)
    if reduction is None:
        parent_forward = getattr(type(self), _PARENT_FORWARD)
        return parent_forward(
            self,
            hidden_states,
            attention_mask,
            encoder_hidden_states,
            encoder_attention_mask,
            timestep,
            cross_attention_kwargs,
            class_labels,
            added_cond_kwargs,
        )
    kwargs = dict(cross_attention_kwargs) if cross_attention_kwargs else {}
    gligen = kwargs.pop("gligen", None)
    x = hidden_states

    query, keys_values = reduction.self_attn_inputs(self.norm1(x))
    if self.only_cross_attention:  # attn1 attends to the prompt: only its queries can be reduced
        context = encoder_hidden_states
    else:
        context = None if keys_values is query else keys_values
    out = self.attn1(query, encoder_hidden_states=context, attention_mask=None, **kwargs)
    x = reduction.self_attn_output(out) + x
    if x.ndim == 4:
        x = x.squeeze(1)
    if gligen is not None:
        x = self.fuser(x, gligen["objs"])

    if self.attn2 is not None:
        n = self.norm2(x)
        # IP-Adapter masks are resized to the query count as if it were the image grid: merged queries break that.
        reduce_queries = kwargs.get("ip_adapter_masks") is None
        query = reduction.cross_attn_query(n) if reduce_queries else n
        out = self.attn2(
            query, encoder_hidden_states=encoder_hidden_states, attention_mask=encoder_attention_mask, **kwargs
        )
        x = (reduction.cross_attn_output(out) if reduce_queries else out) + x

    x = reduction.mlp_output(_feed_forward(self, reduction.mlp_input(self.norm3(x)))) + x
    if x.ndim == 4:
        x = x.squeeze(1)
    return x


def _reduced_class(cls: type) -> type:
    """One subclass per original block class, made once, so patching twice never stacks subclasses."""
    sub = _subclasses.get(cls)
    if sub is None:
        members = {"forward": _reduced_forward, _PARENT: cls, _PARENT_FORWARD: staticmethod(cls.forward)}
        sub = type("TomePatchDiffusersBlock", (cls,), members)
        sub.__module__ = __name__
        _subclasses[cls] = sub
    return sub


def _original_class(module) -> type:
    cls = type(module)
    return getattr(cls, _PARENT) if _PARENT in cls.__dict__ else cls


def find_conflict(unet) -> str | None:
    """Name another patch on the blocks that would make ours wrong or bypass it, or None."""
    if any(type(block).__name__ == "ToMeBlock" for _, block in transformer_blocks(unet)):
        return "tomesd's patch is applied to this UNet: call tomesd.remove_patch on it first"
    for name, block in transformer_blocks(unet):
        if "forward" in block.__dict__:  # an instance-level forward (a wrapping hook) would bypass the class swap
            return f"the transformer block {name} has its forward replaced on the instance (a hook wrapping it)"
    return None


def installed(unet) -> bool:
    return (
        _STATE in unet.__dict__
        or diffusers_layer_reuse.installed(unet) is not None
        or any(_PARENT in type(m).__dict__ for m in unet.modules())
    )


def reduction_of(unet) -> _UNetState | None:
    """The UNet's token reduction state (None: it reduces nothing), for a calibration to switch it off for a run."""
    return unet.__dict__.get(_STATE)


def remove(unet) -> None:
    """Undo ``install``; a no-op on a UNet never patched."""
    handle = unet.__dict__.pop(_HOOK, None)
    if handle is not None:
        handle.remove()
    restore_classes(unet, _STATE, _PARENT)
    diffusers_layer_reuse.remove(unet)


def check_layer_reuse(unet, pipeline) -> None:
    """Raise (before anything is changed) where reuse_interval cannot work: it follows a pipeline's scheduler."""
    if pipeline is None:
        raise ValueError(
            "reuse_interval above 1 needs the pipeline, whose scheduler tells which step each UNet call is: "
            "pass the pipeline to apply_patch, not its UNet (or use reuse_interval=1)"
        )
    if not diffusers_layer_reuse.inner_layers(unet):
        ups = list(getattr(unet, "up_blocks", None) or ())
        last = type(ups[-1]).__name__ if ups else "missing"
        raise UnsupportedModelError(
            f"reuse_interval above 1 supports UNet2DConditionModel layouts whose last up block is one of "
            f"{', '.join(diffusers_layer_reuse.PAIRED_UP_BLOCKS)}; this UNet's is {last}"
        )


def install(unet, pipeline, validated: PatchSettings, schedule) -> None:
    """Replace any earlier patch of ``unet`` by the token reduction of ``validated`` and reuse on ``schedule``."""
    remove(unet)
    step_range = StepRange(validated, pipeline, unet_timestep_of_percent)
    if schedule is not None:
        reuse = diffusers_whole_step if may_forecast(validated.reuse_plan) else diffusers_layer_reuse
        reuse.install(unet, pipeline, validated, step_range.contains, schedule)
    reducer = Reducer(validated, attention_levels(unet))
    if reducer.does_nothing:
        return
    unet_state = _UNetState(reducer, step_range)
    for name, block in transformer_blocks(unet):
        block.__dict__[_STATE] = _BlockState(unet_state, name)
        block.__class__ = _reduced_class(_original_class(block))
    unet.__dict__[_STATE] = unet_state
    unet.__dict__[_HOOK] = unet.register_forward_pre_hook(unet_state.before_unet_call, with_kwargs=True)
