"""``python -m tools.fidelity.neo``: Forge Neo's job on a DiT reference, our accordion beside Neo's Spectrum.

The same job (prompts, seed, steps, CFG, Euler over the ``normal`` schedule) through Forge Neo's path, the test
suite's stand-in (``tests/hosts/neo_host.py``: Neo's call order, script hooks and model wrapper; Neo is not on
PyPI), on a trained reference's weights, four ways: unpatched; Spectrum at Neo's defaults (``spectrum``, installed
as Neo installs it: the clone's ``model_function_wrapper``); our accordion ticked at its defaults; both ticked (ours
then stands down with one line and the picture is Spectrum's). For each: same-seed SSIM against unpatched
(lowest image), the share of the blocks' work run (``work.count_work``: every block computes the same tokens, so
it is the share of the blocks run), CPU seconds. docs/dit-measurements.md
("Spectrum, Forge Neo's step cache") holds the figures.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tools.common.stand_ins import hosts

REPO = Path(__file__).resolve().parents[2]
NEO_FAMILY = {"ref-flux-v2": "flux", "ref-flux-deep": "flux", "ref-qwen-v2": "qwen_image", "ref-qwen": "qwen_image"}


def _batched(entry: list, n: int) -> list:
    """A CONDITIONING entry of one prompt repeated to ``n`` (the stand-in batches cond and uncond as given)."""
    context, extra = entry
    extra = {k: v.expand(n, *v.shape[1:]) if torch.is_tensor(v) else v for k, v in extra.items()}
    return [context.expand(n, *context.shape[1:]), extra]


def measure(name: str, prompts: int, steps: int, cfg: float, seed: int) -> dict:
    _, neo_host, webui_host = hosts()
    import comfy.model_patcher

    from tome_core.hosts.webui import args as webui_args
    from tools.fidelity import run, spectrum
    from tools.fidelity.reference import models
    from tools.fidelity.row import FidelityRow
    from tools.fidelity.work import count_work

    base, encoder = models.load_reference(name)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
    family = NEO_FAMILY[name]
    if family in neo_host.NEO_CLASSES:  # Neo's class name where Neo's differs from ComfyUI's
        base.diffusion_model.__class__ = neo_host.NEO_CLASSES[family]
    size = models.train_size(name)
    chosen = run.benchmark_prompts(0, prompts)
    (positive,) = run.conditioning(name, base, encoder, chosen, size)
    (negative,) = run.conditioning(name, base, encoder, models.PromptEncoder.empty(1), size)
    shape = models.latent_shape(name, prompts, size)
    shape = (shape[0], *shape[2:])  # the stand-in's: no channel axis
    frames, _ = models.as_images(name)

    host = webui_host.Host()
    ours = webui_args.as_list(webui_args.defaults())
    ours[webui_args.ARG_NAMES.index("enabled")] = True
    off = webui_host.script_args(enabled=False)
    with_spectrum = patcher.clone()
    with_spectrum.set_model_unet_function_wrapper(spectrum.SpectrumWrapper(spectrum.SpectrumSettings()))

    def job(model, args):
        p = neo_host.processing(model, args, steps=steps, cfg=cfg)
        conditioning = (positive, _batched(negative, prompts))
        out = neo_host.process_images(host, p, family, shape=shape, seed=seed, conditioning=conditioning)
        return model.model.process_latent_in(out)

    rows, unpatched = {}, None
    for row, model, args in (
        ("unpatched", patcher, off),
        ("Spectrum, Neo's defaults", with_spectrum, off),
        ("ours, the accordion's defaults", patcher, ours),
        ("both ticked", with_spectrum, ours),
    ):
        started = time.process_time()
        with count_work(FidelityRow(row, "neo", lambda m: m), patcher) as work:
            images = job(model, args)
        seconds = time.process_time() - started
        if unpatched is None:
            unpatched = (images, work, seconds)
        metrics = run.image_metrics(frames(images), frames(unpatched[0]))
        rows[row] = {
            "ssim": round(metrics["ssim"], 4),
            "ssim_min": round(metrics["ssim_min"], 4),
            "identical_to_unpatched": metrics["identical_to_unpatched"],
            "blocks_run": round(work.summary(unpatched[1]).get("token_share", 1.0), 3),
            "cpu_s": round(seconds, 2),
            "speedup_cpu": round(unpatched[2] / seconds, 2),
        }
        print(f"{name} {row}: {rows[row]}", flush=True)
    return {
        "model": name,
        "host": "Forge Neo stand-in (tests/hosts/neo_host.py)",
        "prompts": prompts,
        "steps": steps,
        "cfg": cfg,
        "seed": seed,
        "rows": rows,
        "both ticked is Spectrum's picture": rows["both ticked"]["ssim"] == rows["Spectrum, Neo's defaults"]["ssim"],
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="ref-qwen-v2,ref-flux-v2")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--cfg", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "results" / "neo" / "neo-spectrum.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    hosts()  # ComfyUI set up as the stand-ins expect, before anything imports it
    reports = [measure(name, args.prompts, args.steps, args.cfg, args.seed) for name in args.models.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(reports, indent=2) + "\n")
    return reports


if __name__ == "__main__":
    main()
