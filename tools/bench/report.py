"""Figures derived from the timings, the machine's description, and the three outputs: table, JSON, chart."""

from __future__ import annotations

import json
import shutil
import statistics
import textwrap
from pathlib import Path

import torch

from tools.common.machine import gpu_line
from tools.common.measure import median_interval, spread_pct, summary

from .load import describe

CLOCKS = {
    "wall": "on a CUDA device CUDA events around the call (the device synchronised before), elsewhere the wall "
    "clock (time.perf_counter)",
    "cpu": "process CPU time (time.process_time: user + system, all threads), CPU runs only",
}
SPREAD_RULE = (
    "half the width of where the median lies, relative to it: the range up to 5 values, then the "
    "distribution-free 95% confidence interval of the median"
)


def add_figures(records: list[dict], block, with_cpu: bool) -> None:
    """Times, speed-ups and their spreads from the A/B pairs (``bench_pairs.Block``), and the share of the
    ceiling's saving. A speed-up is the median of the pairs' ratios (each against the row's own unpatched UNet,
    timed right beside it); an unpatched row is 1 by definition, its time is that of all its pairs."""
    for record in records:
        series = block.series[record["row"]]
        if not series.wall_s:
            continue
        record.update(summary(series.wall_s))
        record["pairs"] = len(series.wall_s) if record["group"] == "unpatched" else len(series.ratio_wall)
        record["others_cores"] = series.others_cores()
        if with_cpu and series.cpu_s:
            cpu = summary(series.cpu_s)
            record.update(cpu_median_s=cpu["median_s"], cpu_spread_pct=cpu["spread_pct"], cpu_times_s=cpu["times_s"])
        if record["group"] == "unpatched":
            record.update(speedup=1.0, speedup_low=1.0, speedup_high=1.0, speedup_spread_pct=0.0)
            if with_cpu:
                record["speedup_cpu"] = 1.0
            continue
        low, high = median_interval(series.ratio_wall)
        record.update(
            speedup=statistics.median(series.ratio_wall),
            speedup_low=low,
            speedup_high=high,
            speedup_spread_pct=spread_pct(series.ratio_wall),
            ratios_wall=list(series.ratio_wall),
        )
        if with_cpu and series.ratio_cpu:
            record.update(
                speedup_cpu=statistics.median(series.ratio_cpu),
                speedup_cpu_spread_pct=spread_pct(series.ratio_cpu),
                ratios_cpu=list(series.ratio_cpu),
            )
    add_ceiling_fraction(records)


def add_ceiling_fraction(records: list[dict]) -> None:
    """The fraction of the ceiling's time saving that each row reaches (savings from the pairs' speed-ups).

    Savings are taken relative to each row's own baseline (tomesd runs on the ldm UNet), so a small speed
    difference between the two hosts' unpatched UNets does not count for or against a method.
    """
    ceiling = next((r for r in records if r["group"] == "ceiling" and "speedup" in r), None)
    ceiling_saving = None if ceiling is None else 1.0 - 1.0 / ceiling["speedup"]
    for record in records:
        if "speedup" in record:
            saving = 1.0 - 1.0 / record["speedup"]
            record["ceiling_fraction"] = saving / ceiling_saving if ceiling_saving and ceiling_saving > 0 else None


def measurement(args, timing: dict) -> dict:
    """How the figures were taken, for the JSON and the header."""
    return {
        "method": "A/B pairs: each row timed right beside its own unpatched row, speed-up = median of the ratios",
        "speedup_clock": "wall",
        "clocks": CLOCKS,
        "spread": SPREAD_RULE,
        "spread_limit_pct": args.spread,
        "min_pairs": args.repeats,
        "max_minutes": args.max_minutes,
        "rounds": timing["rounds"],
        "timed_seconds": timing["seconds"],
        "stopped": timing["stopped"],
    }


def level_shapes(bench) -> dict[int, dict]:
    """Channels, heads and number of transformer blocks at each level, from one small forward pass."""
    from tome_core import find_level

    from .unet import rows as bench_rows

    seen: dict[int, dict] = {}

    def count(n, context, value, extra_options):
        _, _, height, width = extra_options["original_shape"]
        found = find_level((height, width), n.shape[1])
        if found is not None:
            info = seen.setdefault(found[0], {"channels": n.shape[-1], "heads": extra_options["n_heads"], "blocks": 0})
            info["blocks"] += 1
        return n, context, value

    clone = bench.patcher.clone()
    clone.set_model_attn1_patch(count)
    small = bench.inputs((128, 128))
    with torch.inference_mode():
        bench_rows.comfy_runner(clone, bench.sigma_of)(small["x"], small["timesteps"], small["context"], small["y"])
    return seen


def _fmt(value, pattern: str, empty: str = "-") -> str:
    return empty if value is None else pattern.format(value)


def _spread(value) -> str:
    return " (1 pair)" if value is None else f" ± {value:.0f}%"


MARK = "(!)"


def reliability_line(report: dict) -> str:
    """One line, above the table, when the run cannot be trusted; empty when it can."""
    reasons = report.get("unreliable_reasons") or []
    return "UNRELIABLE: " + "; ".join(reasons) + "." if reasons else ""


def table(report: dict) -> str:
    sampling = report.get("sampling", {})
    sample_at = sampling.get("resolution")
    lines = [
        "| px | row | wall s / eval | CPU s / eval | speed-up (wall) | speed-up (CPU) | of ceiling's saving | "
        f"peak MiB | dev. UNet | dev. {sampling.get('steps', 0)}-step run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for block in report["resolutions"]:
        for r in block["rows"]:
            fraction = r.get("ceiling_fraction")
            sampled = sampling.get("deviation", {}).get(r["row"]) if block["resolution"] == sample_at else None
            wall = f"{r['median_s']:.2f}{_spread(r['spread_pct'])}" if "median_s" in r else "-"
            cpu = f"{r['cpu_median_s']:.2f}{_spread(r['cpu_spread_pct'])}" if "cpu_median_s" in r else "-"
            speedup = "-"
            if "speedup" in r:
                speedup = f"{r['speedup']:.2f}x"
                if r["group"] != "unpatched":
                    speedup += _spread(r.get("speedup_spread_pct"))
                if r.get("unreliable"):
                    speedup += f" {MARK} {', '.join(r['unreliable'])}"
            speedup_cpu = _fmt(r.get("speedup_cpu"), "{:.2f}x")
            lines.append(
                f"| {block['resolution']} | {r['row']} | {wall} | {cpu} | {speedup} | {speedup_cpu} | "
                f"{'' if r['group'] in ('unpatched', 'ceiling') else _fmt(fraction, '{:.0%}')} | "
                f"{_fmt(r.get('peak_mib'), '{:.0f}')} | {_fmt(r.get('deviation_unet'), '{:.3f}')} | "
                f"{_fmt(sampled, '{:.3f}')} |"
            )
    return "\n".join(lines)


def engine_table(report: dict) -> str:
    rows = report.get("engine")
    if not rows:
        return ""
    base = {b["resolution"]: next(r for r in b["rows"] if r["row"] == "unpatched") for b in report["resolutions"]}
    lines = [
        "| px | level | grid | blocks | attention (ms) | ToMe 0.5 attn. | plan | merge | unmerge | ToDo 2 attn. | "
        "downsample | ToMe work / UNet eval |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in rows:
        unet = base.get(e["resolution"], {}).get("median_s")
        share = e["blocks"] * e["tome_work_s"] / unet if unet else None
        ms = {k: e[k] * 1e3 for k in e if k.endswith("_s")}
        lines.append(
            f"| {e['resolution']} | {e['level']} | {e['grid'][0]}x{e['grid'][1]} | {e['blocks']} | "
            f"{ms['attention_s']:.1f} | {ms['attention_tome_s']:.1f} | {ms['plan_s']:.1f} | {ms['merge_s']:.2f} | "
            f"{ms['unmerge_s']:.2f} | {ms['attention_todo_s']:.1f} | {ms['downsample_s']:.2f} | "
            f"{_fmt(share, '{:.1%}')} |"
        )
    return "\n".join(lines)


def header(report: dict) -> str:
    m, v, c = report["machine"], report["versions"], report["config"]
    where = gpu_line(m) or f"{m['cpu']} ({m['cpu_cores']} cores, {m['torch_threads']} threads)"
    host = f"diffusers {v.get('diffusers')}" if c.get("host") == "diffusers" else f"ComfyUI {v['comfyui']}"
    text = (
        f"{c['model']} UNet, random weights, batch {c['batch']}, {c['dtype']} on {c['device']}: {where}. "
        f"torch {v['torch']}, {host}, tomesd {v['tomesd']}. {m['date']}. "
        f"Reduced levels: {report['levels']}."
    )
    t = report.get("measurement")
    if t:
        rounds = ", ".join(f"{size} px {n}" for size, n in t["rounds"].items())
        stopped = "all within the limit" if t["stopped"] == "stable" else "time limit reached"
        text += (
            f" Speed-up: median of A/B pairs (each row timed beside its own unpatched row), wall clock; CPU: "
            f"process CPU time, all threads. ± is the spread of a median (half range up to 5 values, then its 95% "
            f"interval). Pair rounds: {rounds}, {t['timed_seconds'] / 60:.1f} min; {stopped} "
            f"(±{t['spread_limit_pct']:g}%)."
        )
    load = report.get("machine_load")
    if load:
        text += f" At the start {describe(load['at_start'])}; during the pairs {describe(load['during'])}."
    return text


def chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[float, float, float, float]]] = {}
    for block in report["resolutions"]:
        px = (block["size"][0] * block["size"][1]) ** 0.5
        for r in block["rows"]:
            if r["group"] != "unpatched" and "speedup" in r:
                low, high = r.get("speedup_low", r["speedup"]), r.get("speedup_high", r["speedup"])
                series.setdefault(r["row"], []).append((px, r["speedup"], low, high))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for name, points in series.items():
        xs, ys, lows, highs = zip(*sorted(points), strict=True)
        errors = [[y - low for y, low in zip(ys, lows, strict=True)], [h - y for y, h in zip(ys, highs, strict=True)]]
        if name == "ceiling":
            style = {"color": "black", "linestyle": "--", "linewidth": 2, "marker": "s"}
        else:
            style = {"marker": "o"}
        # Error bars: where the median lies (the spread of the table), so overlapping rows read as equal.
        ax.errorbar(xs, ys, yerr=errors, label=name, capsize=3, **style)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("image size (px, square)")
    ax.set_ylabel("speed-up over unpatched (x)")
    c = report["config"]
    where = report["machine"].get("gpu") or report["machine"]["cpu"]
    title = f"{c['model']} UNet, {c['dtype']}, batch {c['batch']}, {where}"
    warning = reliability_line(report)
    if warning:  # the same line as above the table, so that a chart shared alone still says it
        title = "\n".join(textwrap.wrap(warning, 110)[:4]) + "\n" + title
    ax.set_title(title, fontsize=8 if warning else 9, color="firebrick" if warning else "black")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write(report: dict, out: Path, chart_copy: str | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    config = report["config"]
    prefix = "" if config.get("host", "comfy") == "comfy" else f"{config['host']}-"
    stem = f"benchmark-{prefix}{config['model']}"
    warning = reliability_line(report)
    legend = f"{MARK}: the row is concerned by the UNRELIABLE line (busy, spread, ordering)." if warning else ""
    parts = (warning, header(report), table(report), legend, engine_table(report))
    text = "\n\n".join(part for part in parts if part)
    paths = {"markdown": out / f"{stem}.md", "json": out / f"{stem}.json", "chart": out / f"{stem}.png"}
    paths["markdown"].write_text(text + "\n")
    paths["json"].write_text(json.dumps(report, indent=1, default=str) + "\n")
    chart(report, paths["chart"])
    if chart_copy:
        shutil.copyfile(paths["chart"], chart_copy)
    paths["table_text"] = text
    return paths
