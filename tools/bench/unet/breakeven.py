"""Break-even of each method per token count, on one real transformer block: where does a reduction pay?

    python -m tools.bench.unet.breakeven [--model sd15|sdxl] [--sides 32,40,48,...] [--repeats 7]

Only the blocks of the reduced level change when the patch is on, so the whole UNet's time difference is the
number of those blocks times one block's difference. One ComfyUI ``BasicTransformerBlock`` with the shape of
the model's reduced level (SD1.5: 320 channels, 8 heads at level 1; SDXL: 640 channels, 10 heads at level 2)
is timed unpatched and with this project's hooks forced on (``skip_when_slower`` off) on square token grids
of growing side; the smallest side from which every larger side is faster gives the method's MIN_TOKENS
(``tome_core/cost.py``). The whole-UNet rows of ``tools.bench.speed --force`` confirm it at full size.

Scope block (the whole block on merged tokens) makes one plan per level and UNet call, shared by the level's
blocks (SD1.5: 5 per level, SDXL: 10 at level 2, 60 at level 4): "block 0.5" times a block that makes the plan
itself (the first block of a level), "block 0.5 shared" one that finds it already made (every later block).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from tools.common import host as bench_host
from tools.common.measure import timed

SHAPES = {
    "sd15": (320, 8, 40, 768, 1),  # channels, heads, head width, context, level
    "sdxl": (640, 10, 64, 2048, 2),
    "sdxl-4": (1280, 20, 64, 2048, 4),  # SDXL's level 4 (10 blocks per transformer)
}
METHODS = {
    "tome 0.3": {"ratio": 0.3},
    "tome 0.5": {"ratio": 0.5},
    "todo 2": {"method": "todo"},
    "block 0.5": {"ratio": 0.5, "scope": "block"},  # the plan made in every call (a level of one block)
    "block 0.5 shared": {"ratio": 0.5, "scope": "block", "shared": True},  # the plan made by an earlier block
}


def cpu_timed(call, device) -> tuple[float, object]:
    """Like ``bench_measure.timed`` but in CPU seconds of this process (all threads): on a machine shared with
    other jobs, wall time mostly measures waiting for a core, CPU time still measures the work."""
    gc.collect()
    start = time.process_time()
    result = call()
    return time.process_time() - start, result


def block_runner(model: str, device: torch.device, dtype: torch.dtype):
    from comfy.ldm.modules.attention import BasicTransformerBlock

    channels, heads, head_width, context_dim, level = SHAPES[model]
    block = BasicTransformerBlock(channels, heads, head_width, context_dim=context_dim, dtype=dtype, device=device)
    bench_host.initialise(block, 0)
    block.eval()

    def run(tokens: torch.Tensor, context: torch.Tensor, side: int, variant: dict):
        options = variant["options"]
        if "original_shape" not in options:  # a fresh options dict per call, as the host makes per UNet call
            options = dict(options, original_shape=[tokens.shape[0], 4, side * level, side * level])
        return variant.get("forward", block)(tokens, context=context, transformer_options=options)

    return run, block, channels, context_dim, level


def patch_variant(block, shared: bool = False, **values) -> dict:
    """How to call the block with this project's patch forced on at every size: the block's forward and the
    transformer_options holding the hooks.

    Scope block: the block's forward as the patcher hooks install it (``BlockForward``), with the owner mark.
    ``shared`` keeps one options dict per grid across calls, so the plan is found made already (as by every
    block of a level after the first within one UNet call).
    """
    from tome_core import PatchSettings, Reducer
    from tome_core.hosts.shared.model_patcher import OWNER_KEY, BlockForward, PatcherHooks
    from tome_core.schedule import NoiseRange

    settings = PatchSettings.from_values(skip_when_slower=False, **values)
    hooks = PatcherHooks(Reducer(settings, (1, 2, 4)), NoiseRange(0.0, 1.0, float))
    if settings.merges_whole_block:
        return {"forward": BlockForward(hooks, block), "options": {OWNER_KEY: hooks}, "shared": shared}
    patches = {"attn1_patch": [hooks.attn1_patch], "attn1_output_patch": [hooks.attn1_output_patch]}
    return {"options": {"patches": patches}}


def _for_grid(variant: dict, tokens: torch.Tensor, side: int, level: int) -> dict:
    if not variant.get("shared"):
        return variant
    shape = [tokens.shape[0], 4, side * level, side * level]
    return dict(variant, options=dict(variant["options"], original_shape=shape))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sd15", choices=sorted(SHAPES))
    parser.add_argument("--sides", default="32,40,48,56,64,72,80,88,96", help="token grid sides (latent / level)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="cpu: this process's CPU time")
    parser.add_argument("--methods", default=",".join(METHODS), help="which of the patched variants (comma list)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    bench_host.setup_comfy(device.type)
    run, block, channels, context_dim, level = block_runner(args.model, device, dtype)
    methods = {name: METHODS[name] for name in args.methods.split(",") if name}
    variants = {"off": {"options": {}}} | {
        name: patch_variant(block, max_downsample=level, **values) for name, values in methods.items()
    }
    generator = torch.Generator().manual_seed(0)
    results = {}
    print("| side | tokens | off (ms) | " + " | ".join(methods) + " |")
    print("|---|---|---|" + "---|" * len(methods))
    for side in (int(s) for s in args.sides.split(",")):
        tokens = torch.randn(args.batch, side * side, channels, generator=generator).to(device, dtype)
        context = torch.randn(args.batch, 77, context_dim, generator=generator).to(device, dtype)
        times = {name: [] for name in variants}
        per_side = {name: _for_grid(variant, tokens, side, level) for name, variant in variants.items()}
        with torch.inference_mode():
            for options in per_side.values():  # warm-up (for "shared": makes the plan that later calls find)
                run(tokens, context, side, options)
            for _ in range(args.repeats):
                for name, options in per_side.items():
                    call = lambda o=options, t=tokens, c=context, s=side: run(t, c, s, o)  # noqa: E731
                    times[name].append((cpu_timed if args.clock == "cpu" else timed)(call, device)[0])
        medians = {name: statistics.median(t) for name, t in times.items()}
        results[side] = medians
        ratios = " | ".join(f"{medians['off'] / medians[name]:.2f}x" for name in methods)
        print(f"| {side} | {side * side} | {medians['off'] * 1e3:.1f} | {ratios} |", flush=True)
    threads = torch.get_num_threads()
    clock = f"{args.clock} time"
    print(f"({args.model} level {level} block, batch {args.batch}, {dtype}, {device}, {threads} threads, {clock})")
    return results


if __name__ == "__main__":
    main()
