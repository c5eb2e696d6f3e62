"""ComfyUI: reuse across steps on DiTs, setting ``reuse_interval`` (or ``dit_settings`` auto: the family's).

A DiT is a stack of blocks run one after the other. At a *reusing* call the first block runs
(``DIT_OUTER_BLOCKS``) and the blocks after it, the *span*, do not: the span's output is its input at this call
plus its residual (output minus input) predicted from the last full calls (the engine's
``LayerReuseRun.start_span`` / ``predicted_span_output``, the UNets' prediction). Which calls run in full:
``NoiseSpacedSchedule``, one step in ``reuse_interval``, spaced evenly in the run's sigmas.

Hook point (checked in ComfyUI 0.3.75; 0.8.0 the same): the forward loop of every family with a block layout hands block
``i`` to ``transformer_options["patches_replace"]["dit"][(block_type, i)]`` when that key is set, with the block's
inputs as a dict and ``{"original_block": ...}``, and reads the block's outputs back from the dict it returns. The patch
sets such a replacement (``SpanBlock``) on every block of the span, on the clone's options only, wrapping a replacement
another node put there before. A family's layout is part of its registry record: its block lists, the streams a block
passes on and the order the model joins them in, and whether its last block must run, or why a model runs every block
(``no_reuse``). The argument names of each family's dict (``attention_mask`` or ``attn_mask``, ``vec`` as a tensor or
Flux.2's tuple of modulations) never matter: a span block passes the dict on or runs the original block with it, and
reads and writes only the streams. Families that hand no block to the hook (and have no ``forward`` layout), or add
inputs between blocks outside it, have a record whose ``no_reuse`` gives the log its reason.

The sampling run, the step of each call and the batch layout come from the same wrappers as on the UNets
(``layer_reuse.LayerReuseHooks``). A call computes every block (and records) where a step cache, a ControlNet,
another node's replacement of a span block or a patch after each block (``patches["double_block"]``) is there,
where its tokens are laid out otherwise than at the last full call, and at the schedule's full steps.
"""

from __future__ import annotations

import logging

from ...reuse import (
    DIT_OUTER_BLOCKS,
)
from ..shared import dit_families
from ..shared.dit_block_hook import (
    PATCH_NAME,
    SpanBlock,
    SpanForward,
    layout_named,
    why_every_block_runs,
)
from ..shared.dit_block_hook import block_keys as hook_block_keys
from ..shared.dit_block_hook import replacements as _replacements
from ..shared.dit_families import BlockLayout
from .layer_reuse import APPLY_MODEL, OUTER_SAMPLE, WRAPPER_KEY, LayerInjection, LayerReuseHooks

log = logging.getLogger("tome_patch")

INJECTION_KEY = "tome_patch_dit_reuse"  # the span's forwards of a family without a block hook


def layout_of(diffusion_model) -> BlockLayout | None:
    """The block layout of a DiT whose blocks reuse can skip, or None (``why_not`` says why)."""
    record = dit_families.of_model("comfyui", diffusion_model)
    return layout_named(record.name) if record is not None else None


# The families whose blocks reuse reaches here, as the log and the node's tooltip name them.
SUPPORTED_WORDS = dit_families.listed("comfyui")


def known_without_reuse(diffusion_model) -> bool:
    """Whether ``diffusion_model`` is a DiT whose record says it runs every block (``DitFamily.no_reuse``)."""
    record = dit_families.of_model("comfyui", diffusion_model) if diffusion_model is not None else None
    return record is not None and bool(record.no_reuse)


def unfit_record(diffusion_model):
    """The record whose class ``diffusion_model`` derives from but whose blocks it does not have or take as that
    family's do (``dit_families.named_but_unfit``), or None."""
    if diffusion_model is None:
        return None
    return dit_families.named_but_unfit("comfyui", diffusion_model)


def why_not(diffusion_model) -> str:
    """Why reuse does not run on ``diffusion_model`` (for the log)."""
    record = dit_families.of_model("comfyui", diffusion_model)
    if record is not None and record.no_reuse:
        return record.no_reuse
    unfit = unfit_record(diffusion_model)
    if unfit is not None:
        return (
            f"its class derives from {unfit.name}'s, but its blocks are not laid out or called as {unfit.name}'s "
            "(a family this patch does not know yet)"
        )
    if layout_of(diffusion_model) is not None:
        return "too few blocks, or a patcher without block replacements"
    return f"{type(diffusion_model).__name__} is no DiT family this patch knows"


def block_keys(diffusion_model) -> list[tuple[str, int]] | None:
    """Every block of a supported DiT in call order, as its ``patches_replace["dit"]`` key; None if reuse does not
    run on this model."""
    layout = layout_of(diffusion_model)
    return None if layout is None else hook_block_keys(diffusion_model, layout)


def block_streams(diffusion_model) -> tuple[str, ...]:
    """The streams each block passes on, in the order the model joins them."""
    layout = layout_of(diffusion_model)
    return layout.streams if layout is not None else ("txt", "img")


class DitReuseHooks(LayerReuseHooks):
    """The wrappers of ``LayerReuseHooks`` (the run, the step, the batch layout) and the span's blocks."""

    DIT = True
    RUN_WORDS = ("the first block", "blocks' residual")

    def __init__(self, schedule, keys: list, streams: tuple[str, ...], noise_range, extrapolate: float):
        super().__init__(schedule, 1, noise_range, extrapolate)
        self.keys = keys  # the span's blocks, in call order
        self.streams = streams
        self.blocks: dict = {}  # key -> SpanBlock, to tell ours from another node's replacement
        self.warned = False

    def apply_model_wrapper(
        self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kwargs
    ):
        if control is not None:  # ControlNet adds between blocks, which a skipped span would count twice
            return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
        return super().apply_model_wrapper(
            executor, x, t, c_concat, c_crossattn, control, transformer_options, **kwargs
        )

    def runs_in_full(self, transformer_options) -> bool:
        """Whether this call must run every block (``dit_block_hook.why_every_block_runs``); warns once."""
        why = why_every_block_runs(transformer_options, self.keys, self.blocks)
        if why is None:
            return False
        if not self.warned:
            self.warned = True
            log.warning("ToMe reuse across steps: %s; every block runs in full (ToDo still applies).", why)
        return True


def install(clone, settings, noise_range, schedule) -> bool:
    """Give ``clone`` (a DiT's patcher) reuse across steps on ``schedule`` (the front door's: the family's under
    ``dit_settings`` auto, else one step in ``reuse_interval``); False where it cannot (left as it is)."""
    diffusion_model = clone.model.diffusion_model
    layout = layout_of(diffusion_model)
    keys = block_keys(diffusion_model)
    first, last = DIT_OUTER_BLOCKS
    if layout is not None and layout.last_block_runs:
        last = max(last, 1)
    if keys is None or len(keys) <= first + last + 1:
        return False
    needs = "set_model_patch_replace" if layout.hook == "dit" else "set_injections"
    if not (hasattr(clone, "add_wrapper_with_key") and hasattr(clone, needs)):
        return False
    span = keys[first : len(keys) - last]
    extrapolate = dit_families.family(layout.family).extrapolate
    hooks = DitReuseHooks(schedule, span, layout.streams, noise_range, extrapolate)
    if layout.hook == "dit":
        replaced = _replacements(clone)
        for position, (block_type, index) in enumerate(span):
            previous = replaced.get((block_type, index))
            block = SpanBlock(hooks, position, previous)
            hooks.blocks[(block_type, index)] = block
            clone.set_model_patch_replace(block, PATCH_NAME, block_type, index)
    else:
        lists = dict(layout.lists)
        modules = [getattr(diffusion_model, lists[block_type])[index] for block_type, index in span]
        clone.set_injections(INJECTION_KEY, [LayerInjection(hooks, modules, SpanForward)])
    clone.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY, hooks.outer_sample_wrapper)
    clone.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY, hooks.apply_model_wrapper)
    return True


def remove(patcher) -> None:
    """Remove what reuse put on ``patcher`` (a clone): our block replacements (another node's that ours wrapped
    come back) and the wrappers."""
    replaced = _replacements(patcher)
    for key, value in list(replaced.items()):
        if isinstance(value, SpanBlock):
            if value.previous is None:
                del replaced[key]
            else:
                replaced[key] = value.previous
    if hasattr(patcher, "remove_wrappers_with_key"):
        for kind in (OUTER_SAMPLE, APPLY_MODEL):
            patcher.remove_wrappers_with_key(kind, WRAPPER_KEY)
    if hasattr(patcher, "remove_injections"):
        patcher.remove_injections(INJECTION_KEY)
