"""ToDo on ComfyUI's DiT models through ``transformer_options["optimized_attention_override"]``: an APPLY_MODEL
wrapper puts an ``AttentionOverride`` into each call's own options, wrapping any override another node set. Each
family's token layout is read from the model input (``TOKEN_LAYOUTS``). See docs/dit.md, section 'How it works'."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ...joint_attention import ImageTokens, SequenceDownsample
from ...schedule import NoiseRange
from ..shared import dit_families
from ..shared.model_patcher import REDUCTION_OFF_KEY

OVERRIDE_KEY = "optimized_attention_override"
WRAPPER_TYPE = "apply_model"
WRAPPER_KEY = "tome_patch_dit"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _cells(sizes, patch) -> tuple[int, ...]:
    """Tokens along each axis of a latent whose axes are ``sizes``, patched by ``patch`` (padded up)."""
    return tuple(_ceil_div(int(size), int(p)) for size, p in zip(sizes, patch, strict=True))


@dataclass(frozen=True)
class TokenLayout:
    """Where one family's image tokens lie in its attention calls, found by ``find`` from the model input."""

    family: str
    patch: tuple[int, ...]
    find: Callable = field(compare=False, repr=False)
    has_reference_conv: bool = False  # Wan with ``ref_conv``: reference tokens before the video
    # HunyuanVideo: kwargs whose tokens join the text after the context, where the model has their layers.
    text_inputs: tuple[str, ...] = ()
    pad_multiple: int | None = None  # Z-Image: caption and image each padded to a multiple of this many tokens

    def image_tokens(self, x, kwargs: dict, context=None) -> ImageTokens | None:
        return self.find(self, x, kwargs, context)


def _image_after_text(layout, x, kwargs, context) -> ImageTokens | None:
    """Flux, SD3, Qwen-Image: [text, image, reference images]; Qwen-Image's latents are 5-D with one frame."""
    if layout.family == "Qwen-Image" and x.dim() == 5:  # Wan 2.1's latent format: one frame for an image
        if x.shape[2] != 1:
            return None
        x = x[:, :, 0]
    if x.dim() != 4:
        return None
    grid = (1, *_cells(x.shape[-2:], layout.patch))
    after = 0
    if layout.family in ("Flux", "Qwen-Image"):  # Kontext, Qwen-Image Edit: reference latents after the image
        for ref in kwargs.get("ref_latents") or ():
            if layout.family == "Qwen-Image" and ref.dim() == 5 and ref.shape[2] != 1:
                return None
            after += math.prod(_cells(ref.shape[-2:], layout.patch))
    return ImageTokens(grid, after=after)


def _wan_tokens(layout, x, kwargs, context) -> ImageTokens | None:
    if x.dim() != 5:
        return None
    pt, ph, pw = layout.patch
    frames = _ceil_div(x.shape[2], pt)
    extra = kwargs.get("time_dim_concat")  # frames appended in time: part of the same grid
    if extra is not None:
        frames += _ceil_div(extra.shape[2], pt)
    grid = (frames, _ceil_div(x.shape[-2], ph), _ceil_div(x.shape[-1], pw))
    # Reference tokens (Wan 2.2 Fun) come first: let the engine count them; else the video is the sequence.
    before = None if layout.has_reference_conv and "reference_latent" in kwargs else 0
    return ImageTokens(grid, before=before)


def _hunyuan_tokens(layout, x, kwargs, context) -> ImageTokens | None:
    """[reference latent, video, text], both counts exact, so the text refiner's call finds no place."""
    if context is None or x.dim() != len(layout.patch) + 2:
        return None
    grid = _cells(x.shape[2:], layout.patch)
    if len(grid) == 2:  # HunyuanImage 2.1: a still image
        grid = (1, *grid)
    before = 0
    ref = kwargs.get("ref_latent")
    if ref is not None:
        if ref.dim() != x.dim():
            return None
        before = math.prod(_cells(ref.shape[2:], layout.patch))
    text = context.shape[1]
    for key in layout.text_inputs:
        extra = kwargs.get(key)
        if extra is not None:
            text += extra.shape[1]
    return ImageTokens(grid, after=text, before=before)


def _ltxv_tokens(layout, x, kwargs, context) -> ImageTokens | None:
    if x.dim() != 5:
        return None
    return ImageTokens(_cells(x.shape[2:], layout.patch), before=0)


def _lumina_tokens(layout, x, kwargs, context) -> ImageTokens | None:
    """[caption, image, image padding], the padded caption counted exactly, so the refiners' calls find no place."""
    if context is None or x.dim() != 4:
        return None
    grid = (1, *_cells(x.shape[-2:], layout.patch))
    caption, after = context.shape[1], 0
    if layout.pad_multiple:
        caption += -caption % layout.pad_multiple
        after = -math.prod(grid) % layout.pad_multiple
    return ImageTokens(grid, after=after, before=caption)


def _square(model) -> tuple[int, int]:
    p = int(model.patch_size)
    return (p, p)


def _flux(name, model):
    return TokenLayout(name, _square(model), _image_after_text)


def _sd3(name, model):
    return TokenLayout(name, tuple(int(p) for p in model.x_embedder.patch_size), _image_after_text)


def _wan(name, model):
    patch = tuple(int(p) for p in model.patch_size)
    if len(patch) != 3:
        return None
    return TokenLayout(name, patch, _wan_tokens, has_reference_conv=getattr(model, "ref_conv", None) is not None)


def _hunyuan(name, model):
    patch = tuple(int(p) for p in model.patch_size)
    if len(patch) not in (2, 3):
        return None
    inputs = (("txt_byt5", "byt5_in"), ("clip_fea", "vision_in"))
    text_inputs = tuple(key for key, layer in inputs if getattr(model, layer, None) is not None)
    return TokenLayout(name, patch, _hunyuan_tokens, text_inputs=text_inputs)


def _ltxv(name, model):
    patch = tuple(int(p) for p in model.patchifier.patch_size)
    return TokenLayout(name, patch, _ltxv_tokens) if len(patch) == 3 else None


def _lumina(name, model):
    pad = getattr(model, "pad_tokens_multiple", None)
    return TokenLayout(name, _square(model), _lumina_tokens, pad_multiple=int(pad) if pad else None)


# Per family record: how its token layout is read, and its classes refused (their attention sees other tokens).
TOKEN_LAYOUTS = {
    "Flux": (_flux, ("ChromaRadiance",)),
    "SD3": (_sd3, ()),
    "Wan": (_wan, ()),
    "Wan VACE": (_wan, ()),
    "Qwen-Image": (_flux, ()),
    "HunyuanVideo": (_hunyuan, ()),
    "LTX-Video": (_ltxv, ()),
    "Lumina 2": (_lumina, ()),
}


def class_names(module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def token_layout_of(diffusion_model) -> TokenLayout | None:
    """Where ToDo finds the image tokens of a ComfyUI diffusion model, or None if it does not know its attention."""
    record = dit_families.of_model("comfyui", diffusion_model) if diffusion_model is not None else None
    if record is None or record.name not in TOKEN_LAYOUTS:
        return None
    build, refused = TOKEN_LAYOUTS[record.name]
    if class_names(diffusion_model) & set(refused):
        return None
    try:
        return build(record.name, diffusion_model)
    except (AttributeError, TypeError, ValueError):  # a subclass laid out differently
        return None


def describe(diffusion_model) -> str:
    return type(diffusion_model).__name__


class AttentionOverride:
    """One model call's attention override: downsample the image keys and values, then call the previous one."""

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

    def __init__(self, layout: TokenLayout, reducer: SequenceDownsample, noise_range: NoiseRange):
        self.layout = layout
        self.reducer = reducer
        self.noise_range = noise_range

    def __deepcopy__(self, memo):
        return self

    def apply_model_wrapper(
        self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kwargs
    ):
        """ComfyUI's APPLY_MODEL wrapper: this call's step decision and image grid, outside the compiled model."""
        if (
            transformer_options is not None
            and not transformer_options.get(REDUCTION_OFF_KEY)
            and (self.noise_range.everywhere or self.noise_range.contains(float(t.max())))
        ):
            try:
                tokens = self.layout.image_tokens(x, kwargs, c_crossattn)
            except (AttributeError, TypeError, ValueError, IndexError):
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
    """A clone of ``patcher`` with ToDo on its DiT's attention (``patcher`` is unchanged). Raises NotADitError
    before cloning for a model of another family, ValueError for a bad ``time_factor``."""
    model = getattr(getattr(patcher, "model", None), "diffusion_model", None)
    layout = token_layout_of(model)
    if layout is None:
        raise NotADitError(describe(model) if model is not None else type(patcher).__name__)
    if not hasattr(patcher, "add_wrapper_with_key"):
        raise NotADitError(f"{type(patcher).__name__} without model wrappers")
    reducer = SequenceDownsample(settings, time_factor, dit_families.family(layout.family).todo_min_image_tokens)
    clone = patcher.clone()
    remove_patch(clone)
    if reducer.does_nothing:
        return clone
    noise_range = NoiseRange(settings.start_percent, settings.end_percent, percent_to_sigma)
    clone.add_wrapper_with_key(WRAPPER_TYPE, WRAPPER_KEY, DitHooks(layout, reducer, noise_range).apply_model_wrapper)
    return clone
