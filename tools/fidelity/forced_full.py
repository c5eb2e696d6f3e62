"""Where a setting of reuse across steps loses a reference's picture: its plan with one reusing step at a time run
in full, each against the unpatched run, on the fidelity benchmark's prompts and sampler.

``python -m tools.fidelity.forced_full --models ref-sd1-v2 --row "ours ToDo 2 + reuse every 3" --prompts 8
--scales 2`` prints, for every step the row's plan reuses, the same-seed SSIM (lowest image) with that step
computed in full and what it brings back against the plan as it is. A step whose SSIM rises most is where the
plan loses most; one whose SSIM falls costs the plan nothing and shortens the line the next steps are predicted
on. The first-block guards are left as the row has them (a guarded call stays guarded). Every option but ``--row``
is the fidelity benchmark's (``python -m tools.fidelity --help``); one model and one scale per run.
"""

from __future__ import annotations

import argparse
import sys

import torch

from tools.common.host import setup_comfy

from . import run as fidelity


def parse_args(argv=None) -> tuple[str, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m tools.fidelity.forced_full", add_help=False)
    parser.add_argument("--row", required=True, help="the fidelity benchmark's row whose plan is taken apart")
    own, rest = parser.parse_known_args(argv)
    args = fidelity.parse_args([*rest, "--variants", "--only", f"={own.row}"])
    if "," in args.models or "," in args.scales:
        raise SystemExit("forced_full: one model (--models) and one scale (--scales) per run")
    return own.row, args


def main(argv=None) -> list[dict]:
    row_name, args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    setup_comfy("cpu")
    import comfy.model_patcher
    import comfy.utils

    from tome_core.reuse import FullSteps
    from tools.fidelity.reference import models

    comfy.utils.PROGRESS_BAR_ENABLED = False
    name = args.models
    base, encoder = models.load_reference(name)
    frames, _ = models.as_images(name)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
    prompts = fidelity.benchmark_prompts(args.first_prompt, args.prompts)
    size = models.train_size(name) * int(args.scales)
    shape = models.latent_shape(name, len(prompts), size)
    positive = fidelity.conditioning(name, base, encoder, prompts, size)
    negative = fidelity.conditioning(name, base, encoder, models.PromptEncoder.empty(1), models.train_size(name))
    rows = fidelity.rows_for(name, base, args)  # the unpatched row, then the one asked for
    if [row.name for row in rows[1:]] != [row_name]:
        raise SystemExit(f"forced_full: no row named {row_name!r} (python -m tools.fidelity --variants lists them)")

    unpatched, row = rows
    plans: list[set] = []  # the plan's full steps, as each run made it
    # ComfyUI loads the node package under its folder's name: every loaded copy of the engine's hooks.
    hooks = [module.LayerReuse for key, module in sys.modules.items() if key.endswith("tome_core.reuse.hooks")]

    def images(forced: frozenset) -> torch.Tensor:
        """The row's samples with the ``forced`` steps in full on top of its plan; records the plan's full steps."""
        originals = [owner.new_run for owner in hooks]

        def forcing(new_run):
            def forced_run(self, steps, *a, **k):
                run = new_run(self, steps, *a, **k)
                plan = {step for step in range(steps) if run.schedule.is_full(step, steps)}
                plans.append(plan)
                run.schedule = FullSteps(steps, frozenset(plan | forced))
                return run

            return forced_run

        for owner, new_run in zip(hooks, originals, strict=True):
            owner.new_run = forcing(new_run)
        try:
            row.prepare(patcher)
            return fidelity.sample_row(row, patcher, positive, negative, shape, args)[0]
        finally:
            for owner, new_run in zip(hooks, originals, strict=True):
                owner.new_run = new_run

    reference = frames(fidelity.sample_row(unpatched, patcher, positive, negative, shape, args)[0])
    plain = fidelity.image_metrics(frames(images(frozenset())), reference)
    if not plans:
        raise SystemExit(f"forced_full: {row_name!r} made no run of reuse across steps on {name}")
    full = sorted(set().union(*plans))
    print(f"{name}, {row_name}, {args.steps} steps: full steps {full}; SSIM {plain['ssim']:.4f}", flush=True)
    print("| computed in full | SSIM (lowest) | brings back |\n|---|---|---|", flush=True)
    results = []
    for step in range(args.steps):
        if step in full:
            continue
        metrics = fidelity.image_metrics(frames(images(frozenset({step}))), reference)
        gain = metrics["ssim"] - plain["ssim"]
        print(f"| step {step} | {metrics['ssim']:.4f} ({metrics['ssim_min']:.4f}) | {gain:+.4f} |", flush=True)
        results.append({"step": step, **metrics, "gain": gain})
    return results


if __name__ == "__main__":
    main()
