"""``python -m tools.fidelity.diffusers.parallel``: reuse across steps under diffusers' context parallelism against
one process, on a DiT reference in diffusers: ``ref-wan`` in a ``WanPipeline`` (as ``tools.fidelity.diffusers.run``
builds it, UniPC), or ``ref-qwen-v2`` in a ``QwenImagePipeline`` (ComfyUI's weights load as they are; flow-matching
Euler at ComfyUI's shift 1.15, true CFG).

Several gloo processes on the CPU (``--processes``) sample the same clips with ``apply_patch(pipe)`` (the family's
default; ``--todo``: ToDo 2 alone, at every size) as one process does. The report: same-seed SSIM (per frame) of
the parallel run against the single-process one and of both against unpatched, and the model calls each computed
in full. Writes ``results/diffusers-parallel-<model>[-todo].json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tools.fidelity.diffusers.parallel")
    parser.add_argument("--model", default="ref-wan", choices=("ref-wan", "ref-qwen-v2"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cfg", type=float, default=4.0)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--mode", default="ring", choices=("ring", "ulysses"), help="ulysses needs heads per process")
    parser.add_argument("--todo", action="store_true", help="ToDo 2 alone (no reuse), at every size")
    parser.add_argument("--out", default=str(ROOT / "results"))
    return parser.parse_args(argv)


TODO = {"dit_settings": "as set", "reuse_interval": 1, "downsample_factor": 2, "skip_when_slower": False}


def _settings(args) -> dict:
    return TODO if args.todo else {}


def _setup(args):
    """(pipeline, prompt embeddings, latent size) of the reference, as the fidelity benchmark's diffusers path."""
    from tools.common.host import setup_comfy

    setup_comfy("cpu")
    from tools.fidelity.diffusers import run, wan
    from tools.fidelity.reference import models

    base, encoder = models.load_reference(args.model)
    if models.is_qwen(args.model):
        return _qwen_setup(args, base, encoder)
    transformer, _ = wan.load_transformer(args.model, base)
    pipe = run.build_pipeline(transformer, "unipc")
    return pipe, _text(args, encoder), models.train_size(args.model)


def _text(args, encoder):
    from tools.fidelity.reference import data, models
    from tools.fidelity.run import PROMPT_SEED

    every = data.all_prompts().as_tensor()
    prompts = every[torch.randperm(len(every), generator=torch.Generator().manual_seed(PROMPT_SEED))[: args.prompts]]
    with torch.no_grad():
        context, pooled = encoder(prompts)
        negative, negative_pooled = encoder(models.PromptEncoder.empty(1))
    return context, pooled, negative, negative_pooled


def _qwen_setup(args, base, encoder):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    from tools.fidelity.reference import models

    config = {k: v for k, v in models.QWEN_CONFIGS[args.model].items() if k != "image_model"}
    transformer = QwenImageTransformer2DModel(**config)
    transformer.load_state_dict(base.diffusion_model.state_dict(), strict=True)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.15)
    pipe = QwenImagePipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe, _text(args, encoder), models.train_size(args.model)


def _sample(pipe, text, args, size) -> torch.Tensor:
    from tools.fidelity.diffusers import run

    if type(pipe).__name__ != "QwenImagePipeline":
        return run.sample(pipe, text, args, size)
    context, _, negative, _ = text
    n, px = context.shape[0], size * 8
    images = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        with torch.no_grad():
            packed = pipe(
                prompt_embeds=context,
                prompt_embeds_mask=torch.ones(context.shape[:2], dtype=torch.long),
                negative_prompt_embeds=negative.expand(n, -1, -1),
                negative_prompt_embeds_mask=torch.ones((n, negative.shape[1]), dtype=torch.long),
                true_cfg_scale=args.cfg,
                height=px,
                width=px,
                num_inference_steps=args.steps,
                generator=torch.Generator().manual_seed(seed),
                output_type="latent",
            ).images
        images.append(pipe._unpack_latents(packed, px, px, pipe.vae_scale_factor))
    return torch.cat(images)


def _sampled(pipe, text, args, size) -> tuple[torch.Tensor, int, int]:
    """(clips, model calls computed in full, model calls) of one sampling of every prompt."""
    from tome_core.reuse import LayerReuseRun

    runs, made = [], LayerReuseRun.__init__

    def record(self, *a, **k):
        made(self, *a, **k)
        runs.append(self)

    LayerReuseRun.__init__ = record
    try:
        clips = _sample(pipe, text, args, size)
    finally:
        LayerReuseRun.__init__ = made
    calls = sum(r.calls for r in runs)
    return clips, calls - sum(r.reused_calls for r in runs), calls


def _process(rank: int, world: int, folder: str, args) -> None:
    import torch.distributed as dist
    from diffusers import ContextParallelConfig

    import tome_core

    torch.set_num_threads(1)
    store = f"file://{folder}/store"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world, timeout=datetime.timedelta(600))
    try:
        pipe, text, size = _setup(args)
        if args.mode == "ring":
            _ring_on_cpu()
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(**{f"{args.mode}_degree": world}))
        tome_core.apply_patch(pipe, **_settings(args))
        started = time.perf_counter()
        clips, computed, calls = _sampled(pipe, text, args, size)
        seconds = time.perf_counter() - started
        torch.save({"clips": clips, "computed": computed, "calls": calls, "seconds": seconds}, f"{folder}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def lse_attention(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):  # fmt: skip
    """A plain attention for diffusers' ``native`` backend that also returns the log-sum-exp, which ring attention
    merges its chunks by and the backend's own CPU attention does not return."""
    q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if attn_mask is not None:
        scores = scores + attn_mask
    lse = scores.logsumexp(-1)
    out = ((scores - lse[..., None]).exp() @ v).permute(0, 2, 1, 3)
    return (out, lse.permute(0, 2, 1)) if return_lse else out


def _ring_on_cpu() -> None:
    from diffusers.models import attention_dispatch

    attention_dispatch._native_attention_forward_op = lse_attention


def main(argv=None) -> dict:
    import tome_core
    from tools.common.machine import machine, versions
    from tools.fidelity.reference import models
    from tools.fidelity.run import image_metrics

    args = parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        torch.multiprocessing.start_processes(
            _process, args=(args.processes, folder, args), nprocs=args.processes, start_method="spawn"
        )
        parallel = [torch.load(f"{folder}/{rank}.pt") for rank in range(args.processes)]
    pipe, text, size = _setup(args)
    unpatched, _, _ = _sampled(pipe, text, args, size)
    tome_core.apply_patch(pipe, **_settings(args))
    started = time.perf_counter()
    single, computed, calls = _sampled(pipe, text, args, size)
    seconds = time.perf_counter() - started
    tome_core.remove_patch(pipe)
    frames, _ = models.as_images(args.model)
    first = parallel[0]
    report = {
        "model": args.model,
        "machine": machine(torch.device("cpu")),
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "processes_agree": all(torch.equal(p["clips"], first["clips"]) for p in parallel),
        "parallel_vs_single": image_metrics(frames(first["clips"]), frames(single)),
        "largest_difference": float((first["clips"] - single).abs().max()),
        "parallel_vs_unpatched": image_metrics(frames(first["clips"]), frames(unpatched)),
        "single_vs_unpatched": image_metrics(frames(single), frames(unpatched)),
        "computed": {"parallel": [p["computed"] for p in parallel], "single": computed, "calls": calls},
        "seconds": {"parallel": first["seconds"], "single": seconds},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"diffusers-parallel-{args.model}{'-todo' if args.todo else ''}.json").write_text(
        json.dumps(report, indent=2) + "\n"
    )
    print(json.dumps({k: v for k, v in report.items() if k not in ("machine", "versions")}, indent=2))
    return report


if __name__ == "__main__":
    main()
