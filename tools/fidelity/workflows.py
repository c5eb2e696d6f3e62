"""The workflows people build around a sampler, on a trained reference: the default against the same workflow
unpatched (same-seed SSIM, mean and lowest image, and the share of UNet calls computed). docs/step-reuse.md,
"The workflows around the sampler".

    python -m tools.fidelity.workflows --models ref-sd1,ref-sdxl --prompts 4 --scale 2
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from tome_core.settings import SPECS
from tools.common.host import setup_comfy
from tools.common.machine import machine
from tools.fidelity.row import ROOT, load_our_nodes, ours

STEPS, CFG = 25, 4.0


def ksampler(model, seed, sampler, scheduler, positive, negative, latent, cfg=CFG, **options):
    """ComfyUI's KSampler (``options``: denoise, or KSamplerAdvanced's step range and noise switches)."""
    import nodes as comfy_nodes

    (out,) = comfy_nodes.common_ksampler(model, seed, STEPS, cfg, sampler, scheduler, positive, negative, latent,
                                         **options)  # fmt: skip
    return out


def txt2img(sampler, scheduler, cfg=CFG, wrap=None) -> Callable:
    def run(model, seed, positive, negative, start):
        model = wrap(model) if wrap is not None else model
        latent = {"samples": torch.zeros_like(start)}
        return ksampler(model, seed, sampler, scheduler, positive, negative, latent, cfg=cfg)["samples"]

    return run


def img2img(sampler, scheduler, denoise=0.6) -> Callable:
    def run(model, seed, positive, negative, start):
        latent = {"samples": start}
        return ksampler(model, seed, sampler, scheduler, positive, negative, latent, denoise=denoise)["samples"]

    return run


def two_passes(sampler, scheduler, switch=12) -> Callable:
    """KSamplerAdvanced twice: steps 0 to ``switch`` with the leftover noise returned, then the rest."""

    def run(model, seed, positive, negative, start):
        latent = {"samples": torch.zeros_like(start)}
        first = ksampler(model, seed, sampler, scheduler, positive, negative, latent, start_step=0,
                         last_step=switch, force_full_denoise=False)  # fmt: skip
        return ksampler(model, seed, sampler, scheduler, positive, negative, first, start_step=switch,
                        last_step=STEPS, disable_noise=True, force_full_denoise=True)["samples"]  # fmt: skip

    return run


def pag(model):
    from comfy_extras.nodes_pag import PerturbedAttentionGuidance

    return PerturbedAttentionGuidance.execute(model, 3.0).result[0]


def sag(model):
    from comfy_extras.nodes_sag import SelfAttentionGuidance

    return SelfAttentionGuidance.execute(model, 0.5, 2.0).result[0]


WORKFLOWS = {
    "txt2img, Euler": txt2img("euler", "normal"),
    "img2img 0.6, Euler": img2img("euler", "normal"),
    "img2img 0.6, Euler on Karras": img2img("euler", "karras"),
    "img2img 0.6, DPM++ 2M Karras": img2img("dpmpp_2m", "karras"),
    "two KSamplerAdvanced passes, Euler": two_passes("euler", "normal"),
    "two KSamplerAdvanced passes, DPM++ 2M Karras": two_passes("dpmpp_2m", "karras"),
    "PAG 3 at CFG 1, Euler": txt2img("euler", "normal", cfg=1.0, wrap=pag),
    "PAG 3 at CFG 4, Euler": txt2img("euler", "normal", wrap=pag),
    "SAG at CFG 1, Euler": txt2img("euler", "normal", cfg=1.0, wrap=sag),
    "SAG at CFG 4, Euler": txt2img("euler", "normal", wrap=sag),
}


def counted(unet) -> tuple[list, Callable]:
    calls = []
    handle = unet.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls, handle.remove


def measure(name: str, prompts: int, scale: int, only: str | None, log) -> list[dict]:
    import comfy.model_patcher

    from tools.fidelity.reference import models
    from tools.fidelity.run import benchmark_prompts, conditioning, image_metrics

    base, encoder = models.load_reference(name)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
    # The default as a node added anew has it, without ToDo (a GPU's sizes run none).
    interval = SPECS["reuse_interval"].default
    patched = ours(load_our_nodes(), "ours", downsample_factor=1.0, reuse_interval=interval).patch(patcher)
    chosen = benchmark_prompts(0, prompts)  # set B
    size = models.train_size(name) * scale
    positive = conditioning(name, base, encoder, chosen, size)
    negative = conditioning(name, base, encoder, models.PromptEncoder.empty(1), size)
    frames, _ = models.as_images(name)
    zeros = torch.zeros(models.latent_shape(name, prompts, size))
    with torch.no_grad():  # img2img starts from the unpatched txt2img picture of the same prompts
        start = WORKFLOWS["txt2img, Euler"](patcher, 0, positive, negative, zeros)
    records = []
    for workflow, run in WORKFLOWS.items():
        if only and not any(word in workflow for word in only.split(",")):
            continue
        out = {}
        for label, model in (("unpatched", patcher), ("ours", patched)):
            calls, done = counted(patcher.model.diffusion_model)
            try:
                with torch.no_grad():
                    out[label] = (patcher.model.process_latent_in(run(model, 0, positive, negative, start)), len(calls))
            finally:
                done()
        metrics = image_metrics(frames(out["ours"][0]), frames(out["unpatched"][0]))
        record = {"model": name, "workflow": workflow, "calls": out["ours"][1] / out["unpatched"][1], **metrics}
        records.append(record)
        log(f"{name}: {workflow}: ssim {record['ssim']:.3f} ({record['ssim_min']:.3f}), calls {record['calls']:.2f}")
    return records


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="ref-sd1,ref-sdxl")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--scale", type=int, default=2, help="the image size as a multiple of the training size")
    parser.add_argument("--only", default=None, help="the workflows whose name contains one of these (commas)")
    parser.add_argument("--out", default=str(ROOT / "results" / "workflows.json"))
    args = parser.parse_args(argv)
    setup_comfy("cpu")
    torch.manual_seed(0)
    records = [r for name in args.models.split(",") for r in measure(name, args.prompts, args.scale, args.only, print)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "records": records}, indent=1))
    return records


if __name__ == "__main__":
    main()
