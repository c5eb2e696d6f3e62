"""The main command's default: how much faster, and is it the same picture? About five minutes on a 2-core CPU.

Two parts, both through the same entry points as the full benchmarks:
1. speed (``tools.bench.speed``): SD1.5's full-size UNet with random weights at 768 px, where the answer is
   clearest on a CPU (self-attention is a larger share there than at 512 px), with four rows: unpatched, this
   project's default (ToDo 2), its fastest setting (ToMe 0.5 on whole blocks at the two finest levels) and the
   fastest peer (tomesd 0.5). A/B pairs, the spread of each row and the reliability line, as in the full run.
2. picture (``tools.fidelity.run``): the trained reference model ``ref-sd1`` at 64x64 latents, four prompts of
   one seed, unpatched next to the same two settings of ours, with their same-seed SSIM against unpatched.

Everything goes to ``results/quick/`` (``--out``). ``--full`` on the main command runs the whole benchmark instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEED_ROWS = ("ours ToDo 2", "ours ToMe block 0.5 levels<=2", "tomesd 0.5")
PICTURE_ROWS = ("ours ToDo 2", "ours block 0.5")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bash tools/bench.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sd15", help="UNet of the speed part (tiny: a plumbing check)")
    parser.add_argument("--resolution", default="768", help="image size of the speed part in px")
    parser.add_argument("--max-minutes", type=float, default=3.0, help="time for the speed part's timed pairs")
    parser.add_argument("--steps", type=int, default=12, help="Euler steps of the picture")
    parser.add_argument("--out", default=str(ROOT / "results" / "quick"))
    return parser.parse_args(argv)


def speed_argv(args) -> list[str]:
    return [
        "--model", args.model, "--resolutions", args.resolution,
        "--ratios", "", "--block-ratios", "0.5", "--peer-ratios", "0.5",
        "--only", ",".join(SPEED_ROWS), "--exact",
        "--repeats", "2", "--max-minutes", str(args.max_minutes),
        "--steps", "0", "--engine-repeats", "0", "--out", args.out,
    ]  # fmt: skip


def picture_argv(args) -> list[str]:
    return [
        "--models", "ref-sd1", "--scales", "2", "--prompts", "4", "--seeds", "1", "--grid", "4",
        "--steps", str(args.steps), "--real", "256", "--only", ",".join(PICTURE_ROWS), "--out", args.out,
    ]  # fmt: skip


def main(argv=None) -> dict:
    from tools.bench import speed
    from tools.fidelity import run as fidelity

    args = parse_args(argv)
    started = time.perf_counter()
    print(f"1/2 speed: {args.model} UNet (random weights) at {args.resolution} px ...", file=sys.stderr, flush=True)
    speed_report = speed.main(speed_argv(args))
    print("2/2 picture: reference model ref-sd1, the same seed with and without the patch ...", file=sys.stderr)
    picture = fidelity.main(picture_argv(args))["ref-sd1"]
    minutes = (time.perf_counter() - started) / 60
    print(summary(speed_report, picture, Path(args.out), minutes), flush=True)
    return {"speed": speed_report, "picture": picture}


def summary(speed_report: dict, picture: dict, out: Path, minutes: float) -> str:
    entry = speed_report["resolutions"][0]
    model, cpu = speed_report["config"]["model"], speed_report["machine"]["cpu"]
    lines = [f"\nHow much faster ({model} UNet, {entry['resolution']} px, {cpu}):"]
    for row in entry["rows"]:
        if row["group"] != "unpatched" and "speedup" in row:
            spread = row.get("speedup_spread_pct", 0.0)
            lines.append(f"  {row['row']:<32} {row['speedup']:.2f}x  (spread ±{spread:.0f}%)")
    lines.append("Is it the same picture (ref-sd1, 64x64 latent, same seed; SSIM 1 = identical):")
    for record in picture["records"]:
        if record["group"] != "unpatched":
            lines.append(f"  {record['row']:<32} SSIM {record['ssim']:.3f} (lowest {record['ssim_min']:.3f})")
    verdict = "reliable" if speed_report["reliable"] else "UNRELIABLE (see above)"
    lines.append(f"Speed figures {verdict}. Picture: {out / 'fidelity-grid-ref-sd1.png'}. {minutes:.1f} min.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
