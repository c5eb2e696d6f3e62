"""ComfyUI: reuse across steps on DiTs (Flux and Chroma, SD3 / SD3.5, Wan 2.x), setting ``reuse_interval``.

A DiT is a stack of blocks run one after the other. At a *reusing* call the first block runs
(``DIT_OUTER_BLOCKS``) and the blocks after it, the *span*, do not: the span's output is its input at this call
plus its residual (output minus input) predicted from the last full calls (the engine's
``LayerReuseRun.start_span`` / ``predicted_span_output``, the UNets' prediction). Which calls run in full:
``NoiseSpacedSchedule``, one step in ``reuse_interval``, spaced evenly in the run's sigmas.

Hook point (checked in ComfyUI 0.3.75): every family's ``forward_orig`` hands block ``i`` to
``transformer_options["patches_replace"]["dit"][(block_type, i)]`` when that key is set, with the block's inputs
as a dict (``img``, ``txt``, ``vec``, ``pe``, ``transformer_options``) and ``{"original_block": ...}``, and reads
the block's outputs back from the dict it returns. The patch sets such a replacement (``SpanBlock``) on every
block of the span, on the clone's options only, wrapping a replacement another node put there before. Per family:
- Flux / Chroma: ``("double_block", i)`` with streams ``img`` and ``txt``, then ``("single_block", i)`` on the
  text and image tokens joined (``torch.cat((txt, img), 1)``), which is also how the two streams are joined here;
- SD3 / MMDiT: ``("double_block", i)`` over ``joint_blocks``, streams ``img`` and ``txt`` (context);
- Wan: ``("double_block", i)`` over ``blocks``, the stream ``img`` (``txt`` is the text the blocks attend to).

The sampling run, the step of each call and the batch layout come from the same wrappers as on the UNets
(``layer_reuse.LayerReuseHooks``). A call computes every block (and records) where a step cache, a ControlNet or
another node's replacement of a span block is there, where its tokens are laid out otherwise than at the last
full call, and at the schedule's full steps.
"""

from __future__ import annotations

import logging

from ...layer_reuse import DIT_OUTER_BLOCKS, LayerReuseRun, NoiseSpacedSchedule, dit_extrapolate
from .dit import class_names, family_name
from .layer_reuse import APPLY_MODEL, OUTER_SAMPLE, WRAPPER_KEY, LayerReuseHooks

log = logging.getLogger("tome_patch")

PATCH_NAME = "dit"  # transformer_options["patches_replace"]["dit"]

# Families whose blocks reuse can skip: the class names (any class in the MRO) and their block lists, in call
# order, as (block type, attribute). VACE adds hints between blocks that a skipped span would count twice, and
# the other families add tokens or inputs of their own: they run every block.
_BLOCK_LISTS = {
    ("Flux", "Chroma"): (("double_block", "double_blocks"), ("single_block", "single_blocks")),
    ("MMDiT",): (("double_block", "joint_blocks"),),
    ("WanModel", "CameraWanModel"): (("double_block", "blocks"),),
}
_NO_REUSE_CLASSES = ("ChromaRadiance", "VaceWanModel", "WanModel_S2V", "HumoWanModel", "AnimateWanModel")
# The streams a block passes on, per block type and family: Wan's ``txt`` is the text it reads, not a stream.
_STREAMS = {"Wan": ("img",), "other": ("txt", "img")}
# Families whose last block runs at every call, after the span: SD3's returns no text stream (``pre_only``).
_LAST_BLOCK_RUNS = ("MMDiT",)


def block_keys(diffusion_model) -> list[tuple[str, int]] | None:
    """Every block of a supported DiT in call order, as its ``patches_replace["dit"]`` key; None if reuse does not
    run on this model."""
    names = class_names(diffusion_model)
    if names & set(_NO_REUSE_CLASSES):
        return None
    for classes, lists in _BLOCK_LISTS.items():
        if names & set(classes):
            keys = []
            for block_type, attribute in lists:
                blocks = getattr(diffusion_model, attribute, None)
                if blocks is None:
                    return None
                keys += [(block_type, i) for i in range(len(blocks))]
            return keys
    return None


def block_streams(diffusion_model) -> tuple[str, ...]:
    """The streams each block passes on: Flux and SD3 ``txt`` and ``img``, Wan ``img`` alone."""
    names = class_names(diffusion_model)
    return _STREAMS["Wan"] if names & {"WanModel", "CameraWanModel"} else _STREAMS["other"]


class DitReuseHooks(LayerReuseHooks):
    """The wrappers of ``LayerReuseHooks`` (the run, the step, the batch layout) and the span's blocks."""

    DIT = True

    def __init__(self, schedule, keys: list, streams: tuple[str, ...], noise_range, extrapolate: float):
        super().__init__(schedule, 1, noise_range, extrapolate, by_sigma=True)
        self.keys = keys  # the span's blocks, in call order
        self.streams = streams
        self.blocks: dict = {}  # key -> SpanBlock, to tell ours from another node's replacement
        self.warned = False

    def new_run(self, steps: int, noise_levels=None, full_below: float = 0.0) -> LayerReuseRun:
        run = super().new_run(steps, noise_levels, full_below)
        run.outer_words = "the first block"
        run.inner_words = "blocks' residual"
        return run

    def apply_model_wrapper(
        self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kwargs
    ):
        if control is not None:  # ControlNet adds between blocks, which a skipped span would count twice
            return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
        return super().apply_model_wrapper(
            executor, x, t, c_concat, c_crossattn, control, transformer_options, **kwargs
        )

    def ours_everywhere(self, transformer_options) -> bool:
        """Whether every block of the span still has our replacement in this call (another node may have set its
        own on one of them after ours)."""
        replaced = ((transformer_options or {}).get("patches_replace") or {}).get(PATCH_NAME) or {}
        if all(replaced.get(key) is self.blocks.get(key) for key in self.keys):
            return True
        if not self.warned:
            self.warned = True
            log.warning(
                "ToMe reuse across steps: another node replaces one of the DiT's inner blocks; every block runs in "
                "full (ToDo still applies)."
            )
        return False


class SpanBlock:
    """The ``patches_replace["dit"]`` entry of one block of the span: run it (a full call), or pass its inputs on
    untouched (a reusing call); the last one adds the predicted residual."""

    def __init__(self, hooks: DitReuseHooks, position: int, previous=None):
        self.hooks = hooks
        self.position = position  # 0: the span's first block; len(keys) - 1: its last
        self.previous = previous  # another node's replacement that was there before ours

    def __deepcopy__(self, memo):
        return self  # shared by copies of the options, like a function

    def run_block(self, args: dict, extra: dict) -> dict:
        if self.previous is not None:
            return self.previous(args, extra)
        return extra["original_block"](args)

    def __call__(self, args: dict, extra: dict) -> dict:
        hooks = self.hooks
        run = hooks.layer_run()
        if run is None or run.current is None:
            return self.run_block(args, extra)
        streams = {name: args.get(name) for name in hooks.streams}
        return run.span_block(
            first=self.position == 0,
            last=self.position == len(hooks.keys) - 1,
            streams=streams,
            run_block=lambda: self.run_block(args, extra),
            streams_of=lambda out: {name: out.get(name) for name in streams},
            in_full=lambda: not hooks.ours_everywhere(args.get("transformer_options")),
        )


def install(clone, settings, noise_range, outer=DIT_OUTER_BLOCKS, schedule=None, extrapolate=None) -> bool:
    """Give ``clone`` (a DiT's patcher) reuse across steps at ``settings.reuse_interval``; False where it cannot
    (left as it is). ``outer`` (blocks run at every call: at the start, at the end), ``schedule`` and
    ``extrapolate`` (default: the family's, ``layer_reuse.dit_extrapolate``) are for the benchmarks."""
    diffusion_model = clone.model.diffusion_model
    keys = block_keys(diffusion_model)
    first, last = outer
    if class_names(diffusion_model) & set(_LAST_BLOCK_RUNS):
        last = max(last, 1)
    if settings.reuse_interval <= 1 or keys is None or len(keys) <= first + last + 1:
        return False
    if not (hasattr(clone, "add_wrapper_with_key") and hasattr(clone, "set_model_patch_replace")):
        return False
    span = keys[first : len(keys) - last]
    schedule = NoiseSpacedSchedule(settings.reuse_interval) if schedule is None else schedule
    if extrapolate is None:
        extrapolate = dit_extrapolate(family_name(diffusion_model) or "")
    hooks = DitReuseHooks(schedule, span, block_streams(diffusion_model), noise_range, extrapolate)
    replaced = _replacements(clone)
    for position, (block_type, index) in enumerate(span):
        previous = replaced.get((block_type, index))
        block = SpanBlock(hooks, position, previous)
        hooks.blocks[(block_type, index)] = block
        clone.set_model_patch_replace(block, PATCH_NAME, block_type, index)
    clone.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY, hooks.outer_sample_wrapper)
    clone.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY, hooks.apply_model_wrapper)
    return True


def _replacements(patcher) -> dict:
    options = getattr(patcher, "model_options", None) or {}
    return ((options.get("transformer_options") or {}).get("patches_replace") or {}).get(PATCH_NAME) or {}


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
