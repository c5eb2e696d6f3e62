"""The block hook ComfyUI and Forge Neo share: their DiT loops hand block ``i`` to
``transformer_options["patches_replace"]["dit"][(block_type, i)]``, where reuse's span blocks go."""

from __future__ import annotations

from ...reuse import SkippableLayer
from . import dit_families
from .dit_families import BlockLayout

PATCH_NAME = "dit"
BLOCK_PATCHES = ("double_block", "single_block")  # transformer_options["patches"]: run after each block


def layout_named(family: str) -> BlockLayout | None:
    record = dit_families.family(family)
    return record.blocks if record is not dit_families.OTHER else None


def block_keys(diffusion_model, layout: BlockLayout) -> list[tuple[str, int]] | None:
    """Every block's ``patches_replace["dit"]`` key in call order; None where a block list is missing."""
    keys = []
    for block_type, attribute in layout.lists:
        blocks = getattr(diffusion_model, attribute, None)
        if blocks is None:
            return None
        keys += [(block_type, i) for i in range(len(blocks))]
    return keys


def replacements(patcher) -> dict:
    options = getattr(patcher, "model_options", None) or {}
    return ((options.get("transformer_options") or {}).get("patches_replace") or {}).get(PATCH_NAME) or {}


def why_every_block_runs(transformer_options, keys: list, blocks: dict) -> str | None:
    """Why a call must run every block (None: it need not): another patch replaced a span block after ours, or
    patches after each block add to the streams."""
    options = transformer_options or {}
    replaced = (options.get("patches_replace") or {}).get(PATCH_NAME) or {}
    if not all(replaced.get(key) is blocks.get(key) for key in keys):
        return "another node replaces one of the DiT's inner blocks"
    if any((options.get("patches") or {}).get(kind) for kind in BLOCK_PATCHES):
        return "another node patches the DiT's blocks' outputs"
    return None


class SpanBlock:
    """The ``patches_replace["dit"]`` entry of one span block; ``hooks``: the door's owner of the span."""

    def __init__(self, hooks, position: int, previous=None):
        self.hooks = hooks
        self.position = position
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
            in_full=lambda: hooks.runs_in_full(args.get("transformer_options")),
        )


class SpanForward(SkippableLayer):
    """The instance ``forward`` of a span block of a family without a block hook (one stream, the first argument)."""

    def __call__(self, *args, **kwargs):
        hooks = self.owner
        run = hooks.layer_run()
        if run is None or run.current is None or not args:
            return self.original(*args, **kwargs)
        (name,) = hooks.streams
        return run.span_block(
            first=self.index == 0,
            last=self.index == len(hooks.keys) - 1,
            streams={name: args[0]},
            run_block=lambda: self.original(*args, **kwargs),
            streams_of=lambda out: {name: out},
            in_full=lambda: hooks.runs_in_full(kwargs.get("transformer_options")),
            pack=lambda streams: streams[name],
        )
