"""``python -m tools.bench.dit`` (or ``bash tools/bench.sh --dit``): ToDo on DiTs against unpatched and two
free bounds, at the sizes users sample.

Full-width models of ComfyUI's own classes (0.3.75) with seeded random weights, fewer blocks than the real
models where they would not fit in memory (the per-block speed-up is what transfers):
- Flux: width 3072, 24 heads, 1 double + 1 single block (of 19 + 38), 1024 x 1024 px (4096 image tokens),
  512 text tokens.
- SD3.5 Medium: width 1536, 24 heads, 2 of its 24 joint blocks (one with the x-only self-attention that its
  first 13 blocks have, one without), 1024 x 1024 px (4096 image tokens), 333 text tokens.
- Wan 2.1 1.3B: width 1536, 12 heads, 1 of its 30 blocks, 480 x 832 px and 17 frames (5 latent frames,
  7800 video tokens), 512 text tokens.
- The families whose ToDo came later (``qwen-image``, ``hunyuan-video15``, ``ltxv``, ``z-image``; not in the
  default ``--models``): one block each at the real width, a still image at 1024 px (``--image-px`` for other
  sizes): their skip_when_slower break-even (docs/dit.md).
On this 2-core CPU one evaluation of these cut-down models takes about a minute; whole models are 20-40 times
that, with the same per-block share of attention.
One timed call is one model evaluation (``BaseModel.apply_model``, batch 1). Rows:
- unpatched;
- ToDo 2 (the node's defaults: downsample_factor 2, nearest-exact, per frame for video);
- Wan only: ToDo 2 also in time (frames halved too; the engine's ``time_factor``, not a node input);
- free K/V (the ceiling of ToDo 2): attention gets as many keys and values as ToDo 2 leaves (text whole, a
  quarter of the image tokens), taken as a view at no cost;
- attention free: every attention call returns zeros at once (what no attention method can beat).
Rows are timed interleaved, A B C D then D C B A per round, and each row's speed-up is the median of its
ratios to the unpatched call of the same round (the machine drifts less within a round than across it). The
speed-up is taken on the process's CPU time, which other processes on a shared machine disturb far less than
wall time (it does not count the time the benchmark waits for a core); the wall-time speed-up is reported too.

On a GPU (``--device cuda --dtype bf16``) the model is built on the device in that dtype, every row is called
once untimed first (first-call costs; it gives the row's peak memory), the calls are timed with CUDA events and
the speed-up is taken on that time (the CPU time of a GPU run is the host's launching, not the work).
``--full-depth`` builds the models with all their blocks (Flux 19 double + 38 single, SD3.5 Medium 24, Wan 2.1 1.3B
30, Qwen-Image 60, HunyuanVideo 1.5 54, LTX-Video 28, Z-Image 30), the whole model as users run it; its weights are
drawn on the device.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from tools.common.host import initialise, setup_comfy
from tools.common.measure import PeakMemory, clock_for, clocked

RESULTS = Path(__file__).resolve().parents[3] / "results"

MODELS = {
    "flux": {
        "title": "Flux (width 3072, 1 double + 1 single block), 1024 px",
        "config": {
            "image_model": "flux",
            "hidden_size": 3072,
            "num_heads": 24,
            "axes_dim": [16, 56, 56],
            "depth": 1,
            "depth_single_blocks": 1,
            "context_in_dim": 4096,
            "vec_in_dim": 768,
            "in_channels": 16,
            "out_channels": 16,
            "patch_size": 2,
            "mlp_ratio": 4.0,
            "theta": 10000,
            "qkv_bias": True,
            "guidance_embed": True,
        },
        "latent": (16, 128, 128),
        "text": (512, 4096),
        "pooled": 768,
    },
    "sd35m": {
        "title": "SD3.5 Medium (width 1536, 2 of 24 joint blocks), 1024 px",
        "config": {
            "in_channels": 16,
            "patch_size": 2,
            "out_channels": 16,
            "depth": 24,
            "num_blocks": 2,
            "input_size": None,
            "adm_in_channels": 2048,
            "context_embedder_config": {
                "target": "torch.nn.Linear",
                "params": {"in_features": 4096, "out_features": 1536},
            },
            "num_patches": 384 * 384,
            "pos_embed_max_size": 384,
            "qk_norm": "rms",
            "pos_embed_scaling_factor": None,
            "x_block_self_attn_layers": [0],
        },
        "latent": (16, 128, 128),
        "text": (333, 4096),
        "pooled": 2048,
    },
    "wan": {
        "title": "Wan 2.1 1.3B (width 1536, 1 of 30 blocks), 480x832, 17 frames",
        "config": {
            "image_model": "wan2.1",
            "model_type": "t2v",
            "dim": 1536,
            "out_dim": 16,
            "num_heads": 12,
            "ffn_dim": 8960,
            "num_layers": 1,
            "patch_size": (1, 2, 2),
            "freq_dim": 256,
            "window_size": (-1, -1),
            "qk_norm": True,
            "cross_attn_norm": True,
            "eps": 1e-6,
            "in_dim": 16,
            "text_dim": 4096,
        },
        "latent": (16, 5, 60, 104),
        "text": (512, 4096),
        "pooled": None,
    },
    # The families whose ToDo came after Flux, SD3 and Wan: one block each at the real width, a still image (one
    # latent frame) at 1024 px; ``--image-px`` sets the size (their break-even, ``dit_families``).
    "qwen-image": {
        "title": "Qwen-Image (width 3072, 1 of 60 blocks), 1024 px",
        "config": {
            "image_model": "qwen_image",
            "in_channels": 64,
            "out_channels": 16,
            "patch_size": 2,
            "num_layers": 1,
            "attention_head_dim": 128,
            "num_attention_heads": 24,
            "joint_attention_dim": 3584,
            "axes_dims_rope": [16, 56, 56],
        },
        "latent": (16, 1, 128, 128),
        "text": (256, 3584),
        "pooled": None,
    },
    # HunyuanVideo 1.5: 32-channel latents (16x spatial compression) and 33 channels of image condition (zeros:
    # text to video), patch 1.
    "hunyuan-video15": {
        "title": "HunyuanVideo 1.5 (width 2048, 1 double of 54 blocks), 1024 px, 1 frame",
        "config": {
            "image_model": "hunyuan_video",
            "in_channels": 65,
            "out_channels": 32,
            "patch_size": [1, 1, 1],
            "vec_in_dim": None,
            "axes_dim": [16, 56, 56],
            "meanflow": False,
            "context_in_dim": 3584,
            "hidden_size": 2048,
            "mlp_ratio": 4.0,
            "num_heads": 16,
            "depth": 1,
            "depth_single_blocks": 0,
            "theta": 256,
            "qkv_bias": True,
            "byt5": False,
            "guidance_embed": False,
            "use_cond_type_embedding": True,
            "vision_in_dim": 1152,
        },
        "latent": (32, 1, 64, 64),
        "vae_scale": 16,
        "concat": 33,
        "text": (256, 3584),
        "pooled": None,
    },
    # LTX-Video: 128-channel latents (32x spatial compression), patch 1; its forward asks for the text's mask.
    "ltxv": {
        "title": "LTX-Video (width 2048, 1 of 28 blocks), 1024 px, 1 frame",
        "config": {
            "image_model": "ltxv",
            "in_channels": 128,
            "num_layers": 1,
            "attention_head_dim": 64,
            "num_attention_heads": 32,
            "cross_attention_dim": 2048,
            "caption_channels": 4096,
        },
        "latent": (128, 1, 32, 32),
        "vae_scale": 32,
        "text": (128, 4096),
        "text_mask": True,
        "pooled": None,
    },
    # Z-Image (Lumina 2's NextDiT at width 3840): no refiner layers here (they run at every call, outside ToDo's
    # reach, in the real model 2 + 2 of them beside 30 layers); its forward asks for the text's token count.
    "z-image": {
        "title": "Z-Image (width 3840, 1 of 30 layers), 1024 px",
        "config": {
            "image_model": "lumina2",
            "patch_size": 2,
            "in_channels": 16,
            "dim": 3840,
            "cap_feat_dim": 2560,
            "n_layers": 1,
            "n_refiner_layers": 0,
            "qk_norm": True,
            "n_heads": 30,
            "n_kv_heads": 30,
            "axes_dims": [32, 48, 48],
            "axes_lens": [1536, 512, 512],
            "rope_theta": 256.0,
            "ffn_dim_multiplier": 8.0 / 3.0,
            "z_image_modulation": True,
            "time_scale": 1000.0,
            "pad_tokens_multiple": 32,
        },
        "latent": (16, 128, 128),
        "text": (256, 2560),
        "num_tokens": True,
        "pooled": None,
    },
    # A small model of Flux's layout at 64 px, for the tests and quick checks of the code path.
    "tiny-flux": {
        "title": "tiny Flux (width 64, 1 double + 1 single block), 64 px",
        "config": {
            "image_model": "flux",
            "hidden_size": 64,
            "num_heads": 2,
            "axes_dim": [8, 12, 12],
            "depth": 1,
            "depth_single_blocks": 1,
            "context_in_dim": 32,
            "vec_in_dim": 16,
            "in_channels": 16,
            "out_channels": 16,
            "patch_size": 2,
            "mlp_ratio": 4.0,
            "theta": 10000,
            "qkv_bias": True,
            "guidance_embed": True,
        },
        "latent": (16, 8, 8),
        "text": (16, 32),
        "pooled": 16,
    },
}


FULL_DEPTH = {
    "flux": ({"depth": 19, "depth_single_blocks": 38}, "19 double + 38 single blocks"),
    "sd35m": ({"num_blocks": 24, "x_block_self_attn_layers": list(range(13))}, "all 24 joint blocks"),
    "wan": ({"num_layers": 30}, "all 30 blocks"),
    "qwen-image": ({"num_layers": 60}, "all 60 blocks"),
    "hunyuan-video15": ({"depth": 54}, "all 54 double blocks"),
    "ltxv": ({"num_layers": 28}, "all 28 blocks"),
    "z-image": ({"n_layers": 30}, "all 30 layers"),
}


def full_depth() -> None:
    """Every model of ``MODELS`` with all its blocks (``--full-depth``); the titles say so."""
    for name, (config, blocks) in FULL_DEPTH.items():
        MODELS[name]["config"].update(config)
        title = MODELS[name]["title"]
        MODELS[name]["title"] = title[: title.index("(")] + f"(full depth: {blocks})" + title[title.index(")") + 1 :]


def build(name: str, device: torch.device | None = None, dtype: torch.dtype = torch.float32):
    """The model with seeded random weights. On the CPU they are drawn there (the same weights as ever); on
    another device the model is made there and its weights drawn there (fast for billions of parameters)."""
    import comfy.model_detection
    import comfy.model_patcher

    device = device or torch.device("cpu")
    spec = MODELS[name]
    config = comfy.model_detection.model_config_from_unet_config(dict(spec["config"]))
    config.set_inference_dtype(dtype, None)
    model = config.get_model({}, device=device)
    model.to(device)
    initialise(model.diffusion_model, 0, device=device)
    model.eval()
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)


class FreeKeysOverride:
    """The ceiling of ToDo 2: the keys and values that ToDo 2 keeps, as a view of the sequence (no gather)."""

    def __init__(self, tokens, free_attention: bool):
        self.tokens = tokens
        self.free_attention = free_attention

    def __call__(self, func, *args, **kwargs):
        q, k, v = args[:3]
        dim = 2 if kwargs.get("skip_reshape", False) else 1
        if self.free_attention:
            if dim == 2:  # (batch, heads, tokens, d) in, (batch, tokens, heads * d) out
                return q.new_zeros(q.shape[0], q.shape[2], q.shape[1] * q.shape[3])
            return torch.zeros_like(q)
        total = k.shape[dim]
        start = self.tokens.start_in(total)
        if q.shape[dim] == total and start is not None:
            frames, h, w = self.tokens.grid
            # As many keys as ToDo 2 keeps (every key outside the grid, a quarter of the grid's), from the start.
            keep = total - self.tokens.count + frames * math.ceil(h / 2) * math.ceil(w / 2)
            args = (q, k.narrow(dim, 0, keep), v.narrow(dim, 0, keep), *args[3:])
        return func(*args, **kwargs)


def bound_clone(patcher, free_attention: bool):
    from tome_core.hosts.comfyui import dit as comfy_dit

    family = comfy_dit.token_layout_of(patcher.model.diffusion_model)

    def wrapper(executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kwargs):
        options = dict(transformer_options)
        options[comfy_dit.OVERRIDE_KEY] = FreeKeysOverride(family.image_tokens(x, kwargs, c_crossattn), free_attention)
        return executor(x, t, c_concat, c_crossattn, control, options, **kwargs)

    clone = patcher.clone()
    clone.add_wrapper_with_key("apply_model", "bench_bound", wrapper)
    return clone


def todo_clone(patcher, time_factor: float = 1.0):
    from tome_core.hosts.comfyui import dit as comfy_dit
    from tome_core.settings import PatchSettings

    settings = PatchSettings.from_values(method="todo", downsample_factor=2.0, reuse_interval=1)
    sigma = patcher.get_model_object("model_sampling").percent_to_sigma
    return comfy_dit.patched_clone(patcher, settings, sigma, time_factor=time_factor)


def model_call(patcher, name: str, device: torch.device | None = None):
    """One model evaluation through ``apply_model`` with the patcher's options, as the sampler makes it."""
    import comfy.patcher_extension

    device = device or torch.device("cpu")
    spec = MODELS[name]
    generator = torch.Generator().manual_seed(1)
    latent = torch.randn(1, *spec["latent"], generator=generator).to(device)
    context = torch.randn(1, *spec["text"], generator=generator).to(device)
    kwargs = {}
    if spec["pooled"]:
        kwargs["y"] = torch.randn(1, spec["pooled"], generator=generator).to(device)
    if spec["config"].get("guidance_embed"):  # Flux
        kwargs["guidance"] = torch.full((1,), 3.5, device=device)
    if spec.get("num_tokens"):  # Lumina 2 / Z-Image
        kwargs["num_tokens"] = spec["text"][0]
    if spec.get("text_mask"):  # LTX-Video
        kwargs["attention_mask"] = torch.ones(1, spec["text"][0], dtype=torch.long, device=device)
    concat = None
    if spec.get("concat"):  # HunyuanVideo 1.5's image condition: zeros (text to video)
        concat = torch.zeros(1, spec["concat"], *spec["latent"][1:], device=device)
    sigma = torch.full((1,), 0.7, device=device)

    def call():
        options = dict(patcher.model_options.get("transformer_options", {}))
        options["wrappers"] = comfy.patcher_extension.merge_nested_dicts(
            options.get("wrappers", {}), patcher.wrappers, copy_dict1=True
        )
        with torch.inference_mode():
            return patcher.model.apply_model(
                latent, sigma, c_concat=concat, c_crossattn=context, transformer_options=options, **kwargs
            )

    return call


def measure(
    name: str, rounds: int, log, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> dict:
    device = device or torch.device("cpu")
    gpu = clock_for(device) == "cuda events"  # then the speed-up is taken on the GPU's time, not the CPU's
    base = build(name, device, dtype)
    rows = {"unpatched": base, "ToDo 2": todo_clone(base)}
    if len(MODELS[name]["latent"]) == 4 and MODELS[name]["latent"][1] > 1:  # video of several frames
        rows["ToDo 2, also in time"] = todo_clone(base, time_factor=2.0)
    rows["free K/V (ceiling of ToDo 2)"] = bound_clone(base, free_attention=False)
    rows["attention free"] = bound_clone(base, free_attention=True)
    calls = {row: model_call(patcher, name, device) for row, patcher in rows.items()}
    peaks = {}
    with PeakMemory(device) as memory:
        reference = calls["unpatched"]()  # warm-up (first-call costs), and the output the others are compared with
    reference = reference.float()
    peaks["unpatched"] = (memory.mib, memory.total_mib)
    if gpu:  # every row's first-call costs out of its timed calls; its peak memory
        for row in list(rows)[1:]:
            with PeakMemory(device) as memory:
                calls[row]()
            peaks[row] = (memory.mib, memory.total_mib)
    times: dict[str, list[float]] = {row: [] for row in rows}
    cpu_times: dict[str, list[float]] = {row: [] for row in rows}
    ratios: dict[str, list[float]] = {row: [] for row in rows}
    wall_ratios: dict[str, list[float]] = {row: [] for row in rows}
    diffs = {}
    order = list(rows)
    for r in range(rounds):
        wall = {row: [] for row in rows}
        cpu = {row: [] for row in rows}
        for row in order + order[::-1]:
            seconds, cpu_seconds, out = clocked(calls[row], device)
            wall[row].append(seconds)
            cpu[row].append(cpu_seconds)
            diffs[row] = float((out.float() - reference).norm() / reference.norm())
            clock = "GPU" if gpu else "wall"
            log(f"{name} round {r + 1}: {row} {seconds:.3f} s {clock}, {cpu_seconds:.2f} s CPU")
        for row in rows:
            times[row].extend(wall[row])
            cpu_times[row].extend(cpu[row])
            ratios[row].append(statistics.mean(cpu["unpatched"]) / statistics.mean(cpu[row]))
            wall_ratios[row].append(statistics.mean(wall["unpatched"]) / statistics.mean(wall[row]))
    result = {"title": MODELS[name]["title"], "clock": "cuda events" if gpu else "cpu", "rows": {}}
    main_times = times if gpu else cpu_times
    base_time = statistics.median(main_times["unpatched"])
    for row in rows:
        peak_mib, peak_total_mib = peaks.get(row, (None, None))
        result["rows"][row] = {
            "median_cpu_s": statistics.median(cpu_times[row]),
            "median_wall_s": statistics.median(times[row]),
            "speedup": statistics.median(wall_ratios[row] if gpu else ratios[row]),
            "speedup_cpu": statistics.median(ratios[row]),
            "speedup_wall": statistics.median(wall_ratios[row]),
            "saving_pct": 100 * (1 - statistics.median(main_times[row]) / base_time),
            "peak_mib": peak_mib,
            "peak_total_mib": peak_total_mib,
            "rel_l2_vs_unpatched": diffs.get(row, 0.0),
            "cpu_s": cpu_times[row],
            "wall_s": times[row],
        }
    ceiling = result["rows"]["free K/V (ceiling of ToDo 2)"]["speedup"]
    todo = result["rows"]["ToDo 2"]["speedup"]
    # Share of the ceiling's saving that ToDo 2 reaches, in time saved: (1 - 1/todo) / (1 - 1/ceiling).
    result["todo_share_of_ceiling_pct"] = 100 * (1 - 1 / todo) / (1 - 1 / ceiling) if ceiling > 1 else None
    del rows, calls, base, reference
    gc.collect()
    return result


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write_report(results: dict, meta: dict, path: Path) -> None:
    gpu = meta.get("clock") == "cuda events"
    where = meta.get("gpu_line") if gpu else f"{meta['cpu']}, {meta['threads']} torch thread(s)"
    attention = meta.get("attention") or "SDPA"
    lines = [
        "# ToDo on DiTs: speed",
        "",
        f"{where}, {meta.get('dtype', 'fp32')}, {attention}, ComfyUI 0.3.75 classes, random weights; "
        f"{meta['date']}; `{meta['command']}`. One model evaluation, batch 1; median of {meta['rounds']} "
        "interleaved round(s) (A B C D D C B A).",
        "",
    ]
    if gpu:
        lines += [
            "| model, size | row | GPU time (s) | speed-up (GPU time) | time saved | peak MiB | peak total MiB | "
            "change to output (rel. L2) |",
            "|---|---|---|---|---|---|---|---|",
        ]
    else:
        lines += [
            "| model, size | row | CPU time (s) | speed-up (CPU) | time saved | speed-up (wall) | change to output "
            "(rel. L2) |",
            "|---|---|---|---|---|---|---|",
        ]
    for result in results.values():
        for row, r in result["rows"].items():
            if gpu:
                peak = "-" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"
                total = "-" if r.get("peak_total_mib") is None else f"{r['peak_total_mib']:.0f}"
                lines.append(
                    f"| {result['title']} | {row} | {r['median_wall_s']:.3f} | {r['speedup']:.2f}x | "
                    f"{r['saving_pct']:.0f}% | {peak} | {total} | {r['rel_l2_vs_unpatched']:.3f} |"
                )
                continue
            lines.append(
                f"| {result['title']} | {row} | {r['median_cpu_s']:.1f} | {r['speedup']:.2f}x | "
                f"{r['saving_pct']:.0f}% | {r['speedup_wall']:.2f}x | {r['rel_l2_vs_unpatched']:.3f} |"
            )
    lines.append("")
    for result in results.values():
        share = result["todo_share_of_ceiling_pct"]
        text = "n/a" if share is None else f"{share:.0f}%"
        lines.append(f"- {result['title']}: ToDo 2 reaches {text} of the free-K/V ceiling's saving.")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="wan,sd35m,flux", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument(
        "--rounds", type=int, default=2, help="interleaved rounds per model (each times every row twice)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (0: PyTorch's choice)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--full-depth", action="store_true", help="every block of the real models (a GPU's size)")
    parser.add_argument(
        "--image-px",
        type=int,
        default=None,
        help="the image models (all but Wan) at this square size instead of 1024 px (e.g. 512: 1024 image "
        "tokens of Flux, the skip_when_slower threshold)",
    )
    parser.add_argument("--out", default=str(RESULTS / "dit"), help="path of the report without extension")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    if args.full_depth:
        full_depth()
    if args.image_px:
        for spec in MODELS.values():
            if "1024 px" in spec["title"]:
                side = args.image_px // spec.get("vae_scale", 8)
                spec["latent"] = (*spec["latent"][:-2], side, side)
                spec["title"] = spec["title"].replace("1024 px", f"{args.image_px} px")
    setup_comfy(device.type)
    from tools.common.machine import gpu_line, machine

    meta = {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python -m tools.bench.dit", *(sys.argv[1:] if argv is None else argv)]),
        "torch": torch.__version__,
        "device": str(device),
        "dtype": args.dtype,
        "clock": clock_for(device),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.models.split(","):
        results[name] = measure(name, args.rounds, lambda message: print(message, flush=True), device, dtype)
        # After the first model: ComfyUI's attention module is imported by then.
        meta["machine"] = machine(device)
        meta.update(attention=meta["machine"]["attention"], gpu_line=gpu_line(meta["machine"]))
        # Written after every model: a long run that is stopped keeps what it measured.
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        write_report(results, meta, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())
    return {"meta": meta, "results": results}


if __name__ == "__main__":
    main()
