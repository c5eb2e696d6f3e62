"""``python -m tools.fidelity.curve_plans``: what each DiT family's default computes, read against the real model's
published step-to-step change.

For every record of the family registry (``tome_core.hosts.shared.dit_families``) and each step count, on the
noise levels ComfyUI samples the family with (its own model sampling and shift, the ``simple`` scheduler, the
family's usual sampler), it prints the plan of reuse every N alone (the default before the curve guard) and the
default's plan (guarded by the real model's curve; Qwen-Image's by its first block's output while it runs, so
its printed plan is the least it computes), as strings of F (a full step) and . (a reusing one), with the
error MagCache's accumulation gives each on the real model's ratios (the largest over the run, against the
threshold published with them) and the share of the work left (a reusing call runs the first block only).
Needs no weights: only ComfyUI's model sampling classes. Writes ``results/curve-plans.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# family record -> (ComfyUI's model config class, model type, sampler, blocks at the real model's depth, the model)
SAMPLING = {
    "Flux": ("Flux", "FLUX", "euler", 57, "Flux.1 dev"),
    "SD3": ("SD3", "FLOW", "euler", 38, "SD3.5 Large"),
    "Qwen-Image": ("QwenImage", "FLUX", "euler", 60, "Qwen-Image"),
    "Lumina 2": ("ZImage", "FLOW", "euler", 30, "Z-Image"),
    "Wan": ("WAN21_T2V", "FLOW", "uni_pc", 40, "Wan 2.1 14B"),
    "HunyuanVideo": ("HunyuanVideo15", "FLOW", "euler", 54, "HunyuanVideo 1.5"),
    "LTX-Video": ("LTXV", "FLUX", "euler", 28, "LTX-Video 2B"),
}
EXTRA = {"Flux.2": ("Flux2", "FLUX", "euler", 56, "Flux.2 dev", "Flux")}  # Flux.2: Flux's record, its own shift


def noise_levels(config_name: str, model_type: str, sampler: str, steps: int) -> list[float]:
    """The run's noise levels as ComfyUI's KSampler makes them (``simple`` scheduler)."""
    import comfy.model_base
    import comfy.samplers
    import comfy.supported_models
    import torch

    config = getattr(comfy.supported_models, config_name)
    sampling = comfy.model_base.model_sampling(config, getattr(comfy.model_base.ModelType, model_type))
    if sampler in comfy.samplers.KSampler.DISCARD_PENULTIMATE_SIGMA_SAMPLERS:
        sigmas = comfy.samplers.calculate_sigmas(sampling, "simple", steps + 1)
        sigmas = torch.cat([sigmas[:-2], sigmas[-1:]])
    else:
        sigmas = comfy.samplers.calculate_sigmas(sampling, "simple", steps)
    return [float(s) for s in sigmas[:steps]]


def plan_string(full, steps: int) -> str:
    return "".join("F" if step in full else "." for step in range(steps))


def work(full, steps: int, depth: int) -> float:
    """Speed-up in blocks run: a full call runs ``depth`` blocks, a reusing one the first block."""
    return steps * depth / (len(full) * depth + (steps - len(full)))


def rows(step_counts) -> list[dict]:
    from tome_core.hosts.shared import dit_families
    from tome_core.reuse import NoiseSpacedSchedule, full_below_noise

    out = []
    entries = [(name, *spec, name) for name, spec in SAMPLING.items()]
    entries += [(label, *spec) for label, spec in EXTRA.items()]
    for label, config, model_type, sampler, depth, model, record_name in entries:
        record = dit_families.family(record_name)
        schedule = record.auto_schedule()
        for steps in step_counts:
            levels = noise_levels(config, model_type, sampler, steps)
            below = full_below_noise(sampler)
            every_n = NoiseSpacedSchedule(schedule.interval(steps)).for_run(steps, levels, below).full
            default = schedule.for_run(steps, levels, below).full
            curve = record.curve
            out.append(
                {
                    "family": label,
                    "model": model,
                    "sampler": sampler,
                    "steps": steps,
                    "interval": schedule.interval(steps),
                    "curve": record.curve_of,
                    "threshold": curve.threshold,
                    "every_n": plan_string(every_n, steps),
                    "every_n_full": len(every_n),
                    "every_n_error": max(curve.errors(every_n, steps)),
                    "every_n_work": work(every_n, steps, depth),
                    "default": plan_string(default, steps),
                    "default_full": len(default),
                    "default_error": max(curve.errors(default, steps)),
                    "default_work": work(default, steps, depth),
                    # Qwen-Image: the default's plan is the least it computes; the guard adds steps at run time.
                    "first_block_guard": schedule.first_block_guard,
                    "line_guard": schedule.line_guard,
                }
            )
    return out


def guarded(row: dict) -> str:
    """What the printed plan leaves out: the steps a first-block guard adds while the run goes."""
    guard, line = row["first_block_guard"], row.get("line_guard")
    said = [] if guard is None else [f"moves more than {guard:g}"]
    said += [] if line is None else [f"lies more than {line:g} off its line"]
    return f" + the steps whose first block's output {' or '.join(said)}" if said else ""


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m tools.fidelity.curve_plans", description=__doc__)
    parser.add_argument("--steps", default="20,28,50", help="comma-separated step counts")
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    from tools.common.host import setup_comfy

    setup_comfy("cpu")
    table = rows([int(s) for s in args.steps.split(",")])
    print("| family | steps | curve (threshold) | every N alone | error | work | default, work | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(
            f"| {r['family']} ({r['model']}, {r['sampler']}) | {r['steps']} | {r['curve']} ({r['threshold']}) | "
            f"`{r['every_n']}` ({r['every_n_full']} full) | {r['every_n_error']:.2f} | {r['every_n_work']:.2f}x | "
            f"`{r['default']}` ({r['default_full']} full){guarded(r)}, {r['default_work']:.2f}x | "
            f"{r['default_error']:.2f} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "curve-plans.json").write_text(json.dumps(table, indent=1))
    return table


if __name__ == "__main__":
    main()
