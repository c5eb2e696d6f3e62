"""The calibration's evidence on the trained references (docs/calibration.md, 'Measured'): per model and sampler,
calibrate ``reuse_plan`` "calibrated" on ONE prompt and seed of set A through the node, then report on the 16
prompts of set B against the unpatched run, beside the fixed default (same-seed SSIM, mean and lowest image, and
the share of model calls computed); no ToDo, as a GPU runs these sizes.

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
from tools.fidelity.row import load_our_nodes, ours

SET_A_FIRST, SET_B_FIRST, CFG = 16, 0, 4.0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="ref-sd1,ref-sd1-v2,ref-sdxl,ref-sdxl-v2")
    parser.add_argument("--runs", default="euler:normal:25,dpmpp_2m:karras:25", help="sampler:scheduler:steps,...")
    parser.add_argument("--prompts", type=int, default=16, help="set B's prompts reported on")
    parser.add_argument("--scale", type=int, default=2, help="the size as a multiple of the training size")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/calibration.json")
    return parser.parse_args(argv)


def sample(model, patcher, positive, negative, shape, run) -> tuple[torch.Tensor, int]:
    """The run's latents (data space) and the batch entries the UNet computed."""
    import nodes as comfy_nodes

    sampler, scheduler, steps = run
    calls = []
    handle = patcher.model.diffusion_model.register_forward_pre_hook(lambda module, args: calls.append(len(args[0])))
    try:
        with torch.no_grad():
            (out,) = comfy_nodes.common_ksampler(model, 0, steps, CFG, sampler, scheduler, positive, negative,
                                                 {"samples": torch.zeros(shape)})  # fmt: skip
    finally:
        handle.remove()
    return patcher.model.process_latent_in(out["samples"]), sum(calls)


def measure(name: str, runs: list[tuple[str, str, int]], args, log) -> list[dict]:
    import comfy.model_patcher
    import folder_paths

    from tools.fidelity.reference import models
    from tools.fidelity.run import benchmark_prompts, conditioning, image_metrics

    base, encoder = models.load_reference(name)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
    size = models.train_size(name) * args.scale
    nodes = load_our_nodes()
    negative = conditioning(name, base, encoder, models.PromptEncoder.empty(1), size)
    set_a = conditioning(name, base, encoder, benchmark_prompts(SET_A_FIRST, 1), size)
    set_b = conditioning(name, base, encoder, benchmark_prompts(SET_B_FIRST, args.prompts), size)
    one, shape = models.latent_shape(name, 1, size), models.latent_shape(name, args.prompts, size)
    rows = []
    for run in runs:
        with tempfile.TemporaryDirectory() as user:
            folder_paths.set_user_directory(user)
            model = ours(
                nodes, "calibrated", method="todo", downsample_factor=1.0, reuse_interval=3, reuse_plan="calibrated"
            ).patch(patcher)
            started = time.perf_counter()
            _, calibration_calls = sample(model, patcher, set_a, negative, one, run)
            calibration_s = time.perf_counter() - started
            (entry,) = json.loads((Path(user) / "tome_patch" / "calibrations.json").read_text())["entries"].values()
            plain, plain_calls = sample(patcher, patcher, set_b, negative, shape, run)
            row = {"model": name, "run": list(run), "calibration": entry["result"], "calibration_s": round(
                calibration_s, 1), "calibration_calls": calibration_calls * args.prompts / plain_calls}  # fmt: skip
            default = ours(nodes, "default", method="todo", downsample_factor=1.0, reuse_interval=3).patch(patcher)
            for label, patched in (("calibrated", model), ("default", default)):
                images, calls = sample(patched, patcher, set_b, negative, shape, run)
                metrics = image_metrics(images, plain)
                latent = latent_ssim(images, plain)
                row[label] = {"ssim": metrics["ssim"], "ssim_min": metrics["ssim_min"], "calls": calls / plain_calls,
                              "latent_ssim": float(latent.mean()), "latent_ssim_min": float(latent.min())}  # fmt: skip
            log(json.dumps(row))
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| model | run | calibrated: computed (search's score) | set B, calibrated | set B, default | runs, s |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        kept, cal, fixed = row["calibration"], row["calibrated"], row["default"]
        lines.append(
            f"| `{row['model']}` | {' '.join(map(str, row['run']))} | {kept['computed']} of "
            f"{kept['steps']} ({kept['worst']:.3f}) | {cal['ssim']:.3f} ({cal['ssim_min']:.3f}) at {cal['calls']:.2f}"
            f" | {fixed['ssim']:.3f} ({fixed['ssim_min']:.3f}) at {fixed['calls']:.2f} | {kept['runs']}, "
            f"{row['calibration_s']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    setup_comfy("cpu")
    import comfy.utils

    comfy.utils.PROGRESS_BAR_ENABLED = False
    started = time.time()

    def log(message):
        print(f"[{time.time() - started:6.0f} s] {message}", flush=True)

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
