"""ComfyUI: reuse across steps on DiTs through the block hook (``dit_block_hook``) or, for a loop without one,
instance forwards; the run, step and batch layout come from the UNets' wrappers (``layer_reuse``). In a process
that is one of several of a ``torch.distributed`` group every block runs (docs/comfyui.md, several GPUs).
"""

from __future__ import annotations

import logging

from ...calibration.fingerprint import settings_words
from ...reuse import (
    DIT_OUTER_BLOCKS,
)
from ...reuse.agreement import several_processes
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


SUPPORTED_WORDS = dit_families.listed("comfyui")


def known_without_reuse(diffusion_model) -> bool:
    record = dit_families.of_model("comfyui", diffusion_model) if diffusion_model is not None else None
    return record is not None and bool(record.no_reuse)


def unfit_record(diffusion_model):
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
    layout = layout_of(diffusion_model)
    return None if layout is None else hook_block_keys(diffusion_model, layout)


def block_streams(diffusion_model) -> tuple[str, ...]:
    layout = layout_of(diffusion_model)
    return layout.streams if layout is not None else ("txt", "img")


class DitReuseHooks(LayerReuseHooks):
    """The UNets' wrappers (the run, the step, the batch layout) and the span's blocks."""

    DIT = True
    RUN_WORDS = ("the first block", "blocks' residual")

    def __init__(self, schedule, keys: list, streams: tuple[str, ...], noise_range, extrapolate: float):
        super().__init__(schedule, 1, noise_range, extrapolate)
        self.keys = keys
        self.streams = streams
        self.blocks: dict = {}  # key -> SpanBlock, to tell ours from another node's replacement
        self.warned = False
        self.told_group = False

    def apply_model_wrapper(
        self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kwargs
    ):
        # ControlNet adds between blocks, which a skipped span would count twice.
        if control is not None or self.in_a_process_group():
            return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
        return super().apply_model_wrapper(
            executor, x, t, c_concat, c_crossattn, control, transformer_options, **kwargs
        )

    def in_a_process_group(self) -> bool:
        """Whether this process is one of several of a ``torch.distributed`` group (every block runs); warns once."""
        if not several_processes():
            return False
        if not self.told_group:
            self.told_group = True
            log.warning(
                "ToMe reuse across steps is off: this process is one of several of a torch.distributed group (a "
                "multi-GPU sampler such as Raylight's), whose processes would each have to skip the same steps; "
                "every block runs in full."
            )
        return True

    def runs_in_full(self, transformer_options) -> bool:
        """Whether this call must run every block (``why_every_block_runs``); warns once."""
        why = why_every_block_runs(transformer_options, self.keys, self.blocks)
        if why is None:
            return False
        if not self.warned:
            self.warned = True
            log.warning("ToMe reuse across steps: %s; every block runs in full (ToDo still applies).", why)
        return True


def install(clone, settings, noise_range, schedule) -> bool:
    """Give ``clone`` (a DiT's patcher) reuse across steps on ``schedule``; False where it cannot."""
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
    hooks.plan, hooks.target = settings.reuse_plan, settings.calibration_target
    hooks.reduces = not settings.reduces_nothing  # a calibration then decides ToDo too
    hooks.settings_words = (settings_words(settings),)  # another ToDo or step range is another kept plan
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
    """Remove what reuse put on ``patcher``; another node's replacements that ours wrapped come back."""
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
