"""Break-even of each method per token count, on one real transformer block: where does a reduction pay?

    python -m tools.bench_breakeven [--model sd15|sdxl] [--sides 32,40,48,...] [--repeats 7]

Only the blocks of the reduced level change when the patch is on, so the whole UNet's time difference is the
number of those blocks times one block's difference. One ComfyUI ``BasicTransformerBlock`` with the shape of
the model's reduced level (SD1.5: 320 channels, 8 heads at level 1; SDXL: 640 channels, 10 heads at level 2)
is timed unpatched and with this project's hooks forced on (``skip_when_slower`` off) on square token grids
of growing side; the smallest side from which every larger side is faster gives the method's MIN_TOKENS
(``tome_core/cost.py``). The whole-UNet rows of ``tools.benchmark --force`` confirm it at full size.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from . import bench_host
from .bench_measure import timed

SHAPES = {"sd15": (320, 8, 40, 768, 1), "sdxl": (640, 10, 64, 2048, 2)}  # channels, heads, head width, context, level
METHODS = {"tome 0.3": {"ratio": 0.3}, "tome 0.5": {"ratio": 0.5}, "todo 2": {"method": "todo"}}


def block_runner(model: str, device: torch.device, dtype: torch.dtype):
    from comfy.ldm.modules.attention import BasicTransformerBlock

    channels, heads, head_width, context_dim, level = SHAPES[model]
    block = BasicTransformerBlock(channels, heads, head_width, context_dim=context_dim, dtype=dtype, device=device)
    bench_host.initialise(block, 0)
    block.eval()

    def run(tokens: torch.Tensor, context: torch.Tensor, side: int, options: dict):
        transformer_options = dict(options, original_shape=[tokens.shape[0], 4, side * level, side * level])
        return block(tokens, context=context, transformer_options=transformer_options)

    return run, channels, context_dim, level


def patch_options(**values) -> dict:
    """transformer_options holding this project's hooks, forced on at every size."""
    from tome_core import PatchSettings, Reducer
    from tome_core.adapters.patcher_hooks import PatcherHooks
    from tome_core.schedule import NoiseRange

    settings = PatchSettings.from_values(skip_when_slower=False, **values)
    hooks = PatcherHooks(Reducer(settings, (1, 2, 4)), NoiseRange(0.0, 1.0, float))
    return {"patches": {"attn1_patch": [hooks.attn1_patch], "attn1_output_patch": [hooks.attn1_output_patch]}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sd15", choices=sorted(SHAPES))
    parser.add_argument("--sides", default="32,40,48,56,64,72,80,88,96", help="token grid sides (latent / level)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    bench_host.setup_comfy(device.type)
    run, channels, context_dim, level = block_runner(args.model, device, dtype)
    variants = {"off": {}} | {name: patch_options(max_downsample=level, **v) for name, v in METHODS.items()}
    generator = torch.Generator().manual_seed(0)
    results = {}
    print("| side | tokens | off (ms) | " + " | ".join(METHODS) + " |")
    print("|---|---|---|" + "---|" * len(METHODS))
    for side in (int(s) for s in args.sides.split(",")):
        tokens = torch.randn(args.batch, side * side, channels, generator=generator).to(device, dtype)
        context = torch.randn(args.batch, 77, context_dim, generator=generator).to(device, dtype)
        times = {name: [] for name in variants}
        with torch.inference_mode():
            for options in variants.values():  # warm-up
                run(tokens, context, side, options)
            for _ in range(args.repeats):
                for name, options in variants.items():
                    call = lambda o=options, t=tokens, c=context, s=side: run(t, c, s, o)  # noqa: E731
                    times[name].append(timed(call, device)[0])
        medians = {name: statistics.median(t) for name, t in times.items()}
        results[side] = medians
        ratios = " | ".join(f"{medians['off'] / medians[name]:.2f}x" for name in METHODS)
        print(f"| {side} | {side * side} | {medians['off'] * 1e3:.1f} | {ratios} |", flush=True)
    threads = torch.get_num_threads()
    print(f"({args.model} level {level} block, batch {args.batch}, {dtype}, {device}, {threads} threads)")
    return results


if __name__ == "__main__":
    main()
