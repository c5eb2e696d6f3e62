"""Why fewer computed steps lose the picture (issue #60; a diagnosis, not offered): the whole-step forecast's line
drawn from the unpatched run's own outputs in place of the patched run's.

A skipped step's output is the line through the last two computed steps' outputs over the noise level. Those
outputs are the model's at the patched run's latents, which earlier forecasts have moved. Drawing the line (its
anchor, the last computed output, and its slope) from the unpatched run's outputs at the same steps instead
separates the line's own miss from what the moved latents carry into it. The unpatched run is recorded first, with
the same prompts and seeds; every row then computes its computed steps at its own latents and returns, at a skipped
step, the line with its anchor and its slope each taken from the run itself ("own") or from the recording
("unpatched"), or the line between the recording's computed steps around it ("interpolated", which no causal
forecast has). ``trend`` below 1 smooths the slope over the computed steps (Holt's trend: that share of the newest
slope, the rest of the one before).

    python -m tools.fidelity.line_diagnosis --model ref-sdxl --prompts 16 --first-prompt 16
    python -m tools.fidelity.line_diagnosis --model ref-sdxl --sampler dpmpp_2m --scheduler karras --plans "16 of 25
    (forecast v2's DPM++ 2M),14 of 25 (0 1 3 6 9 11 13 15 17 19 21 22 23 24)"
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from tome_core.schedule import step_of
from tools.fidelity.spectrum import line_through

PLANS = {
    "11 of 25 (0 1 3 6 9 12 18 21 22 23 24)": (0, 1, 3, 6, 9, 12, 18, 21, 22, 23, 24),
    "13 of 25 (the default's)": (0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 22, 23, 24),
    "9 of 25 (0 1 3 6 10 15 21 23 24)": (0, 1, 3, 6, 10, 15, 21, 23, 24),
    # DPM++ 2M on Karras sigmas: "forecast v2"'s 16 of 25 and the best 14 of 25 on `ref-sdxl` (docs/step-reuse.md).
    "16 of 25 (forecast v2's DPM++ 2M)": (0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 22, 23, 24),
    "14 of 25 (0 1 3 6 9 11 13 15 17 19 21 22 23 24)": (0, 1, 3, 6, 9, 11, 13, 15, 17, 19, 21, 22, 23, 24),
}
EULER_PLANS = tuple(PLANS)[:3]


@dataclass(frozen=True)
class Line:
    anchor: str = "own"  # "own", "unpatched" or "interpolated"
    slope: str = "own"  # "own" or "unpatched"
    trend: float = 1.0
    reach: float = 0.75

    def label(self) -> str:
        if self.anchor == "interpolated":
            return "the unpatched run's outputs, interpolated"
        smoothed = f", trend {self.trend}" if self.trend < 1 else ""
        return f"anchor {self.anchor}, slope {self.slope}{smoothed}"


class Recorder:
    """ComfyUI's cond-batch hook that runs the model and keeps every step's outputs by noise level."""

    def __init__(self):
        self.outputs: dict[float, list[torch.Tensor]] = {}

    def __deepcopy__(self, memo):
        return self

    def __call__(self, args: dict) -> list:
        import comfy.samplers

        out = comfy.samplers.calc_cond_batch(
            args["model"], args["conds"], args["input"], args["sigma"], args["model_options"]
        )
        self.outputs[float(args["sigma"].max())] = [o.clone() for o in out]
        return out


class DiagnosedLine:
    """ComfyUI's cond-batch hook of one row: the model at the ``computed`` steps, the diagnosed line at the others."""

    def __init__(self, computed: tuple[int, ...], line: Line, recorded: Recorder):
        self.computed, self.line, self.recorded = computed, line, recorded
        self.kept: list[tuple[float, list[torch.Tensor]]] = []  # the last computed step's noise level and outputs
        self.slope: list[torch.Tensor] | None = None
        self.last_sigma = float("inf")

    def __deepcopy__(self, memo):
        return self

    def _slope(self, sigma: float, outputs: list, before: tuple[float, list]) -> list:
        if self.line.slope == "unpatched":
            outputs, before = self.recorded.outputs[sigma], (before[0], self.recorded.outputs[before[0]])
        newest = [(o - b) / (sigma - before[0]) for o, b in zip(outputs, before[1], strict=True)]
        if self.slope is None:
            return newest
        return [self.line.trend * n + (1 - self.line.trend) * s for n, s in zip(newest, self.slope, strict=True)]

    def __call__(self, args: dict) -> list:
        import comfy.samplers

        sigma = float(args["sigma"].max())
        if sigma > self.last_sigma:  # a new run
            self.kept, self.slope = [], None
        self.last_sigma = sigma
        sigmas = [float(s) for s in args["model_options"]["transformer_options"]["sample_sigmas"]]
        step = step_of(sigmas, sigma)
        if step is None or step in self.computed or len(self.kept) < 2:
            out = comfy.samplers.calc_cond_batch(
                args["model"], args["conds"], args["input"], args["sigma"], args["model_options"]
            )
            if self.kept:
                self.slope = self._slope(sigma, out, self.kept[-1])
            self.kept = (self.kept + [(sigma, [o.clone() for o in out])])[-2:]
            return out
        if self.line.anchor == "interpolated":
            after = sigmas[min(s for s in self.computed if s > step)]
            around = [self.kept[-1][0], after]
            outputs = [self.recorded.outputs[around[0]], self.recorded.outputs[after]]
            return [line_through(around, [o[i] for o in outputs], sigma, 1.0) for i in range(len(outputs[0]))]
        at, anchor = self.kept[-1]
        if self.line.anchor == "unpatched":
            anchor = self.recorded.outputs[at]
        return [a + self.line.reach * (sigma - at) * s for a, s in zip(anchor, self.slope, strict=True)]


def hooked(hook):
    def patch(model):
        clone = model.clone()
        clone.model_options["sampler_calc_cond_batch_function"] = hook
        return clone

    return patch


LINES = (
    Line(),
    Line(slope="unpatched"),
    Line(anchor="unpatched"),
    Line(anchor="unpatched", slope="unpatched"),
    Line(anchor="interpolated"),
    Line(trend=0.5),
)


def main(argv=None) -> None:
    from tools.common.host import setup_comfy

    parser = argparse.ArgumentParser(prog="python -m tools.fidelity.line_diagnosis", description=__doc__)
    parser.add_argument("--model", default="ref-sdxl")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--first-prompt", type=int, default=16)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--cfg", type=float, default=4.0)
    parser.add_argument("--sampler", default="euler", help="ComfyUI's sampler name (euler, dpmpp_2m, ...)")
    parser.add_argument("--scheduler", default="normal", help="ComfyUI's scheduler name (normal, karras, ...)")
    parser.add_argument("--plans", default=",".join(EULER_PLANS), help="which of the plans, comma-separated")
    parser.add_argument(
        "--trends", default="", help="only the run's own line, as shipped and with each of these trends (0.5,0.3)"
    )
    args = parser.parse_args(argv)
    setup_comfy("cpu")
    torch.set_num_threads(1)
    import comfy.model_patcher

    from tools.fidelity import run
    from tools.fidelity.reference import models
    from tools.fidelity.row import FidelityRow

    sampling = argparse.Namespace(
        steps=args.steps,
        cfg=args.cfg,
        sampler=args.sampler,
        scheduler=args.scheduler,
        seeds=1,
        first_seed=args.first_seed,
    )
    base, encoder = models.load_reference(args.model)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
    prompts = run.benchmark_prompts(args.first_prompt, args.prompts)
    size = models.train_size(args.model) * 2
    shape = models.latent_shape(args.model, len(prompts), size)
    positive = run.conditioning(args.model, base, encoder, prompts, size)
    negative = run.conditioning(args.model, base, encoder, models.PromptEncoder.empty(1), size)
    recorded = Recorder()
    unpatched, _, _ = run.sample_row(
        FidelityRow("unpatched", "unpatched", hooked(recorded)), patcher, positive, negative, shape, sampling
    )
    first, last = args.first_prompt, args.first_prompt + args.prompts - 1
    print(f"{args.model}, {args.sampler} {args.scheduler}, prompts {first}-{last}, seed {args.first_seed}")
    lines = [Line()] + [Line(trend=float(t)) for t in args.trends.split(",")] if args.trends else LINES
    for plan in args.plans.split(","):
        for line in lines:
            row = FidelityRow(line.label(), "ours", hooked(DiagnosedLine(PLANS[plan], line, recorded)))
            images, _, _ = run.sample_row(row, patcher, positive, negative, shape, sampling)
            metrics = run.image_metrics(images, unpatched)
            print(f"| {plan} | {line.label()} | {metrics['ssim']:.3f} ({metrics['ssim_min']:.3f}) |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
