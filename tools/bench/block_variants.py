"""Two ways to run a whole transformer block on merged tokens, compared on one real block: cost and deviation.

    python -m tools.bench.block_variants [--model sd15|sdxl] [--sides 32,64] [--ratio 0.5] [--repeats 7]

- **per sub-layer** (ToMe for SD with merge_attn, merge_crossattn and merge_mlp on): each sub-layer's input is
  normalised at full size, merged, run, and its output unmerged and added to the full-size residual. Three merges
  and three unmerges, norms and residual additions at full size.
- **merged residual** (this project's scope ``block``): the residual is merged once, the whole block (norms,
  sub-layers, residual additions) runs on the merged tokens, and only its total update is unmerged. One merge,
  one unmerge. Since merge(x + unmerge(a)) == merge(x) + a with one plan, this also equals running every block
  of a level on the merged residual and unmerging once at the end: the two variants differ in norm-then-merge
  versus merge-then-norm, and in where the residual additions happen.

Both use the same plan (ToMe matching on the block input, 2x2 cells, no randomness), made outside the timed
calls; the plan's own time is a separate column. The input is a smooth random field plus a little noise (image
features are spatially redundant; white noise is not), the weights are seeded random. Deviation is the relative
L2 distance of the block output from the unpatched block's: a proxy for what each variant changes, not quality.
The per-sub-layer variant is written out here from ComfyUI's block (comfy/ldm/modules/attention.py 0.3.75,
BasicTransformerBlock.forward); the merged-residual one is the engine's ``BlockMerge.run_block`` around the
block's own forward.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from . import host as bench_host
from .breakeven import SHAPES, cpu_timed
from .measure import relative_l2, timed


def smooth_tokens(batch: int, side: int, channels: int, generator: torch.Generator) -> torch.Tensor:
    """(batch, side*side, channels): a random field at a quarter of the resolution, upsampled, plus 10% noise."""
    coarse = torch.randn(batch, channels, max(1, side // 4), max(1, side // 4), generator=generator)
    field = F.interpolate(coarse, size=(side, side), mode="bilinear", align_corners=False)
    field = field + 0.1 * torch.randn(field.shape, generator=generator)
    return field.flatten(2).transpose(1, 2).contiguous()


def per_sublayer(block, reduction, x, context):
    """ToMe for SD's whole-block merging: merge each sub-layer's input, unmerge its output into the residual."""
    merge, unmerge = reduction.merge, reduction.unmerge
    x = unmerge(block.attn1(merge(block.norm1(x)))) + x
    x = unmerge(block.attn2(merge(block.norm2(x)), context=context)) + x
    return unmerge(block.ff(merge(block.norm3(x)))) + x


def measure_side(block, side: int, args, context_dim: int, generator: torch.Generator) -> dict:
    """Medians (ms) of the unpatched block, both variants and the plan, and both variants' deviations."""
    from tome_core import BlockMerge, matching
    from tome_core.patterns import PatternCache

    x = smooth_tokens(args.batch, side, block.norm1.normalized_shape[0], generator)
    context = torch.randn(args.batch, 77, context_dim, generator=generator)
    pattern = PatternCache().get(side, side, 2, 2, None, x.device)
    r = int(side * side * args.ratio)
    reduction = BlockMerge(matching.make_plan(x, pattern, r))
    calls = {
        "off": lambda: block(x, context=context),
        "per sub-layer": lambda: per_sublayer(block, reduction, x, context),
        "merged residual": lambda: reduction.run_block(x, lambda tokens: block(tokens, context=context)),
        "plan": lambda: matching.make_plan(x, pattern, r),
    }
    times = {name: [] for name in calls}
    with torch.inference_mode():
        outputs = {name: call() for name, call in calls.items()}  # warm-up, and the outputs compared
        for _ in range(args.repeats):
            for name, call in calls.items():
                times[name].append((cpu_timed if args.clock == "cpu" else timed)(call, x.device)[0])
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    dev = {name: relative_l2(outputs[name], outputs["off"]) for name in ("per sub-layer", "merged residual")}
    return {"ms": ms, "deviation": dev}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sd15", choices=sorted(SHAPES))
    parser.add_argument("--sides", default="32,64")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="cpu: this process's CPU time")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bench_host.setup_comfy("cpu")
    from comfy.ldm.modules.attention import BasicTransformerBlock

    channels, heads, head_width, context_dim, _ = SHAPES[args.model]
    block = BasicTransformerBlock(channels, heads, head_width, context_dim=context_dim, dtype=torch.float32)
    bench_host.initialise(block, 0)
    block.eval()
    generator = torch.Generator().manual_seed(0)
    results = {}
    columns = ("side", "tokens", "off (ms)", "per sub-layer", "merged residual", "plan (ms)", "dev. sub", "dev. merged")
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for side in (int(s) for s in args.sides.split(",")):
        result = results[side] = measure_side(block, side, args, context_dim, generator)
        ms, dev = result["ms"], result["deviation"]
        print(
            f"| {side} | {side * side} | {ms['off']:.1f} | {ms['off'] / ms['per sub-layer']:.2f}x | "
            f"{ms['off'] / ms['merged residual']:.2f}x | {ms['plan']:.1f} | {dev['per sub-layer']:.3f} | "
            f"{dev['merged residual']:.3f} |",
            flush=True,
        )
    threads = torch.get_num_threads()
    setup = f"ratio {args.ratio}, batch {args.batch}, fp32, cpu, {threads} threads, {args.clock} time"
    print(f"({args.model} block, {setup})")
    return results


if __name__ == "__main__":
    main()
