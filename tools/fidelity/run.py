"""The fidelity benchmark: do I get the same picture, sooner? Measured on the trained reference models.

``bash tools/bench.sh --fidelity`` (= ``python -m tools.fidelity``) samples a fixed set of prompts x seeds with
each row (unpatched; this project's methods and settings through the ComfyUI node; ComfyUI's built-in
TomePatchModel; tomesd 0.1.3 and a ToDo reference-style patch on the same weights) with ComfyUI's own KSampler
(Euler, CFG), at the models' training size and at twice that size, and reports for every row:
- same-seed similarity of each final image to the unpatched one: SSIM and PSNR (torchmetrics), on the colour
  channels mapped to [0, 1];
- the attribute accuracy of the reference classifier (kind, colour, position, background), mean over the
  four and all four right at once;
- the Frechet distance between the samples and real scenes in the classifier's feature space (torchmetrics'
  FrechetInceptionDistance with the classifier as feature extractor);
- the speed of the same sampling run: wall time and process CPU time, and the speed-up over unpatched.
Output: ``results/fidelity-<model>.md`` and ``.json``, a speed-versus-fidelity chart
``results/fidelity-<model>.png``, and an image grid (same prompts and seeds side by side per row)
``results/fidelity-grid-<model>.png``; ``--docs`` copies grid and chart into ``docs/``.

On the Flux reference model (``ref-flux``) the rows are unpatched, ours through the same node (ToDo 2 and 3, and
ToDo 2 in the first 60% of the steps only), and ToMe through attention at 0.5 and 0.25 (``dit_tome``: measured,
not offered by the nodes on DiTs), reuse across steps (every N and the default), and the step caches: ComfyUI's
EasyCache and LazyCache, and (``dit_peers``) First Block Cache, a TaylorSeer-style forecast and MagCache calibrated
on the reference; the UNet-only rows (tomesd, TomePatchModel, the ToDo reference patch, block scope) do not apply.

Our rows force the reduction at every size (``skip_when_slower`` off): the reference models' token grids are
smaller than the sizes where the shipped defaults switch the reduction on, and the question here is what the
reduction does to the picture. Speed at real sizes is the speed benchmark's job (``bash tools/bench.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tome_core.settings import SPECS
from tools.common.any_sampler import reuse_with_any_sampler
from tools.common.host import setup_comfy
from tools.common.machine import machine, versions
from tools.fidelity.dit_rows import dit_rows
from tools.fidelity.peer_rows import comfy_builtin, spectrum_rows, step_cache_rows, todo_reference, tomesd_row
from tools.fidelity.row import ROOT, FidelityRow, load_our_nodes, ours
from tools.fidelity.unet_rows import layer_reuse_rows
from tools.fidelity.work import count_work

PROMPT_SEED = 1234


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.fidelity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        default="ref-sd1,ref-sdxl,ref-flux",
        help="reference models (ref-sd1, ref-sdxl, ref-flux, ref-flux-deep, ref-flux2, ref-wan, ref-qwen; the second "
        "generation ref-qwen-v2, ref-flux-v2, ref-sdxl-v2, ref-sd1-v2)",
    )
    parser.add_argument("--scales", default="1,2", help="image sizes as multiples of the training size")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per seed (one sampling batch)")
    parser.add_argument("--seeds", type=int, default=4, help="seeds: images = prompts x seeds")
    parser.add_argument(
        "--first-seed", type=int, default=0, help="the first seed (another set of seeds: unpatched's own spread)"
    )
    parser.add_argument(
        "--first-prompt",
        type=int,
        default=0,
        help="where the prompts start in the fixed shuffled list (another set: 16 for the second 16, where settings "
        "are chosen before they are reported on the first)",
    )
    parser.add_argument("--steps", type=int, default=12, help="sampling steps")
    parser.add_argument("--sampler", default="euler", help="ComfyUI sampler name (euler, euler_ancestral, heun, ...)")
    parser.add_argument("--scheduler", default="normal", help="ComfyUI scheduler name (normal, karras, ...)")
    parser.add_argument("--cfg", type=float, default=4.0)
    parser.add_argument(
        "--any-sampler", action="store_true", help="let reuse run with a sampler it is not measured with yet"
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated words: keep rows whose name contains one ('=name': exactly that row)",
    )
    parser.add_argument("--broken", action="store_true", help="add a deliberately broken patch (plumbing check)")
    parser.add_argument(
        "--variants",
        action="store_true",
        help="add rows beside the defaults: the plan of jobs saved before reuse_plan and EasyCache 0.5 / 0.6 (UNets), "
        "start_percent and the slope in 4 bits (DiTs)",
    )
    parser.add_argument("--real", type=int, default=1024, help="real scenes for the Frechet distance")
    parser.add_argument("--grid", type=int, default=8, help="images per row in the grid")
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument("--docs", action="store_true", help="copy grid and chart to docs/")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's choice)")
    return parser.parse_args(argv)


def broken_patch(model):
    """A deliberately wrong merge: self-attention's output shifted by one token at every level."""
    clone = model.clone()
    clone.set_model_attn1_output_patch(lambda out, extra_options: out.roll(1, dims=1))
    return clone


def _shifted_attention(func, *args, **kwargs):
    return func(*args, **kwargs).roll(1, dims=1)


def broken_dit_patch(model):
    """The same wrong merge on a DiT: every attention's output shifted by one token (text and image tokens),
    through ComfyUI's ``optimized_attention_override`` (DiT blocks have no attn1 output patch)."""
    clone = model.clone()
    clone.model_options["transformer_options"]["optimized_attention_override"] = _shifted_attention
    return clone


def keep_asked_rows(rows: list[FidelityRow], args, broken=broken_patch) -> list[FidelityRow]:
    if args.broken:
        rows.append(FidelityRow("broken (shifted tokens)", "broken", broken))
    if args.only:
        words = [w.strip() for w in args.only.split(",") if w.strip()]
        # "=name" keeps the row of exactly that name, any other word every row whose name contains it
        rows = [
            r
            for r in rows
            if r.group == "unpatched" or any(r.name == w[1:] if w.startswith("=") else w in r.name for w in words)
        ]
    return rows


def rows_for(name: str, base_model, args) -> list[FidelityRow]:
    from tools.fidelity.reference import models

    nodes = load_our_nodes()
    if models.is_dit(name):  # Flux, Flux.2, Wan, Qwen-Image: the same rows (the family comes from the model)
        ratios_of = magcache_calibration(name, args)
        rows = dit_rows(nodes, args.variants, models.is_video(name), args, ratios_of)
        return keep_asked_rows(rows, args, broken_dit_patch)
    family = models.FAMILIES[name]
    finest = 1 if family.depth[0] else 2  # the finest level that has attention
    rows = [
        FidelityRow("unpatched", "unpatched", lambda model: model),
        ours(nodes, "ours ToMe 0.5", method="tome", ratio=0.5),
        ours(nodes, "ours ToDo 2", method="todo", downsample_factor=2.0),
    ]
    if "scope" in SPECS:  # the whole transformer block on merged tokens, at the two finest attention levels
        for ratio in (0.5, 0.3):
            rows.append(
                ours(nodes, f"ours block {ratio}", method="tome", ratio=ratio, scope="block", max_downsample=finest * 2)
            )
    if "reuse_interval" in SPECS:  # reuse across steps, layer by layer (tome_core/reuse/)
        rows += layer_reuse_rows(nodes, args.variants)
    rows += [comfy_builtin(0.5), todo_reference(2.0, finest)]
    rows += step_cache_rows()
    # The default's work: 12 of 25 (SDXL), 13 (forecast), 15 (SD1.x); 14 (DPM++ 2M's 1.7x target); 16 and 19 (DPM++
    # 2M on Karras sigmas under the forecasts of today and before).
    rows += spectrum_rows(args.steps, (0.48, 0.52, 0.56, 0.6, 0.64, 0.76))
    if args.variants:  # EasyCache at the work of the default's plan (12 full steps of 25: 0.48 of the calls)
        rows += [row for row in step_cache_rows((0.5, 0.6)) if row.name.startswith("EasyCache")]
    state_dict = base_model.diffusion_model.state_dict()
    for everywhere in (False, True):
        row = tomesd_row(family, state_dict, 0.5, finest, everywhere)
        if row is not None:
            rows.append(row)
    return keep_asked_rows(rows, args)


def magcache_calibration(name: str, args, prompts: int = 4) -> Callable:
    """``ratios_of(model)``: MagCache's calibration of the reference (the step-to-step ratio of its block stack's
    residual on the image tokens, as ``step_change`` measures it) from one unpatched run at the benchmark's steps,
    CFG, sampler and scheduler, on ``prompts`` prompts the benchmark does not report; once per model."""
    calibrated: dict = {}

    def ratios_of(model) -> list[float]:
        key = id(model.model)
        if key not in calibrated:
            calibrated[key] = calibrate_magcache(name, model, args, prompts)
        return calibrated[key]

    return ratios_of


def benchmark_prompts(first: int, count: int) -> torch.Tensor:
    """The benchmark's prompts: every prompt in one fixed shuffled order, ``count`` of them from ``first`` on
    (``--first-prompt`` 0 and 16: the two prompt sets)."""
    from tools.fidelity.reference import data

    every = data.all_prompts().as_tensor()
    order = torch.randperm(len(every), generator=torch.Generator().manual_seed(PROMPT_SEED))
    return every[order[first:][:count]]


def calibrate_magcache(name: str, model, args, prompts: int) -> list[float]:
    import nodes as comfy_nodes

    from tools.fidelity.reference import models
    from tools.fidelity.residuals import ResidualRecorder, ratios

    _, encoder = models.load_reference(name)
    after = args.first_prompt + args.prompts  # after the reported ones: none of them
    chosen = benchmark_prompts(after, prompts)
    size = models.train_size(name)
    positive = conditioning(name, model.model, encoder, chosen, size)
    negative = conditioning(name, model.model, encoder, models.PromptEncoder.empty(1), size)
    latent = {"samples": torch.zeros(models.latent_shape(name, prompts, size))}
    recorder = ResidualRecorder(model.model.diffusion_model, image_tokens=True)
    try:
        with torch.no_grad():
            comfy_nodes.common_ksampler(
                model, 0, args.steps, args.cfg, args.sampler, args.scheduler, positive, negative, latent
            )
    finally:
        recorder.remove()
    per_step = len(recorder.residuals) // args.steps  # cond and uncond in one call or two
    streams = [ratios(recorder.residuals[k::per_step])["norm_ratio"] for k in range(per_step)]
    return [sum(values) / len(values) for values in zip(*streams, strict=True)]


def conditioning(name: str, base_model, encoder, prompt_indices: torch.Tensor, size: int) -> list:
    """ComfyUI CONDITIONING for a batch of prompts (SDXL: pooled vector and size conditioning too; Flux: pooled
    vector and the guidance value it was trained with; Wan and Qwen-Image: the text tokens alone)."""
    from tools.fidelity.reference import models

    with torch.no_grad():
        context, pooled = encoder(prompt_indices)
    extra = {}
    if models.is_video(name) or models.is_qwen(name):
        pass
    elif models.is_flux(name):
        extra = {"pooled_output": pooled, "guidance": models.FLUX_GUIDANCE}
    elif models.FAMILIES[name].adm_channels:
        pixels = models.TRAIN_SIZE * 8  # the size conditioning the model was trained with
        extra = {"pooled_output": pooled, "width": pixels, "height": pixels, "crop_w": 0, "crop_h": 0}
        extra.update(target_width=pixels, target_height=pixels)
    return [[context, extra]]


def sample_row(row: FidelityRow, patcher, positive, negative, shape: tuple, args):
    """All samples of one row: (seeds * prompts, *shape[1:]) in data space (images or clips), with wall and CPU
    seconds; ``shape`` is one seed's empty latent."""
    import nodes as comfy_nodes

    model = row.patch(patcher)
    row.enter()
    # Measuring reuse with a sampler no plan knows yet (``--any-sampler``).
    allow = reuse_with_any_sampler(args.sampler) if getattr(args, "any_sampler", False) else contextlib.nullcontext()
    try:
        with allow:
            wall, cpu = time.perf_counter(), time.process_time()
            images = []
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                latent = {"samples": torch.zeros(shape)}
                # Without gradients, as ComfyUI's executor runs a prompt: most samplers say so themselves, uni_pc does
                # not (it would keep every step's graph).
                with torch.no_grad():
                    (out,) = comfy_nodes.common_ksampler(
                        model, seed, args.steps, args.cfg, args.sampler, args.scheduler, positive, negative, latent
                    )
                images.append(patcher.model.process_latent_in(out["samples"]))  # undo the latent scale factor
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        row.leave()
    return torch.cat(images), wall, cpu


def image_metrics(images: torch.Tensor, reference: torch.Tensor) -> dict:
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    from tools.fidelity.reference.data import to_rgb

    a, b = to_rgb(images), to_rgb(reference)
    ssim = structural_similarity_index_measure(a, b, data_range=1.0, reduction="none")
    psnr = peak_signal_noise_ratio(a, b, data_range=1.0, reduction="none", dim=(1, 2, 3))
    identical = bool(torch.equal(images, reference))
    return {
        "ssim": float(ssim.mean()),
        "ssim_min": float(ssim.min()),
        "psnr": None if identical else float(psnr[torch.isfinite(psnr)].mean()),
        "identical_to_unpatched": identical,
    }


def attribute_accuracy(classifier, images: torch.Tensor, prompts: torch.Tensor) -> dict:
    from tools.fidelity.reference.data import ATTRIBUTES

    with torch.no_grad():
        predicted = torch.stack([logits.argmax(1) for logits in classifier(images)], dim=1)
    correct = predicted == prompts
    result = {name: float(correct[:, i].float().mean()) for i, name in enumerate(ATTRIBUTES)}
    result["mean"] = float(correct.float().mean())
    result["all_four"] = float(correct.all(dim=1).float().mean())
    return result


def motion_metrics(clips: torch.Tensor, reference: torch.Tensor) -> dict:
    """How a row's clips move against unpatched's, from the frame-to-frame differences of the colour channels
    (``d = frame t+1 - frame t``): ``motion_error`` is mean |d_row - d_unpatched| / mean |d_unpatched| (0: the same
    motion), ``motion_kept`` mean |d_row| / mean |d_unpatched| (1: as much motion; below 1 motion lost or
    blurred, above 1 flicker)."""
    from tools.fidelity.reference.data import frames_of, to_rgb

    def steps(x):
        frames = to_rgb(frames_of(x)).unflatten(0, x.shape[:1] + x.shape[2:3])  # (N, T, 3, H, W)
        return frames[:, 1:] - frames[:, :-1]

    moved, moved_reference = steps(clips), steps(reference)
    scale = float(moved_reference.abs().mean())
    return {
        "motion_error": float((moved - moved_reference).abs().mean()) / scale,
        "motion_kept": float(moved.abs().mean()) / scale,
    }


class FrechetDistance:
    """Frechet distance to real scenes in the classifier's feature space (torchmetrics keeps the real side)."""

    def __init__(self, classifier, real: torch.Tensor):
        from torchmetrics.image.fid import FrechetInceptionDistance

        from tools.fidelity.reference.models import ClassifierFeatures

        self.metric = FrechetInceptionDistance(
            feature=ClassifierFeatures(classifier), normalize=True, reset_real_features=False
        )
        with torch.no_grad():
            self.metric.update(real, real=True)

    def __call__(self, images: torch.Tensor) -> float:
        self.metric.reset()
        with torch.no_grad():
            self.metric.update(images, real=False)
            return float(self.metric.compute())


def evaluate_model(name: str, args, log) -> dict:
    import comfy.model_patcher

    from tools.fidelity.reference import data, models

    base, encoder = models.load_reference(name)
    classifier = models.load_classifier(name)
    video = models.is_video(name)
    # A clip's metrics are its frames' (SSIM, attributes, FD), each frame an image, plus its motion.
    frames, per_frame = models.as_images(name)
    train_size = models.train_size(name)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
    prompts = benchmark_prompts(args.first_prompt, args.prompts)
    labels = prompts.repeat(args.seeds, 1)  # image i of seed s is prompt i
    real, _ = models.samples(name, args.real // per_frame, train_size, torch.Generator().manual_seed(PROMPT_SEED + 1))
    fresh, fresh_prompts = models.samples(name, len(labels), train_size, torch.Generator().manual_seed(PROMPT_SEED + 2))
    frechet = FrechetDistance(classifier, frames(real))
    reference_rows = {
        "real scenes": {
            "frechet": frechet(frames(fresh)),
            "accuracy": attribute_accuracy(
                classifier, frames(fresh), fresh_prompts.as_tensor().repeat_interleave(per_frame, 0)
            ),
        }
    }
    negative = conditioning(name, base, encoder, models.PromptEncoder.empty(1), train_size)
    rows = rows_for(name, base, args)
    records, grids = [], {}
    for scale in [int(s) for s in args.scales.split(",")]:
        size = train_size * scale
        shape = models.latent_shape(name, len(prompts), size)
        positive = conditioning(name, base, encoder, prompts, size)
        # Warm-up (untimed): the first sampling call at a size pays for allocations and caches.
        warm = argparse.Namespace(**{**vars(args), "seeds": 1, "steps": 1})
        sample_row(rows[0], patcher, positive, negative, shape, warm)
        baseline = None
        for row in rows:
            log(f"{name} {size}x{size}: {row.name} ...")
            row.prepare(patcher)
            with count_work(row, patcher) as work:
                images, wall, cpu_s = sample_row(row, patcher, positive, negative, shape, args)
            if baseline is None:
                baseline = {"images": images, "wall": wall, "cpu": cpu_s, "work": work}
            record = {
                "model": name,
                "size": size,
                "row": row.name,
                "group": row.group,
                "settings": row.settings,
                "wall_s": wall,
                "cpu_s": cpu_s,
                "speedup": baseline["wall"] / wall,
                "speedup_cpu": baseline["cpu"] / cpu_s,
                **image_metrics(frames(images), frames(baseline["images"])),
                **(motion_metrics(images, baseline["images"]) if video else {}),
                "accuracy": attribute_accuracy(classifier, frames(images), labels.repeat_interleave(per_frame, 0)),
                "frechet": frechet(frames(images)),
                "work": work.summary(baseline["work"]),
            }
            records.append(record)
            grids[(size, row.name)] = frames(images[: max(1, args.grid // per_frame)])
            motion = f"motion error {record['motion_error']:.3f}, " if video else ""
            log(
                f"  ssim {record['ssim']:.3f}, {motion}accuracy {record['accuracy']['mean']:.3f}, "
                f"FD {record['frechet']:.2f}, {wall:.1f} s ({record['speedup']:.2f}x), "
                f"calls {record['work'].get('call_share', 1):.2f}, tokens {record['work'].get('token_share', 1):.2f}"
            )
    from tools.fidelity.report import pareto_fronts

    return {
        "model": name,
        "prompts": [data.describe(data.Prompts.from_tensor(prompts), i) for i in range(len(prompts))],
        "reference": reference_rows,
        "records": records,
        "pareto_front": pareto_fronts(records),
        "grids": grids,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    setup_comfy("cpu")
    import comfy.utils

    from tools.fidelity import report as fidelity_report
    from tools.fidelity.reference import models

    comfy.utils.PROGRESS_BAR_ENABLED = False  # one log line per row instead

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    def log(message):
        print(f"[{time.time() - started:6.0f} s] {message}", flush=True)

    reports = {}
    for name in args.models.split(","):
        result = evaluate_model(name, args, log)
        report = {
            "machine": machine(torch.device("cpu")),
            "versions": versions(),
            "settings": {k: v for k, v in vars(args).items() if k not in ("out", "docs")},
            "full_depth": models.FULL_DEPTH.get(name),
            "date": time.strftime("%Y-%m-%d"),
            "minutes": round((time.time() - started) / 60, 1),
            **{k: v for k, v in result.items() if k != "grids"},
        }
        paths = fidelity_report.write(report, result["grids"], out)
        print(fidelity_report.table(report))
        if args.docs:
            for path in paths:
                shutil.copy(path, ROOT / "docs" / path.name)
        (out / f"fidelity-{name}.json").write_text(json.dumps(report, indent=2) + "\n")
        reports[name] = report
    return reports


if __name__ == "__main__":
    main()
