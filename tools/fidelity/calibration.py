"""The calibration's evidence on the trained references (docs/calibration.md, 'Measured'): per model and sampler,
calibrate ``reuse_plan`` "calibrated" on ONE prompt and seed of set A through the node, then report on the 16
prompts of set B against the unpatched run, beside the fixed default (same-seed SSIM, mean and lowest image, and
the share of model calls computed); no ToDo, as a GPU runs these sizes. Beside them at equal calls: Spectrum
computing the kept count and ComfyUI's EasyCache at two thresholds; on a DiT (``calibration_dit``) also MagCache
calibrated on the same prompt and seed. ``--todo 2``: ToDo 2 in the calibrated and the default rows (the
calibration decides it against the unreduced picture; a DiT then runs as set, reuse every 3). A model name ending
in ``+lora`` is that reference with a LoRA-like weight patch (``lora_like``): another key, calibrated on its own.

    python -m tools.fidelity.calibration --models ref-sd1,ref-sd1-v2,ref-sdxl,ref-sdxl-v2 \\
        --runs euler:normal:25,dpmpp_2m:karras:25
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from tome_core.calibration import latent_ssim
from tools.common.host import setup_comfy
from tools.common.machine import machine
from tools.fidelity import calibration_dit
from tools.fidelity.row import load_our_nodes, ours

SET_A_FIRST, SET_B_FIRST, CFG = 16, 0, 4.0
LORA = "+lora"
EASYCACHE_THRESHOLDS = (0.1, 0.2)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="ref-sd1,ref-sd1-v2,ref-sdxl,ref-sdxl-v2")
    parser.add_argument("--runs", default="euler:normal:25,dpmpp_2m:karras:25", help="sampler:scheduler:steps,...")
    parser.add_argument("--prompts", type=int, default=16, help="set B's prompts reported on")
    parser.add_argument("--calibration-prompt", type=int, default=0, help="which of set A's prompts calibrates")
    parser.add_argument("--scale", type=int, default=2, help="the size as a multiple of the training size")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--todo", type=float, default=1.0, help="ToDo's factor in both rows (1: none; a DiT: as set)")
    parser.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", default="results/calibration.json")
    return parser.parse_args(argv)


def sample(model, patcher, positive, negative, shape, run) -> tuple[torch.Tensor, int]:
    """The run's latents (data space) and the batch entries the UNet computed."""
    import nodes as comfy_nodes

    sampler, scheduler, steps = run
    calls = []  # a UNet's first convolution, a DiT's last block: a step cache that skips the model runs neither
    diffusion_model = patcher.model.diffusion_model
    if hasattr(diffusion_model, "input_blocks"):
        counted = diffusion_model.input_blocks[0][0]
    else:
        counted = calibration_dit.counted_block(diffusion_model)
    handle = counted.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(calibration_dit.batch_of(args, kwargs)), with_kwargs=True
    )
    try:
        with torch.no_grad():
            (out,) = comfy_nodes.common_ksampler(model, 0, steps, CFG, sampler, scheduler, positive, negative,
                                                 {"samples": torch.zeros(shape)})  # fmt: skip
    finally:
        handle.remove()
    return patcher.model.process_latent_in(out["samples"]), sum(calls)


def lora_like(patcher, rank: int = 4, share: float = 0.15) -> None:
    """A LoRA-like patch on every attention projection (strength 1): a rank-``rank`` change of ``share`` of each
    weight's norm, from a fixed seed, added the way ComfyUI adds a LoRA (``add_patches``)."""
    generator = torch.Generator().manual_seed(7)
    patches = {}
    for name, weight in patcher.model.diffusion_model.state_dict().items():
        if weight.dim() != 2 or not any(part in name for part in (".to_q.", ".to_k.", ".to_v.", ".to_out.0.")):
            continue
        down = torch.randn(rank, weight.shape[1], generator=generator)
        up = torch.randn(weight.shape[0], rank, generator=generator)
        change = up @ down
        patches[f"diffusion_model.{name}"] = (change * (share * weight.norm() / change.norm()),)
    patcher.add_patches(patches, strength_patch=1.0)


def peers(steps: int, computed: int) -> list:
    """Spectrum computing ``computed`` of ``steps`` and EasyCache at ``EASYCACHE_THRESHOLDS``."""
    from tools.fidelity import spectrum
    from tools.fidelity.peer_rows import step_cache_rows
    from tools.fidelity.row import FidelityRow

    rows = [row for row in step_cache_rows(EASYCACHE_THRESHOLDS) if row.name.startswith("EasyCache")]
    try:
        settings = spectrum.settings_computing(steps, computed)
    except ValueError:
        return rows
    return [FidelityRow(f"Spectrum {computed} of {steps}", "peer", spectrum.spectrum_patch(settings)), *rows]


def measure(name: str, runs: list[tuple[str, str, int]], args, log) -> list[dict]:
    import comfy.model_patcher
    import folder_paths

    from tools.fidelity.reference import models
    from tools.fidelity.run import benchmark_prompts, conditioning, image_metrics

    reference = name.removesuffix(LORA)
    dit = models.is_dit(reference)
    frames, _ = models.as_images(reference)
    base, encoder = models.load_reference(reference)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
    if name.endswith(LORA):
        lora_like(patcher)
    size = models.train_size(reference) * args.scale
    nodes = load_our_nodes()
    negative = conditioning(reference, base, encoder, models.PromptEncoder.empty(1), size)
    set_a = conditioning(reference, base, encoder, benchmark_prompts(SET_A_FIRST + args.calibration_prompt, 1), size)
    set_b = conditioning(reference, base, encoder, benchmark_prompts(SET_B_FIRST, args.prompts), size)
    one, shape = models.latent_shape(reference, 1, size), models.latent_shape(reference, args.prompts, size)
    rows = []
    for run in runs:
        with tempfile.TemporaryDirectory() as user:
            folder_paths.set_user_directory(user)
            if dit:
                calibrated_row, default_row = calibration_dit.calibrated_rows(nodes, args.todo)
            else:
                todo = {"method": "todo", "downsample_factor": args.todo, "skip_when_slower": False}
                calibrated_row = ours(nodes, "calibrated", reuse_interval=3, reuse_plan="calibrated", **todo)
                default_row = ours(nodes, "default", reuse_interval=3, **todo)
            model = calibrated_row.patch(patcher)
            started = time.perf_counter()
            _, calibration_calls = sample(model, patcher, set_a, negative, one, run)
            calibration_s = time.perf_counter() - started
            kept = Path(user) / "tome_patch" / "calibrations.json"
            entries = json.loads(kept.read_text())["entries"] if kept.exists() else {}
            plain, plain_calls = sample(patcher, patcher, set_b, negative, shape, run)
            row = {
                "model": name,
                "run": list(run),
                "calibration_prompt": args.calibration_prompt,
                "calibration": next(iter(entries.values()))["result"] if entries else None,
                "calibration_s": round(calibration_s, 1),
                "calibration_calls": calibration_calls * args.prompts / plain_calls,  # in whole runs of one image
            }
            compared = [("calibrated", model, None), ("default", default_row.patch(patcher), None)]
            if args.peers and row["calibration"] is not None:
                kept_count = row["calibration"]["computed"]
                if dit:  # MagCache calibrated the same way: on the calibration prompt and seed
                    ratios = calibration_dit.magcache_ratios(patcher, set_a, negative, one, run, CFG)
                    beside = calibration_dit.peers(run[2], kept_count, ratios)
                else:
                    beside = peers(run[2], kept_count)
                compared += [(peer.name, peer.patch(patcher), peer) for peer in beside]
            for label, patched, peer in compared:
                if peer is not None:
                    peer.enter()
                try:
                    images, calls = sample(patched, patcher, set_b, negative, shape, run)
                finally:
                    if peer is not None:
                        peer.leave()
                metrics = image_metrics(frames(images), frames(plain))  # a clip's frames as images
                latent = latent_ssim(images, plain)
                row[label] = {"ssim": metrics["ssim"], "ssim_min": metrics["ssim_min"], "calls": calls / plain_calls,
                              "latent_ssim": float(latent.mean()), "latent_ssim_min": float(latent.min())}  # fmt: skip
            log(json.dumps(row))
            rows.append(row)
    return rows


def _cell(result: dict | None) -> str:
    return "" if result is None else f"{result['ssim']:.3f} ({result['ssim_min']:.3f}) at {result['calls']:.2f}"


def against_targets(row: dict) -> str:
    """The issue's targets at 0.98 for one cell: set B's mean at least 0.97 and lowest image at least 0.93, fewer
    calls than the default (or at most 1.2x), at most 6 runs."""
    calibrated, default, kept = row["calibrated"], row["default"], row["calibration"]
    missed = []
    if calibrated["ssim"] < 0.97:
        missed.append(f"mean {calibrated['ssim']:.3f}")
    if calibrated["ssim_min"] < 0.93:
        missed.append(f"lowest {calibrated['ssim_min']:.3f}")
    ratio = calibrated["calls"] / default["calls"]
    if ratio > 1.2:
        missed.append(f"{ratio:.2f}x the calls")
    if kept is not None and kept["runs"] > 6:
        missed.append(f"{kept['runs']} runs")
    fewer = "fewer calls" if ratio < 1 else "same calls" if ratio == 1 else f"{ratio:.2f}x the calls"
    return f"missed: {', '.join(missed)}" if missed else f"met, {fewer}"


def table(rows: list[dict]) -> str:
    magcache = sorted({key for row in rows for key in row if key.startswith("MagCache")})
    lines = [
        "| model | run | calibrated: computed (search's score), runs, s | set B, calibrated | set B, default | "
        "Spectrum, same count | EasyCache 0.1 | EasyCache 0.2 | "
        + "".join(f"{key} | " for key in magcache)
        + "targets |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(magcache) + "---|",
    ]
    for row in rows:
        kept = row["calibration"]
        searched = (
            "not calibrated: the default's plan"
            if kept is None
            else (
                f"{kept['computed']} of {kept['steps']} ({kept['worst']:.3f}), {kept['runs']}, {row['calibration_s']}"
            )
        )
        spectrum = next((value for key, value in row.items() if key.startswith("Spectrum")), None)
        lines.append(
            f"| `{row['model']}` | {' '.join(map(str, row['run']))} | {searched} | {_cell(row['calibrated'])} | "
            f"{_cell(row['default'])} | {_cell(spectrum)} | {_cell(row.get('EasyCache 0.1'))} | "
            f"{_cell(row.get('EasyCache 0.2'))} | "
            + "".join(f"{_cell(row.get(key))} | " for key in magcache)
            + f"{against_targets(row)} |"
        )
    return "\n".join(lines)


def cpu_session(threads: int):
    """ComfyUI on the CPU with ``threads`` threads and no progress bars; returns a log with the seconds since."""
    torch.set_num_threads(threads)
    setup_comfy("cpu")
    import comfy.utils

    comfy.utils.PROGRESS_BAR_ENABLED = False
    started = time.time()

    def log(message):
        print(f"[{time.time() - started:6.0f} s] {message}", flush=True)

    return log


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    log = cpu_session(args.threads)
    runs = [(s, c, int(n)) for s, c, n in (item.split(":") for item in args.runs.split(","))]
    rows = [row for name in args.models.split(",") for row in measure(name, runs, args, log)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(torch.device("cpu")), "date": time.strftime("%Y-%m-%d"),
                               "rows": rows}, indent=1) + "\n")  # fmt: skip
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
