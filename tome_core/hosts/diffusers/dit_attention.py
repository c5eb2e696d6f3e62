"""diffusers: ToDo on the attention of DiT transformers (the engine's ``SequenceDownsample``, as in ComfyUI's DiT
door): the keys and values of the image tokens are downsampled on their grid, after the rotary position
embedding, so every kept key keeps its own position; queries and text keys stay whole, and the kept image keys
get their share of the softmax back through the additive mask (``joint_attention``).

Hook point (checked in diffusers 0.39.0): ``FluxAttention.forward`` hands every call to its ``processor``. Where
that is diffusers' own ``FluxAttnProcessor`` (double and single blocks alike), the patch sets a ``TodoFluxProcessor``
that holds it: per call it computes the projections, the q/k norms and the rotary embedding through the module's
own layers and diffusers' ``apply_rotary_emb``, downsamples the image keys and values, and calls diffusers'
``dispatch_attention_fn`` with the processor's own attention backend; a call it cannot reduce (outside the step
range, fused projections, a mask of the caller's, a backend that takes no mask, another layout) goes to the held
processor unchanged. Any other processor (IP-Adapter's, a user's own) is left in place, unreduced.

The image grid comes from the transformer call's ``img_ids`` (Flux packs 2x2 latent patches in raster order;
Kontext's reference tokens, whose first id is not 0, come after the image and stay whole), read by a forward
pre-hook on the transformer. SD3 and Wan: ToDo is not wired in this host yet (reuse across steps is); the patch
says so once and leaves their attention as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ...joint_attention import ImageTokens, SequenceDownsample

log = logging.getLogger("tome_patch")

_STATE = "_tome_patch_dit_attention"  # on the transformer: its _CallState
_HOOK = "_tome_patch_dit_attention_hook"
FLUX_PROCESSORS = ("FluxAttnProcessor", "FluxAttnProcessor2_0")
# The attention backends that take an additive mask (the kept image keys' share of the softmax needs one).
MASKED_BACKENDS = (None, "native", "_native_math", "_native_efficient", "_native_cudnn")
# Flux's break-even, as in ComfyUI's door (hosts.comfyui.dit.MIN_IMAGE_TOKENS): 4096 image tokens (1024 px).
FLUX_MIN_IMAGE_TOKENS = 4096


class _CallState:
    """What the transformer call in progress looks like: its image tokens, or None (leave attention as it is)."""

    def __init__(self, reducer: SequenceDownsample, allowed: Callable[[float], bool], timestep_scale: float):
        self.reducer = reducer
        self.allowed = allowed
        self.timestep_scale = timestep_scale
        self.tokens: ImageTokens | None = None

    def before_call(self, module, args, kwargs):
        self.tokens = None
        img_ids = kwargs.get("img_ids")
        timestep = kwargs.get("timestep")
        if not isinstance(img_ids, torch.Tensor) or img_ids.dim() not in (2, 3):
            return None
        if timestep is not None and not self.allowed(float(torch.as_tensor(timestep).max()) * self.timestep_scale):
            return None
        self.tokens = flux_image_tokens(img_ids)
        return None

    def after_call(self, module, args, kwargs, output):
        self.tokens = None
        return None


def flux_image_tokens(img_ids: torch.Tensor) -> ImageTokens | None:
    """The image grid of a Flux call from its ``img_ids`` ((tokens, 3): kind, row, column; kind 0 the image),
    or None where the image tokens are not one raster-ordered grid ahead of the reference tokens."""
    ids = img_ids[0] if img_ids.dim() == 3 else img_ids
    ids = ids.detach().to("cpu", torch.float64)
    image = int((ids[:, 0] == 0).sum())
    if image == 0 or bool((ids[:image, 0] != 0).any()):
        return None
    rows = int(ids[:image, 1].max()) + 1
    cols = int(ids[:image, 2].max()) + 1
    if rows * cols != image:
        return None
    expected_rows = torch.arange(rows, dtype=torch.float64).repeat_interleave(cols)
    if not torch.equal(ids[:image, 1], expected_rows):
        return None
    return ImageTokens((1, rows, cols), after=ids.shape[0] - image)


class TodoFluxProcessor:
    """diffusers' ``FluxAttnProcessor`` with ToDo on the image keys and values (see the module docstring)."""

    def __init__(self, state: _CallState, original):
        self.state = state
        self.original = original

    @property
    def _attention_backend(self):
        return getattr(self.original, "_attention_backend", None)

    @property
    def _parallel_config(self):
        return getattr(self.original, "_parallel_config", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        tokens = self.state.tokens
        backend = self._attention_backend
        if (
            tokens is None
            or attention_mask is not None
            or getattr(attn, "fused_projections", False)
            or (backend.value if hasattr(backend, "value") else backend) not in MASKED_BACKENDS
            or self._parallel_config is not None
        ):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb

        joint = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        q, k, v = (attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states))
        q, k, v = (x.unflatten(-1, (attn.heads, -1)) for x in (q, k, v))  # (batch, tokens, heads, head_dim)
        q, k = attn.norm_q(q), attn.norm_k(k)
        if joint:
            text = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            tq, tk, tv = (proj(encoder_hidden_states).unflatten(-1, (attn.heads, -1)) for proj in text)
            tq, tk = attn.norm_added_q(tq), attn.norm_added_k(tk)
            q, k, v = (torch.cat(pair, dim=1) for pair in ((tq, q), (tk, k), (tv, v)))
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        reduced = self.state.reducer.keys_values(k, v, tokens, 1)
        if reduced is None:
            mask = None
        else:
            k, v, mask = reduced
        out = dispatch_attention_fn(
            q, k, v, attn_mask=mask, backend=backend, parallel_config=self._parallel_config
        ).flatten(2, 3)
        out = out.to(q.dtype)
        if not joint:
            return out
        text_out, image_out = out.split_with_sizes([encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())


def install(transformer, settings, allowed: Callable[[float], bool], family: str, timestep_scale: float) -> bool:
    """ToDo on ``transformer``'s attention; False where it reduces nothing here (left as it is)."""
    if family != "Flux":
        if settings.method == "todo" and not settings.reduces_nothing:
            log.info(
                "ToMe Patch: ToDo is not available for %s in diffusers yet; reuse across steps applies alone.", family
            )
        return False
    reducer = SequenceDownsample(settings, min_tokens=FLUX_MIN_IMAGE_TOKENS)
    if reducer.does_nothing:
        return False
    state = _CallState(reducer, allowed, timestep_scale)
    replaced = 0
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if type(processor).__name__ in FLUX_PROCESSORS and hasattr(module, "set_processor"):
            module.processor = TodoFluxProcessor(state, processor)
            replaced += 1
    if not replaced:
        return False
    transformer.__dict__[_STATE] = state
    transformer.__dict__[_HOOK] = (
        transformer.register_forward_pre_hook(torch.compiler.disable(state.before_call), with_kwargs=True),
        transformer.register_forward_hook(torch.compiler.disable(state.after_call), with_kwargs=True, always_call=True),
    )
    return True


def installed(transformer) -> bool:
    return _STATE in transformer.__dict__


def remove(transformer) -> None:
    """Put every held processor back and remove the hooks; a no-op where nothing is installed."""
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if isinstance(processor, TodoFluxProcessor):
            module.processor = processor.original
    transformer.__dict__.pop(_STATE, None)
    for handle in transformer.__dict__.pop(_HOOK, ()):
        handle.remove()
