"""``python -m tools.bench.dit.reuse``: what reuse across steps saves on full-width DiTs, over whole runs.

A reusing call runs the model's first block and the parts around the blocks (embeddings, the final layer), and
adds the predicted residual; a full call runs every block. Both are timed here, in A/B pairs, on full-width
models of ComfyUI's own classes (``tools.bench.dit``'s configurations, random weights) with four blocks (Flux: 2
double + 2 single; SD3.5 Medium and Wan 2.1 1.3B: 4), through this project's own code (``dit_reuse.install`` and
the sampling run's wrappers, driven call by call: full, full, then reusing and full in turn). The two timings
give the cost of the span's three blocks (SD3: two; full minus reusing) and of everything a reusing call runs; the whole
model's full call is then that plus the other blocks at the measured cost per block (Flux's double and single
blocks counted alike: 12 multiply-adds per token and width squared each), and a whole run of N steps costs
``full calls x full + reusing calls x reusing`` with the DiT schedule at ``reuse_interval`` 3 and 6 on the
model's own sigmas (ComfyUI's ``simple`` scheduler; Wan with ``uni_pc``, whose calls below noise 0.5 run in
full). Speed-ups are taken on process CPU time, as in ``tools.bench.dit``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from tools.common.host import setup_comfy
from tools.common.measure import clocked

from .todo import MODELS, build, cpu_name

RESULTS = Path(__file__).resolve().parents[3] / "results"

# Four blocks each, and the full depth with the step counts users run.
FOUR_BLOCKS = {
    "flux": ({"depth": 2, "depth_single_blocks": 2}, 19 + 38, (28, 50)),
    "sd35m": ({"num_blocks": 4}, 24, (28,)),
    "wan": ({"num_layers": 4}, 30, (30,)),
    "tiny-flux": ({"depth": 2, "depth_single_blocks": 2}, 19 + 38, (28,)),  # the tests' plumbing check
}
INTERVALS = (3, 6)  # the default, and a setting for speed
SAMPLERS = {"wan": "uni_pc"}  # the sampler each model's runs are counted with (default: euler)
WAN_33_FRAMES = (16, 9, 60, 104)  # 480 x 832 px, 33 frames: (33 - 1) / 4 + 1 latent frames


def four_block_title(name: str) -> str:
    """The model's title in ``tools.bench.dit`` with this measurement's block count and size."""
    title = MODELS[name]["title"].replace("1 double + 1 single block", "2 double + 2 single blocks")
    title = title.replace("1 of 30 blocks", "4 of 30 blocks").replace("2 of 24 joint blocks", "4 of 24 joint blocks")
    return title.replace("17 frames", "33 frames") if name == "wan" else title


def reusing_model(name: str):
    """The four-block model and its clone with reuse on a schedule that alternates from step 2 on."""
    from tome_core.hosts.comfyui import dit_reuse
    from tome_core.reuse import IntervalSchedule
    from tome_core.schedule import NoiseRange
    from tome_core.settings import PatchSettings

    config, _, _ = FOUR_BLOCKS[name]
    MODELS[name]["config"].update(config)
    if name == "wan":
        MODELS[name]["latent"] = WAN_33_FRAMES
    base = build(name)
    clone = base.clone()
    settings = PatchSettings(method="todo", downsample_factor=1.0, reuse_interval=2)
    schedule = IntervalSchedule(2, full_start=0.0, full_end=0, short_run=0, min_steps=0)
    if not dit_reuse.install(clone, settings, NoiseRange(0.0, 1.0, lambda p: p), schedule):
        raise RuntimeError(f"reuse does not install on {name}")
    return base, clone


def calls_of(patcher, name: str, steps: int):
    """``call(step)``: one model evaluation of a sampling run of ``steps`` steps (its own run object)."""
    import comfy.patcher_extension

    from tome_core.hosts.comfyui.layer_reuse import RUN_KEY, RunState

    hooks = patcher.wrappers["apply_model"]["tome_patch_layer_reuse"][0].__self__
    run = hooks.new_run(steps)
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    spec = MODELS[name]
    generator = torch.Generator().manual_seed(1)
    latent = torch.randn(1, *spec["latent"], generator=generator)
    context = torch.randn(1, *spec["text"], generator=generator)
    kwargs = {}
    if spec["pooled"]:
        kwargs["y"] = torch.randn(1, spec["pooled"], generator=generator)
    if spec["config"].get("guidance_embed"):
        kwargs["guidance"] = torch.full((1,), 3.5)

    def call(step: int):
        options = dict(patcher.model_options.get("transformer_options", {}))
        options["wrappers"] = comfy.patcher_extension.merge_nested_dicts(
            options.get("wrappers", {}), patcher.wrappers, copy_dict1=True
        )
        options[RUN_KEY] = RunState(run, sigmas)
        sigma = sigmas[step : step + 1]
        with torch.inference_mode():
            return patcher.model.apply_model(latent, sigma, c_crossattn=context, transformer_options=options, **kwargs)

    return call, run


def full_steps(clone, name: str, steps: int, interval: int) -> int:
    """How many of a run's ``steps`` the DiT schedule runs in full on the model's own sigmas."""
    import comfy.samplers

    from tome_core.reuse import NoiseSpacedSchedule, decide

    sampler = SAMPLERS.get(name, "euler")
    sampling = clone.get_model_object("model_sampling")
    if sampler in comfy.samplers.KSampler.DISCARD_PENULTIMATE_SIGMA_SAMPLERS:  # as ComfyUI samples uni_pc
        sigmas = comfy.samplers.calculate_sigmas(sampling, "simple", steps + 1)
        sigmas = torch.cat([sigmas[:-2], sigmas[-1:]])
    else:
        sigmas = comfy.samplers.calculate_sigmas(sampling, "simple", steps)
    levels = [float(s) for s in sigmas[:steps]]
    plan = NoiseSpacedSchedule(interval).for_run(steps, levels, decide(None, sampler, None, dit=True).full_below)
    return plan.full_steps(steps)


def span_length(clone) -> int:
    """How many blocks the clone's reusing calls skip."""
    from tome_core.hosts.comfyui import dit_reuse

    return sum(isinstance(block, dit_reuse.SpanBlock) for block in dit_reuse._replacements(clone).values())


def measure(name: str, rounds: int, log) -> dict:
    _, clone = reusing_model(name)
    steps = 2 + 2 * rounds
    call, run = calls_of(clone, name, steps)
    call(0)  # full, recorded (and the first-call costs)
    call(1)  # full: now a line to predict on
    full_cpu, reuse_cpu, ratios = [], [], []
    for r in range(rounds):
        reusing_step = 2 + 2 * r
        _, reuse_s, _ = clocked(lambda step=reusing_step: call(step), torch.device("cpu"))
        _, full_s, _ = clocked(lambda step=reusing_step + 1: call(step), torch.device("cpu"))
        reuse_cpu.append(reuse_s)
        full_cpu.append(full_s)
        ratios.append(full_s / reuse_s)
        log(f"{name} round {r + 1}: full {full_s:.2f} s CPU, reusing {reuse_s:.2f} s CPU")
    if run.reused_calls != rounds:
        raise RuntimeError(f"{name}: {run.reused_calls} reusing calls, expected {rounds}")
    full, reuse = statistics.median(full_cpu), statistics.median(reuse_cpu)
    span = span_length(clone)  # the blocks of the four a reusing call skips (SD3: two, its last block runs)
    per_block = (full - reuse) / span
    _, depth, step_counts = FOUR_BLOCKS[name]
    whole_full = reuse + (depth - (4 - span)) * per_block
    # A span that timed no dearer than the reusing call (timing noise on a small model or a busy machine) gives
    # no cost per block to convert with: the speed-ups are then left out (None) and the record says so.
    measured = per_block > 0
    runs = {}
    for n in step_counts:
        for interval in INTERVALS:
            computed = full_steps(clone, name, n, interval)
            cost = computed * whole_full + (n - computed) * reuse
            speedup = n * whole_full / cost if measured else None
            runs[f"{n} steps, every {interval}"] = {"full_steps": computed, "speedup": speedup}
    return {
        "title": four_block_title(name),
        "four_blocks_full_cpu_s": full,
        "four_blocks_reusing_cpu_s": reuse,
        "per_block_cpu_s": per_block,
        "depth": depth,
        "whole_model_full_cpu_s": whole_full,
        "reusing_share_of_full": reuse / whole_full,
        "runs": runs,
        "measured": measured,
        "full_cpu_s": full_cpu,
        "reusing_cpu_s": reuse_cpu,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.dit.reuse", description=__doc__)
    parser.add_argument("--models", default="flux,sd35m,wan", help="comma-separated: " + ", ".join(FOUR_BLOCKS))
    parser.add_argument("--rounds", type=int, default=2, help="A/B pairs of a reusing and a full call")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's choice)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    setup_comfy("cpu")

    def log(message):
        print(message, flush=True)

    results = {"cpu": cpu_name(), "torch": torch.__version__, "models": {}}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        results["models"][name] = measure(name, args.rounds, log)
    print("| model | full call (whole model) | reusing call | share | " + "whole run |")
    print("|---|---|---|---|---|")
    for r in results["models"].values():
        runs = ", ".join(
            f"{n}: {v['speedup']:.2f}x ({v['full_steps']} full)" if r["measured"] else f"{n}: not measured"
            for n, v in r["runs"].items()
        )
        print(
            f"| {r['title']} | {r['whole_model_full_cpu_s']:.1f} s | {r['four_blocks_reusing_cpu_s']:.1f} s | "
            f"{r['reusing_share_of_full']:.3f} | {runs} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dit-reuse.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
