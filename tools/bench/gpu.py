"""The GPU table: whole ComfyUI sampling runs of full-size UNets, every setting timed in A/B pairs beside
unpatched, with its peak memory; ToDo on Flux at full depth in bf16; the break-even behind skip_when_slower.

    python -m tools.bench.gpu [--configs sd15:512,sd15:768,sd15:1024,sdxl:1024] [--steps 25] [--max-minutes 20]
    bash tools/gpu_bench.sh [flags]   (installs the carried wheels first: docs/benchmark.md, "On a GPU")

For each model and size (``--configs``), ComfyUI's full-size UNet with random weights in ``--dtype`` (fp16) and
these rows, each a whole sampling run of ``--steps`` (25) through ComfyUI's own ``common_ksampler`` (Euler,
normal schedule, CFG 5, one latent: ComfyUI runs cond and uncond as one call of batch 2 where its memory
estimate allows, as for a user; the batch column says what it did):
- unpatched;
- ours: the node's defaults (today ToDo 2 with reuse_interval 3, skip_when_slower on), ToDo 2 alone and with
  reuse_interval 2 and 3 (each setting once: the one the default already is is not repeated), ToMe 0.5 with
  scope block at the two finest attention levels (no reuse), each through ``patched_unet`` as the ComfyUI node
  applies it;
- ComfyUI's built-in TomePatchModel 0.5 and EasyCache at its defaults (reuse_threshold 0.2, 15-95% of the
  steps), each applied through its node class; Forge Neo's Spectrum at its defaults and at the default's work (as
  many steps computed as the default computes: 13 of 25 with Euler), as the fidelity benchmark runs it
  (``tools/fidelity/spectrum.py``);
- for each sampler of ``--samplers`` (DPM++ 2M on Karras sigmas, the WebUI's default, and Euler ancestral):
  unpatched, the node's defaults, EasyCache and Spectrum at their defaults with that sampler, and Spectrum at the
  default's work where the default forecasts with it (16 of 25 with DPM++ 2M Karras), each paired with the
  unpatched run of its own sampler;
- SD1.x only: tomesd 0.5 on the WebUI's ldm UNet with the same weights (swapped in by an object patch, so the
  same sampler drives it), paired with that ldm UNet unpatched (ldm cannot build SDXL, which the WebUI runs on
  sgm, so tomesd has no SDXL row).
First one unpatched 2-step run; then each row once, untimed: a 2-step run (first-call costs, kernel selection) and a
whole run, which gives its peak memory (the allocator's peak above what was allocated before the run, and in all),
its model calls (full, reusing, skipped by EasyCache; their batch), the steps it computed in full, its cost per full
and per reusing step, and its final latent's deviation from its own unpatched run (relative L2; random weights: a
proxy). Then the rows are timed in A/B pairs beside their own unpatched row (``tools/bench/pairs.py``; on a GPU each
run is timed with CUDA events), ``--repeats`` pairs at least, more while a speed-up's spread is above ``--spread``
and the time lasts; the verdict of ``tools/bench/verdict.py`` writes the reliability line above the table. Each run
loads its model as ComfyUI does when a graph's model changes (no weights are patched).
Then ToDo on Flux at 1024 px with all its blocks in bf16 (``tools/bench/dit/todo.py --full-depth``); with
``--dit-whole``, whole runs of full-depth DiTs (Flux.2, Qwen-Image, Wan, HunyuanVideo 1.5) unpatched, with the
node's defaults and with two reuse intervals (``tools/bench/dit/whole.py``); and the break-even of each method per
token count on one transformer block of SD1.5 and SDXL (``tools/bench/unet/breakeven.py``): where a reduction starts
to pay on this GPU, against the thresholds of ``skip_when_slower`` (``tome_core/cost.py``).

Outputs in ``--out`` (``results/gpu/``): ``gpu-table.md`` (everything, also printed) and ``gpu-table.json``,
rewritten after each part so that a stopped run keeps what it measured; ``dit.md``/``.json``,
``dit-whole.md``/``.json`` and ``breakeven-<model>.json`` beside them. The same code runs on the CPU (``--device
cpu``, the tests' tiny case).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tools.common import host as bench_host
from tools.common import machine as bench_machine
from tools.common.measure import relative_l2

from . import load as bench_load
from . import pairs as bench_pairs
from . import report as bench_report
from . import verdict as bench_verdict

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = "sd15:512,sd15:768,sd15:1024,sdxl:1024"
EASYCACHE_DEFAULTS = {"reuse_threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95, "verbose": False}
SAMPLERS = "dpmpp_2m:karras,euler_ancestral:normal"  # beside the table's Euler on the normal schedule
SAMPLER_WORDS = {"dpmpp_2m": "DPM++ 2M", "euler_ancestral": "Euler a", "dpmpp_2m_sde": "DPM++ 2M SDE"}
BREAKEVEN_SIDES = "16,24,32,40,48,56,64,80,96,128"
BREAKEVEN_SHAPES = {"sd15": "sd15", "sdxl": "sdxl", "tiny": "sd15", "tiny-xl": "sdxl"}
# Minutes set aside for the parts after the UNet table (on an H200: Flux 0.4, SD1.5's break-even about 1.3, SDXL's
# more), with a margin.
DIT_MINUTES, BREAKEVEN_MINUTES = 1.0, 2.5


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=CONFIGS, help="model:size pairs (size 768 or 1024x768), comma list")
    parser.add_argument("--steps", type=int, default=25, help="steps of every whole sampling run")
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:1, cpu ...")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"], help="auto: fp16 on GPU")
    parser.add_argument(
        "--attention", default="sdpa", choices=bench_host.ATTENTION_CHOICES, help="ComfyUI's attention (auto: its own)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="A/B pairs per row at least")
    parser.add_argument("--spread", type=float, default=2.0, help="more pairs while a speed-up's spread is above (%%)")
    parser.add_argument("--max-minutes", type=float, default=20.0, help="time for the whole command")
    parser.add_argument("--busy-limit", type=float, default=bench_load.BUSY_LIMIT_CORES)
    parser.add_argument("--only", default="", help="keep only rows whose name contains one of these (comma list)")
    parser.add_argument(
        "--samplers", default=SAMPLERS, help="sampler:scheduler pairs with rows of their own ('' for none)"
    )
    parser.add_argument("--dit-models", default="flux", help="models of tools.bench.dit ('' for none)")
    parser.add_argument("--dit-dtype", default="bf16", choices=["fp32", "fp16", "bf16"])
    parser.add_argument(
        "--dit-whole",
        default="",
        help="models of tools.bench.dit.whole: whole DiT runs, after the UNets (e.g. flux2,qwen-image,wan)",
    )
    parser.add_argument("--dit-whole-minutes", type=float, default=5.0, help="time set aside for --dit-whole")
    parser.add_argument("--dit-rounds", type=int, default=3)
    parser.add_argument("--dit-depth", default="full", choices=["full", "cut"], help="cut: the CPU benchmark's blocks")
    parser.add_argument("--breakeven", default="sd15,sdxl", help="blocks of tools.bench.unet.breakeven ('' for none)")
    parser.add_argument("--breakeven-sides", default=BREAKEVEN_SIDES, help="token grid sides")
    parser.add_argument("--breakeven-repeats", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "results" / "gpu"))
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 2 or args.spread <= 0 or args.max_minutes < 0:
        parser.error("--repeats must be 1 or more, --steps 2 or more, --spread above 0, --max-minutes 0 or more")
    return args


def parse_configs(text: str) -> list[tuple[str, tuple[int, int]]]:
    """'sd15:512,sdxl:1024x768' -> [('sd15', (512, 512)), ('sdxl', (768, 1024))] (height, width)."""
    from .speed import parse_size

    configs = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        model, _, size = part.partition(":")
        if model not in bench_host.FAMILIES or not size:
            raise SystemExit(f"--configs: {part!r} is not model:size with a model of {', '.join(bench_host.FAMILIES)}")
        configs.append((model, parse_size(size)))
    return configs


@dataclass
class WholeRow:
    """One row of the table: a model to sample with, and what to do around its runs (tomesd's class swaps)."""

    name: str
    group: str  # "unpatched", "ours" or "peer"
    host: str  # "comfy", "ldm" or "comfy <sampler>": which unpatched row it is paired with
    model: object
    settings: dict = field(default_factory=dict)
    sampler: tuple[str, str] = ("euler", "normal")  # ComfyUI's sampler and scheduler
    enter: object = None
    leave: object = None

    def __enter__(self):
        if self.enter is not None:
            self.enter()
        return self

    def __exit__(self, *exc):
        if self.leave is not None:
            self.leave()
        return False


def parse_samplers(text: str) -> list[tuple[str, str]]:
    """'dpmpp_2m:karras,euler_ancestral' -> [('dpmpp_2m', 'karras'), ('euler_ancestral', 'normal')]."""
    pairs = []
    for part in (p.strip() for p in text.split(",")):
        if part:
            sampler, _, scheduler = part.partition(":")
            pairs.append((sampler, scheduler or "normal"))
    return pairs


def sampler_words(sampler: tuple[str, str]) -> str:
    """('dpmpp_2m', 'karras') -> 'DPM++ 2M Karras'."""
    name, scheduler = sampler
    words = SAMPLER_WORDS.get(name, name)
    return words if scheduler == "normal" else f"{words} {scheduler.capitalize()}"


def spectrum_at_our_work(steps: int, sampler: tuple[str, str]):
    """Spectrum's settings computing as many of ``steps`` as the default does with ``sampler`` (ComfyUI's sampler
    and scheduler), or None where the default forecasts no step with it or no plan of Spectrum's has that count."""
    from tome_core import PatchSettings
    from tome_core.reuse import FORECAST, decide
    from tools.fidelity import spectrum

    default = PatchSettings()
    decision = decide(default.reuse_plan, *sampler, default.reuse_interval)
    if decision.runs != FORECAST:
        return None
    planned = decision.schedule
    try:
        return spectrum.settings_computing(steps, planned.full_steps(steps))
    except ValueError:
        return None


def table_rows(bench, size: tuple[int, int], only: str, samplers=(), steps: int = 25) -> list[WholeRow]:
    """The rows for one model (``speed.Bench``: the patcher, the ldm UNet, the levels) at one size; ``samplers``:
    (sampler, scheduler) pairs that get an unpatched, a default, an EasyCache and Spectrum rows of their own;
    ``steps``: the runs' length (Spectrum at the default's work computes as many)."""
    from comfy_extras.nodes_easycache import EasyCacheNode
    from comfy_extras.nodes_tomesd import TomePatchModel

    from tome_core import PatchSettings
    from tome_core.hosts.comfyui.patch import patched_unet
    from tools.fidelity import spectrum

    patcher = bench.patcher
    percent_to_sigma = patcher.get_model_object("model_sampling").percent_to_sigma

    def ours(name: str, host: str = "comfy", sampler=("euler", "normal"), **values) -> WholeRow:
        clone = patched_unet(patcher, PatchSettings.from_values(**values), percent_to_sigma)
        return WholeRow(name, "ours", host, clone, dict(values), sampler=sampler)

    def easycache(name: str, host: str = "comfy", sampler=("euler", "normal")) -> WholeRow:
        model = EasyCacheNode.execute(model=patcher, **EASYCACHE_DEFAULTS).result[0]
        return WholeRow(name, "peer", host, model, dict(EASYCACHE_DEFAULTS), sampler=sampler)

    def spectrum_row(name: str, settings, host: str = "comfy", sampler=("euler", "normal")) -> WholeRow:
        # Forge Neo's Spectrum as the fidelity benchmark runs it (tools/fidelity/spectrum.py).
        model = spectrum.spectrum_patch(settings)(patcher)
        return WholeRow(name, "peer", host, model, vars(settings), sampler=sampler)

    neo = spectrum.SpectrumSettings()

    def at_our_work(sampler=("euler", "normal"), words: str = "") -> list[WholeRow]:
        settings = spectrum_at_our_work(steps, sampler)
        if settings is None:
            return []
        name = f"Spectrum ({settings.label(steps)} computed, the default's work){words}"
        return [spectrum_row(name, settings, "comfy" if not words else f"comfy {sampler[0]} {sampler[1]}", sampler)]

    default = PatchSettings()
    todo = [{"method": "todo", "downsample_factor": 2.0, "reuse_interval": n} for n in (1, 2, 3)]
    # The default before "forecast": the outer layers run at the reusing steps (``reuse_plan`` "auto").
    todo.append({"method": "todo", "downsample_factor": 2.0, "reuse_interval": 3, "reuse_plan": "auto"})
    # ToMe block on its own: no reuse across steps, whatever the default's.
    block = {"method": "tome", "ratio": 0.5, "scope": "block", "max_downsample": bench.block_level, "reuse_interval": 1}
    rows = [
        WholeRow("unpatched", "unpatched", "comfy", patcher),
        ours(f"ours default ({describe(default)})", **dataclasses.asdict(default)),
        *(ours(f"ours {describe(values)}", **values) for values in todo if PatchSettings(**values) != default),
        ours(f"ours ToMe block 0.5 levels<={bench.block_level}", **block),
        WholeRow(
            "ComfyUI TomePatchModel 0.5",
            "peer",
            "comfy",
            TomePatchModel.execute(patcher, 0.5).result[0],
            {"ratio": 0.5},
        ),
        easycache("EasyCache 0.2 (its default)"),
        spectrum_row("Spectrum (Neo's defaults)", neo),
        *at_our_work(),
    ]
    for sampler in samplers:
        words, host = sampler_words(sampler), f"comfy {sampler[0]} {sampler[1]}"
        rows += [
            WholeRow(f"unpatched, {words}", "unpatched", host, patcher, sampler=sampler),
            ours(f"ours default, {words}", host, sampler, **dataclasses.asdict(default)),
            easycache(f"EasyCache 0.2, {words}", host, sampler),
            spectrum_row(f"Spectrum (Neo's defaults), {words}", neo, host, sampler),
            *at_our_work(sampler, f", {words}"),
        ]
    if bench.holder is not None and bench.ldm_fits(size):
        import tomesd

        ldm = patcher.clone()
        ldm.add_object_patch("diffusion_model", bench.holder.model.diffusion_model)
        settings = {"ratio": 0.5, "max_downsample": bench.level, "use_rand": False}
        rows.append(WholeRow("unpatched (ldm UNet)", "unpatched", "ldm", ldm))
        rows.append(
            WholeRow(
                "tomesd 0.5",
                "peer",
                "ldm",
                ldm,
                settings,
                enter=lambda: tomesd.apply_patch(bench.holder, **settings),
                leave=lambda: tomesd.remove_patch(bench.holder),
            )
        )
    keep = [word.strip() for word in only.split(",") if word.strip()]
    if keep:
        rows = [row for row in rows if row.group == "unpatched" or any(word in row.name for word in keep)]
    return rows


def describe(values) -> str:
    """'ToDo 2 + reuse every 3', 'ToDo 2', 'ToMe 0.5': a setting's name in the table."""
    from tome_core import PatchSettings
    from tome_core.settings import SPECS

    settings = values if isinstance(values, PatchSettings) else PatchSettings.from_values(**values)
    name = f"ToDo {settings.downsample_factor:g}" if settings.method == "todo" else f"ToMe {settings.ratio:g}"
    name += f" + reuse every {settings.reuse_interval}" if settings.reuse_interval > 1 else ""
    plan = settings.reuse_plan
    return name + (f" plan {plan}" if settings.reuse_interval > 1 and plan != SPECS["reuse_plan"].default else "")


class Config:
    """One model at one size: its rows, their sampling runs, and what the untimed runs found."""

    def __init__(self, bench, size: tuple[int, int], args, device: torch.device):
        from .speed import size_label
        from .unet import steps as bench_steps

        self.bench, self.size, self.args, self.device = bench, size, args, device
        self.label = f"{bench.family.name} {size_label(size)}"
        self.latent_hw = ((size[0] + 7) // 8, (size[1] + 7) // 8)
        self.positive, self.negative = bench_steps.conditioning(bench.family, args.seed)
        self.rows = table_rows(bench, size, args.only, parse_samplers(args.samplers), args.steps)

    def run(self, row: WholeRow, steps: int | None = None):
        """One whole sampling run of the row (untimed here: the caller times it)."""
        import nodes as comfy_nodes

        latent = {"samples": torch.zeros(1, 4, *self.latent_hw)}
        with row:
            return comfy_nodes.common_ksampler(
                row.model,
                self.args.seed,
                steps or self.args.steps,
                5.0,
                *row.sampler,
                self.positive,
                self.negative,
                latent,
            )

    def examine(self, row: WholeRow) -> dict:
        """The row's untimed runs: first-call costs out of the way, then one whole run that is looked at."""
        from .unet import steps as bench_steps

        self.run(row, steps=2)
        # UNet evaluations that ran: EasyCache's skipped steps never reach the UNet's first layer (its input
        # convolution, called as a module where the block holding it is not), reusing calls of layer reuse do.
        first_layer = self.bench.comfy_unet.input_blocks[0][0]
        computed = [0]
        handle = first_layer.register_forward_pre_hook(lambda *_: computed.__setitem__(0, computed[0] + 1))
        try:
            with row:
                seconds, timer = bench_steps.sample(
                    row.model,
                    self.positive,
                    self.negative,
                    self.latent_hw,
                    self.args.steps,
                    self.args.seed,
                    False,
                    self.device,
                    row.sampler,
                )
        finally:
            handle.remove()
        steps = self.args.steps
        calls = timer.calls
        reusing = [s for s, reused in calls if reused]
        skipped = max(0, len(calls) - computed[0]) if row.host != "ldm" else 0
        full = [s for s, reused in calls if not reused]
        # Steps computed in full: the calls that were neither reusing nor skipped, over the calls a step makes
        # (one, or two where ComfyUI runs cond and uncond apart).
        calls_per_step = max(1, round(len(calls) / steps))
        full_steps = (len(calls) - len(reusing) - skipped) / calls_per_step
        return {
            "row": row.name,
            "group": row.group,
            "host": row.host,
            "settings": dict(row.settings),
            "examined_run_s": seconds,
            "peak_mib": timer.peak_mib,
            "peak_total_mib": timer.peak_total_mib,
            "model_calls": len(calls),
            "reusing_calls": len(reusing),
            "skipped_calls": skipped,
            "full_steps": full_steps,
            "sampler": list(row.sampler),
            "batch": sorted(set(timer.batches)),
            # Per step, as tools/bench/unet/steps.py: ComfyUI may run cond and uncond as one call or as two.
            "full_step_s": sum(full) / full_steps if full and not skipped else None,
            "reusing_step_s": sum(reusing) / (steps - full_steps) if reusing and steps > full_steps else None,
            "latent": timer.latent,
        }


def measure_config(config: Config, deadline: float, log) -> tuple[dict, dict]:
    """The untimed runs and the timed A/B pairs of one model and size: its report entry and the pairs' load."""
    log(f"{config.label}: {len(config.rows)} rows, {config.args.steps}-step runs")
    config.run(config.rows[0], steps=2)  # the model loaded, the kernels chosen
    records, warm = [], {}
    for row in config.rows:
        record = config.examine(row)
        warm[row.name] = record["examined_run_s"]
        records.append(record)
        peak = "-" if record["peak_mib"] is None else f"{record['peak_mib']:.0f} MiB"
        log(f"  {row.name}: {record['examined_run_s']:.2f} s untimed, peak {peak}, calls {record['model_calls']}")
    # Against the row's own unpatched run (tomesd: the ldm UNet's), as tools/bench/speed.py does.
    reference = {r["host"]: r["latent"] for r in records if r["group"] == "unpatched"}
    for record in records:
        latent, base = record.pop("latent"), reference.get(record["host"])
        record["deviation"] = None if base is None else relative_l2(latent, base)
    block = bench_pairs.Block(config.label, config.rows, {}, warm)
    timing = bench_pairs.run(
        [block],
        lambda row, _inputs: config.run(row),
        config.device,
        min_repeats=config.args.repeats,
        spread_limit_pct=config.args.spread,
        deadline=deadline,
    )
    bench_report.add_figures(records, block, with_cpu=False)
    entry = {
        "resolution": config.label,
        "model": config.bench.family.name,
        "size": list(config.size),
        "levels": sorted(config.bench.levels),
        "rounds": timing["rounds"][config.label],
        "timed_seconds": timing["seconds"],
        "stopped": timing["stopped"],
        "rows": records,
    }
    return entry, timing["load"].as_dict()


def combined_load(loads: list[dict]) -> dict:
    """Others' CPU use over several timed parts, weighted by their seconds (``load.Load.as_dict`` form)."""
    known = [load for load in loads if load.get("others_cores") is not None]
    seconds = sum(load["seconds"] for load in known)
    if not known or seconds <= 0:
        return {"seconds": 0.0, "others_cores": None, "steal_cores": None, "own_cores": 0.0, "cores": 0}

    def mean(key: str) -> float:
        return sum((load.get(key) or 0.0) * load["seconds"] for load in known) / seconds

    return {
        "seconds": round(seconds, 3),
        "others_cores": round(mean("others_cores"), 3),
        "steal_cores": round(mean("steal_cores"), 3),
        "own_cores": round(mean("own_cores"), 3),
        "cores": max(load["cores"] for load in known),
    }


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _mib(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def unet_table(report: dict) -> str:
    lines = [
        "| model, px | row | s / run | speed-up | full steps | peak MiB | peak total MiB | "
        "calls: all / reusing / skipped | batch | full step ms | reusing step ms | dev. |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for block in report["resolutions"]:
        for r in block["rows"]:
            wall = "-"
            if "median_s" in r:
                spread = r.get("spread_pct")
                wall = f"{r['median_s']:.2f}" + ("" if spread is None else f" ± {spread:.0f}%")
            speedup = "-"
            if "speedup" in r:
                speedup = f"{r['speedup']:.2f}x"
                if r["group"] != "unpatched":
                    spread = r.get("speedup_spread_pct")
                    speedup += " (1 pair)" if spread is None else f" ± {spread:.0f}%"
                if r.get("unreliable"):
                    speedup += f" {bench_report.MARK} {', '.join(r['unreliable'])}"
            calls = f"{r['model_calls']} / {r['reusing_calls']} / {r['skipped_calls']}"
            batch = ", ".join(str(b) for b in r["batch"]) or "-"
            deviation = "-" if r.get("deviation") is None else f"{r['deviation']:.3f}"
            full_steps = "-" if r.get("full_steps") is None else f"{r['full_steps']:g}"
            lines.append(
                f"| {block['resolution']} | {r['row']} | {wall} | {speedup} | {full_steps} | {_mib(r['peak_mib'])} | "
                f"{_mib(r['peak_total_mib'])} | {calls} | {batch} | {_ms(r['full_step_s'])} | "
                f"{_ms(r['reusing_step_s'])} | {deviation} |"
            )
    return "\n".join(lines)


def breakeven_table(model: str, results: dict, device_type: str) -> str:
    """Each method's speed-up on one block per grid side, and the first side from which it stays above 1."""
    from tome_core.cost import MIN_TOKENS, min_tokens

    sides = sorted(results)
    methods = [name for name in results[sides[0]] if name != "off"]
    lines = [
        "| side | tokens | off (ms) | " + " | ".join(methods) + " |",
        "|---|---|---|" + "---|" * len(methods),
    ]
    for side in sides:
        medians = results[side]
        ratios = " | ".join(f"{medians['off'] / medians[name]:.2f}x" for name in methods)
        lines.append(f"| {side} | {side * side} | {medians['off'] * 1e3:.2f} | {ratios} |")
    pays = []
    for name in methods:
        faster = [results[side]["off"] / results[side][name] > 1.0 for side in sides]
        first = next((i for i in range(len(sides)) if all(faster[i:])), None)
        pays.append(f"{name}: {'never' if first is None else f'from {sides[first] ** 2} tokens'}")
    thresholds = ", ".join(f"{key} {min_tokens(key, device_type)}" for key in MIN_TOKENS)
    summary = (
        f"Faster than the unpatched block ({model}): {'; '.join(pays)}. "
        f"skip_when_slower today on {device_type}: {thresholds}."
    )
    lines += ["", summary]
    return "\n".join(lines)


def markdown(report: dict) -> str:
    m, v, s = report["machine"], report["versions"], report["settings"]
    where = bench_machine.gpu_line(m) or f"{m['cpu']} ({m['cpu_cores']} cores, {m['torch_threads']} threads)"
    parts = [bench_report.reliability_line(report), "# ToMe Patch on a GPU"]
    rounds = {block["resolution"]: block["rounds"] for block in report["resolutions"]}
    parts.append(
        f"{where}. torch {v['torch']} (CUDA {m.get('cuda')}, cuDNN {m.get('cudnn')}), ComfyUI {v['comfyui']}, "
        f"tomesd {v['tomesd']}; {s['dtype']} on {s['device']}, attention {m.get('attention')}, clock "
        f"{m['clock']}; {m['date']}. `{s['command']}`.\n\n"
        f"Whole ComfyUI sampling runs of {s['steps']} steps (Euler, normal schedule, unless the row names its "
        "sampler; CFG 5, one latent: cond and uncond in one call where the batch column says 2), full-size UNets "
        "with random weights. Full steps: the steps computed in full (neither reusing nor skipped). Speed-up: the "
        "median of A/B pairs, each row's run timed right beside its own unpatched run (tomesd beside the ldm "
        "UNet). ± is the spread of a median (half the range up to 5 values, then its 95% interval). Peak MiB: "
        "the allocator's peak during the row's run above what was allocated before it; total: with the weights "
        "and all else allocated. dev.: relative L2 of the final latent against the row's own unpatched run "
        f"(random weights: a proxy). Pair rounds: {', '.join(f'{k} px: {n}' for k, n in rounds.items()) or 'none'}; "
        f"{report.get('minutes_total', 0):.1f} min in all."
    )
    if report["resolutions"]:
        parts.append(unet_table(report))
    if any(r.get("unreliable") for block in report["resolutions"] for r in block["rows"]):
        parts.append(f"{bench_report.MARK}: the row is concerned by the UNRELIABLE line (busy, spread).")
    if report.get("dit_markdown"):
        text = report["dit_markdown"].split("\n", 2)[-1].strip()  # without its own title
        parts += ["## ToDo on Flux", text]
    if report.get("dit_whole_markdown"):
        text = report["dit_whole_markdown"].split("\n", 2)[-1].strip()  # without its own title
        parts += ["## Whole DiT runs", text]
    for model, results in report.get("breakeven", {}).items():
        parts += [
            f"## Break-even per token count: one {model} transformer block",
            breakeven_table(model, results, torch.device(s["device"]).type),
        ]
    return "\n\n".join(part for part in parts if part) + "\n"


def write(report: dict, out: Path) -> Path:
    report["versions"] = bench_machine.versions()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu-table.md"
    path.write_text(markdown(report))
    (out / "gpu-table.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return path


def judge(report: dict, args) -> None:
    reasons = bench_verdict.judge(report, args.spread, args.busy_limit)
    report["reliable"], report["unreliable_reasons"] = not reasons, reasons


def run_breakeven(model: str, args, device: torch.device, log) -> dict:
    from .unet import breakeven

    shape = BREAKEVEN_SHAPES.get(model, model)
    log(f"break-even: one {shape} transformer block, sides {args.breakeven_sides}")
    argv = ["--model", shape, "--device", str(device), "--sides", args.breakeven_sides]
    argv += ["--repeats", str(args.breakeven_repeats)]
    with contextlib.redirect_stdout(sys.stderr):  # stdout: the table alone, at the end
        return breakeven.main(argv)


def main(argv=None) -> dict:
    from tools.common.device import choose_device, choose_dtype

    from .speed import Bench

    args = parse_args(argv)
    started = time.perf_counter()
    deadline = started + 60.0 * args.max_minutes

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    at_start, load_average = bench_load.sample(1.0), bench_load.load_average()
    log(f"machine at the start: {at_start.describe()}")
    device = choose_device(args.device)
    dtype = choose_dtype(args.dtype, device)
    bench_host.setup_comfy(device.type, args.attention)
    import comfy.model_management
    import comfy.utils

    comfy.utils.set_progress_bar_enabled(False)
    configs = parse_configs(args.configs)
    out = Path(args.out)
    command = " ".join(["python -m tools.bench.gpu", *(sys.argv[1:] if argv is None else argv)])
    report = {
        "reliable": None,
        "unreliable_reasons": [],
        "machine": bench_machine.machine(device),
        "versions": bench_machine.versions(),
        "settings": {**vars(args), "dtype": str(dtype).replace("torch.", ""), "device": str(device)},
        "resolutions": [],
        "machine_load": {
            "at_start": {**at_start.as_dict(), "load_average": load_average},
            "during": None,
            "busy_limit_cores": args.busy_limit,
        },
    }
    report["settings"]["command"] = command
    reserve = 60.0 * (
        (DIT_MINUTES if args.dit_models else 0.0)
        + (args.dit_whole_minutes if args.dit_whole else 0.0)
        + BREAKEVEN_MINUTES * len([m for m in args.breakeven.split(",") if m.strip()])
    )
    # The pairs' time shared by the configs in proportion to their pixels (a run's cost grows with them).
    weights = [size[0] * size[1] for _, size in configs]
    loads = []
    built = {}
    for index, (model, size) in enumerate(configs):
        if model not in built:
            built.clear()  # one model on the device at a time
            comfy.model_management.unload_all_models()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            log(f"building {model} ({dtype}, {device}) ...")
            namespace = argparse.Namespace(model=model, seed=args.seed, no_peers=False, batch=1)
            built[model] = Bench(namespace, device, dtype)
            # ComfyUI's own UNet, kept before any run: the ldm rows' object patch swaps the model's attribute.
            built[model].comfy_unet = built[model].patcher.model.diffusion_model
        now = time.perf_counter()
        share = max(0.0, deadline - reserve - now) * weights[index] / sum(weights[index:])
        entry, load = measure_config(Config(built[model], size, args, device), now + share, log)
        report["resolutions"].append(entry)
        loads.append(load)
        report["machine"] = bench_machine.machine(device)  # ComfyUI's attention is known by now
        report["machine_load"]["during"] = combined_load(loads)
        report["minutes_total"] = round((time.perf_counter() - started) / 60.0, 2)
        judge(report, args)
        write(report, out)
    built.clear()
    comfy.model_management.unload_all_models()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.dit_models:
        from .dit import todo as dit

        dit_argv = ["--models", args.dit_models, "--device", str(device), "--dtype", args.dit_dtype]
        dit_argv += ["--rounds", str(args.dit_rounds), "--threads", "0", "--out", str(out / "dit")]
        if args.dit_depth == "full":
            dit_argv.append("--full-depth")
        log("DiT: " + " ".join(dit_argv))
        with contextlib.redirect_stdout(sys.stderr):  # stdout: the table alone, at the end
            report["dit"] = dit.main(dit_argv)
        report["dit_markdown"] = (out / "dit.md").read_text()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report["minutes_total"] = round((time.perf_counter() - started) / 60.0, 2)
        write(report, out)
    if args.dit_whole:
        from .dit import whole

        left = max(0.5, (deadline - time.perf_counter()) / 60.0 - BREAKEVEN_MINUTES * len(args.breakeven.split(",")))
        whole_argv = ["--models", args.dit_whole, "--device", str(device), "--dtype", args.dit_dtype]
        whole_argv += ["--max-minutes", f"{min(left, args.dit_whole_minutes):.2f}", "--out", str(out)]
        log("whole DiT runs: " + " ".join(whole_argv))
        with contextlib.redirect_stdout(sys.stderr):  # stdout: the table alone, at the end
            report["dit_whole"] = whole.main(whole_argv)
        report["dit_whole_markdown"] = (out / "dit-whole.md").read_text()
        report["minutes_total"] = round((time.perf_counter() - started) / 60.0, 2)
        write(report, out)
    report["breakeven"] = {}
    for model in (m.strip() for m in args.breakeven.split(",")):
        if not model:
            continue
        results = run_breakeven(model, args, device, log)
        report["breakeven"][BREAKEVEN_SHAPES.get(model, model)] = results
        (out / f"breakeven-{model}.json").write_text(json.dumps(results, indent=1) + "\n")
        report["minutes_total"] = round((time.perf_counter() - started) / 60.0, 2)
        write(report, out)
    judge(report, args)
    path = write(report, out)
    print(path.read_text())
    log(f"wrote {path} and {out / 'gpu-table.json'} ({report['minutes_total']:.1f} min)")
    return report


if __name__ == "__main__":
    main()
