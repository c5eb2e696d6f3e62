"""Whole sampling runs of the settings that save work on some steps only (``reuse_interval``), timed call by call.

    python -m tools.bench.unet.steps [--model sd15|sdxl] [--resolution 512] [--steps 10] [--convert 25,10]

A real ComfyUI sampling run (Euler, CFG 5, cond and uncond batched: one model call of batch 2 per step, as a
user's graph runs) on the full-size random-weight UNet, once per row: unpatched, ToDo 2, reuse_interval 2/3/4
alone and with ToDo 2 (layer reuse: ``reuse_plan`` "auto"). Every model call is timed and marked as full or
reusing (the run's own count), which gives each row's cost of a full step and of a reusing step (per step:
ComfyUI runs cond and uncond as one call or two, as its memory estimate says); the schedule of layer reuse is
fixed (it does not depend on the picture), so a whole run of any step count converts exactly from those two costs:
``steps * unpatched step / (full steps * full step + reusing steps * reusing step)``. The run's own total is the
direct timing the conversion is checked against (``direct`` vs ``converted at --steps``).

``--device`` and ``--dtype`` as in ``tools.bench.speed`` (auto: CUDA in fp16 where there is a GPU, else the CPU in
fp32). On a CUDA device every row first makes an untimed 2-step run (kernel selection, first-call costs), the
whole run is timed with CUDA events and each model call with events recorded without synchronising (read at the
run's end), and the peak memory of each row is the allocator's (above the weights, and in all).

The step caches (ComfyUI's EasyCache and LazyCache) decide from the picture which calls to skip, so their speed
is converted from the share of calls they computed on the trained reference models (the fidelity benchmark's
``calls``): a skipped call costs next to nothing, so their speed-up is about 1 / calls. ``--peers
results/fidelity-ref-sd1.json`` adds those rows (and ToDo 2 followed by EasyCache: its calls at ToDo 2's cost),
converted with this run's costs at the fidelity run's step count.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tools.common import host as bench_host
from tools.common.measure import PeakMemory, clocked, timed

ROOT = Path(__file__).resolve().parents[3]
# The reuse rows run ``reuse_plan`` "auto", whose reusing steps run the outer layers (the cost this benchmark times);
# under "forecast" (the default) a skipped step runs nothing, so its conversion needs only the full step's cost.
_LAYERS = {"method": "todo", "reuse_plan": "auto"}
ROWS = {
    "unpatched": {},
    "ToDo 2": {"method": "todo", "downsample_factor": 2.0, "reuse_interval": 1},
    "reuse every 2": {**_LAYERS, "downsample_factor": 1.0, "reuse_interval": 2},
    "reuse every 3": {**_LAYERS, "downsample_factor": 1.0, "reuse_interval": 3},
    "reuse every 4": {**_LAYERS, "downsample_factor": 1.0, "reuse_interval": 4},
    "ToDo 2 + reuse every 2": {**_LAYERS, "downsample_factor": 2.0, "reuse_interval": 2},
    "ToDo 2 + reuse every 3": {**_LAYERS, "downsample_factor": 2.0, "reuse_interval": 3},
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sd15", choices=sorted(bench_host.FAMILIES))
    parser.add_argument("--resolution", type=int, default=512, help="square image size in px")
    parser.add_argument("--steps", type=int, default=10, help="steps of each timed sampling run")
    parser.add_argument("--convert", default="25,10", help="step counts to convert to (comma list)")
    parser.add_argument("--only", default="", help="keep only rows whose name contains one of these (comma list)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's choice)")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with this process's CPU time (on a machine shared with other work; use with --threads 1)",
    )
    parser.add_argument(
        "--calls-only",
        default="",
        help="a row name: time one unpatched call, one full and one reusing call of that row (no sampling run)",
    )
    parser.add_argument(
        "--peers",
        default="",
        help="a fidelity benchmark JSON: add the step caches' rows, converted from the calls they computed there",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    parser.add_argument(
        "--attention", default="sdpa", choices=bench_host.ATTENTION_CHOICES, help="ComfyUI's attention (auto: its own)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "results" / "steps"))
    return parser.parse_args(argv)


def conditioning(family, seed: int) -> tuple[list, list]:
    """Random prompt embeddings of the family's width (and SDXL's pooled vector and size conditioning)."""
    generator = torch.Generator().manual_seed(seed + 1)

    def one():
        context = torch.randn(1, 77, family.context_dim, generator=generator)
        extra = {}
        if family.adm_channels:
            extra = {"pooled_output": torch.randn(1, 1280, generator=generator), "width": 1024, "height": 1024}
        return [[context, extra]]

    return one(), one()


class CallTimer:
    """An APPLY_MODEL wrapper that times every model call and marks it reusing when the run counted it so.

    On a CUDA device (``events``, a ``measure.EventClock``) each call is a pair of CUDA events, recorded without
    synchronising and read when ``calls`` is first asked for after the run; elsewhere the wall clock or, with
    ``cpu``, this process's CPU time."""

    def __init__(self, cpu: bool, events=None):
        self.cpu = cpu  # this process's CPU time instead of wall time
        self.events = events
        self._calls: list[tuple[float, bool]] = []
        self._pending: list[tuple[object, object, bool]] = []
        self.cache_bytes = 0  # the most the run's cache held after a call
        self.batches: list[int] = []  # the batch of every call (2: cond and uncond in one call)

    @property
    def calls(self) -> list[tuple[float, bool]]:
        """(seconds, reusing) of every call so far."""
        if self._pending:
            self._calls += [(self.events.seconds(start, end), reused) for start, end, reused in self._pending]
            self._pending = []
        return self._calls

    def _now(self):
        if self.events is not None:
            return self.events.mark()
        return time.process_time() if self.cpu else time.perf_counter()

    def __call__(self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kw):
        from tome_core.hosts.comfyui.layer_reuse import RUN_KEY

        run = getattr((transformer_options or {}).get(RUN_KEY), "run", None)
        before = run.reused_calls if run is not None else 0
        inside = run is not None and run.current is not None
        self.batches.append(int(x.shape[0]))
        start = self._now()
        out = executor(x, t, c_concat, c_crossattn, control, transformer_options, **kw)
        end = self._now()
        # Inside our wrapper the run's current call says it; outside it, the run's count went up.
        reused = run.current.reuse if inside else (run is not None and run.reused_calls > before)
        if self.events is not None:
            self._pending.append((start, end, reused))
        else:
            self._calls.append((end - start, reused))
        if run is not None:
            self.cache_bytes = max(self.cache_bytes, run.cache_bytes())
        return out


def sample(
    model,
    positive,
    negative,
    latent_hw,
    steps: int,
    seed: int,
    cpu: bool,
    device: torch.device | None = None,
    sampler: tuple[str, str] = ("euler", "normal"),
) -> tuple[float, CallTimer]:
    """One whole ComfyUI sampling run (``sampler``: sampler and scheduler, Euler on the normal schedule by
    default; CFG 5) of ``steps``: its seconds and the timer of
    its calls, which also holds the run's peak memory (``peak_mib`` above what was allocated before, and on CUDA
    ``peak_total_mib``) and, after it, the run's output (``latent``, on the CPU)."""
    import nodes as comfy_nodes

    from tools.common.measure import EventClock, clock_for

    device = device or torch.device("cpu")
    events = EventClock(device) if clock_for(device) == "cuda events" else None
    timer = CallTimer(cpu, events)
    model = model.clone()
    model.add_wrapper_with_key("apply_model", "tome_patch_bench_timer", timer)
    latent = {"samples": torch.zeros(1, 4, *latent_hw)}

    def run():
        return comfy_nodes.common_ksampler(model, seed, steps, 5.0, *sampler, positive, negative, latent)

    with PeakMemory(device) as peak:
        if cpu:
            start = time.process_time()
            out = run()
            seconds = time.process_time() - start
        else:
            seconds, _, out = clocked(run, device)
    timer.peak_mib, timer.peak_total_mib = peak.mib, peak.total_mib
    timer.latent = out[0]["samples"].float().cpu()
    return seconds, timer


def schedule_of(values: dict, patcher):
    """The layer reuse schedule a row's settings run on ``patcher``'s UNet (its family's plan)."""
    from tome_core.hosts.shared.unet_layout import attention_levels
    from tome_core.reuse import unet_schedule

    levels = attention_levels(patcher.model.diffusion_model)
    return unet_schedule(values.get("reuse_interval", 1), levels, values.get("reuse_plan", "auto"))


def per_call(patcher, values: dict, family, latent_hw, seed: int, device: torch.device | None = None) -> dict:
    """``--calls-only``: the CPU seconds of one unpatched call, one full call of the row and one reusing call,
    each a direct model call (batch 2, sigma of a mid step), for sizes where whole runs take too long. On a CUDA
    device the seconds of CUDA events instead, each call made once untimed first."""
    from tome_core.hosts.comfyui.patch import patched_unet
    from tome_core.reuse import IntervalSchedule, LayerReuseRun
    from tome_core.settings import PatchSettings

    percent_to_sigma = patcher.get_model_object("model_sampling").percent_to_sigma
    generator = torch.Generator().manual_seed(seed + 2)
    device = device or torch.device("cpu")
    x = torch.randn(2, 4, *latent_hw, generator=generator).to(device)
    context = torch.randn(2, 77, family.context_dim, generator=generator).to(device)
    kwargs = {"y": torch.randn(2, family.adm_channels, generator=generator).to(device)} if family.adm_channels else {}
    sigma = torch.full((2,), 3.0, device=device)
    model = patched_unet(patcher, PatchSettings(**values), percent_to_sigma)
    hooks = model.wrappers["apply_model"]["tome_patch_layer_reuse"][0].__self__
    import comfy.patcher_extension

    def call(m):
        # No run in the options: the wrapper leaves the call alone, and the layers follow the run set below.
        options = dict(m.model_options.get("transformer_options", {}))
        options["wrappers"] = comfy.patcher_extension.merge_nested_dicts(
            options.get("wrappers", {}), m.wrappers, copy_dict1=True
        )

        def one():
            with torch.no_grad():
                return m.model.apply_model(x, sigma, c_crossattn=context, transformer_options=options, **kwargs)

        if device.type == "cuda":
            return timed(one, device)[0]
        start = time.process_time()
        one()
        return time.process_time() - start

    # One full call records the run's entry; the next step reuses it (the schedule has no full steps after 0).
    # The patched full call goes first: a first call's one-time costs then count against the patch.
    run = LayerReuseRun(
        IntervalSchedule(values.get("reuse_interval", 3), full_start=0.0, full_end=0, min_steps=0), 4, hooks.layers
    )
    model.inject_model()
    try:
        if device.type == "cuda":  # first-call costs (kernel selection) out of the timed calls
            call(patcher)
        run.begin_call(0, "probe")
        hooks._current = run
        full = call(model)
        hooks._current = None
        run.end_call()
        unpatched = call(patcher)  # the layers' forwards run the layers as they are without a current run
        assert run.begin_call(2, "probe"), "the probe's second call must reuse"
        hooks._current = run
        reusing = call(model)
    finally:
        hooks._current = None
        model.eject_model()
    return {"unpatched_call_s": unpatched, "full_call_s": full, "reusing_call_s": reusing}


def peer_rows(fidelity_json: Path, results: dict) -> dict:
    """The step caches' rows of a fidelity run, converted to this run's costs: each computed call costs a full
    step of the row it follows (unpatched, or ToDo 2 where ours comes first), a skipped call nothing."""
    fidelity = json.loads(fidelity_json.read_text())
    base = results["unpatched"]["full_call_s"]
    peers = {}
    for record in fidelity["records"]:
        name = record["row"]
        if "Cache" not in name or record.get("work") is None or "reuse" in name:
            continue  # our reuse under a step cache: layer reuse stands down there, so not a setting a user gets
        under = "ToDo 2" if name.startswith("ours ToDo 2 +") else "unpatched"
        if under not in results:
            raise SystemExit(f"--peers: the row {name!r} needs the row {under!r} in this run (see --only)")
        calls = record["work"]["call_share"]
        peers[name] = {
            "calls": calls,
            "steps": fidelity["settings"]["steps"],
            "model": fidelity["model"],
            "speedup": base / (calls * results[under]["full_call_s"]),
        }
    return peers


def main(argv=None) -> dict:
    from tools.common.device import choose_device, choose_dtype

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = choose_device(args.device)
    dtype = choose_dtype(args.dtype, device)
    if args.cpu_time and device.type != "cpu":
        raise SystemExit("--cpu-time times the CPU's work: it needs --device cpu")
    bench_host.setup_comfy(device.type, args.attention)
    if args.calls_only:
        family = bench_host.FAMILIES[args.model]
        patcher = bench_host.build_comfy_model(family, dtype, device, args.seed)
        values = ROWS[args.calls_only]
        costs = per_call(patcher, values, family, (args.resolution // 8, args.resolution // 8), args.seed, device)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {"model": args.model, "resolution": args.resolution, "row": args.calls_only, **costs}
        result.update(device=str(device), dtype=str(dtype).replace("torch.", ""))
        if args.peers:
            # The row's full call is the call its reduction in space makes (ToDo 2 where the row has it).
            reduced = values.get("downsample_factor", 1.0) == 2.0 and values.get("method") == "todo"
            results = {"unpatched": {"full_call_s": costs["unpatched_call_s"]}}
            if reduced:
                results["ToDo 2"] = {"full_call_s": costs["full_call_s"]}
            result["peers"] = peer_rows(Path(args.peers), results)
        (out / f"calls-{args.model}-{args.resolution}.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result))
        return result
    from tome_core.hosts.comfyui.patch import patched_unet
    from tome_core.settings import PatchSettings

    def log(message):
        print(message, file=sys.stderr, flush=True)

    family = bench_host.FAMILIES[args.model]
    log(f"building {args.model} ({dtype}, {device}) ...")
    patcher = bench_host.build_comfy_model(family, dtype, device, args.seed)
    percent_to_sigma = patcher.get_model_object("model_sampling").percent_to_sigma
    positive, negative = conditioning(family, args.seed)
    latent_hw = (args.resolution // 8, args.resolution // 8)
    keep = [w.strip() for w in args.only.split(",") if w.strip()]
    rows = {
        name: values for name, values in ROWS.items() if name == "unpatched" or not keep or any(w in name for w in keep)
    }
    log("warm-up (2 steps, unpatched) ...")
    sample(patcher, positive, negative, latent_hw, 2, args.seed, args.cpu_time, device)
    results = {}
    for name, values in rows.items():
        model = patcher if not values else patched_unet(patcher, PatchSettings(**values), percent_to_sigma)
        if device.type == "cuda":  # the row's own first-call costs out of its timed run
            sample(model, positive, negative, latent_hw, 2, args.seed, args.cpu_time, device)
        total, timer = sample(model, positive, negative, latent_hw, args.steps, args.seed, args.cpu_time, device)
        full = [s for s, reused in timer.calls if not reused]
        reusing = [s for s, reused in timer.calls if reused]
        # Per step, not per call: ComfyUI may run cond and uncond as one call or as two (its memory estimate).
        full_steps = schedule_of(values, patcher).full_steps(args.steps)
        results[name] = {
            "settings": values,
            "direct_s": total,
            "calls": len(timer.calls),
            "full_call_s": sum(full) / full_steps,
            "reusing_call_s": sum(reusing) / (args.steps - full_steps) if reusing else None,
            "reusing_calls": len(reusing),
            "peak_mib": timer.peak_mib,
            "peak_total_mib": timer.peak_total_mib,
            "cache_mib": timer.cache_bytes / 2**20,
        }
        log(f"{name}: {total:.1f} s, {len(full)} full calls, {len(reusing)} reusing")
    base = results["unpatched"]
    base_call = base["full_call_s"]
    for r in results.values():
        r["direct_speedup"] = base["direct_s"] / r["direct_s"]
        schedule = schedule_of(r["settings"], patcher)
        r["converted"] = {}
        for steps in [args.steps] + [int(s) for s in args.convert.split(",") if s.strip()]:
            full = schedule.full_steps(steps)
            reusing_cost = r["reusing_call_s"] if r["reusing_call_s"] is not None else r["full_call_s"]
            time_s = full * r["full_call_s"] + (steps - full) * reusing_cost
            r["converted"][str(steps)] = {"full_steps": full, "speedup": steps * base_call / time_s}
    peers = peer_rows(Path(args.peers), results) if args.peers else {}
    meta = {
        "model": args.model,
        "resolution": args.resolution,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "clock": "process CPU time" if args.cpu_time else ("CUDA events" if device.type == "cuda" else "wall time"),
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
    }
    from tools.common.machine import gpu_line, machine, versions

    meta.update(machine=machine(device), versions=versions())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"steps-{args.model}-{args.resolution}"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": results, "peers": peers}, indent=2))
    steps_list = list(results["unpatched"]["converted"])
    head = "| row | full step s | reusing step s | peak MiB | peak total MiB | cache MiB | direct speed-up | "
    head += " | ".join(f"converted {s} steps" for s in steps_list)
    lines = [head + " |", "|---" * (7 + len(steps_list)) + "|"]
    for name, r in results.items():
        reusing = f"{r['reusing_call_s']:.2f}" if r["reusing_call_s"] is not None else "-"
        conv = " | ".join(
            f"{r['converted'][s]['speedup']:.2f}x ({r['converted'][s]['full_steps']} full)" for s in steps_list
        )
        peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-"
        total = f"{r['peak_total_mib']:.0f}" if r["peak_total_mib"] is not None else "-"
        lines.append(
            f"| {name} | {r['full_call_s']:.2f} | {reusing} | {peak} | {total} | {r['cache_mib']:.1f} | "
            f"{r['direct_speedup']:.2f}x | {conv} |"
        )
    if peers:
        lines += ["", "| row (calls computed in the fidelity run) | calls | converted speed-up |", "|---|---|---|"]
        for name, p in peers.items():
            lines.append(f"| {name} | {p['calls']:.2f} | {p['speedup']:.2f}x at {p['steps']} steps |")
    table = "\n".join(lines)
    where = gpu_line(meta["machine"]) or f"{meta['threads']} threads"
    (out / f"{stem}.md").write_text(
        f"{args.model} {args.resolution} px, {args.steps}-step runs, batch 2 (cond + uncond), {meta['dtype']} on "
        f"{meta['device']}, {where}, {meta['clock']}\n\n{table}\n"
    )
    print(table)
    return {"meta": meta, "rows": results}


if __name__ == "__main__":
    main()
