"""``python -m tools.fidelity.diffusers.run``: the fidelity benchmark's diffusers path for the DiT references,
with diffusers' own step caches side by side with ours.

The Flux reference (``ref-flux-deep`` by default) runs as diffusers' ``FluxTransformer2DModel``
(``diffusers.flux``: converted from the committed ComfyUI weights, checked to give the ComfyUI model's output
within float tolerance) inside a real ``FluxPipeline`` with Flux.1-dev's scheduler configuration (flow matching,
dynamic shift), the same prompts, seed and CFG as the ComfyUI path (true CFG 4 against the empty prompt, guidance
3.5). The video reference (``--model ref-wan``) runs as diffusers' ``WanTransformer3DModel`` (``diffusers.wan``,
diffusers' own converter) inside a real ``WanPipeline`` with Wan 2.1's UniPC scheduler (flow shift 3, as at
480p), CFG as two calls per step; its clips are measured frame by frame and for their motion, as in the ComfyUI
path. Rows:

- unpatched;
- ours: ``tome_core.apply_patch(pipe, downsample_factor=1, reuse_interval=N)`` (reuse alone, the DiT setting);
- diffusers' ``FirstBlockCacheConfig``, ``TaylorSeerCacheConfig`` and ``MagCacheConfig`` at three settings each
  (``pipe.transformer.enable_cache``). MagCache is calibrated on the reference first, as diffusers' docs say
  (one run with ``calibrate=True``; its ratios are in the report).

Each row: same-seed SSIM (and the lowest image's) against unpatched, attributes, FD, wall time, and the blocks'
work: the multiply-adds of every Linear layer inside the transformer blocks, per block, as a share of
unpatched's. "At full depth" converts that work to the real model's blocks (Flux.1: 57, Wan 2.1 1.3B: 30): the
first and the last block as measured, the others as the mean of the reference's middle blocks (every method here
skips the middle blocks alike); speed = 1 / that work. Writes ``results/diffusers-fidelity-<model>.json`` and
prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tools.common.any_sampler import reuse_with_any_sampler
from tools.fidelity.work import at_depth

ROOT = Path(__file__).resolve().parents[3]
# Flux.1-dev's scheduler configuration (its scheduler_config.json), which diffusers users get.
FLUX_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


@dataclass
class Row:
    name: str
    group: str  # "unpatched", "ours", "diffusers"
    setup: object = None  # setup(pipe, args) -> None, before sampling
    settings: dict = field(default_factory=dict)


def _ours(interval: int):
    def setup(pipe, args):
        import tome_core

        tome_core.apply_patch(pipe, downsample_factor=1, reuse_interval=interval)

    return setup


def _cache(make):
    def setup(pipe, args):
        pipe.transformer.enable_cache(make(args))
        forget_hook_registries(pipe.transformer)

    return setup


def forget_hook_registries(transformer) -> None:
    """diffusers 0.39 keeps, from a model's first ``cache_context``, the list of its blocks' hook registries and
    never renews it: a cache enabled after the pipeline has run once gets no context and raises ("No context is
    set"). Dropping the kept list makes the next ``cache_context`` look again, as on a fresh pipeline."""
    for module in transformer.modules():
        registry = module.__dict__.get("_diffusers_hook")
        if registry is not None and hasattr(registry, "_child_registries_cache"):
            registry._child_registries_cache = None


# reuse_interval's rows; on video also 12 and 16, where the peers' largest thresholds go.
INTERVALS = (2, 3, 4, 6, 8)
VIDEO_INTERVALS = INTERVALS + (12, 16)


def rows(mag_ratios, video: bool = False) -> list[Row]:
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    out = [Row("unpatched", "unpatched")]
    for interval in VIDEO_INTERVALS if video else INTERVALS:
        out.append(Row(f"ours reuse every {interval}", "ours", _ours(interval), {"reuse_interval": interval}))
    for threshold in (0.08, 0.12, 0.2):
        make = lambda args, t=threshold: FirstBlockCacheConfig(threshold=t)  # noqa: E731
        out.append(Row(f"First Block Cache {threshold}", "diffusers", _cache(make), {"threshold": threshold}))
    # (5, 1): diffusers' defaults (attention forecast, the MLPs computed); lite: its whole-block variant (blocks
    # skipped, the output projection forecast), published for Wan 2.2.
    for interval, order, lite in ((3, 1, False), (4, 2, False), (5, 1, False), (4, 2, True)):
        make = lambda args, i=interval, o=order, lite=lite: TaylorSeerCacheConfig(  # noqa: E731
            cache_interval=i, max_order=o, taylor_factors_dtype=torch.float32, use_lite_mode=lite
        )
        name = f"TaylorSeer every {interval}, order {order}" + (", lite" if lite else "")
        settings = {"cache_interval": interval, "max_order": order, "use_lite_mode": lite}
        out.append(Row(name, "diffusers", _cache(make), settings))
    if video:
        # diffusers' default attention patterns are matched whole ("^blocks.*attn"), so they miss Wan's ``attn1``
        # and ``attn2`` and the default forecasts nothing there: this row names Wan's attention modules.
        named = [r"^blocks\.\d+\.attn\d$"]
        make = lambda args: TaylorSeerCacheConfig(  # noqa: E731
            cache_interval=4, max_order=2, taylor_factors_dtype=torch.float32, cache_identifiers=named
        )
        settings = {"cache_interval": 4, "max_order": 2, "cache_identifiers": named}
        out.append(Row("TaylorSeer every 4, order 2, Wan's attention named", "diffusers", _cache(make), settings))
    for threshold in (0.03, 0.06, 0.12):  # 0.06: diffusers' default
        make = lambda args, t=threshold: MagCacheConfig(  # noqa: E731
            threshold=t, num_inference_steps=args.steps, mag_ratios=list(mag_ratios)
        )
        out.append(Row(f"MagCache {threshold}", "diffusers", _cache(make), {"threshold": threshold}))
    return out


def teardown(pipe) -> None:
    import tome_core

    tome_core.remove_patch(pipe)
    if getattr(pipe.transformer, "is_cache_enabled", False):
        pipe.transformer.disable_cache()


class BlockWork:
    """Multiply-adds of every Linear layer inside each transformer block, per block, while it is entered."""

    def __init__(self, transformer):
        self.blocks = [
            *getattr(transformer, "transformer_blocks", ()),
            *getattr(transformer, "single_transformer_blocks", ()),
            *getattr(transformer, "blocks", ()),  # Wan
        ]
        self.macs = [0] * len(self.blocks)
        self.handles = []

    def __enter__(self):
        for index, block in enumerate(self.blocks):
            for module in block.modules():
                if isinstance(module, torch.nn.Linear):
                    self.handles.append(module.register_forward_hook(self._counter(index)))
        return self

    def _counter(self, index):
        def count(module, inputs, output):
            tokens = inputs[0].numel() // module.in_features
            self.macs[index] += tokens * module.in_features * module.out_features

        return count

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def make_scheduler(name: str):
    """``flux``: Flux.1-dev's flow-matching Euler; ``unipc``: the multistep UniPC that Wan's pipelines default to
    (flow sigmas, shift 3 as Wan 2.1 at 480p)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    if name == "unipc":
        return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)


def build_pipeline(transformer, scheduler: str = "flux"):
    from diffusers import FluxPipeline, WanPipeline

    if type(transformer).__name__ == "WanTransformer3DModel":
        return WanPipeline(
            tokenizer=None, text_encoder=None, vae=None, scheduler=make_scheduler(scheduler), transformer=transformer
        )
    return FluxPipeline(
        scheduler=make_scheduler(scheduler),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer,
    )


def sample(pipe, text, args, size: int) -> torch.Tensor:
    """Latents (batch, channels, size, size) of the prompts in ``text``, each with its own seed generator; clips
    (batch, channels, frames, size, size) from a Wan pipeline."""
    from tools.fidelity.diffusers import flux as diffusers_flux
    from tools.fidelity.reference import models

    context, pooled, negative, negative_pooled = text
    n = context.shape[0]
    images = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        generator = torch.Generator().manual_seed(seed)
        if type(pipe).__name__ == "WanPipeline":
            with torch.no_grad():
                out = pipe(
                    prompt_embeds=context,
                    negative_prompt_embeds=negative.expand(n, -1, -1),
                    guidance_scale=args.cfg,
                    height=size * 8,
                    width=size * 8,
                    num_frames=(models.CLIP_FRAMES - 1) * 4 + 1,  # the video frames the latent frames stand for
                    num_inference_steps=args.steps,
                    generator=generator,
                    output_type="latent",
                ).frames
            images.append(out)
            continue
        with torch.no_grad():
            out = pipe(
                prompt_embeds=context,
                pooled_prompt_embeds=pooled,
                negative_prompt_embeds=negative.expand(n, -1, -1),
                negative_pooled_prompt_embeds=negative_pooled.expand(n, -1),
                true_cfg_scale=args.cfg,
                guidance_scale=models.FLUX_GUIDANCE,
                height=size * 8,
                width=size * 8,
                num_inference_steps=args.steps,
                generator=generator,
                output_type="latent",
            ).images
        images.append(diffusers_flux.unpack(out, size, size))
    return torch.cat(images)


def calibrate_mag_ratios(pipe, text, args, size: int) -> list[float]:
    """MagCache's ratios for this model and step count: one run with ``calibrate=True`` (diffusers logs them)."""
    from diffusers import MagCacheConfig

    found = []

    class Grab(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if "MagCache Calibration Results:" in message:
                found.append(json.loads(message.split(":", 1)[1].strip()))

    logger = logging.getLogger("diffusers.hooks.mag_cache")
    handler, level = Grab(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    pipe.transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=args.steps))
    forget_hook_registries(pipe.transformer)
    try:
        one = argparse.Namespace(**{**vars(args), "seeds": 1})
        sample(pipe, text, one, size)
    finally:
        pipe.transformer.disable_cache()
        logger.removeHandler(handler)
        logger.setLevel(level)
    if not found:
        raise RuntimeError("MagCache's calibration logged no ratios")
    return found[0]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tools.fidelity.diffusers.run", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default="ref-flux-deep", help="a DiT reference model (ref-flux, ref-flux-deep, ref-wan)"
    )
    parser.add_argument("--scale", type=int, default=1, help="image size as a multiple of the training size")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--cfg", type=float, default=4.0)
    parser.add_argument(
        "--scheduler",
        default=None,
        choices=("flux", "unipc"),
        help="the pipeline's scheduler (default: flux for Flux, unipc for Wan)",
    )
    parser.add_argument(
        "--any-scheduler", action="store_true", help="let reuse run with a scheduler it is not measured with yet"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated words: rows whose name contains one ('=name': exactly that row)"
    )
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--real", type=int, default=1024, help="real scenes for the Frechet distance")
    parser.add_argument("--out", default=str(ROOT / "results"))
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    from tools.common.host import setup_comfy
    from tools.common.machine import machine, versions

    args = parse_args(argv)
    from tools.fidelity.reference import models

    video = models.is_video(args.model)
    args.scheduler = args.scheduler or ("unipc" if video else "flux")
    if args.threads:
        torch.set_num_threads(args.threads)
    setup_comfy("cpu")  # the reference weights load through ComfyUI's Flux class
    from tools.fidelity.diffusers import flux as diffusers_flux
    from tools.fidelity.diffusers import wan as diffusers_wan
    from tools.fidelity.reference import data
    from tools.fidelity.run import PROMPT_SEED, FrechetDistance, attribute_accuracy, image_metrics, motion_metrics

    started = time.time()

    def log(message):
        print(f"[{time.time() - started:6.0f} s] {message}", flush=True)

    conversion = diffusers_wan if video else diffusers_flux
    depth = models.FULL_DEPTH[args.model]
    base, encoder = models.load_reference(args.model)
    transformer, _ = conversion.load_transformer(args.model, base)
    difference = conversion.max_difference(args.model)
    log(
        f"{args.model} as diffusers' {type(transformer).__name__}: largest difference to ComfyUI's model "
        f"{difference:.2e}"
    )
    # A clip's metrics are its frames' (SSIM, attributes, FD), each frame an image, plus its motion.
    frames, per_frame = models.as_images(args.model)
    classifier = models.load_classifier(args.model)
    every = data.all_prompts().as_tensor()
    prompts = every[torch.randperm(len(every), generator=torch.Generator().manual_seed(PROMPT_SEED))[: args.prompts]]
    labels = prompts.repeat(args.seeds, 1).repeat_interleave(per_frame, 0)
    size = models.train_size(args.model) * args.scale
    real, _ = models.samples(args.model, args.real // per_frame, size, torch.Generator().manual_seed(PROMPT_SEED + 1))
    frechet = FrechetDistance(classifier, frames(real))
    with torch.no_grad():
        context, pooled = encoder(prompts)
        negative, negative_pooled = encoder(models.PromptEncoder.empty(1))
    text = (context, pooled, negative, negative_pooled)
    pipe = build_pipeline(transformer, args.scheduler)
    pipe.set_progress_bar_config(disable=True)
    sample(pipe, text, argparse.Namespace(**{**vars(args), "seeds": 1, "steps": 2}), size)  # warm-up
    log("MagCache calibration run ...")
    mag_ratios = calibrate_mag_ratios(pipe, text, args, size)
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    records, baseline = [], None
    for row in rows(mag_ratios, video):
        asked = any(row.name == w[1:] if w.startswith("=") else w in row.name for w in wanted)
        if row.group != "unpatched" and wanted and not asked:
            continue
        log(f"{row.name} ...")
        if row.setup is not None:
            row.setup(pipe, args)
        try:
            scheduler = type(pipe.scheduler).__name__
            allow = reuse_with_any_sampler(scheduler) if args.any_scheduler else contextlib.nullcontext()
            with allow, BlockWork(pipe.transformer) as work:
                wall = time.perf_counter()
                images = sample(pipe, text, args, size)
                wall = time.perf_counter() - wall
        finally:
            teardown(pipe)
        if baseline is None:
            baseline = {"images": images, "wall": wall, "macs": work.macs}
        shares = [m / b for m, b in zip(work.macs, baseline["macs"], strict=True)]
        record = {
            "row": row.name,
            "group": row.group,
            "settings": row.settings,
            **image_metrics(frames(images), frames(baseline["images"])),
            **(motion_metrics(images, baseline["images"]) if video else {}),
            "accuracy": attribute_accuracy(classifier, frames(images), labels),
            "frechet": frechet(frames(images)),
            "wall_s": wall,
            "speedup_wall": baseline["wall"] / wall,
            "block_shares": shares,
            "blocks_work": sum(work.macs) / sum(baseline["macs"]),
            "work_at_full_depth": at_depth(shares, depth),
        }
        records.append(record)
        log(
            f"  ssim {record['ssim']:.3f} ({record['ssim_min']:.3f}), attributes {record['accuracy']['mean']:.3f}, "
            f"FD {record['frechet']:.2f}, blocks' work {record['blocks_work']:.2f}, at {depth} blocks "
            f"{1 / record['work_at_full_depth']:.2f}x, {wall:.0f} s"
        )
    report = {
        "model": args.model,
        "host": "diffusers",
        "machine": machine(torch.device("cpu")),
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "full_depth": depth,
        "comfyui_difference": difference,
        "mag_ratios": mag_ratios,
        "minutes": round((time.time() - started) / 60, 1),
        "records": records,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"diffusers-fidelity-{args.model}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return report


def table(report: dict) -> str:
    video = any("motion_error" in r for r in report["records"])
    depth = report.get("full_depth", 57)  # reports written before Wan's rows: Flux.1's
    lines = [
        f"{report['model']} in diffusers, {report['settings']['steps']} steps, scheduler "
        f"{report['settings']['scheduler']} ({report['date']})",
        f"| row | SSIM (lowest) | attributes | FD | blocks' work | at {depth} blocks |"
        + (" motion error | motion kept |" if video else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if video else ""),
    ]
    for r in report["records"]:
        # Reports written before Wan's rows name the conversion after Flux.1.
        full = r.get("work_at_full_depth", r.get("work_at_flux1_depth"))
        motion = f" {r['motion_error']:.3f} | {r['motion_kept']:.3f} |" if video else ""
        lines.append(
            f"| {r['row']} | {r['ssim']:.3f} ({r['ssim_min']:.3f}) | {r['accuracy']['mean']:.1%} | "
            f"{r['frechet']:.2f} | {r['blocks_work']:.2f} | {1 / full:.2f}x |" + motion
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
