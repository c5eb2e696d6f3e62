"""Counted work of a sampling run: how many model calls and transformer-block tokens were actually computed.

A step cache (ComfyUI's EasyCache / LazyCache) decides from the features how much to compute,
so its speed on the small reference models says little about full size; the work it did does. Counted here with
forward pre-hooks on the UNet that really runs (ComfyUI's, or a UNet swapped in by an object patch):
- model calls: calls of the UNet's first layer (its input convolution), in batch entries (a cond+uncond batch
  of 16 prompts at one step is 32), so a call that a cache answers without running the UNet is not counted;
- tokens: the tokens that reach each transformer block's feed-forward layer (batch x tokens), summed over the
  run; the feed-forward layer runs on exactly the tokens the block computes (all of them unpatched and with
  ToDo, the merged ones with scope block; none in the inner layers at a step that reuses them).
On a DiT (Flux, Wan, Qwen-Image): model calls are calls of its input projection (Flux and Qwen-Image ``img_in``,
Wan ``patch_embedding``), and tokens are the tokens each transformer block computes (Flux and Qwen-Image: image and
text; a double block's two streams
cost about what a single block costs on the joined sequence per token: 12 width-squared multiply-adds each), so a
block skipped by a step cache or by reuse across steps is not counted.
Shares are against the unpatched row of the same run; ``block_shares`` lists each block's, in call order, which
``at_depth`` converts to a real model's depth.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import torch


def _unets(row, patcher) -> list[torch.nn.Module]:
    """The UNets a row may run: the patcher's own and any swapped in by an object patch (tomesd's rows)."""
    unets = [patcher.model.diffusion_model]
    model = row.patch(patcher)  # a throwaway clone: only its object patches are read
    for value in getattr(model, "object_patches", {}).values():
        if isinstance(value, torch.nn.Module) and value not in unets:
            unets.append(value)
    return unets


class WorkCount:
    def __init__(self):
        self.calls = 0
        self.call_entries = 0
        self.tokens: dict[str, int] = defaultdict(int)  # per transformer block: batch x tokens, summed

    def summary(self, baseline: WorkCount | None) -> dict:
        total = sum(self.tokens.values())
        record = {"calls": self.calls, "call_entries": self.call_entries, "block_tokens": total}
        if baseline is not None and baseline.call_entries and baseline.tokens:
            record["call_share"] = self.call_entries / baseline.call_entries
            record["token_share"] = total / sum(baseline.tokens.values())
            per_block = [self.tokens.get(name, 0) / n for name, n in baseline.tokens.items() if n]
            record["token_share_min_block"] = min(per_block)
            record["block_shares"] = per_block
        return record


def at_depth(shares: list[float], depth: int) -> float:
    """A run's blocks' work on a model of ``depth`` blocks, from the reference's per-block shares in call order:
    the first and the last block as measured (reuse across steps always runs the first, and SD3's last), every
    other block at the mean of the reference's inner blocks."""
    middle = shares[1:-1]
    return (shares[0] + shares[-1] + (depth - 2) * sum(middle) / len(middle)) / depth


@contextmanager
def count_work(row, patcher):
    """Count the work of the sampling done inside the ``with`` (see the module docstring)."""
    work = WorkCount()
    handles = []

    def on_call(module, args):
        work.calls += 1
        work.call_entries += int(args[0].shape[0])

    def on_block(name):
        def hook(module, args):
            x = args[0]
            if x.dim() == 3:
                work.tokens[name] += int(x.shape[0]) * int(x.shape[1])

        return hook

    for unet in _unets(row, patcher):  # ComfyUI and ldm name their blocks alike
        if _count_dit(unet, work, handles, on_call):
            continue
        first = getattr(unet, "input_blocks", None)
        if first is not None:
            # The UNets iterate over the layers of each input block rather than calling it: hook its first layer.
            handles.append(first[0][0].register_forward_pre_hook(on_call))
        for name, module in unet.named_modules():
            if name.endswith(".ff") and "transformer_blocks" in name:
                handles.append(module.register_forward_pre_hook(on_block(name)))
    try:
        yield work
    finally:
        for handle in handles:
            handle.remove()


def _count_dit(model, work: WorkCount, handles: list, on_call) -> bool:
    """Hooks on a Flux or Wan transformer (see the module docstring); False for any other model."""
    first = getattr(model, "img_in", getattr(model, "patch_embedding", None))
    blocks = [*getattr(model, "double_blocks", ()), *getattr(model, "single_blocks", ()), *getattr(model, "blocks", ())]
    blocks += [*getattr(model, "transformer_blocks", ())]  # Qwen-Image
    if first is None or not blocks:
        return False
    handles.append(first.register_forward_pre_hook(on_call))

    def on_block(name):
        def hook(module, args, kwargs):
            # Flux ``img`` / ``txt``, Qwen-Image ``hidden_states`` / ``encoder_hidden_states`` (keywords only)
            names = ("img", "txt", "hidden_states", "encoder_hidden_states")
            streams = [*args[:1], *(kwargs[k] for k in names if k in kwargs)]
            work.tokens[name] += sum(int(x.shape[0]) * int(x.shape[1]) for x in streams if x.dim() == 3)

        return hook

    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(on_block(f"block{index}"), with_kwargs=True))
    return True
