"""The calibration's margin, measured on set A (docs/calibration.md, 'The margin'): every candidate the search can
try runs on set A's 16 prompts once; then the engine's own search (``Calibration.run``) is replayed with each prompt
and the next one as the two calibration samples (``--samples``), and the kept plan is scored on the 14 other
prompts, at each loss share (the share of what the target lets the picture lose that the samples may lose). The
shipped calibration's second sample is another seed of the same prompt: two prompts differ more, one prompt alone
(``--samples 1``) less.

    python -m tools.fidelity.calibration_margin --models ref-sd1,ref-sd1-v2,ref-sdxl,ref-sdxl-v2 \\
        --runs euler:normal:25,dpmpp_2m:karras:25
    python -m tools.fidelity.calibration_margin --replay results/calibration-margin
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from statistics import mean
from unittest import mock

import torch

from tome_core.calibration import latent_ssim
from tome_core.calibration.candidates import candidates
from tome_core.calibration.search import Calibration
from tome_core.reuse import decide
from tome_core.reuse.plans import FORECAST, Decision
from tools.fidelity.calibration import CFG, cpu_session, sample

SET_A_FIRST = 16
SHARES = (1.0, 0.5, 0.375, 0.25, 0.125)
TARGET = 0.98


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="ref-sd1,ref-sd1-v2,ref-sdxl,ref-sdxl-v2")
    parser.add_argument("--runs", default="euler:normal:25,dpmpp_2m:karras:25", help="sampler:scheduler:steps,...")
    parser.add_argument("--prompts", type=int, default=16, help="set A's prompts")
    parser.add_argument("--scale", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fewest", type=int, default=0, help="leave out candidates computing fewer steps")
    parser.add_argument("--out", default="results/calibration-margin")
    parser.add_argument("--replay", help="a folder of measured cells: print the margins' table only")
    parser.add_argument("--samples", type=int, default=2, help="calibration samples per replayed calibration")
    parser.add_argument("--last", type=int, default=0, help="placements nearest the default with this many last steps")
    return parser.parse_args(argv)


def per_sample_ssim(images: torch.Tensor, reference: torch.Tensor) -> list[float]:
    from torchmetrics.functional.image import structural_similarity_index_measure

    from tools.fidelity.reference.data import to_rgb

    scores = structural_similarity_index_measure(to_rgb(images), to_rgb(reference), data_range=1.0, reduction="none")
    return [float(score) for score in scores]


def measure(name: str, run: tuple[str, str, int], args, out: Path, log) -> None:
    import comfy.model_patcher

    from tools.fidelity.reference import models
    from tools.fidelity.row import load_our_nodes, ours
    from tools.fidelity.run import benchmark_prompts, conditioning

    sampler, scheduler, steps = run
    base, encoder = models.load_reference(name)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
    size = models.train_size(name) * args.scale
    negative = conditioning(name, base, encoder, models.PromptEncoder.empty(1), size)
    prompts = conditioning(name, base, encoder, benchmark_prompts(SET_A_FIRST, args.prompts), size)
    shape = models.latent_shape(name, args.prompts, size)
    plain, plain_calls = sample(patcher, patcher, prompts, negative, shape, run)
    default = decide("forecast v3", sampler, scheduler, 3).schedule.for_run(steps)
    cell = {"model": name, "run": list(run), "cfg": CFG, "default": default.full_steps(steps), "candidates": [],
            "last": args.last}  # fmt: skip
    latents = {"plain": plain}
    node = ours(load_our_nodes(), "lab", method="todo", downsample_factor=1.0, reuse_interval=3).patch(patcher)
    doors = [module for name, module in list(sys.modules.items()) if name.endswith("hosts.comfyui.layer_reuse")]
    for spacing in candidates(shaped(default, args.last), steps):
        schedule = spacing.schedule(spacing.every)
        count = schedule.full_steps(steps)
        if count < args.fewest:
            continue
        decision = Decision(FORECAST, "calibration margin lab", schedule)
        with contextlib.ExitStack() as stack:
            for door in doors:  # the node's own copy of the door, loaded as a custom node package
                stack.enter_context(mock.patch.object(door, "decide", lambda *_, decision=decision, **__: decision))
            images, calls = sample(node, patcher, prompts, negative, shape, run)
        entry = {"spacing": [spacing.full_start, spacing.full_end, spacing.every], "computed": count,
                 "calls": calls / plain_calls, "latent_ssim": latent_ssim(images, plain).tolist(),
                 "ssim": per_sample_ssim(images, plain)}  # fmt: skip
        latents[str(count)] = images
        cell["candidates"].append(entry)
        log(
            f"{name} {run}: {count} of {steps} ({len(doors)} doors, calls {entry['calls']:.2f}): "
            f"mean {mean(entry['ssim']):.3f}"
        )
    stem = f"{name}-{sampler}-{scheduler}-{steps}" + (f"-last{args.last}" if args.last else "")
    (out / f"{stem}.json").write_text(json.dumps(cell) + "\n")
    torch.save(latents, out / f"{stem}.pt")


def shaped(base, last: int):
    """``base``, or with ``last`` > 0 the same plan computing at least its ``last`` last steps: the search's
    candidates are then the placements nearest that shape (``candidates``)."""
    return base if last <= 0 else dataclasses.replace(base, full_end=max(base.full_end, last))


def replay(cell: dict, latents: dict, share: float, samples: int) -> list[dict]:
    """Per calibration prompt: what the engine's search keeps at ``TARGET`` with the loss ``share`` asked of the
    calibration sample, and its picture on the others (every step where no candidate kept it)."""
    steps = cell["run"][2]
    by_count = {entry["computed"]: entry for entry in cell["candidates"]}
    base = shaped(decide("forecast v3", cell["run"][0], cell["run"][1], 3).schedule.for_run(steps), cell.get("last", 0))
    outcomes = []
    prompts = len(latents["plain"])
    for prompt in range(prompts):
        calibration = Calibration(base, steps, TARGET, share=share)
        chosen = [(prompt + offset) % prompts for offset in range(samples)]

        def one(schedule, chosen=chosen):
            if schedule is None:
                return latents["plain"][chosen]
            count = schedule.full_steps(steps)
            if count not in by_count:  # not measured (``--fewest``): counted as missing the target
                return torch.zeros_like(latents["plain"][chosen])
            return latents[str(count)][chosen]

        result = calibration.run(one)
        others = [i for i in range(prompts) if i not in chosen]
        if result.spacing is None:
            outcomes.append({"computed": steps, "calls": 1.0, "mean": 1.0, "lowest": 1.0, "runs": result.runs})
            continue
        entry = by_count[result.computed]
        scores = [entry["ssim"][i] for i in others]
        outcomes.append({"computed": result.computed, "calls": entry["calls"], "mean": sum(scores) / len(scores),
                         "lowest": min(scores), "runs": result.runs})  # fmt: skip
    return outcomes


def table(folder: Path, samples: int) -> str:
    head = "| cell | default | " + " | ".join(f"share {share} (asks {1 - 0.02 * share:.4f})" for share in SHARES)
    lines = [head + " |", "|---" * (len(SHARES) + 2) + "|"]
    for path in sorted(folder.glob("*.json")):
        cell = json.loads(path.read_text())
        latents = torch.load(path.with_suffix(".pt"))
        default = next((e for e in cell["candidates"] if e["computed"] == cell["default"]), None)
        scores = default["ssim"] if default else [0.0]
        fixed = f"{cell['default']}: {mean(scores):.3f} ({min(scores):.3f})"
        variant = f", last {cell['last']}" if cell.get("last") else ""
        row = [f"`{cell['model']}` {' '.join(map(str, cell['run']))}{variant}", fixed]
        for share in SHARES:
            outcomes = replay(cell, latents, share, samples)
            failing = sum(o["mean"] < 0.97 or o["lowest"] < 0.93 for o in outcomes)
            worst_mean = min(o["mean"] for o in outcomes)
            worst_low = min(o["lowest"] for o in outcomes)
            counts = sorted(o["computed"] for o in outcomes)
            row.append(f"{counts[0]}-{counts[len(counts) // 2]}-{counts[-1]}; {worst_mean:.3f} ({worst_low:.3f}); "
                       f"miss {failing}/{len(outcomes)}; calls {mean(o['calls'] for o in outcomes):.2f}")  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.replay:
        print(table(Path(args.replay), args.samples))
        return
    log = cpu_session(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        for sampler, scheduler, steps in (item.split(":") for item in args.runs.split(",")):
            measure(name, (sampler, scheduler, int(steps)), args, out, log)
    print(table(out, args.samples))


if __name__ == "__main__":
    main()
