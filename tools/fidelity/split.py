"""A schedule sampled in two passes, as Wan 2.2's two experts are in ComfyUI (two KSamplerAdvanced nodes: the
high-noise model from the first step, returning its leftover noise; the low-noise model from the switch step on,
adding none), each expert patched by its own node, on a video reference (``ref-wan``: one model plays both
experts).

    python -m tools.fidelity.split --model ref-wan --steps 30 --switch 15

Rows: unpatched in one pass, unpatched in two, and the node's defaults in one pass and in two; per row the same-seed
SSIM per frame (mean and lowest) against unpatched in the same number of passes and the model calls computed in
full. Results: ``results/split-<model>.json`` and printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tools.common.host import setup_comfy
from tools.common.machine import machine, versions

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.fidelity.split", description=__doc__)
    parser.add_argument("--model", default="ref-wan")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--switch", type=int, default=15, help="the step the second pass starts at")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--first-prompt", type=int, default=0)
    parser.add_argument("--sampler", default="uni_pc")
    parser.add_argument("--scheduler", default="simple")
    parser.add_argument("--cfg", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "results"))
    return parser.parse_args(argv)


def sample(models, positive, negative, shape, args, seed: int = 0) -> torch.Tensor:
    """One pass with ``models[0]`` or, with two, the first up to the switch and the second from there."""
    import nodes as comfy_nodes

    latent = {"samples": torch.zeros(shape)}
    common = (seed, args.steps, args.cfg, args.sampler, args.scheduler, positive, negative)
    with torch.no_grad():
        if len(models) == 1:
            (out,) = comfy_nodes.common_ksampler(models[0], *common, latent)
            return out["samples"]
        (part,) = comfy_nodes.common_ksampler(
            models[0], *common, latent, start_step=0, last_step=args.switch, force_full_denoise=False
        )
        (out,) = comfy_nodes.common_ksampler(
            models[1], *common, part, disable_noise=True, start_step=args.switch, last_step=args.steps,
            force_full_denoise=True,
        )  # fmt: skip
    return out["samples"]


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    setup_comfy("cpu")
    import comfy.model_patcher

    from tools.fidelity.reference import models
    from tools.fidelity.row import load_our_nodes, node_patch
    from tools.fidelity.run import benchmark_prompts, conditioning, image_metrics

    base, encoder = models.load_reference(args.model)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
    frames, _ = models.as_images(args.model)
    size = models.train_size(args.model)
    prompts = benchmark_prompts(args.first_prompt, args.prompts)
    positive = conditioning(args.model, base, encoder, prompts, size)
    negative = conditioning(args.model, base, encoder, models.PromptEncoder.empty(1), size)
    shape = models.latent_shape(args.model, len(prompts), size)
    nodes = load_our_nodes()
    node = nodes["ToMePatch"]
    # The node as a user adds it anew: every input at its default (a saved job that leaves one out means older
    # behaviour).
    default = node_patch(node, **{spec.id: spec.default for spec in node.GET_SCHEMA().inputs[1:]})
    runs = []
    for engine in [m for name, m in sys.modules.items() if name.endswith("tome_core.reuse.hooks")]:
        made = engine.LayerReuse.new_run

        def record(self, *a, _made=made, **kw):
            runs.append(_made(self, *a, **kw))
            return runs[-1]

        engine.LayerReuse.new_run = record
    rows = {
        "unpatched, one pass": [patcher],
        "unpatched, two passes": [patcher, patcher],
        "default, one pass": [default(patcher)],
        "default, two passes (an expert each)": [default(patcher), default(patcher)],
    }
    samples, records = {}, []
    for name, row in rows.items():
        before = len(runs)
        samples[name] = sample(row, positive, negative, shape, args)
        made = runs[before:]
        calls = sum(run.calls for run in made) or None
        full = sum(run.calls - run.reused_calls for run in made) if made else None
        reference = samples["unpatched, two passes" if "two" in name else "unpatched, one pass"]
        metrics = image_metrics(frames(samples[name]), frames(reference))
        records.append({"row": name, "calls": calls, "full_calls": full, **metrics})
        print(f"{name}: SSIM {metrics['ssim']:.3f} (lowest {metrics['ssim_min']:.3f}), full calls {full} of {calls}")
    apart = image_metrics(frames(samples["unpatched, two passes"]), frames(samples["unpatched, one pass"]))
    print(f"unpatched two passes against one: SSIM {apart['ssim']:.3f}")
    result = {"args": vars(args), "machine": machine(cpu), "versions": versions(), "records": records,
              "two_passes_against_one_unpatched": apart}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"split-{args.model}.json").write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
