"""How fast a DiT reference model's blocks change their output from one sampling step to the next, against the
real model's published curve: does the reference behave like the real model where a step cache's gain is decided?

``python -m tools.fidelity.step_change --models ref-flux,ref-flux-deep --steps 28`` samples 16 prompts with
ComfyUI's KSampler (Euler, CFG 4, as the fidelity benchmark does) and records, at every step, the residual of
the whole block stack: the last single block's output minus the first double block's input (text and image
tokens joined, as Flux joins them). Per step it prints the ratio that MagCache calibrates (the mean over tokens
of the residual's norm divided by the previous step's), beside real Flux.1's ratios as diffusers ships them
(``diffusers.hooks.mag_cache.FLUX_MAG_RATIOS``, 28 steps), and the mean relative change of the residual
(|r_t - r_t-1| / |r_t-1|, what reuse across steps must predict); the conditional and unconditional calls each on
their own, averaged. Writes ``results/step-change.json``.

The probe of real Flux.1-dev's calibration (guidance-distilled: one call per step at CFG 1, the guidance embedding
fed ComfyUI's 3.5; diffusers' MagCache measures the image tokens): ``--cfg 1 --tokens image --seeds 2 --over-prompts
median``. Every run also prints the curve's three gate numbers (``gate``): the least ratio over steps 1-3, the
product over the first 20% of the steps, and the mean |1 - ratio| over the middle (after those, up to 75% of the
steps), beside real Flux.1's at 28 steps, and the residual split in two: the one vector every token and sample
of a call shares (where a DiT's large, time-driven activations sit) and the rest, with the rest's own product over
the first 20%. ``--judge``: the samples' attribute accuracy and Frechet distance to real
scenes (as the fidelity benchmark judges them), so that a model that no longer draws its scenes shows.
``--weights`` measures a fine-tune's weights (``python -m tools.fidelity.reference.train --out-dir``), ``--shift``
samples at another shift than the family's default (``--shift size``: a Flux.1 layout at ComfyUI's ModelSamplingFlux
node's shift for the sampled size, as the curve gate asks). ``--chart`` draws the curves beside the published ones.

The curve gate (docs/dit-measurements.md, "The second generation"): ``--cfg 1 --tokens image --seeds 2 --over-prompts
median --shift size --judge`` at 28 steps (and at 50 for Qwen-Image, beside its published curve).

The video reference (``--models ref-wan --steps 50``, sampled with ``uni_pc`` and the ``simple`` scheduler as Wan
users sample in ComfyUI): the residual of Wan's block stack, beside real Wan 2.1 1.3B's ratios at 50 steps as
ComfyUI-MagCache publishes them (``REAL_WAN_RATIOS``: the conditional call's, every fifth step and the last).
The Qwen-Image reference (``--models ref-qwen --steps 50``): the image stream's residual (Qwen-Image's blocks
carry text and image apart), beside real Qwen-Image's ratios at 50 steps as MagCache publishes them
(``REAL_QWEN_RATIOS``). Flux.2 has no published calibration: ``ref-flux2`` is shown beside Flux.1's at 28 steps.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from tools.fidelity.residuals import ResidualRecorder, per_sample_ratios, ratios

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.fidelity.step_change", description=__doc__)
    parser.add_argument("--models", default="ref-flux", help="DiT reference models (Flux, ref-wan), comma-separated")
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--cfg", type=float, default=4.0)
    parser.add_argument(
        "--scale", type=int, default=1, help="image size as a multiple of the training size (more tokens per step)"
    )
    parser.add_argument("--seeds", type=int, default=1, help="noise seeds 0, 1, ...: every prompt sampled once each")
    parser.add_argument(
        "--tokens",
        choices=("all", "image"),
        default="all",
        help="the residual of the text and image tokens joined, or of the image tokens alone (diffusers' MagCache)",
    )
    parser.add_argument(
        "--over-prompts",
        choices=("mean", "median"),
        default="mean",
        help="each prompt's ratio (the mean over its tokens and seeds), combined over prompts by mean or median",
    )
    parser.add_argument(
        "--weights", default=None, help="folder with <model>.safetensors to measure instead of the committed weights"
    )
    parser.add_argument(
        "--shift",
        default=None,
        help="the schedule's shift (Flux: mu) instead of the model's default: a number, or 'size': the Flux.1 "
        "layouts at ComfyUI's ModelSamplingFlux node's shift for the sampled size (mu 0.5 at 256x256 px, the "
        "references' 32x32 latents; 1.15 at 1024x1024), the others at their default",
    )
    parser.add_argument("--judge", action="store_true", help="attribute accuracy and FD of the samples")
    parser.add_argument(
        "--open-scenes", type=float, default=0.0, help="judge against real scenes opened up so (train.py's option)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's choice)")
    parser.add_argument(
        "--chart", default=None, help="also draw each model's ratios beside the published real curve (a PNG path)"
    )
    parser.add_argument("--out", default=str(ROOT / "results"))
    return parser.parse_args(argv)


def flux_node_shift(latent_size: int, base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """ComfyUI's ModelSamplingFlux node's shift for a square image of ``latent_size`` latent pixels: linear in the
    count of 2x2 tokens, ``base_shift`` at 256 tokens, ``max_shift`` at 4096."""
    tokens = (latent_size // 2) ** 2
    return base_shift + (max_shift - base_shift) * (tokens - 256) / (4096 - 256)


def probe_shift(name: str, shift: str | None, latent_size: int) -> float | None:
    """The shift ``--shift`` asks of ``name`` (None: the model's default)."""
    from tools.fidelity.reference import models

    if shift is None:
        return None
    if shift == "size":
        flux1 = models.is_flux(name) and not models.is_flux2(name)
        return flux_node_shift(latent_size) if flux1 else None
    return float(shift)


def real_flux_ratios() -> list[float] | None:
    """diffusers' FLUX_MAG_RATIOS (real Flux.1, 28 steps), or None where this diffusers lacks them."""
    try:
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS
    except ImportError:
        return None
    return [float(r) for r in FLUX_MAG_RATIOS]


# Real Wan 2.1 T2V 1.3B, 50 steps: MagCache's calibrated ratio of the conditional call at these steps (published
# in ComfyUI-MagCache's table ``wan2.1_t2v_1.3B``, rounded): nearly flat at 0.995 for most of the run, falling
# over the last tenth.
REAL_WAN_RATIOS = {
    1: 1.012, 5: 0.996, 10: 0.995, 15: 0.995, 20: 0.994, 25: 0.993, 30: 0.990, 35: 0.985, 40: 0.974, 45: 0.940,
    49: 0.818,
}  # fmt: skip


# Real Qwen-Image, 50 steps: MagCache's calibrated ratio of the conditional call at these steps (published with
# MagCache's Qwen-Image example, ``mag_ratios``, rounded): the residual grows fast over the first steps and falls
# fast over the last ones.
REAL_QWEN_RATIOS = {
    1: 1.641, 2: 1.453, 3: 1.188, 5: 1.055, 10: 1.117, 15: 1.078, 20: 1.031, 25: 1.039, 30: 1.023, 35: 0.992,
    40: 0.992, 45: 0.805, 47: 0.75, 48: 0.609, 49: 0.551,
}  # fmt: skip
# The published 50-step curve each reference is compared with at 50 steps (Wan's for any other).
REAL_CURVES = {
    "ref-wan": ("Wan 2.1 1.3B", REAL_WAN_RATIOS),
    "ref-qwen": ("Qwen-Image", REAL_QWEN_RATIOS),
    "ref-qwen-v2": ("Qwen-Image", REAL_QWEN_RATIOS),
}


def over_prompts(per_sample: torch.Tensor, seeds: int, how: str) -> list[float]:
    """(steps, seeds * prompts, seed-major) -> one ratio per step: each prompt's mean over seeds, then the mean or
    median over prompts."""
    per_prompt = per_sample.unflatten(1, (seeds, -1)).mean(dim=1)
    combined = per_prompt.median(dim=1).values if how == "median" else per_prompt.mean(dim=1)
    return [float(r) for r in combined]


def gate(norm_ratio: list[float]) -> dict:
    """The curve's three numbers that decide a step cache's defaults on it: the least ratio over steps 1-3 (real
    Flux.1-dev's residual grows there), the product of the ratios over the first 20% of the steps (steps 1-5 of
    28) and the mean |1 - ratio| over the middle (up to 75% of the steps: 6-21 of 28)."""
    steps = len(norm_ratio)
    early, middle_end = int(0.2 * steps), int(0.75 * steps)
    return {
        "least_1_3": min(norm_ratio[1:4]),
        "product_first_20pct": math.prod(norm_ratio[1 : early + 1]),
        "middle_deviation": sum(abs(1 - r) for r in norm_ratio[early + 1 : middle_end + 1]) / (middle_end - early),
    }


def chart(result: dict, path: Path) -> None:
    """Each model's ratio per step (as a share of the run, so 28 and 50 steps share an axis) beside the published
    real curves at the same step count: Flux.1's at 28 steps, Qwen-Image's and Wan's at 50."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["steps"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    published = []
    if result.get("real_flux_norm_ratio") and steps == 28:
        published.append(("real Flux.1-dev (published)", dict(enumerate(result["real_flux_norm_ratio"]))))
    if steps == 50:
        published += [
            ("real Qwen-Image (published)", REAL_QWEN_RATIOS),
            ("real Wan 2.1 1.3B (published)", REAL_WAN_RATIOS),
        ]
    styles = iter(("k--", "k:", "k-."))
    for label, curve in published:
        points = sorted(curve.items())
        ax.plot([s for s, _ in points], [r for _, r in points], next(styles), label=label)
    for name, record in result["models"].items():
        ax.plot(range(steps), record["norm_ratio"], marker=".", label=name)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel(f"step of {steps}")
    ax.set_ylabel("||residual_t|| / ||residual_t-1|| (MagCache's ratio)")
    probe = result["probe"]
    ax.set_title(f"CFG {probe['cfg']}, {probe['prompts']} prompts x {probe['seeds']} seeds, {probe['over_prompts']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def judge(name: str, images: torch.Tensor, labels: torch.Tensor, open_scenes: float = 0.0) -> dict:
    """Attribute accuracy and Frechet distance to 1024 real scenes (``open_scenes``: opened up so, as the model was
    trained), as the fidelity benchmark judges samples."""
    from tools.fidelity.reference import data, models
    from tools.fidelity.run import PROMPT_SEED, FrechetDistance, attribute_accuracy

    classifier = models.load_classifier(name)
    frames, per_frame = models.as_images(name)
    real, real_prompts = models.samples(
        name, 1024 // per_frame, models.train_size(name), torch.Generator().manual_seed(PROMPT_SEED + 1)
    )
    real = data.open_up(real, open_scenes, torch.Generator().manual_seed(PROMPT_SEED + 3))
    accuracy = attribute_accuracy(classifier, frames(images), labels.repeat_interleave(per_frame, 0))
    on_real = attribute_accuracy(classifier, frames(real), real_prompts.as_tensor().repeat_interleave(per_frame, 0))
    return {
        "real_accuracy": on_real["mean"],  # the classifier's on the real scenes: the most the samples can score
        "accuracy": accuracy["mean"],
        "all_four": accuracy["all_four"],
        "frechet": FrechetDistance(classifier, frames(real))(frames(images)),
    }


def measure(name: str, args) -> dict:
    import comfy.model_patcher
    import nodes as comfy_nodes

    from tools.fidelity.reference import data, models
    from tools.fidelity.run import PROMPT_SEED, conditioning

    if not models.is_dit(name):
        raise ValueError(f"{name} is not a DiT reference model")
    weights = Path(args.weights) / f"{name}.safetensors" if args.weights else None
    base, encoder = models.load_reference(name, weights)
    shift = probe_shift(name, args.shift, models.train_size(name) * args.scale)
    if shift is not None:
        base.model_sampling.set_parameters(shift=shift)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
    every = data.all_prompts().as_tensor()
    prompts = every[torch.randperm(len(every), generator=torch.Generator().manual_seed(PROMPT_SEED))[: args.prompts]]
    size = models.train_size(name) * args.scale
    positive = conditioning(name, base, encoder, prompts, size)
    negative = conditioning(name, base, encoder, models.PromptEncoder.empty(1), size)
    sampler, scheduler = ("uni_pc", "simple") if models.is_video(name) else ("euler", "normal")
    streams, per_sample, images = [], [], []
    for seed in range(args.seeds):
        recorder = ResidualRecorder(base.diffusion_model, image_tokens=args.tokens == "image")
        try:
            latent = {"samples": torch.zeros(models.latent_shape(name, len(prompts), size))}
            with torch.no_grad():
                (out,) = comfy_nodes.common_ksampler(
                    patcher, seed, args.steps, args.cfg, sampler, scheduler, positive, negative, latent
                )
        finally:
            recorder.remove()
        images.append(base.process_latent_in(out["samples"]))  # as the fidelity benchmark: the scenes
        calls = len(recorder.residuals)
        if calls % args.steps:
            raise RuntimeError(f"expected the same model calls at every step, got {calls} for {args.steps} steps")
        # Cond and uncond in one call or in two (the empty prompt has another token count): each on its own.
        per_step = calls // args.steps
        streams += [ratios(recorder.residuals[k::per_step]) for k in range(per_step)]
        per_sample.append(torch.cat([per_sample_ratios(recorder.residuals[k::per_step]) for k in range(per_step)], 1))
    record = {  # the relative change and the split: each stream's and seed's, averaged
        key: [None if v[0] is None else sum(v) / len(v) for v in zip(*(s[key] for s in streams), strict=True)]
        for key in ("norm_ratio", "relative_change", "shared_norm", "shared_share", "rest_norm", "rest_ratio")
    }
    record["norm_ratio"] = over_prompts(torch.cat(per_sample, 1), args.seeds, args.over_prompts)
    record["gate"] = gate(record["norm_ratio"])
    record["rest_gate"] = gate(record["rest_ratio"])
    if args.judge:
        record.update(judge(name, torch.cat(images), prompts.repeat(args.seeds, 1), args.open_scenes))
    return record


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tools.common.host import setup_comfy

    setup_comfy("cpu")
    result = {"steps": args.steps, "scale": args.scale, "real_flux_norm_ratio": real_flux_ratios(), "models": {}}
    probe = ("cfg", "seeds", "prompts", "tokens", "over_prompts", "shift")
    result["probe"] = {key: getattr(args, key) for key in probe}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        result["models"][name] = measure(name, args)
    if args.steps == 50:
        result["real_wan_norm_ratio"] = REAL_WAN_RATIOS
        result["real_qwen_norm_ratio"] = REAL_QWEN_RATIOS
        for name, record in result["models"].items():
            real_name, curve = REAL_CURVES.get(name, REAL_CURVES["ref-wan"])
            pairs = [(record["norm_ratio"][step], real) for step, real in curve.items()]
            record["mean_gap_to_real"] = sum(abs(a - b) for a, b in pairs) / len(pairs)
            record["real_curve"] = real_name
            gap = record["mean_gap_to_real"]
            print(f"{name}: mean |ratio - real {real_name}'s| at {len(pairs)} steps = {gap:.3f}")
            cells = [f"{step}: {record['norm_ratio'][step]:.3f} ({real})" for step, real in curve.items()]
            print("  at those steps (real in brackets): " + ", ".join(cells))
    real = result["real_flux_norm_ratio"] if args.steps == 28 else None
    names = list(result["models"])
    header = " | ".join(f"{n} ratio | {n} change" for n in names)
    print(f"| step | {header}" + (" | real Flux.1 ratio |" if real else " |"))
    print("|---" * (1 + 2 * len(names) + bool(real)) + "|")
    for step in range(args.steps):
        cells = []
        for name in names:
            record = result["models"][name]
            change = record["relative_change"][step]
            cells += [f"{record['norm_ratio'][step]:.3f}", "-" if change is None else f"{change:.3f}"]
        if real:
            cells.append(f"{real[step]:.3f}")
        print(f"| {step} | " + " | ".join(cells) + " |")
    if real:
        for name in names:
            ours = result["models"][name]["norm_ratio"]
            gap = sum(abs(a - b) for a, b in zip(ours, real, strict=True)) / len(real)
            result["models"][name]["mean_gap_to_real"] = gap
            print(f"{name}: mean |ratio - real Flux.1's| = {gap:.3f}")
    rows = [(name, record["gate"]) for name, record in result["models"].items()]
    if real:
        rows.append(("real Flux.1", gate(real)))
    for name, numbers in rows:
        record = result["models"].get(name, {})
        judged = f", accuracy {record['accuracy']:.3f}, FD {record['frechet']:.2f}" if "frechet" in record else ""
        print(
            f"{name}: least ratio over steps 1-3 {numbers['least_1_3']:.3f}, product over the first 20% "
            f"{numbers['product_first_20pct']:.3f}, middle's mean |1 - ratio| {numbers['middle_deviation']:.4f}"
            + judged
        )
    for name, record in result["models"].items():
        shared, rest = record["shared_norm"], record["rest_norm"]
        peak = max(range(len(shared)), key=shared.__getitem__)
        print(
            f"{name}: the part every token shares {shared[0]:.2f} at step 0 ({record['shared_share'][0]:.0%} of the "
            f"residual's square norm), {shared[peak]:.2f} at its peak (step {peak}); the rest {rest[0]:.2f} at step "
            f"0, {rest[peak]:.2f} at step {peak}; the rest's product over the first 20% "
            f"{record['rest_gate']['product_first_20pct']:.3f}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step-change.json").write_text(json.dumps(result, indent=1))
    if args.chart:
        chart(result, Path(args.chart))
    return result


if __name__ == "__main__":
    main()
