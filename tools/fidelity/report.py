"""Tables, the speed-versus-fidelity chart and the image grid of a fidelity run (``tools.fidelity``).

``python -m tools.fidelity.report results/fidelity-<model>.json`` renders table and chart again from the JSON.

Speed on these charts is the process CPU time's speed-up: unlike wall time it does not grow when other
processes take the cores, so the front stays put on a shared machine (both clocks are in the table).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tools.fidelity.work import at_depth


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def _work(record: dict, key: str) -> str:
    """Counted work as a share of the unpatched row's (records written before it was counted show "-")."""
    return _fmt(record.get("work", {}).get(key), ".2f")


def table(report: dict) -> str:
    m = report["machine"]
    s = report["settings"]
    n_images = s["prompts"] * s["seeds"]
    video = any("motion_error" in r for r in report["records"])
    depth = report.get("full_depth")  # DiT references: the real model's blocks, for the converted speed
    samples = "clips (SSIM, accuracy and FD over their frames)" if video else "images"
    sampler = s.get("sampler", "euler")
    lines = [
        f"Fidelity on reference model `{report['model']}`: {n_images} {samples} per row ({s['prompts']} prompts x "
        f"{s['seeds']} seeds), {s['steps']} steps of `{sampler}`, CFG {s['cfg']}; {m.get('cpu', m.get('device'))}, "
        f"torch {report['versions'].get('torch')}, {report['date']}.",
        "",
        "| size | row | SSIM | min SSIM | PSNR dB | accuracy | all four | FD | time (s) | speed-up | speed-up CPU "
        "| calls | tokens |"
        + (f" at {depth} blocks |" if depth else "")
        + (" motion error | motion kept |" if video else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        + ("---|" if depth else "")
        + ("---|---|" if video else ""),
    ]
    for r in report["records"]:
        motion = f" {r['motion_error']:.3f} | {r['motion_kept']:.3f} |" if video else ""
        shares = r.get("work", {}).get("block_shares")
        if depth:
            motion = (f" {1 / at_depth(shares, depth):.2f}x |" if shares else " - |") + motion
        lines.append(
            f"| {r['size']} | {r['row']} | {r['ssim']:.3f} | {r['ssim_min']:.3f} | {_fmt(r['psnr'], '.1f')} "
            f"| {r['accuracy']['mean']:.1%} | {r['accuracy']['all_four']:.1%} | {r['frechet']:.2f} "
            f"| {r['wall_s']:.1f} | {r['speedup']:.2f}x | {r['speedup_cpu']:.2f}x | {_work(r, 'call_share')} "
            f"| {_work(r, 'token_share')} |" + motion
        )
    real = report["reference"]["real scenes"]
    lines += [
        "",
        f"Real scenes (the data, {n_images} fresh ones): accuracy {real['accuracy']['mean']:.1%} "
        f"(all four {real['accuracy']['all_four']:.1%}), FD {real['frechet']:.2f}.",
    ]
    for size, front in report["pareto_front"].items():
        lines.append(f"Pareto front at {size}x{size} (CPU-time speed-up, SSIM): {', '.join(front)}.")
    lines.append(
        "calls: model calls computed (batch entries) and tokens: tokens computed by the transformer blocks over "
        "the whole run, each as a share of the unpatched row's."
    )
    if video:
        lines.append(
            "motion error: how far the frame-to-frame differences are from unpatched's (mean absolute difference "
            "over unpatched's mean absolute frame difference; 0 is the same motion); motion kept: the row's mean "
            "absolute frame difference over unpatched's (1: as much motion, below 1 lost or blurred, above 1 "
            "flicker)."
        )
    return "\n".join(lines)


SPEED = "speedup_cpu"


def pareto_front(records: list[dict]) -> list[str]:
    """Rows that no other row beats in both speed and SSIM (at least as good in both, better in one)."""

    def beats(o, r):
        at_least = o[SPEED] >= r[SPEED] and o["ssim"] >= r["ssim"]
        return at_least and (o[SPEED] > r[SPEED] or o["ssim"] > r["ssim"])

    candidates = [r for r in records if r["group"] != "broken"]
    return [r["row"] for r in candidates if not any(beats(o, r) for o in candidates if o is not r)]


def pareto_fronts(records: list[dict]) -> dict[str, list[str]]:
    return {
        str(size): pareto_front([r for r in records if r["size"] == size])
        for size in sorted({r["size"] for r in records})
    }


def chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["size"] for r in report["records"]})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.8), squeeze=False)
    colours = {"unpatched": "black", "ours": "tab:blue", "peer": "tab:orange", "broken": "tab:red"}
    for ax, size in zip(axes[0], sizes, strict=True):
        front = set(report["pareto_front"][str(size)])
        for r in (r for r in report["records"] if r["size"] == size):
            marker = "*" if r["row"] in front else "o"
            ax.scatter(r[SPEED], r["ssim"], color=colours[r["group"]], marker=marker, s=90 if marker == "*" else 40)
            ax.annotate(r["row"], (r[SPEED], r["ssim"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
        ax.set_title(f"{report['model']} at {size}x{size} latent (* = Pareto front)")
        ax.set_xlabel("speed-up of the sampling run (process CPU time)")
        ax.set_ylabel("SSIM to the unpatched image (same seed)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def grid(report: dict, grids: dict, path: Path) -> None:
    """Rows of the run top to bottom, the same prompts and seeds left to right, one block per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch.nn.functional as F

    from tools.fidelity.reference.data import to_rgb

    sizes = sorted({size for size, _ in grids})
    names = list(dict.fromkeys(name for _, name in grids))
    display = max(sizes)
    strips = []
    for name in names:
        parts = []
        for size in sizes:
            images = to_rgb(grids[(size, name)])
            images = F.interpolate(images, size=(display, display), mode="nearest")
            parts.append(torch.cat(list(F.pad(images, (1, 1, 1, 1), value=1.0)), dim=2))
        strips.append(torch.cat(parts, dim=2))
    picture = torch.cat(strips, dim=1).permute(1, 2, 0).numpy()
    height = picture.shape[0] / picture.shape[1] * 14
    fig, ax = plt.subplots(figsize=(14 + 2.6, height + 0.6))
    ax.imshow(picture, interpolation="nearest")
    row_height = picture.shape[0] / len(names)
    ax.set_yticks([row_height * (i + 0.5) for i in range(len(names))], names, fontsize=8)
    width = picture.shape[1] / len(sizes)
    ax.set_xticks([width * (i + 0.5) for i in range(len(sizes))], [f"{s}x{s} latent" for s in sizes], fontsize=9)
    ax.tick_params(length=0)
    ax.set_title(f"{report['model']}: the same prompts and seeds in every row", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(report: dict, grids: dict, out: Path) -> list[Path]:
    name = report["model"]
    (out / f"fidelity-{name}.md").write_text(table(report) + "\n")
    chart_path, grid_path = out / f"fidelity-{name}.png", out / f"fidelity-grid-{name}.png"
    chart(report, chart_path)
    grid(report, grids, grid_path)
    return [chart_path, grid_path]


if __name__ == "__main__":
    import json
    import sys

    for arg in sys.argv[1:]:
        source = Path(arg)
        saved = json.loads(source.read_text())
        saved["pareto_front"] = pareto_fronts(saved["records"])
        source.write_text(json.dumps(saved, indent=2) + "\n")
        source.with_suffix(".md").write_text(table(saved) + "\n")
        chart(saved, source.with_suffix(".png"))
        print(table(saved))
