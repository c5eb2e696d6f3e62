"""diffusers: reuse across steps on DiT pipelines (Flux.1, Flux.2, SD3 / SD3.5, Wan 2.x, Qwen-Image, Z-Image,
HunyuanVideo 1.5, LTX-Video, LTX-2), setting ``reuse_interval``.

The engine's DiT reuse (``LayerReuseRun.span_block``), as in ComfyUI's door (``hosts.comfyui.dit_reuse``): at a
*reusing* call the transformer's first block runs (``DIT_OUTER_BLOCKS``) and the blocks after it, the *span*, do
not; the span's output is its input plus its residual predicted from the last full calls. The same schedule
(``NoiseSpacedSchedule``: one step in ``reuse_interval`` full, spaced evenly in the scheduler's sigmas).

Hook points (checked in diffusers 0.39.0): each transformer's ``forward`` calls its main blocks one after the
other (a row of ``LAYOUTS`` each):
- ``FluxTransformer2DModel``: ``transformer_blocks`` then ``single_transformer_blocks``, and
  ``SD3Transformer2DModel`` and ``QwenImageTransformer2DModel``: ``transformer_blocks``, all with keyword arguments
  ``hidden_states`` and ``encoder_hidden_states`` and returning ``(encoder_hidden_states, hidden_states)``;
- ``Flux2Transformer2DModel``: its ``transformer_blocks`` so too; its ``single_transformer_blocks`` then get text
  and image as one tensor, ``hidden_states = cat((text, image))`` (``encoder_hidden_states=None``), and return
  that tensor: the same tokens in the same order as the double blocks' joined streams, so one residual spans both;
- ``WanTransformer3DModel``: ``blocks`` with ``(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)``,
  returning ``hidden_states``, and ``LTXVideoTransformer3DModel``: ``transformer_blocks`` with keyword
  ``hidden_states`` returning it (there ``encoder_hidden_states`` is the text the blocks read, not a stream they
  pass on), and ``LTX2VideoTransformer3DModel``: ``transformer_blocks`` with keywords ``hidden_states`` and
  ``audio_hidden_states`` (video and audio tokens, of two widths), returning both;
- ``HunyuanVideo15Transformer3DModel``: ``transformer_blocks`` with positional ``(hidden_states,
  encoder_hidden_states, ...)``, returning ``(hidden_states, encoder_hidden_states)``;
- ``ZImageTransformer2DModel``: ``layers``, each called as ``layer(unified, mask, freqs, adaln_input, ...)`` on one
  padded sequence of image and caption tokens, returning it; its ``noise_refiner`` and ``context_refiner`` run
  before, on the image and the caption apart, at every call. Its forward takes a list of latents and the timestep
  as ``1 - t / 1000`` (``ZImagePipeline``): ``DitLayout.inputs`` reads them.
Every block of the span gets an instance ``forward`` (``SpanForward``); the transformer a forward pre-hook and hook
that find the call's step in the pipeline's scheduler (``layer_reuse.PipelineReuse``, as for the UNets).

A call computes every block where ControlNet residuals are added between blocks (Flux, SD3, Qwen-Image, Z-Image),
where SD3's ``skip_layers`` leaves blocks out, where Flux.2 Klein extracts its reference tokens' KV cache (the
blocks write it), where diffusers' own cache (``enable_cache``) is on the transformer (it skips blocks of its own:
ours then stands down, with a warning), and at the schedule's full steps. Removal deletes the forwards and hooks:
the transformer then computes bit-identically to one never patched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ...reuse import (
    DIT_OUTER_BLOCKS,
    SkippableLayer,
    attach_forwards,
    detach_forwards,
)
from ..shared import dit_families
from .layer_reuse import PipelineReuse, _disabled

log = logging.getLogger("tome_patch")

_STATE = "_tome_patch_dit_reuse"  # on the transformer: its DitReuse
_HOOKS = "_tome_patch_dit_reuse_hooks"


Streams = tuple[tuple[str, int], ...]  # (keyword, position) of the streams a block passes on, in its return order


def streams_in(streams: Streams, args: tuple, kwargs: dict) -> dict:
    return {name: kwargs[name] if name in kwargs else args[index] for name, index in streams}


def streams_out(streams: Streams, out) -> dict:
    """A block's output as streams: a tuple in the order of ``streams`` or, with one stream, the tensor."""
    if len(streams) == 1:
        return {streams[0][0]: out}
    return dict(zip((name for name, _ in streams), out, strict=True))


def output(streams: Streams, values: dict):
    """The inverse of ``streams_out``: what the block would return."""
    packed = tuple(values[name] for name, _ in streams)
    return packed[0] if len(packed) == 1 else packed


@dataclass(frozen=True)
class DitLayout:
    """How one transformer class calls its blocks."""

    block_lists: tuple[str, ...]  # the attributes holding the blocks, in call order
    # The streams a block passes on, in the order it returns them; where the blocks return several, the joined
    # tensor (``join_streams``) must list the tokens in the same order in every block list of the span.
    streams: Streams
    timestep_scale: float  # the pipeline gives the transformer the scheduler's timestep divided by this
    in_full_when: tuple[str, ...]  # the transformer's keyword arguments that, when given, make a call full
    # SD3's last block returns no text stream (``context_pre_only``): it runs at every call, after the span.
    last_block_runs: bool = False
    title: str = ""  # the family in messages where ``name`` is shared (Flux.2 reuses as Flux does)
    list_streams: tuple[tuple[str, Streams], ...] = ()  # (block list, its blocks' streams) where not ``streams``
    in_full_if: tuple[tuple[str, object], ...] = ()  # (keyword, value): a call given that value is full
    # (args, kwargs) of a transformer call -> (the noisy input, its timestep as the pipeline passes ``timestep``),
    # where the forward names them otherwise (Z-Image); None (the default): ``hidden_states`` and ``timestep``.
    inputs: Callable[[tuple, dict], tuple] | None = None
    todo: bool = True  # whether ``dit_attention`` has ToDo processors for this class's attention
    # The family: its record's name in the registry (``hosts.shared.dit_families``), set by ``layout_of``; the key
    # of ToDo's processors (``dit_attention.PROCESSORS``); in messages unless ``title`` says otherwise.
    name: str = ""

    @property
    def label(self) -> str:
        return self.title or self.name

    def blocks(self, transformer) -> list[tuple[torch.nn.Module, Streams]] | None:
        """(block, its streams) of every block, in call order; None where a block list is missing."""
        found = []
        other = dict(self.list_streams)
        for attribute in self.block_lists:
            blocks = getattr(transformer, attribute, None)
            if blocks is None:
                return None
            found += [(block, other.get(attribute, self.streams)) for block in blocks]
        return found

    def in_full(self, kwargs: dict) -> bool:
        """Whether a call with these keyword arguments must compute every block."""
        if any(kwargs.get(name) is not None for name in self.in_full_when):
            return True
        return any(name in kwargs and kwargs[name] == value for name, value in self.in_full_if)


def _z_image_inputs(args: tuple, kwargs: dict) -> tuple:
    """``ZImageTransformer2DModel.forward(x, t, cap_feats, ...)``: ``x`` a list of (channels, frames, h, w) latents,
    one per batch item; ``t`` is ``(1000 - timestep) / 1000`` (``ZImagePipeline`` and its variants, diffusers
    0.39.0), given back here as ``timestep / 1000`` (in float64: the last steps' timesteps stay within the
    schedule's tolerance). The sample stands for the batch by its shape alone (a meta tensor: no memory), which is
    all the step lookup keeps of it. Omni mode (``x`` a list of lists, conditioning images among the latents) gives
    no sample: those calls run every block."""
    x = args[0] if args else kwargs.get("x")
    t = args[1] if len(args) > 1 else kwargs.get("t")
    if not isinstance(x, (list, tuple)) or not x or not all(isinstance(item, torch.Tensor) for item in x):
        return None, None
    if len({tuple(item.shape) for item in x}) != 1 or t is None:
        return None, None
    sample = torch.empty((len(x), *x[0].shape), dtype=x[0].dtype, device="meta")
    return sample, 1.0 - torch.as_tensor(t).detach().to("cpu", torch.float64)


_JOINT = (("encoder_hidden_states", 1), ("hidden_states", 0))  # Flux's, SD3's, Qwen's blocks return them so
_IMAGE = (("hidden_states", 0),)  # blocks that pass on the image (video) tokens alone
LAYOUTS = {
    "FluxTransformer2DModel": DitLayout(
        ("transformer_blocks", "single_transformer_blocks"),
        _JOINT,
        1000.0,
        ("controlnet_block_samples", "controlnet_single_block_samples"),
    ),
    "SD3Transformer2DModel": DitLayout(
        ("transformer_blocks",), _JOINT, 1.0, ("block_controlnet_hidden_states", "skip_layers"), True
    ),
    "WanTransformer3DModel": DitLayout(("blocks",), _IMAGE, 1.0, ()),
    # Flux2Pipeline and the Klein pipelines pass ``timestep / 1000``; ToDo's Flux processors do not fit Flux.2's
    # attention (``Flux2AttnProcessor``, the parallel single blocks' fused projections).
    "Flux2Transformer2DModel": DitLayout(
        ("transformer_blocks", "single_transformer_blocks"),
        _JOINT,
        1000.0,
        (),
        title="Flux.2",
        list_streams=(("single_transformer_blocks", _IMAGE),),
        in_full_if=(("kv_cache_mode", "extract"),),
        todo=False,
    ),
    # QwenImagePipeline, its Edit, image-to-image, inpainting and ControlNet pipelines pass ``timestep / 1000``;
    # the Edit pipelines' reference latents are image tokens after the image's, in the same stream.
    "QwenImageTransformer2DModel": DitLayout(
        ("transformer_blocks",), _JOINT, 1000.0, ("controlnet_block_samples",), todo=False
    ),
    "ZImageTransformer2DModel": DitLayout(
        ("layers",),
        (("x", 0),),
        1000.0,
        ("controlnet_block_samples",),
        title="Z-Image",
        inputs=_z_image_inputs,
        todo=False,
    ),
    # HunyuanVideo15Pipeline (its guider runs the prompt and the negative prompt as two calls) and its
    # image-to-video pipeline pass the scheduler's timestep as it is.
    "HunyuanVideo15Transformer3DModel": DitLayout(
        ("transformer_blocks",),
        (("hidden_states", 0), ("encoder_hidden_states", 1)),
        1.0,
        (),
        title="HunyuanVideo 1.5",
        todo=False,
    ),
    # LTXPipeline (and its image-to-video and condition pipelines, whose conditioning tokens get timestep 0: the
    # call's largest is the step's) passes the scheduler's timestep as it is.
    "LTXVideoTransformer3DModel": DitLayout(("transformer_blocks",), _IMAGE, 1.0, (), todo=False),
    # LTX2Pipeline and its image-to-video and condition pipelines pass the scheduler's timestep as it is. Its
    # blocks pass on the video and the audio tokens, of two widths, and return both. A call with spatio-temporal
    # guidance perturbs some blocks, one with modalities isolated skips the cross-attention between them: full.
    "LTX2VideoTransformer3DModel": DitLayout(
        ("transformer_blocks",),
        (("hidden_states", 0), ("audio_hidden_states", 1)),
        1.0,
        ("spatio_temporal_guidance_blocks", "perturbation_mask"),
        in_full_if=(("isolate_modalities", True),),
        todo=False,
    ),
}


def layout_of(transformer) -> DitLayout | None:
    """The layout of a transformer whose blocks reuse can skip (exact class: subclasses such as Wan's VACE add
    inputs between blocks that a skipped span would count twice), named by its family's record, or None."""
    layout = LAYOUTS.get(type(transformer).__name__)
    record = dit_families.of_model("diffusers", transformer) if layout is not None else None
    return None if record is None else replace(layout, name=record.name)


class DitReuse(PipelineReuse):
    """The span's owner on one transformer: the pipeline's runs (``PipelineReuse``) and the span's blocks."""

    SAMPLE = "hidden_states"
    DIT = True
    RUN_WORDS = ("the first block", "blocks' residual")

    def __init__(self, pipeline, transformer, layout: DitLayout, schedule, span, allowed: Callable[[float], bool]):
        blocks = [(f"span.{i}", block) for i, (block, _) in enumerate(span)]
        super().__init__(pipeline, schedule, blocks, allowed, dit_families.family(layout.name).extrapolate)
        self.layers = 1  # what is recorded: the span's residual, one tensor per batch layout
        self.layout = layout
        self.block_streams = [streams for _, streams in span]
        self.span_length = len(span)
        self.TIMESTEP_SCALE = layout.timestep_scale
        self._transformer = transformer
        self._warned_cache = False

    def before_call(self, module, args, kwargs):
        if self.layout.inputs is None:
            return super().before_call(module, args, kwargs)
        sample, timestep = self.layout.inputs(args, kwargs)
        if sample is None:  # a call this layout cannot place: every block runs
            self._current = None
            return None
        return super().before_call(module, (sample, timestep), kwargs)

    def must_run_in_full(self, module, kwargs) -> bool:
        if self.layout.in_full(kwargs):
            return True
        if getattr(module, "is_cache_enabled", False):  # diffusers' own step cache skips blocks of its own
            if not self._warned_cache:
                self._warned_cache = True
                log.warning(
                    "ToMe reuse across steps stands down: diffusers' own cache is enabled on this transformer "
                    "(enable_cache); every block runs in full (call transformer.disable_cache() to use ours)."
                )
            return True
        return False


class DiffusersSpanForward(SkippableLayer):
    """The ``forward`` of one block of the span: run it (a full call), or pass its streams on (a reusing call);
    the last one adds the predicted residual."""

    def __call__(self, *args, **kwargs):
        owner = self.owner
        run = owner.layer_run()
        if run is None or run.current is None:
            return self.original(*args, **kwargs)
        streams = owner.block_streams[self.index]
        return run.span_block(
            first=self.index == 0,
            last=self.index == owner.span_length - 1,
            streams=streams_in(streams, args, kwargs),
            run_block=lambda: self.original(*args, **kwargs),
            streams_of=lambda out: streams_out(streams, out),
            pack=lambda values: output(streams, values),
        )


def span_of(transformer, layout: DitLayout, outer=DIT_OUTER_BLOCKS) -> list[tuple[torch.nn.Module, Streams]]:
    """(block, its streams) of the blocks a reusing call skips: all but ``outer`` (at the start, at the end)."""
    blocks = layout.blocks(transformer) or []
    first, last = outer[0], max(outer[1], int(layout.last_block_runs))
    return blocks[first : len(blocks) - last] if len(blocks) > first + last + 1 else []


def install(transformer, pipeline, settings, allowed: Callable[[float], bool], schedule) -> bool:
    """Give ``transformer`` reuse across steps on ``schedule`` (the front door's: the family's under
    ``dit_settings`` auto, else one step in ``reuse_interval``), following ``pipeline``'s scheduler; False where
    its class is not one this door knows (it is then left as it is)."""
    layout = layout_of(transformer)
    if layout is None:
        return False
    span = span_of(transformer, layout)
    if not span:
        return False
    owner = DitReuse(pipeline, transformer, layout, schedule, span, allowed)
    attach_forwards(owner, [block for block, _ in span], DiffusersSpanForward)
    transformer.__dict__[_STATE] = owner
    transformer.__dict__[_HOOKS] = (
        transformer.register_forward_pre_hook(_disabled(owner.before_call), with_kwargs=True),
        transformer.register_forward_hook(_disabled(owner.after_call), with_kwargs=True, always_call=True),
    )
    return True


def installed(transformer) -> DitReuse | None:
    return transformer.__dict__.get(_STATE)


def remove(transformer) -> None:
    """Remove everything ``install`` put on ``transformer``; a no-op where nothing is."""
    owner = transformer.__dict__.pop(_STATE, None)
    for handle in transformer.__dict__.pop(_HOOKS, ()):
        handle.remove()
    detach_forwards(transformer.modules(), lambda other: isinstance(other, DitReuse))
    if owner is not None:
        owner.drop()
