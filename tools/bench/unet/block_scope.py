"""Scope block at the two finest attention levels: speed of whole UNet evaluations, and the plans' share of them.

    python -m tools.bench.unet.block_scope [--model sd15|sdxl] [--resolutions 512] [--ratio 0.5] [--repeats 2]

The rows are those ``tools.bench.speed`` adds for this (``bench_rows.block_scope_rows``): the unpatched UNet,
ToMe scope block and ToMe scope self-attention, both at the two finest attention levels (SD1.x: 1 and 2, SDXL:
2 and 4, i.e. ``max_downsample`` 2 and 4) and the same ratio, each through the ``patched_unet`` the ComfyUI
node calls, on the full-size ComfyUI UNet with random weights. Rows are interleaved as in the benchmark, the
first call of each untimed. During every call the time spent making merge plans is summed (a timer around
``tome_core.matching.make_plan``), which gives the plans per evaluation and their share of it: scope block
makes one plan per level and call, scope self-attention one per block. This is the quick way to the issue's
figures; ``tools.bench.speed`` runs the same rows among all the others.

Each call is timed twice: wall time, and the CPU time of this process (``time.process_time``, all threads).
On a machine shared with other jobs the wall time mostly measures waiting for a core; the CPU time still
measures the work, so its ratios are the better estimate of the speed-up on an idle machine. With more than one
thread it does not: OpenMP threads that wait for a partner without a core spin, and the spinning counts as CPU
time, so on a busy machine measure CPU time with ``--threads 1``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from tools.common import host as bench_host


class PlanTimer:
    """Sums the seconds (wall and this process's CPU time) and calls of ``matching.make_plan`` while active."""

    def __init__(self):
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.calls = 0

    def __enter__(self):
        from tome_core import matching

        self._module, self._real = matching, matching.make_plan

        def make_plan(*args, **kwargs):
            start, cpu_start = time.perf_counter(), time.process_time()
            try:
                return self._real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.cpu_seconds += time.process_time() - cpu_start
                self.calls += 1

        matching.make_plan = make_plan
        return self

    def __exit__(self, *exc):
        self._module.make_plan = self._real
        return False


def inputs(family, size: tuple[int, int], seed: int) -> dict:
    """One random latent, timestep 500, 77 random text tokens (and SDXL's vector), as ``tools.bench.speed``."""
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, 4, (size[0] + 7) // 8, (size[1] + 7) // 8, generator=generator)
    context = torch.randn(1, 77, family.context_dim, generator=generator)
    y = torch.randn(1, family.adm_channels, generator=generator) if family.adm_channels else None
    return {"x": x, "timesteps": torch.full((1,), 500.0), "context": context, "y": y}


def call_row(row, batch: dict) -> tuple[float, float, PlanTimer]:
    """One evaluation of ``row`` (entered and left around it, untimed): wall seconds, CPU seconds of this process
    (all its threads), and its plan time."""
    row.enter()
    try:
        with torch.inference_mode(), PlanTimer() as timer:
            args = (batch["x"], batch["timesteps"], batch["context"], batch["y"])
            gc.collect()  # as bench_measure.timed, but outside both clocks
            start, cpu_start = time.perf_counter(), time.process_time()
            row.run(*args)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        row.leave()
    return seconds, cpu_seconds, timer


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sd15", choices=sorted(bench_host.FAMILIES))
    parser.add_argument("--resolutions", default="512", help="square image sizes in px, comma list")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", default="", help="keep only rows whose name contains one of these (comma list)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads (0: torch's default). Use 1 for CPU time on a busy machine: waiting OpenMP threads "
        "spin and count as CPU time when their partner thread has no core",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bench_host.setup_comfy("cpu")
    from tome_core.hosts.shared.unet_layout import attention_levels

    from . import rows as R

    def log(message):
        print(message, file=sys.stderr, flush=True)

    family = bench_host.FAMILIES[args.model]
    log(f"building {args.model} ...")
    patcher = bench_host.build_comfy_model(family, torch.float32, torch.device("cpu"), args.seed)
    max_downsample = sorted(attention_levels(patcher.model.diffusion_model))[:2][-1]
    ms = patcher.get_model_object("model_sampling")

    def sigma_of(timesteps):
        return ms.sigma(timesteps.float())

    rows = [R.Row("unpatched", "unpatched", "comfy", R.comfy_runner(patcher, sigma_of))]
    rows += R.block_scope_rows(patcher, sigma_of, max_downsample, args.ratio, {})
    if args.only:
        keep = [part.strip() for part in args.only.split(",") if part.strip()]
        rows = [row for row in rows if row.group == "unpatched" or any(k in row.name for k in keep)]
    records = []
    print(
        "| px | row | wall s / eval | speed-up (wall) | CPU s / eval | speed-up (CPU) | plans / eval | "
        "plan CPU ms / eval | plan share (CPU) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for side in (int(s) for s in args.resolutions.split(",") if s.strip()):
        batch = inputs(family, (side, side), args.seed)
        times = {row.name: [] for row in rows}
        cpu_times = {row.name: [] for row in rows}
        plans = {row.name: [] for row in rows}

        for row in rows:  # warm-up
            call_row(row, batch)
            log(f"  {side} px warm-up {row.name}")
        for round_index in range(args.repeats):
            start = round_index % len(rows)
            for row in rows[start:] + rows[:start]:
                seconds, cpu_seconds, timer = call_row(row, batch)
                times[row.name].append(seconds)
                cpu_times[row.name].append(cpu_seconds)
                plans[row.name].append((timer.calls, timer.cpu_seconds))
            log(f"  {side} px round {round_index + 1}: " + ", ".join(f"{n} {t[-1]:.1f}s" for n, t in times.items()))
        base = statistics.median(times["unpatched"])
        cpu_base = statistics.median(cpu_times["unpatched"])
        for row in rows:
            median = statistics.median(times[row.name])
            cpu_median = statistics.median(cpu_times[row.name])
            calls = plans[row.name][-1][0]
            plan_s = statistics.median(p[1] for p in plans[row.name])
            record = {
                "px": side,
                "row": row.name,
                "median_s": median,
                "times_s": times[row.name],
                "speedup": base / median,
                "cpu_median_s": cpu_median,
                "cpu_times_s": cpu_times[row.name],
                "cpu_speedup": cpu_base / cpu_median,
                "plans_per_eval": calls,
                "plan_cpu_s_per_eval": plan_s,
                "plan_share": plan_s / cpu_median,
            }
            records.append(record)
            print(
                f"| {side} | {row.name} | {median:.2f} | {base / median:.2f}x | {cpu_median:.2f} | "
                f"{cpu_base / cpu_median:.2f}x | {calls} | {plan_s * 1e3:.1f} | {plan_s / cpu_median:.1%} |",
                flush=True,
            )
    log(f"({args.model}, fp32, cpu, {torch.get_num_threads()} threads, {args.repeats} timed calls per row)")
    return records


if __name__ == "__main__":
    main()
