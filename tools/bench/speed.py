"""Benchmark of the patch against the unpatched UNet, its peers and the ceiling, on this machine.

    python -m tools.bench.speed [--model sd15|sdxl] [--resolutions 512,768] [--repeats 2] [--max-minutes 20] ...
    python -m tools.bench.speed --host diffusers ...   (diffusers' UNet: tools/bench/unet/diffusers_path.py)

Every row runs in this one process on the same random-weight UNet and the same inputs. First every row is
called once, untimed, at every size (warm-up; it gives the output deviation, the peak memory and a first cost
estimate). Then each row is timed in A/B pairs with its own unpatched row (``bench_pairs``): its speed-up is the
median of the pairs' ratios, repeated until every row's spread is within ``--spread`` or the time runs out.
Finally a verdict (``bench_verdict``): a run on a busy machine, with spreads left too wide, or with an
impossible ordering is marked ``UNRELIABLE:`` with its reasons. Outputs go to ``--out`` (default ``results/``):
a markdown table (also printed), a JSON file with the machine, versions and every figure, and a PNG chart of
speed-up versus resolution.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from tools.common import host as bench_host
from tools.common import machine as bench_machine
from tools.common.device import choose_device, choose_dtype
from tools.common.measure import PeakMemory, clocked, relative_l2

from . import (
    load as bench_load,
)
from . import (
    pairs as bench_pairs,
)
from . import (
    report as bench_report,
)
from . import (
    verdict as bench_verdict,
)

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sd15", choices=sorted(bench_host.FAMILIES))
    parser.add_argument("--host", default="comfy", choices=["comfy", "diffusers"], help="whose UNet classes to run")
    parser.add_argument("--resolutions", default="512,768", help="image sizes in px: 768 or 1024x768, comma list")
    parser.add_argument("--batch", type=int, default=1, help="UNet batch (2 = one image with cfg)")
    parser.add_argument("--repeats", type=int, default=2, help="A/B pairs per row and resolution, at least")
    parser.add_argument(
        "--max-minutes", type=float, default=20.0, help="time for the whole run; more pairs only while it lasts"
    )
    parser.add_argument("--spread", type=float, default=5.0, help="stable when every speed-up's spread is within (%%)")
    parser.add_argument(
        "--busy-limit",
        type=float,
        default=bench_load.BUSY_LIMIT_CORES,
        help="cores other processes may use before the run counts as disturbed",
    )
    parser.add_argument("--steps", type=int, default=2, help="steps of the sampling run (0: none)")
    parser.add_argument("--sample-resolution", default=None, help="size of the sampling run (default: the smallest)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    parser.add_argument(
        "--attention", default="sdpa", choices=bench_host.ATTENTION_CHOICES, help="ComfyUI's attention (auto: its own)"
    )
    parser.add_argument("--ratios", default="0.3,0.5", help="ToMe ratios of this project")
    parser.add_argument("--peer-ratios", default="0.5", help="ToMe ratios of ComfyUI's node and tomesd")
    parser.add_argument(
        "--block-ratios",
        default="0.5",
        help="ToMe ratios of the rows at the two finest attention levels: scope block, scope self-attention and "
        "tomesd with merge_crossattn+merge_mlp ('' for none)",
    )
    parser.add_argument("--force", action="store_true", help="our rows with skip_when_slower off (break-even)")
    parser.add_argument("--only", default="", help="keep only rows whose name contains one of these (comma list)")
    parser.add_argument("--exact", action="store_true", help="--only names whole row names")
    parser.add_argument("--no-peers", action="store_true", help="skip ComfyUI's node, tomesd and ToDo reference")
    parser.add_argument("--engine-repeats", type=int, default=5, help="repeats of the engine sub-benchmark (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "results"), help="folder for the table, JSON and chart")
    parser.add_argument("--chart", default=None, help="also copy the chart to this path")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.max_minutes < 0 or args.spread <= 0 or args.busy_limit < 0:
        parser.error("--max-minutes and --busy-limit must be 0 or more, --spread more than 0")
    return args


def parse_size(text: str) -> tuple[int, int]:
    """'768' -> (768, 768); '1024x768' -> (768, 1024) as (height, width)."""
    if "x" in text:
        width, height = text.lower().split("x")
        return int(height), int(width)
    return int(text), int(text)


def size_label(size: tuple[int, int]) -> str:
    return str(size[0]) if size[0] == size[1] else f"{size[1]}x{size[0]}"


class Bench:
    """The model, its baselines and peers, and the inputs of one resolution."""

    def __init__(self, args, device, dtype):
        from tome_core import reduced_levels
        from tome_core.hosts.shared.unet_layout import attention_levels

        self.args, self.device, self.dtype = args, device, dtype
        self.family = bench_host.FAMILIES[args.model]
        self.patcher = bench_host.build_comfy_model(self.family, dtype, device, args.seed)
        unet = self.patcher.model.diffusion_model
        self.levels = reduced_levels(0, attention_levels(unet))  # this project's default levels
        self.level = max(self.levels)
        self.block_level = sorted(attention_levels(unet))[:2][-1]  # the two finest attention levels
        self.holder = None
        if not args.no_peers:
            ldm = bench_host.build_ldm_unet(self.family, unet.state_dict(), dtype, device)
            self.holder = None if ldm is None else bench_host.LdmHolder(ldm)
        self.model_sampling = self.patcher.get_model_object("model_sampling")

    def ldm_fits(self, size: tuple[int, int]) -> bool:
        """ldm's UNet concatenates skips without resizing: the latent must halve evenly at every level."""
        step = 8 * 2 ** (len(self.family.channel_mult) - 1)
        return size[0] % step == 0 and size[1] % step == 0

    def sigma_of(self, timesteps):
        return self.model_sampling.sigma(timesteps.float())

    def inputs(self, size: tuple[int, int], seed_offset: int = 0) -> dict:
        generator = torch.Generator().manual_seed(self.args.seed + 1 + seed_offset)
        batch, family = self.args.batch, self.family
        x = torch.randn(batch, 4, (size[0] + 7) // 8, (size[1] + 7) // 8, generator=generator)
        context = torch.randn(batch, 77, family.context_dim, generator=generator)
        y = torch.randn(batch, family.adm_channels, generator=generator) if family.adm_channels else None
        as_model = {"device": self.device, "dtype": self.dtype}
        return {
            "x": x.to(**as_model),
            "timesteps": torch.full((batch,), 500.0, device=self.device),
            "context": context.to(**as_model),
            "y": None if y is None else y.to(**as_model),
        }

    def rows(self, size: tuple[int, int]) -> list:
        from .unet import rows as R

        args, patcher, sigma_of = self.args, self.patcher, self.sigma_of
        unpatched = R.comfy_runner(patcher, sigma_of)
        rows = [R.Row("unpatched", "unpatched", "comfy", unpatched)]
        force = {"skip_when_slower": False} if args.force else {}
        suffix = " forced" if args.force else ""
        for ratio in _floats(args.ratios):
            values = {"method": "tome", "ratio": ratio, **force}
            rows.append(R.Row(f"ours ToMe {ratio:g}{suffix}", "ours", "comfy", R.ours(patcher, sigma_of, **values)))
        factors = [2.0] + ([4.0] if min(size) >= 1536 else [])
        for factor in factors:
            values = {"method": "todo", "downsample_factor": factor, **force}
            rows.append(R.Row(f"ours ToDo {factor:g}{suffix}", "ours", "comfy", R.ours(patcher, sigma_of, **values)))
        for ratio in _floats(args.block_ratios):
            rows += R.block_scope_rows(patcher, sigma_of, self.block_level, ratio, force)
        if not args.no_peers:
            for ratio in _floats(args.peer_ratios):
                run = R.comfy_builtin(patcher, sigma_of, ratio)
                rows.append(R.Row(f"ComfyUI TomePatchModel {ratio:g}", "peer", "comfy", run, settings={"ratio": ratio}))
            if self.holder is not None and self.ldm_fits(size):
                rows.append(R.ldm_unpatched(self.holder))
                for ratio in _floats(args.peer_ratios):
                    rows.append(R.tomesd_row(f"tomesd {ratio:g}", self.holder, ratio, self.level))
                for ratio in _floats(args.block_ratios):
                    name = f"tomesd {ratio:g} +crossattn+mlp levels<={self.block_level}"
                    whole = {"merge_crossattn": True, "merge_mlp": True}
                    rows.append(R.tomesd_row(name, self.holder, ratio, self.block_level, **whole))
            for factor in factors:
                run = R.todo_reference(patcher, sigma_of, factor, self.level)
                rows.append(R.Row(f"ToDo reference {factor:g}", "peer", "comfy", run, settings={"factor": factor}))
        rows.append(R.Row("ceiling", "ceiling", "comfy", R.ceiling(patcher, sigma_of, self.levels)))
        if args.only:
            keep = [part.strip() for part in args.only.split(",") if part.strip()]
            wanted = (lambda name: name in keep) if args.exact else (lambda name: any(k in name for k in keep))
            rows = [row for row in rows if row.group == "unpatched" or wanted(row.name)]
        return rows


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def call_row(row, inputs: dict):
    row.enter()
    try:
        with torch.inference_mode():
            return row.run(inputs["x"], inputs["timesteps"], inputs["context"], inputs["y"])
    finally:
        row.leave()


def warm_up(bench: Bench, size: tuple[int, int], log) -> tuple[bench_pairs.Block, list[dict]]:
    """Every row called once, untimed but clocked (first cost estimate): output deviation and peak memory."""
    rows = bench.rows(size)
    inputs = bench.inputs(size)
    outputs, records, warm = {}, [], {}
    for row in rows:
        with PeakMemory(bench.device) as memory:
            warm[row.name], _, out = clocked(lambda row=row: call_row(row, inputs), bench.device)
        outputs[row.name] = out.float().cpu()
        record = {"row": row.name, "group": row.group, "host": row.host, "peak_mib": memory.mib}
        record["peak_total_mib"] = memory.total_mib  # CUDA: the allocator's whole peak, weights included
        if row.settings:
            record["settings"] = dict(row.settings)
        records.append(record)
        log(f"  warm-up {size_label(size)} px {row.name} ({warm[row.name]:.2f} s)")
    baselines = {row.host: row.name for row in rows if row.group == "unpatched"}
    for record in records:
        record["deviation_unet"] = relative_l2(outputs[record["row"]], outputs[baselines[record["host"]]])
    return bench_pairs.Block(size_label(size), rows, inputs, warm), records


def sampling_deviation(bench: Bench, size: tuple[int, int], steps: int, log) -> dict[str, float]:
    """Relative L2 of a short Euler run (eps prediction, ComfyUI's normal schedule) against the unpatched run."""
    import comfy.samplers

    ms = bench.model_sampling
    sigmas = comfy.samplers.calculate_sigmas(ms, "normal", steps).to(bench.device)
    rows = [
        row
        for row in bench.rows(size)
        if row.group in ("unpatched", "ours", "peer") and row.name != "unpatched (ldm UNet)"
    ]
    base = bench.inputs(size, seed_offset=100)
    finals = {}
    for row in rows:
        x = base["x"].float() * sigmas[0]
        for i in range(steps):
            sigma = sigmas[i]
            x_in = (x / (sigma**2 + 1) ** 0.5).to(bench.dtype)
            timesteps = ms.timestep(sigma).float().expand(x.shape[0])
            inputs = dict(base, x=x_in, timesteps=timesteps)
            eps = call_row(row, inputs).float()
            x = x + (sigmas[i + 1] - sigma) * eps
        finals[row.name] = x.cpu()
        log(f"  sampled {row.name}")
    return {name: relative_l2(final, finals["unpatched"]) for name, final in finals.items()}


def engine_benchmark(bench: Bench, sizes, log) -> list[dict]:
    """Engine work versus attention at each reduced level, and its share of one UNet evaluation."""
    from .unet import engine as bench_engine

    shapes = bench_report.level_shapes(bench)
    results = []
    for size in sizes:
        latent = ((size[0] + 7) // 8, (size[1] + 7) // 8)
        for level in sorted(bench.levels):
            info = shapes[level]
            grid = bench_host_grid(latent, level)
            row = bench_engine.engine_rows(
                grid,
                info["channels"],
                info["heads"],
                bench.args.batch,
                0.5,
                2.0,
                bench.device,
                bench.dtype,
                bench.args.engine_repeats,
            )
            row.update(resolution=size_label(size), level=level, blocks=info["blocks"])
            results.append(row)
            log(f"  engine {size_label(size)} level {level}: plan {row['plan_s'] * 1e3:.1f} ms")
    return results


def bench_host_grid(latent, level):
    from tome_core import grid_at_level

    return grid_at_level(latent, level)


def sampling_estimate(blocks, size, steps: int) -> float:
    """Seconds the sampling run will take, from the warm-up at its size (0 when that size was not warmed up)."""
    block = next((b for b in blocks if b.label == size_label(size)), None)
    return 0.0 if block is None else steps * sum(block.warm_s.values())


def main(argv=None, keep: dict | None = None) -> dict:
    """The speed benchmark; ``keep`` (a dict), where given, receives the built model as ``keep["bench"]`` for a
    caller that measures more on it (the quick run)."""
    args = parse_args(argv)
    started = time.perf_counter()

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    # Before anything heavy: what do other processes take of the CPU while this one sleeps?
    at_start, load_average = bench_load.sample(1.0), bench_load.load_average()
    log(f"machine at the start: {at_start.describe()}")
    device = choose_device(args.device)
    dtype = choose_dtype(args.dtype, device)
    if args.host == "comfy":
        bench_host.setup_comfy(device.type, args.attention)
    torch.manual_seed(args.seed)
    sizes = [parse_size(part) for part in args.resolutions.split(",") if part.strip()]
    log(f"building {args.model} ({dtype}, {device}) ...")
    if args.host == "diffusers":
        from .unet import diffusers_path as bench_diffusers

        bench = bench_diffusers.DiffusersBench(args, device, dtype)
    else:
        bench = Bench(args, device, dtype)
    if keep is not None:
        keep["bench"] = bench
    report = {
        "reliable": None,  # filled by the verdict; first in the JSON, where a reader looks
        "unreliable_reasons": [],
        "machine": bench_machine.machine(device),
        "versions": bench_machine.versions(),
        "config": {**vars(args), "dtype": str(dtype).replace("torch.", ""), "device": str(device)},
        "levels": sorted(bench.levels),
        "resolutions": [],
    }
    blocks = []
    for size in sizes:
        block, records = warm_up(bench, size, log)
        blocks.append(block)
        report["resolutions"].append({"resolution": size_label(size), "size": list(size), "rows": records})
    sample_size = parse_size(args.sample_resolution) if args.sample_resolution else min(sizes)
    reserve = sampling_estimate(blocks, sample_size, args.steps) if args.steps > 0 else 0.0
    log(f"timing A/B pairs: {args.repeats} per row at least, then until within ±{args.spread:g}% or out of time")
    timing = bench_pairs.run(
        blocks,
        call_row,
        device,
        min_repeats=args.repeats,
        spread_limit_pct=args.spread,
        deadline=started + 60.0 * args.max_minutes - reserve,
    )
    for block, entry in zip(blocks, report["resolutions"], strict=True):
        bench_report.add_figures(entry["rows"], block, with_cpu=device.type == "cpu")
    report["measurement"] = bench_report.measurement(args, timing)
    report["machine_load"] = {
        "at_start": {**at_start.as_dict(), "load_average": load_average},
        "during": timing["load"].as_dict(),
        "busy_limit_cores": args.busy_limit,
    }
    if args.steps > 0:
        log(f"sampling run, {args.steps} steps at {size_label(sample_size)} px:")
        if args.host == "diffusers":
            deviations = bench.sampling_deviation(sample_size, args.steps, log)
        else:
            deviations = sampling_deviation(bench, sample_size, args.steps, log)
        report["sampling"] = {"resolution": size_label(sample_size), "steps": args.steps, "deviation": deviations}
    if args.engine_repeats > 0 and args.host == "comfy":  # host-independent: measured on the ComfyUI path
        log("engine sub-benchmark:")
        report["engine"] = engine_benchmark(bench, sizes, log)
    reasons = bench_verdict.judge(report, args.spread, args.busy_limit)
    report["reliable"], report["unreliable_reasons"] = not reasons, reasons
    report["measurement"]["minutes_total"] = round((time.perf_counter() - started) / 60.0, 2)
    paths = bench_report.write(report, Path(args.out), args.chart)
    print(paths["table_text"])
    log("wrote " + ", ".join(str(paths[key]) for key in ("markdown", "json", "chart")))
    return report


if __name__ == "__main__":
    main()
