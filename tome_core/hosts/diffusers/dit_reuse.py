"""diffusers: reuse across steps on DiT pipelines (Flux, SD3 / SD3.5, Wan 2.x), setting ``reuse_interval``.

The engine's DiT reuse (``LayerReuseRun.span_block``), as in ComfyUI's door (``hosts.comfyui.dit_reuse``): at a
*reusing* call the transformer's first block runs (``DIT_OUTER_BLOCKS``) and the blocks after it, the *span*, do
not; the span's output is its input plus its residual predicted from the last full calls. The same schedule
(``NoiseSpacedSchedule``: one step in ``reuse_interval`` full, spaced evenly in the scheduler's sigmas).

Hook points (checked in diffusers 0.39.0): each transformer's ``forward`` calls its blocks one after the other,
``FluxTransformer2DModel`` its ``transformer_blocks`` then ``single_transformer_blocks`` and
``SD3Transformer2DModel`` its ``transformer_blocks``, all with keyword arguments ``hidden_states`` and
``encoder_hidden_states`` and returning ``(encoder_hidden_states, hidden_states)``; ``WanTransformer3DModel`` its
``blocks`` with ``(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)``, returning
``hidden_states`` (there ``encoder_hidden_states`` is the text the blocks read, not a stream they pass on). Every
block of the span gets an instance ``forward`` (``SpanForward``); the transformer a forward pre-hook and hook that
find the call's step in the pipeline's scheduler (``layer_reuse.PipelineReuse``, as for the UNets).

A call computes every block where ControlNet residuals are added between blocks (Flux, SD3), where SD3's
``skip_layers`` leaves blocks out, where diffusers' own cache (``enable_cache``) is on the transformer (it
skips blocks of its own: ours then stands down, with a warning), and at the schedule's full steps. Removal
deletes the forwards and hooks: the transformer then computes bit-identically to one never patched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...layer_reuse import (
    DIT_OUTER_BLOCKS,
    NoiseSpacedSchedule,
    SkippableLayer,
    attach_forwards,
    detach_forwards,
    dit_extrapolate,
)
from .layer_reuse import PipelineReuse, _disabled

log = logging.getLogger("tome_patch")

_STATE = "_tome_patch_dit_reuse"  # on the transformer: its DitReuse
_HOOKS = "_tome_patch_dit_reuse_hooks"


@dataclass(frozen=True)
class DitLayout:
    """How one transformer class calls its blocks."""

    name: str  # the family, in messages: "Flux", "SD3", "Wan"
    block_lists: tuple[str, ...]  # the attributes holding the blocks, in call order
    streams: tuple[tuple[str, int], ...]  # (keyword, position) of the streams a block passes on, in token order
    timestep_scale: float  # the pipeline gives the transformer the scheduler's timestep divided by this
    in_full_when: tuple[str, ...]  # the transformer's keyword arguments that, when given, make a call full
    # SD3's last block returns no text stream (``context_pre_only``): it runs at every call, after the span.
    last_block_runs: bool = False

    def blocks(self, transformer) -> list[torch.nn.Module] | None:
        found = []
        for attribute in self.block_lists:
            blocks = getattr(transformer, attribute, None)
            if blocks is None:
                return None
            found += list(blocks)
        return found

    def streams_in(self, args: tuple, kwargs: dict) -> dict:
        return {name: kwargs[name] if name in kwargs else args[index] for name, index in self.streams}

    def streams_out(self, out) -> dict:
        """A block's output as streams: a tuple in the order of ``streams`` or, with one stream, the tensor."""
        if len(self.streams) == 1:
            return {self.streams[0][0]: out}
        return dict(zip((name for name, _ in self.streams), out, strict=True))

    def output(self, streams: dict):
        """The inverse of ``streams_out``: what the block would return."""
        values = tuple(streams[name] for name, _ in self.streams)
        return values[0] if len(values) == 1 else values


_JOINT = (("encoder_hidden_states", 1), ("hidden_states", 0))  # Flux's and SD3's blocks return them in this order
LAYOUTS = {
    "FluxTransformer2DModel": DitLayout(
        "Flux",
        ("transformer_blocks", "single_transformer_blocks"),
        _JOINT,
        1000.0,
        ("controlnet_block_samples", "controlnet_single_block_samples"),
    ),
    "SD3Transformer2DModel": DitLayout(
        "SD3", ("transformer_blocks",), _JOINT, 1.0, ("block_controlnet_hidden_states", "skip_layers"), True
    ),
    "WanTransformer3DModel": DitLayout("Wan", ("blocks",), (("hidden_states", 0),), 1.0, ()),
}


def layout_of(transformer) -> DitLayout | None:
    """The layout of a transformer whose blocks reuse can skip (exact class: subclasses such as Wan's VACE add
    inputs between blocks that a skipped span would count twice), or None."""
    return LAYOUTS.get(type(transformer).__name__)


class DitReuse(PipelineReuse):
    """The span's owner on one transformer: the pipeline's runs (``PipelineReuse``) and the span's blocks."""

    SAMPLE = "hidden_states"
    DIT = True

    def __init__(self, pipeline, transformer, layout: DitLayout, schedule, span, allowed: Callable[[float], bool]):
        blocks = [(f"span.{i}", block) for i, block in enumerate(span)]
        super().__init__(pipeline, schedule, blocks, allowed, dit_extrapolate(layout.name))
        self.layers = 1  # what is recorded: the span's residual, one tensor per batch layout
        self.layout = layout
        self.span_length = len(span)
        self.TIMESTEP_SCALE = layout.timestep_scale
        self._transformer = transformer
        self._warned_cache = False

    def new_run(self, steps: int, noise_levels=None, full_below: float = 0.0):
        run = super().new_run(steps, noise_levels, full_below)
        run.outer_words = "the first block"
        run.inner_words = "blocks' residual"
        return run

    def must_run_in_full(self, module, kwargs) -> bool:
        if any(kwargs.get(name) is not None for name in self.layout.in_full_when):
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


class SpanForward(SkippableLayer):
    """The ``forward`` of one block of the span: run it (a full call), or pass its streams on (a reusing call);
    the last one adds the predicted residual."""

    def __call__(self, *args, **kwargs):
        owner = self.owner
        run = owner.layer_run()
        if run is None or run.current is None:
            return self.original(*args, **kwargs)
        layout = owner.layout
        return run.span_block(
            first=self.index == 0,
            last=self.index == owner.span_length - 1,
            streams=layout.streams_in(args, kwargs),
            run_block=lambda: self.original(*args, **kwargs),
            streams_of=layout.streams_out,
            pack=layout.output,
        )


def span_of(transformer, layout: DitLayout, outer=DIT_OUTER_BLOCKS) -> list[torch.nn.Module]:
    """The blocks a reusing call skips: all but ``outer`` (at the start, at the end)."""
    blocks = layout.blocks(transformer) or []
    first, last = outer[0], max(outer[1], int(layout.last_block_runs))
    return blocks[first : len(blocks) - last] if len(blocks) > first + last + 1 else []


def install(transformer, pipeline, settings, allowed: Callable[[float], bool], schedule=None) -> bool:
    """Give ``transformer`` reuse across steps at ``settings.reuse_interval`` (or ``schedule``: the family's under
    ``dit_settings`` auto), following ``pipeline``'s scheduler; False where its class is not one this door knows
    (it is then left as it is)."""
    layout = layout_of(transformer)
    if (schedule is None and settings.reuse_interval <= 1) or layout is None:
        return False
    span = span_of(transformer, layout)
    if not span:
        return False
    if schedule is None:
        schedule = NoiseSpacedSchedule(settings.reuse_interval)
    owner = DitReuse(pipeline, transformer, layout, schedule, span, allowed)
    attach_forwards(owner, span, SpanForward)
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
