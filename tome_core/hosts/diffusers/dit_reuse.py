"""diffusers: reuse across steps on DiT pipelines (``reuse_interval``), as ComfyUI's door: at a reusing call the first
block runs and the span after it passes its streams on, the last adding the predicted residual. A ``LAYOUTS`` row
says how each class's forward calls its blocks (diffusers 0.39.0); the step comes from the pipeline's scheduler
(``layer_reuse.PipelineReuse``). Under context parallelism each process records its shard and the group decides every
call together (``reuse.agreement``). Removal leaves the transformer as never patched.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ...reuse import (
    DIT_OUTER_BLOCKS,
    SkippableLayer,
    attach_forwards,
    detach_forwards,
)
from ...reuse.agreement import Agreement
from ..shared import dit_families
from .layer_reuse import PipelineReuse, _disabled

log = logging.getLogger("tome_patch")

_STATE = "_tome_patch_dit_reuse"
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

    block_lists: tuple[str, ...]
    # The streams a block passes on, in its return order (the same token order in every block list of the span).
    streams: Streams
    timestep_scale: float  # the pipeline gives the transformer the scheduler's timestep divided by this
    in_full_when: tuple[str, ...]  # the transformer's keyword arguments that, when given, make a call full
    # SD3's last block returns no text stream (``context_pre_only``): it runs at every call, after the span.
    last_block_runs: bool = False
    title: str = ""
    list_streams: tuple[tuple[str, Streams], ...] = ()  # (block list, its blocks' streams) where not ``streams``
    in_full_if: tuple[tuple[str, object], ...] = ()  # (keyword, value): a call given that value is full
    # (args, kwargs) -> (noisy input, timestep) where the forward names them otherwise (Z-Image).
    inputs: Callable[[tuple, dict], tuple] | None = None
    todo: bool = True
    # The family's record name (``dit_families``), set by ``layout_of``.
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
    """Z-Image's ``forward(x, t, ...)``: ``x`` a list of latents, ``t`` ``1 - timestep / 1000`` (given back in float64);
    the sample a meta tensor of the batch's shape. Omni mode's nested lists give none: every block runs."""
    x = args[0] if args else kwargs.get("x")
    t = args[1] if len(args) > 1 else kwargs.get("t")
    if not isinstance(x, (list, tuple)) or not x or not all(isinstance(item, torch.Tensor) for item in x):
        return None, None
    if len({tuple(item.shape) for item in x}) != 1 or t is None:
        return None, None
    sample = torch.empty((len(x), *x[0].shape), dtype=x[0].dtype, device="meta")
    return sample, 1.0 - torch.as_tensor(t).detach().to("cpu", torch.float64)


_JOINT = (("encoder_hidden_states", 1), ("hidden_states", 0))  # Flux's, SD3's, Qwen's blocks return them so
_IMAGE = (("hidden_states", 0),)
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
    # Flux.2's pipelines pass ``timestep / 1000``; ToDo's Flux processors do not fit its attention.
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
    # Qwen-Image's pipelines pass ``timestep / 1000``; Edit's reference latents follow the image's tokens.
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
    # HunyuanVideo 1.5's pipelines pass the scheduler's timestep as it is (its guider: two calls per step).
    "HunyuanVideo15Transformer3DModel": DitLayout(
        ("transformer_blocks",),
        (("hidden_states", 0), ("encoder_hidden_states", 1)),
        1.0,
        (),
        title="HunyuanVideo 1.5",
        todo=False,
    ),
    # LTX's pipelines pass the timestep as it is (conditioning tokens get 0: the call's largest is the step's).
    "LTXVideoTransformer3DModel": DitLayout(("transformer_blocks",), _IMAGE, 1.0, (), todo=False),
    # LTX-2: video and audio tokens of two widths; spatio-temporal guidance or isolated modalities run every block.
    "LTX2VideoTransformer3DModel": DitLayout(
        ("transformer_blocks",),
        (("hidden_states", 0), ("audio_hidden_states", 1)),
        1.0,
        ("spatio_temporal_guidance_blocks", "perturbation_mask"),
        in_full_if=(("isolate_modalities", True),),
        todo=False,
    ),
}


def parallelism(transformer) -> tuple[object, object]:
    """(diffusers' parallel config or None, the mesh its tokens are sharded over or None)."""
    config = getattr(transformer, "_parallel_config", None)
    return config, getattr(getattr(config, "context_parallel_config", None), "_flattened_mesh", None)


def layout_of(transformer) -> DitLayout | None:
    """The layout of exactly this class (subclasses such as Wan's VACE add between blocks), or None."""
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
        self.layers = 1
        self.layout = layout
        self.block_streams = [streams for _, streams in span]
        self.span_length = len(span)
        self.TIMESTEP_SCALE = layout.timestep_scale
        self._transformer = transformer
        self._warned_cache = False
        self._told_parallel = False
        # A calibration's schedule for the pipeline call that runs now (a candidate or the kept plan), read where
        # the call's run is made; None: the patch's own.
        self.calibration_schedule = None

    def before_call(self, module, args, kwargs):
        if self.layout.inputs is None:
            return super().before_call(module, args, kwargs)
        sample, timestep = self.layout.inputs(args, kwargs)
        if sample is None:  # a call this layout cannot place: every block runs
            self._current = None
            return None
        return super().before_call(module, (sample, timestep), kwargs)

    def run_for(self, scheduler, steps: int, levels: list[float] | None):
        """The run of a pipeline call: on the calibration's schedule where one is set, else the patch's."""
        decision = self.decision(scheduler, self._first_step)
        full_below = (decision.fallback or decision).full_below
        return self.new_run(steps, levels, full_below, schedule=self.calibration_schedule)

    def begin_call(self, run, step, key, allowed=True, position=None) -> bool:
        run.agreement = self._agreement()
        return super().begin_call(run, step, key, allowed, position)

    def _agreement(self) -> Agreement | None:
        """The group that decides each call together where the transformer runs under context parallelism."""
        config, mesh = parallelism(self._transformer)
        if mesh is None or mesh.size() < 2:
            return None
        if not self._told_parallel:
            self._told_parallel = True
            log.info(
                "ToMe reuse across steps under context parallelism: %d processes each keep their shard of the "
                "cache and take every step's decision together.",
                mesh.size(),
            )
        return Agreement(mesh.get_group(), getattr(config.context_parallel_config, "_device", None))

    def must_run_in_full(self, module, kwargs) -> bool:
        if self.layout.in_full(kwargs):
            return True
        config, mesh = parallelism(module)
        if config is not None and mesh is None:
            if not self._told_parallel:
                self._told_parallel = True
                log.warning(
                    "ToMe reuse across steps stands down: the transformer runs under a parallelism whose process "
                    "group this patch cannot find; every block runs in full."
                )
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
    """The ``forward`` of one span block: run it, or pass its streams on (the last adds the predicted residual)."""

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
    """Give ``transformer`` reuse on ``schedule``, following ``pipeline``'s scheduler; False: class unknown."""
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
    _out_of_diffusers_hooks(transformer)
    if owner is not None:
        owner.drop()


def _out_of_diffusers_hooks(transformer) -> None:
    """Take our forwards out of diffusers' hook chains (``enable_parallelism`` after ``apply_patch`` wraps them)."""
    for module in transformer.modules():
        registry = module.__dict__.get("_diffusers_hook")
        for ref in getattr(registry, "_fn_refs", ()):
            for name in ("forward", "original_forward"):
                ours = getattr(ref, name, None)
                if isinstance(ours, SkippableLayer) and isinstance(ours.owner, DitReuse):
                    inner = ours.inner or types.MethodType(type(module).forward, module)
                    setattr(ref, name, inner)
