"""ToDo on ComfyUI's DiT models: Flux (and Chroma), SD3 / SD3.5 (MMDiT) and Wan 2.x video.

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
The image grid comes from the model input's shape and the family's patch size, and the engine finds it in each
call's sequence (``ImageTokens``): a call whose sequence has another layout is left exactly as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...joint_attention import ImageTokens, SequenceDownsample
from ...schedule import NoiseRange

OVERRIDE_KEY = "optimized_attention_override"
WRAPPER_TYPE = "apply_model"  # comfy.patcher_extension.WrappersMP.APPLY_MODEL
WRAPPER_KEY = "tome_patch_dit"

# Class names (any class in the MRO) of the supported families. Other DiTs (HunyuanVideo, Lumina, Qwen-Image,
# ...) and the Wan variants that add tokens of their own (speech-to-video, HuMo, Animate) are refused.
_FLUX_CLASSES = ("Flux", "Chroma")
_SD3_CLASSES = ("MMDiT",)
_WAN_CLASSES = ("WanModel", "VaceWanModel", "CameraWanModel")
_REFUSED_CLASSES = ("ChromaRadiance", "WanModel_S2V", "HumoWanModel", "AnimateWanModel")


# skip_when_slower: image tokens per attention call from which ToDo pays off, per family (``python -m
# tools.bench.dit --image-px``, docs/dit.md). Flux's blocks are wide (3072 channels, 4x MLP) and attention is a
# small share of them at small sizes: at 512 px (1024 image tokens) ToDo 2 was 4% slower and even free keys
# saved nothing, at 1024 px (4096) it was 1.15x faster. SD3.5 Medium gained 1.11x at 512 px already, so SD3 and
# Wan keep the engine's ToDo threshold (1024, ``cost.MIN_TOKENS``); every Wan video size is far above it.
MIN_IMAGE_TOKENS = {"Flux": 4096, "SD3": None, "Wan": None}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class DitFamily:
    """Where a family's image tokens lie, from the shape of the model input ``x`` and the call's kwargs."""

    name: str  # "Flux", "SD3" or "Wan": the words of messages and docs
    patch: tuple[int, ...]  # (ph, pw) or, for video, (pt, ph, pw)
    has_reference_conv: bool = False  # Wan with ``ref_conv``: reference tokens before the video

    def image_tokens(self, x, kwargs: dict) -> ImageTokens | None:
        if self.name == "Wan":
            return self._video_tokens(x, kwargs)
        if x.dim() != 4:
            return None
        ph, pw = self.patch
        grid = (1, _ceil_div(x.shape[-2], ph), _ceil_div(x.shape[-1], pw))
        after = 0
        if self.name == "Flux":  # Kontext: reference latents appended after the image, kept whole
            for ref in kwargs.get("ref_latents") or ():
                after += _ceil_div(ref.shape[-2], ph) * _ceil_div(ref.shape[-1], pw)
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


def class_names(module) -> set[str]:
    """The names of the module's class and of every class it derives from."""
    return {c.__name__ for c in type(module).__mro__}


def family_name(diffusion_model) -> str | None:
    """ "Flux" (Chroma too), "SD3" or "Wan" by the model's classes, or None for any other model."""
    names = class_names(diffusion_model)
    for name, classes in (("Flux", _FLUX_CLASSES), ("SD3", _SD3_CLASSES), ("Wan", _WAN_CLASSES)):
        if names & set(classes):
            return name
    return None


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
            tokens = self.family.image_tokens(x, kwargs)
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
    reducer = SequenceDownsample(settings, time_factor, MIN_IMAGE_TOKENS.get(family.name))
    clone = patcher.clone()
    remove_patch(clone)  # applying the patch again replaces the earlier one
    if reducer.does_nothing:
        return clone
    noise_range = NoiseRange(settings.start_percent, settings.end_percent, percent_to_sigma)
    clone.add_wrapper_with_key(WRAPPER_TYPE, WRAPPER_KEY, DitHooks(family, reducer, noise_range).apply_model_wrapper)
    return clone
