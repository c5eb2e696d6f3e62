"""ToDo on ComfyUI's DiT models: Flux (Flux.1, Flux.2, Chroma), SD3 / SD3.5 (MMDiT), Wan 2.x video, Qwen-Image,
HunyuanVideo 1.0 / 1.5 (and HunyuanImage 2.1), LTX-Video, Lumina 2 and Z-Image.

Hook point (checked in ComfyUI 0.3.75): every attention call of these models goes through ``optimized_attention``
(comfy/ldm/modules/attention.py), whose ``wrap_attn`` hands the call to
``transformer_options["optimized_attention_override"](func, *args, **kwargs)`` when that key is set. The patch
adds one APPLY_MODEL wrapper to the clone; per model call, inside the step range, the wrapper puts an
``AttentionOverride`` into that call's own ``transformer_options`` (a fresh dict per call), wrapping any override
that another node put there. Nothing is set on a module, no class is replaced, and nothing outlives the call.

What the override sees, per family (0.3.75):
- Flux / Chroma (comfy/ldm/flux/math.py ``attention``): q, k, v of shape (batch, heads, tokens, head_dim) with
  ``skip_reshape=True``, RoPE already applied to q and k. The sequence is [text, image, reference images]
  in double blocks (text and image concatenated) and single blocks alike; Kontext's reference latents come
  after the image.
- SD3 / MMDiT (mmdit.py ``_block_mixing``): (batch, tokens, channels), [context, x] in joint attention;
  SD3.5's extra x-only self-attention (``x_block_self_attn``) sees the image tokens alone. Positions are
  added to x before the blocks, so the tokens carry them.
- Wan (wan/model.py ``WanSelfAttention``): (batch, frames*h*w, channels) with RoPE applied, in raster order
  frame first; the cross-attention to the text has other key counts and is left alone.
- Qwen-Image (qwen_image/model.py ``Attention``): (batch, heads, tokens, head_dim), ``skip_reshape=True``, RoPE
  applied, no mask: [text, image, reference images] (Qwen-Image Edit's reference latents follow the image). Its
  latents are 5-D with one frame (Wan 2.1's latent format); patch 2, padded up.
- HunyuanVideo 1.0 / 1.5 (hunyuan_video/model.py, Flux's blocks): (batch, heads, tokens, head_dim) with RoPE
  applied: [reference latent, video, text] in double and single blocks alike, the video BEFORE the text. The
  text is the context's tokens plus, where the model has their inputs, ByT5's glyph tokens and the vision
  tokens of ``clip_fea``; its mask (a text with padding) is an additive (1, 1, tokens) mask. The token refiner's
  self-attention over the text alone has another length and is left alone. HunyuanImage 2.1 is the same class
  with a 2-D patch on 4-D latents.
- LTX-Video (lightricks/model.py ``CrossAttention``): (batch, frames*h*w, channels), patch 1, RoPE applied; its
  self-attention (``attn1``) sees the video tokens alone (LTXVAddGuide's keyframe latents are frames of the same
  latent); the cross-attention to the text (``attn2``) has other key counts and is left alone.
- Lumina 2 / Z-Image (lumina/model.py ``JointAttention``, ``NextDiT``): (batch, heads, tokens, head_dim), RoPE
  applied, no mask in the main layers: [caption, image, image padding]. Z-Image pads the caption and the image
  each to a multiple of ``pad_tokens_multiple`` tokens with learnt pad tokens (kept whole, as the caption).
  The refiners before the main layers (caption alone, image and its padding alone) have other lengths and are
  left alone.
The image grid comes from the model input's shape and the family's patch size, and the engine finds it in each
call's sequence (``ImageTokens``): a call whose sequence has another layout is left exactly as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...joint_attention import ImageTokens, SequenceDownsample
from ...schedule import NoiseRange
from ..shared import dit_families

OVERRIDE_KEY = "optimized_attention_override"
WRAPPER_TYPE = "apply_model"  # comfy.patcher_extension.WrappersMP.APPLY_MODEL
WRAPPER_KEY = "tome_patch_dit"

# The supported families' classes are the family registry's (``dit_families``, ComfyUI's names). Other DiTs
# (HiDream, Cosmos, OmniGen2, ...) and the Wan variants that add tokens of their own (speech-to-video, HuMo,
# Animate) are refused.
_REFUSED_CLASSES = ("ChromaRadiance", "WanModel_S2V", "HumoWanModel", "AnimateWanModel")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _cells(sizes, patch) -> tuple[int, ...]:
    """Tokens along each axis of a latent whose axes are ``sizes``, patched by ``patch`` (padded up)."""
    return tuple(_ceil_div(int(size), int(p)) for size, p in zip(sizes, patch, strict=True))


@dataclass(frozen=True)
class DitFamily:
    """Where a family's image tokens lie, from the shape of the model input ``x``, the call's kwargs and its text
    context (``c_crossattn``)."""

    name: str  # "Flux", "SD3", "Wan", "Qwen-Image", "HunyuanVideo", "LTX-Video", "Lumina 2": the words of messages
    patch: tuple[int, ...]  # (ph, pw) or, for video, (pt, ph, pw)
    has_reference_conv: bool = False  # Wan with ``ref_conv``: reference tokens before the video
    # HunyuanVideo: the call's kwargs whose tokens join the text after the context (ByT5's glyphs, the vision
    # tokens), where the model has their input layers.
    text_inputs: tuple[str, ...] = ()
    pad_multiple: int | None = None  # Z-Image: caption and image each padded to a multiple of this many tokens

    def image_tokens(self, x, kwargs: dict, context=None) -> ImageTokens | None:
        if self.name == "Wan":
            return self._video_tokens(x, kwargs)
        if self.name == "HunyuanVideo":
            return self._hunyuan_tokens(x, kwargs, context)
        if self.name == "LTX-Video":
            if x.dim() != 5:
                return None
            return ImageTokens(_cells(x.shape[2:], self.patch), before=0)
        if self.name == "Lumina 2":
            return self._lumina_tokens(x, context)
        if self.name == "Qwen-Image" and x.dim() == 5:  # Wan 2.1's latent format: one frame for an image
            if x.shape[2] != 1:
                return None
            x = x[:, :, 0]
        if x.dim() != 4:
            return None
        grid = (1, *_cells(x.shape[-2:], self.patch))
        after = 0
        if self.name in ("Flux", "Qwen-Image"):  # Kontext, Qwen-Image Edit: reference latents after the image
            for ref in kwargs.get("ref_latents") or ():
                if self.name == "Qwen-Image" and ref.dim() == 5 and ref.shape[2] != 1:
                    return None
                after += math.prod(_cells(ref.shape[-2:], self.patch))
        return ImageTokens(grid, after=after)

    def _video_tokens(self, x, kwargs: dict) -> ImageTokens | None:
        if x.dim() != 5:
            return None
        pt, ph, pw = self.patch
        frames = _ceil_div(x.shape[2], pt)
        extra = kwargs.get("time_dim_concat")  # frames appended in time: part of the same grid
        if extra is not None:
            frames += _ceil_div(extra.shape[2], pt)
        grid = (frames, _ceil_div(x.shape[-2], ph), _ceil_div(x.shape[-1], pw))
        # Reference tokens (Wan 2.2 Fun) come first: let the engine count them; else the video is the sequence.
        before = None if self.has_reference_conv and "reference_latent" in kwargs else 0
        return ImageTokens(grid, before=before)

    def _hunyuan_tokens(self, x, kwargs: dict, context) -> ImageTokens | None:
        """[reference latent, video, text]: both counts exact, so the text refiner's call (the context alone) and
        any other layout find no place."""
        if context is None or x.dim() != len(self.patch) + 2:
            return None
        grid = _cells(x.shape[2:], self.patch)
        if len(grid) == 2:  # HunyuanImage 2.1: a still image
            grid = (1, *grid)
        before = 0
        ref = kwargs.get("ref_latent")
        if ref is not None:
            if ref.dim() != x.dim():
                return None
            before = math.prod(_cells(ref.shape[2:], self.patch))
        text = context.shape[1]
        for key in self.text_inputs:
            extra = kwargs.get(key)
            if extra is not None:
                text += extra.shape[1]
        return ImageTokens(grid, after=text, before=before)

    def _lumina_tokens(self, x, context) -> ImageTokens | None:
        """[caption, image, image padding]: the caption (padded) counted exactly, so the refiners' calls (caption
        alone, image alone) find no place."""
        if context is None or x.dim() != 4:
            return None
        grid = (1, *_cells(x.shape[-2:], self.patch))
        caption, after = context.shape[1], 0
        if self.pad_multiple:
            caption += -caption % self.pad_multiple
            after = -math.prod(grid) % self.pad_multiple
        return ImageTokens(grid, after=after, before=caption)


def class_names(module) -> set[str]:
    """The names of the module's class and of every class it derives from."""
    return {c.__name__ for c in type(module).__mro__}


def family_name(diffusion_model) -> str | None:
    """The family ("Flux", Chroma too, "SD3", "Wan", "Qwen-Image", "HunyuanVideo", "LTX-Video", "Lumina 2") by
    the model's classes, or None for any other model."""
    record = dit_families.of_model("comfyui", diffusion_model)
    return record.name if record is not None else None


def family_of(diffusion_model) -> DitFamily | None:
    """The family of a ComfyUI diffusion model, or None if this patch does not support it."""
    if class_names(diffusion_model) & set(_REFUSED_CLASSES):
        return None
    name = family_name(diffusion_model)
    try:
        if name == "Flux":
            p = int(diffusion_model.patch_size)
            return DitFamily("Flux", (p, p))
        if name == "SD3":
            return DitFamily("SD3", tuple(int(p) for p in diffusion_model.x_embedder.patch_size))
        if name == "Wan":
            patch = tuple(int(p) for p in diffusion_model.patch_size)
            if len(patch) != 3:
                return None
            return DitFamily("Wan", patch, getattr(diffusion_model, "ref_conv", None) is not None)
        if name == "Qwen-Image":
            p = int(diffusion_model.patch_size)
            return DitFamily("Qwen-Image", (p, p))
        if name == "HunyuanVideo":
            patch = tuple(int(p) for p in diffusion_model.patch_size)
            if len(patch) not in (2, 3):
                return None
            inputs = (("txt_byt5", "byt5_in"), ("clip_fea", "vision_in"))
            text_inputs = tuple(key for key, layer in inputs if getattr(diffusion_model, layer, None) is not None)
            return DitFamily("HunyuanVideo", patch, text_inputs=text_inputs)
        if name == "LTX-Video":
            patch = tuple(int(p) for p in diffusion_model.patchifier.patch_size)
            return DitFamily("LTX-Video", patch) if len(patch) == 3 else None
        if name == "Lumina 2":
            p = int(diffusion_model.patch_size)
            pad = getattr(diffusion_model, "pad_tokens_multiple", None)
            return DitFamily("Lumina 2", (p, p), pad_multiple=int(pad) if pad else None)
    except (AttributeError, TypeError, ValueError):  # a subclass laid out differently
        return None
    return None


def describe(diffusion_model) -> str:
    return type(diffusion_model).__name__


class AttentionOverride:
    """One model call's ``optimized_attention_override``: downsample the image keys and values, then call the
    override that was there before (another node's) or ComfyUI's attention function."""

    def __init__(self, reducer: SequenceDownsample, tokens: ImageTokens, previous=None):
        self.reducer = reducer
        self.tokens = tokens
        self.previous = previous

    def __call__(self, func, *args, **kwargs):
        if len(args) >= 3:
            q, k, v = args[:3]
            dim = 2 if kwargs.get("skip_reshape", False) else 1  # (batch, heads, tokens, d) or (batch, tokens, c)
            # Self- and joint attention only: a cross-attention has fewer keys than queries.
            if q.dim() == k.dim() and q.shape[dim] == k.shape[dim]:
                mask_in_args = len(args) >= 5  # (q, k, v, heads, mask, ...) as ComfyUI's functions are declared
                mask = args[4] if mask_in_args else kwargs.get("mask")
                reduced = self.reducer.keys_values(k, v, self.tokens, dim, mask)
                if reduced is not None:
                    k, v, mask = reduced
                    if mask_in_args:
                        args = (q, k, v, args[3], mask, *args[5:])
                    else:
                        args = (q, k, v, *args[3:])
                        if mask is not None:
                            kwargs = dict(kwargs, mask=mask)
        if self.previous is not None:
            return self.previous(func, *args, **kwargs)
        return func(*args, **kwargs)


class DitHooks:
    """The APPLY_MODEL wrapper of one patched clone. Immutable; shared by copies of the clone's options."""

    def __init__(self, family: DitFamily, reducer: SequenceDownsample, noise_range: NoiseRange):
        self.family = family
        self.reducer = reducer
        self.noise_range = noise_range

    def __deepcopy__(self, memo):
        # Patchers deep-copy model_options on clone(); the hooks are shared, like functions.
        return self

    def apply_model_wrapper(
        self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kwargs
    ):
        """ComfyUI APPLY_MODEL wrapper (comfy/model_base.py ``BaseModel.apply_model``): the step decision and the
        image grid of this call, taken outside the (possibly compiled) diffusion model."""
        if transformer_options is not None and (
            self.noise_range.everywhere or self.noise_range.contains(float(t.max()))
        ):
            try:
                tokens = self.family.image_tokens(x, kwargs, c_crossattn)
            except (AttributeError, TypeError, ValueError, IndexError):  # an input of another kind: left as it is
                tokens = None
            if tokens is not None:
                transformer_options = dict(transformer_options)  # this call's own copy: nothing outlives it
                previous = transformer_options.get(OVERRIDE_KEY)
                transformer_options[OVERRIDE_KEY] = AttentionOverride(self.reducer, tokens, previous)
        return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)


class NotADitError(Exception):
    """The model is no DiT of a family this patch supports."""


def remove_patch(patcher) -> None:
    if hasattr(patcher, "remove_wrappers_with_key"):
        patcher.remove_wrappers_with_key(WRAPPER_TYPE, WRAPPER_KEY)


def patched_clone(patcher, settings, percent_to_sigma, time_factor: float = 1.0):
    """A clone of ``patcher`` with ToDo on its DiT's attention; ``patcher`` itself is never changed.

    ``settings.method`` must be "todo" (the caller refuses ToMe on DiTs). Raises NotADitError (before cloning)
    for a model of another family, ValueError for a bad ``time_factor``.
    """
    model = getattr(getattr(patcher, "model", None), "diffusion_model", None)
    family = family_of(model) if model is not None else None
    if family is None:
        raise NotADitError(describe(model) if model is not None else type(patcher).__name__)
    if not hasattr(patcher, "add_wrapper_with_key"):
        raise NotADitError(f"{type(patcher).__name__} without model wrappers")
    reducer = SequenceDownsample(settings, time_factor, dit_families.family(family.name).todo_min_image_tokens)
    clone = patcher.clone()
    remove_patch(clone)  # applying the patch again replaces the earlier one
    if reducer.does_nothing:
        return clone
    noise_range = NoiseRange(settings.start_percent, settings.end_percent, percent_to_sigma)
    clone.add_wrapper_with_key(WRAPPER_TYPE, WRAPPER_KEY, DitHooks(family, reducer, noise_range).apply_model_wrapper)
    return clone
