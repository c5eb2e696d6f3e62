"""``python -m tools.bench.dit.whole``: whole ComfyUI sampling runs of full-depth DiTs, unpatched and with reuse.

The GPU table's DiT part (``tools/gpu_bench.sh --dit-whole ...``; docs/dit-measurements.md, "On a GPU"). Each model is
built at its full depth and width with ComfyUI's own class (0.3.75), random weights drawn on the device, in ``--dtype``
(bf16), and sampled through ComfyUI's ``common_ksampler`` under ``torch.inference_mode()`` as ComfyUI's executor runs a
prompt (ComfyUI's ``uni_pc`` has no ``no_grad`` of its own: without it every block's activations are kept). ComfyUI runs
in its high-VRAM mode: the weights are made on the device and stay there (its usual mode would count them as not loaded
yet and load part of them on each call). Rows, each one whole run of the family's steps:
- unpatched (timed first and last: the speed-ups are against the mean of the two);
- ours default: the node's defaults (``dit_settings`` auto: the family's reuse interval for the step count);
- ours every N (``dit_settings`` "as set", ``downsample_factor`` 1) at the family's two other intervals;
- where the family's default guards its reusing steps by the first block's output (Qwen-Image), the default's plan
  without the guard too: on random weights the guard runs most steps in full (the block outputs move as fast as
  noise does), so the default's row is its worst case and this row its best.
Every row first runs 2 steps untimed (first-call costs, kernel choice). Each row gives its seconds (CUDA events on
a GPU), its peak memory above the weights and in all, its model calls and how many ran the blocks in full (calls
of a block in the middle of the span), and its final latent's relative L2 to the unpatched run's (random weights:
a proxy of nothing but plumbing). ComfyUI's EasyCache is not timed: on random weights its output changes from step
to step as fast as noise does, so its threshold never lets it skip a step (it needs a trained model's slow change).

Models (``--models``, in order; one on the device at a time; a model whose unpatched run would not fit in the time
left is skipped and said so):
- flux2: Flux.2 dev (width 6144, 48 heads, 8 double + 48 single blocks), 1024 px (4096 tokens of 128 channels),
  512 text tokens of 15360, guidance 4, CFG 1, 28 Euler steps, simple schedule;
- flux1: Flux.1 dev (width 3072, 19 double + 38 single blocks), 1024 px, 512 text tokens of 4096, guidance 3.5,
  CFG 1, 28 Euler steps (not in the default list: its whole runs were timed before the curve's plan);
- qwen-image: Qwen-Image (60 blocks, 24 heads of 128), 1024 px, 64 text tokens of 3584 (prompt and negative),
  CFG 4, 50 Euler steps;
- wan: Wan 2.1 1.3B (30 blocks, width 1536), 480 x 832 px, 33 frames, 512 text tokens, CFG 5, 30 ``uni_pc`` steps;
- hunyuan-video-15: HunyuanVideo 1.5 (54 double blocks, width 2048), 480 x 848 px, 33 frames (9 x 30 x 53
  latents of 32 channels, patch 1), 128 text tokens of 3584, CFG 6, 50 Euler steps;
- tiny-flux1, tiny-flux2, tiny-qwen-image: the same code on small models (``--device cpu``: the tests run
  tiny-qwen-image).
Results: ``--out``/dit-whole.md and .json, rewritten after each model.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from .todo import FULL_DEPTH
from .todo import MODELS as PER_CALL

RESULTS = Path(__file__).resolve().parents[3] / "results" / "gpu"


def full_width(name: str) -> dict:
    """The ComfyUI config of a model of ``tools.bench.dit`` (its real width) with all its blocks."""
    return {**PER_CALL[name]["config"], **FULL_DEPTH[name][0]}


# What a whole run of each model is: its ComfyUI config, latent (without the batch axis), text tokens and width,
# the conditioning's other entries, sampler, scheduler, CFG, steps and the two intervals timed beside the default.
MODELS = {
    "flux2": {
        "title": "Flux.2 dev (8 double + 48 single blocks, width 6144), 1024 px",
        "config": {
            "image_model": "flux2",
            "in_channels": 128,
            "out_channels": 128,
            "hidden_size": 6144,
            "num_heads": 48,
            "axes_dim": [32, 32, 32, 32],
            "depth": 8,
            "depth_single_blocks": 48,
            "context_in_dim": 15360,
            "vec_in_dim": None,
            "patch_size": 1,
            "mlp_ratio": 3.0,
            "theta": 2000,
            "qkv_bias": False,
            "guidance_embed": True,
            "global_modulation": True,
            "mlp_silu_act": True,
            "ops_bias": False,
            "default_ref_method": "index",
            "ref_index_scale": 10.0,
        },
        "latent": (128, 64, 64),
        "text": (512, 15360),
        "extra": {"guidance": 4.0, "pooled_output": None},
        "sampler": ("euler", "simple"),
        "cfg": 1.0,
        "steps": 28,
        "intervals": (4, 6),
    },
    "flux1": {
        "title": "Flux.1 dev (19 double + 38 single blocks, width 3072), 1024 px",
        "config": full_width("flux"),
        "latent": (16, 128, 128),
        "text": (512, 4096),
        "extra": {"guidance": 3.5, "pooled_output": torch.zeros(1, 768)},
        "sampler": ("euler", "simple"),
        "cfg": 1.0,
        "steps": 28,
        "intervals": (4, 6),
    },
    "qwen-image": {
        "title": "Qwen-Image (60 blocks, width 3072), 1024 px",
        "config": full_width("qwen-image"),
        "latent": (16, 128, 128),
        "text": (64, 3584),
        "extra": {},
        "sampler": ("euler", "simple"),
        "cfg": 4.0,
        "steps": 50,
        "intervals": (3, 6),
    },
    "wan": {
        "title": "Wan 2.1 1.3B (30 blocks, width 1536), 480x832, 33 frames",
        "config": full_width("wan"),
        "latent": (16, 9, 60, 104),
        "text": (512, 4096),
        "extra": {},
        "sampler": ("uni_pc", "simple"),
        "cfg": 5.0,
        "steps": 30,
        "intervals": (4, 6),
    },
    "hunyuan-video-15": {
        "title": "HunyuanVideo 1.5 (54 blocks, width 2048), 480x848, 33 frames",
        "config": full_width("hunyuan-video15"),
        "latent": (32, 9, 30, 53),
        "text": (128, 3584),
        "extra": {"pooled_output": None},
        "sampler": ("euler", "simple"),
        "cfg": 6.0,
        "steps": 50,
        "intervals": (3, 6),
    },
}
# Small models of the same classes: the tests' check of this code on the CPU.
MODELS["tiny-flux2"] = {
    **MODELS["flux2"],
    "title": "tiny Flux.2 (2 + 2 blocks, width 32), 64 px",
    "config": {
        **MODELS["flux2"]["config"],
        "hidden_size": 32,
        "num_heads": 2,
        "axes_dim": [4, 4, 4, 4],
        "depth": 2,
        "depth_single_blocks": 2,
        "context_in_dim": 64,
    },
    "latent": (128, 4, 4),
    "text": (8, 64),
    "steps": 12,
}
MODELS["tiny-flux1"] = {
    **MODELS["flux1"],
    "title": "tiny Flux.1 (2 + 2 blocks, width 64), 64 px",
    "config": {**PER_CALL["tiny-flux"]["config"], "depth": 2, "depth_single_blocks": 2},
    "latent": (16, 8, 8),
    "text": (8, 32),
    "extra": {"guidance": 3.5, "pooled_output": torch.zeros(1, 16)},
    "steps": 12,
}
MODELS["tiny-qwen-image"] = {
    **MODELS["qwen-image"],
    "title": "tiny Qwen-Image (4 blocks, width 32), 64 px",
    "config": {
        **MODELS["qwen-image"]["config"],
        "num_layers": 4,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 64,
        "axes_dims_rope": [4, 6, 6],
    },
    "latent": (16, 8, 8),
    "text": (8, 64),
    "steps": 12,
}
GPU_MODELS = "flux2,qwen-image,wan,hunyuan-video-15"
EASYCACHE_NOTE = (
    "ComfyUI's EasyCache is not timed: on random weights the output changes between steps as fast as noise, so "
    "its threshold never lets it skip a step (it needs a trained model's slow change; its fidelity rows are in "
    "docs/dit.md)."
)


def build(name: str, device: torch.device, dtype: torch.dtype):
    """A ModelPatcher over the model, made on ``device`` in ``dtype`` with random weights drawn there."""
    import comfy.model_detection
    import comfy.model_patcher

    from tools.common.host import initialise

    config = comfy.model_detection.model_config_from_unet_config(dict(MODELS[name]["config"]))
    if config is None:
        raise RuntimeError(f"ComfyUI does not detect {name}'s config")
    config.set_inference_dtype(dtype, None)
    model = config.get_model({}, device=device)
    model.to(device)
    initialise(model.diffusion_model, 0, device=device)
    model.eval()
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)


def conditioning(name: str, seed: int) -> tuple[list, list]:
    """Positive and negative conditioning: random text features of the family's width (the same length, so that
    ComfyUI may run both in one call, as it does for a user's prompts of one length)."""
    spec = MODELS[name]
    generator = torch.Generator().manual_seed(seed)
    made = []
    for _ in range(2):
        text = torch.randn(1, *spec["text"], generator=generator)
        made.append([[text, dict(spec["extra"])]])
    return made[0], made[1]


def middle_block(diffusion_model) -> torch.nn.Module:
    """A block in the middle of the model's block lists: it runs only in calls computed in full."""
    from tome_core.hosts.comfyui import dit_reuse

    layout = dit_reuse.layout_of(diffusion_model)
    blocks = [block for _, attribute in layout.lists for block in getattr(diffusion_model, attribute)]
    return blocks[len(blocks) // 2]


def rows(patcher, name: str) -> list[tuple[str, object, dict]]:
    """(name, model, settings) of each row."""
    from tome_core import PatchSettings
    from tome_core.hosts.comfyui import dit_reuse
    from tome_core.hosts.comfyui.patch import patch_model
    from tome_core.hosts.shared import dit_families

    made = [("unpatched", patcher, {})]
    default = PatchSettings()
    made.append(("ours default (dit_settings auto)", patch_model(patcher, default), {"dit_settings": "auto"}))
    record = dit_families.family(dit_reuse.layout_of(patcher.model.diffusion_model).family)
    unguarded = None
    if record.guarded_by_first_block:
        # On random weights the first block's output moves as fast as noise, so the guard runs most steps in full:
        # the default's plan without the guard is its best case, the speed where a trained model moves slowly.
        interval = unguarded = record.auto_schedule().interval(MODELS[name]["steps"])
        values = {"method": "todo", "downsample_factor": 1.0, "reuse_interval": interval, "dit_settings": "as set"}
        title = f"ours default's plan without its guard (every {interval})"
        made.append((title, patch_model(patcher, PatchSettings.from_values(**values)), values))
    for interval in MODELS[name]["intervals"]:
        if interval == unguarded:
            continue  # the same plan as the row above
        values = {"method": "todo", "downsample_factor": 1.0, "reuse_interval": interval, "dit_settings": "as set"}
        made.append((f"ours every {interval}", patch_model(patcher, PatchSettings.from_values(**values)), values))
    return made


class Sampler:
    """Whole sampling runs of one model: one ``run`` is ``common_ksampler`` as the KSampler node calls it."""

    def __init__(self, name: str, patcher, device: torch.device, seed: int, steps: int):
        self.name, self.patcher, self.device, self.seed, self.steps = name, patcher, device, seed, steps
        self.spec = MODELS[name]
        self.positive, self.negative = conditioning(name, seed)
        self.counts = {"calls": 0, "full": 0}
        diffusion_model = patcher.model.diffusion_model
        self._hooks = [
            diffusion_model.register_forward_pre_hook(lambda *_: self._count("calls")),
            middle_block(diffusion_model).register_forward_pre_hook(lambda *_: self._count("full")),
        ]

    def _count(self, key: str) -> None:
        self.counts[key] += 1

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()

    def run(self, model, steps: int):
        import nodes as comfy_nodes

        sampler, scheduler = self.spec["sampler"]
        latent = {"samples": torch.zeros(1, *self.spec["latent"])}
        with torch.inference_mode():
            out = comfy_nodes.common_ksampler(
                model,
                self.seed,
                steps,
                self.spec["cfg"],
                sampler,
                scheduler,
                self.positive,
                self.negative,
                latent,
            )
        return out[0]["samples"]

    def measure(self, model) -> dict:
        """One whole run, after a 2-step run: its seconds, peak memory, calls and final latent."""
        from tools.common.measure import PeakMemory, clocked

        self.run(model, 2)
        self.counts.update(calls=0, full=0)
        with PeakMemory(self.device) as peak:
            seconds, _, latent = clocked(lambda: self.run(model, self.steps), self.device)
        return {
            "seconds": seconds,
            "peak_mib": peak.mib,
            "peak_total_mib": peak.total_mib,
            "model_calls": self.counts["calls"],
            "full_calls": self.counts["full"],
            "latent": latent.float().cpu(),
        }


class NotInTimeError(Exception):
    """The model's runs would not end before the deadline."""


# A model's runs take about this many unpatched runs: two unpatched, three with reuse (each under half of one),
# and the 2-step runs before each.
UNPATCHED_RUNS_PER_MODEL = 4.0


def measure_model(name: str, device, dtype, seed: int, steps: int | None, deadline: float, log) -> dict:
    from tools.common.measure import clocked, relative_l2

    started = time.perf_counter()
    patcher = build(name, device, dtype)
    built_s = time.perf_counter() - started
    steps = steps or MODELS[name]["steps"]
    sampler = Sampler(name, patcher, device, seed, steps)
    records = []
    try:
        sampler.run(patcher, 2)  # first-call costs; then 2 steps timed give the guess of the model's time
        two_steps, _, _ = clocked(lambda: sampler.run(patcher, 2), device)
        guess = two_steps / 2 * steps * UNPATCHED_RUNS_PER_MODEL
        if time.perf_counter() + guess > deadline:
            left = max(0.0, deadline - time.perf_counter())
            raise NotInTimeError(f"about {guess / 60:.1f} min needed, {left / 60:.1f} min left of --max-minutes")
        made = rows(patcher, name)
        for row, model, settings in [*made, made[0]]:
            record = sampler.measure(model)
            record.update(row=row, settings=settings)
            records.append(record)
            calls = f"calls {record['model_calls']}, full {record['full_calls']}"
            log(f"  {name} {row}: {record['seconds']:.2f} s, {calls}")
    finally:
        sampler.close()
    first, last = records[0], records.pop()
    unpatched_s = (first["seconds"] + last["seconds"]) / 2
    first["seconds_again"] = last["seconds"]
    reference = first["latent"]
    for record in records:
        latent = record.pop("latent")
        record["speedup"] = unpatched_s / record["seconds"]
        record["deviation"] = relative_l2(latent, reference)
        calls_per_step = max(1, round(first["model_calls"] / steps))
        record["full_steps"] = record["full_calls"] / calls_per_step
    last.pop("latent")
    weights = sum(p.numel() for p in patcher.model.diffusion_model.parameters())
    return {
        "model": name,
        "title": MODELS[name]["title"],
        "steps": steps,
        "sampler": list(MODELS[name]["sampler"]),
        "cfg": MODELS[name]["cfg"],
        "parameters": weights,
        "build_s": round(built_s, 1),
        "unpatched_s": unpatched_s,
        "rows": records,
    }


def markdown(report: dict) -> str:
    lines = [
        "# Whole DiT runs on a GPU",
        "",
        f"{report['machine']}. torch {report['torch']}, ComfyUI {report['comfyui']}; {report['dtype']}; "
        f"{report['date']}. `{report['command']}`.",
        "",
        "One whole ComfyUI sampling run per row (after a 2-step run), through `common_ksampler` under "
        "`torch.inference_mode()`, random weights at full depth. Speed-up: against the mean of the unpatched run "
        "before the rows and after them (the second figure in its row). Full steps: the steps whose call ran "
        "every block. Peak MiB: above what was allocated before the run (the weights); total: in all. dev.: "
        "relative L2 of the final latent against the unpatched run's (random weights: plumbing only). "
        + EASYCACHE_NOTE,
        "",
        "| model | steps, sampler, CFG | row | s / run | speed-up | full steps | calls | peak MiB | peak total MiB | "
        "dev. |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in report["models"]:
        how = f"{entry['steps']}, {entry['sampler'][0]} {entry['sampler'][1]}, {entry['cfg']:g}"
        for r in entry["rows"]:
            seconds = f"{r['seconds']:.2f}"
            if "seconds_again" in r:
                seconds += f" / {r['seconds_again']:.2f}"
            peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
            total = "-" if r["peak_total_mib"] is None else f"{r['peak_total_mib']:.0f}"
            lines.append(
                f"| {entry['title']} | {how} | {r['row']} | {seconds} | {r['speedup']:.2f}x | "
                f"{r['full_steps']:g} | {r['model_calls']} | {peak} | {total} | {r['deviation']:.3f} |"
            )
    for skipped in report["skipped"]:
        lines += ["", f"Not measured: {skipped}."]
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "dit-whole.md"
    path.write_text(markdown(report))
    (out / "dit-whole.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return path


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.dit.whole", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=GPU_MODELS, help="comma list of: " + ", ".join(MODELS))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--steps", type=int, default=0, help="steps of every run (0: each model's own)")
    parser.add_argument("--max-minutes", type=float, default=10.0, help="models that would not fit are skipped")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    args.command = " ".join(["python -m tools.bench.dit.whole", *(sys.argv[1:] if argv is None else argv)])
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(MODELS)})")

    from tools.common.device import choose_device
    from tools.common.host import setup_comfy

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    device = choose_device(args.device)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    setup_comfy(device.type)
    import comfy.model_management
    import comfy.utils

    comfy.utils.set_progress_bar_enabled(False)
    # ComfyUI's --highvram, set here as it may have been imported already (the GPU table runs this after its
    # UNets): load_models_gpu reads it at each call.
    normal_state = comfy.model_management.vram_state
    comfy.model_management.vram_state = comfy.model_management.VRAMState.HIGH_VRAM
    try:
        return _measure_all(args, names, device, dtype, started, log)
    finally:
        comfy.model_management.vram_state = normal_state


def _measure_all(args, names: list[str], device, dtype, started: float, log) -> dict:
    import comfy.model_management

    from tools.common import machine as bench_machine

    deadline = started + 60.0 * args.max_minutes
    machine = bench_machine.machine(device)
    versions = bench_machine.versions()
    report = {
        "machine": bench_machine.gpu_line(machine) or machine["cpu"],
        "torch": versions["torch"],
        "comfyui": versions["comfyui"],
        "dtype": args.dtype,
        "date": machine["date"],
        "command": args.command,
        "models": [],
        "skipped": [],
    }
    out = Path(args.out)
    for name in names:
        log(f"{name}: building ({dtype}, {device}) ...")
        try:
            report["models"].append(measure_model(name, device, dtype, args.seed, args.steps or None, deadline, log))
        except Exception as err:  # noqa: BLE001  (one model's failure, out of memory included, ends only its rows)
            words = str(err).splitlines()[0] if str(err) else type(err).__name__
            report["skipped"].append(f"{MODELS[name]['title']} ({words})")
            log(f"  {name} skipped: {report['skipped'][-1]}")
        comfy.model_management.unload_all_models()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report["minutes_total"] = round((time.perf_counter() - started) / 60.0, 2)
        write(report, out)
    path = write(report, out)
    print(path.read_text())
    return report


if __name__ == "__main__":
    main()
