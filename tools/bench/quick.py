"""The main command's default: how much faster over a whole sampling run, and is it the same picture? About three
minutes on a 2-core CPU.

Five rows over a 25-step run: unpatched, this project's default (ToDo 2 with reuse across steps every third step,
whose skipped steps run nothing: ``reuse_plan`` "forecast v3"), ToDo 2 alone, ComfyUI's EasyCache at its default
threshold (0.2) and Forge Neo's Spectrum at its defaults, in two parts, each through the same entry points as the
full benchmarks:
1. picture (``tools.fidelity.run``): the trained reference model ``ref-sd1`` at 64x64 latents, four prompts of
   one seed, 25 Euler steps, every row's same-seed SSIM against unpatched; EasyCache's share of computed model
   calls, like every row's, come from here (counted: the calls that reached the UNet).
2. speed of one model call (``tools.bench.speed``): SD1.5's full-size UNet with random weights at 768 px,
   unpatched against ToDo 2 in A/B pairs, with the spread of each row and the reliability line, as in the full run.

Whole-run speed: the default computes its planned steps at ToDo 2's cost and runs nothing at the others (a skipped
step is one multiply-add of the latent, counted as nothing): ``ToDo 2 speed-up / calls``; EasyCache and Spectrum
compute a share of the calls at the unpatched cost and skip the rest for next to nothing: ``1 / calls``.

Everything goes to ``results/quick/`` (``--out``). ``--full`` on the main command runs the whole benchmark instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ROW = "ours ToDo 2 + reuse every 3"  # the nodes' and the WebUI's default (reuse_interval 3, ToDo 2)
TODO_ROW = "ours ToDo 2"
EASYCACHE_ROW = "EasyCache 0.2"  # ComfyUI's EasyCache node at its default threshold
SPECTRUM_ROW = "Spectrum (Neo's defaults)"  # the fidelity run's name adds its count: "..., 17 of 25 computed)"
SPEED_ROWS = ("ours ToDo 2",)
LABELS = {
    "unpatched": "unpatched",
    DEFAULT_ROW: "ToDo 2 + reuse every 3 (the default)",
    TODO_ROW: "ToDo 2 alone",
    EASYCACHE_ROW: "ComfyUI EasyCache 0.2 (its default)",
    SPECTRUM_ROW: "Forge Neo's Spectrum (its defaults)",
}


def spectrum_name(steps: int) -> str:
    """The fidelity run's name of Spectrum at Neo's defaults over ``steps``."""
    from tools.fidelity import spectrum

    return f"Spectrum (Neo's defaults, {spectrum.SpectrumSettings().label(steps)} computed)"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bash tools/bench.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sd15", help="UNet of the speed parts (tiny: a plumbing check)")
    parser.add_argument("--resolution", default="768", help="image size of the speed parts in px")
    parser.add_argument("--max-minutes", type=float, default=2.0, help="time for the speed part's timed pairs")
    parser.add_argument("--steps", type=int, default=25, help="steps of the sampling run (picture and conversion)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts of the picture part (fewer: a plumbing check)")
    parser.add_argument("--out", default=str(ROOT / "results" / "quick"))
    return parser.parse_args(argv)


def speed_argv(args) -> list[str]:
    return [
        "--model", args.model, "--resolutions", args.resolution,
        "--ratios", "", "--block-ratios", "", "--peer-ratios", "",
        "--only", ",".join(SPEED_ROWS), "--exact",
        "--repeats", "2", "--max-minutes", str(args.max_minutes),
        "--steps", "0", "--engine-repeats", "0", "--no-peers", "--out", args.out,
    ]  # fmt: skip


def picture_argv(args) -> list[str]:
    only = ",".join(f"={name}" for name in (DEFAULT_ROW, TODO_ROW, EASYCACHE_ROW, spectrum_name(args.steps)))
    return [
        "--models", "ref-sd1", "--scales", "2", "--prompts", str(args.prompts), "--seeds", "1",
        "--grid", str(min(4, args.prompts)),
        "--steps", str(args.steps), "--real", "256", "--only", only, "--out", args.out,
    ]  # fmt: skip


def whole_run(speed_report: dict, picture: dict, steps: int) -> dict:
    """Each row's speed-up over a run of ``steps`` (see the module docstring) and its picture figures."""
    call = {row["row"]: row for row in speed_report["resolutions"][0]["rows"]}
    todo = call[TODO_ROW]["speedup"]
    records = {record["row"]: record for record in picture["records"]}
    records[SPECTRUM_ROW] = records[spectrum_name(steps)]
    calls = {name: records[name]["work"].get("call_share", 1.0) for name in LABELS}
    speed = {
        "unpatched": 1.0,
        DEFAULT_ROW: todo / calls[DEFAULT_ROW],
        TODO_ROW: todo,
        EASYCACHE_ROW: 1.0 / calls[EASYCACHE_ROW],
        SPECTRUM_ROW: 1.0 / calls[SPECTRUM_ROW],
    }
    rows = {}
    for name, label in LABELS.items():
        record = records[name]
        rows[name] = {
            "label": label,
            "speedup": speed[name],
            "ssim": record["ssim"],
            "ssim_min": record["ssim_min"],
            "calls": calls[name],
        }
    rows[DEFAULT_ROW]["full_steps"] = round(calls[DEFAULT_ROW] * steps)
    return {"steps": steps, "todo_spread_pct": call[TODO_ROW].get("speedup_spread_pct"), "rows": rows}


def main(argv=None) -> dict:
    from tools.bench import speed
    from tools.fidelity import run as fidelity

    args = parse_args(argv)
    started = time.perf_counter()
    print(f"1/2 picture: reference model ref-sd1, {args.steps} steps, the same seed per row ...", file=sys.stderr)
    picture = fidelity.main(picture_argv(args))["ref-sd1"]
    print(f"2/2 speed of a call: {args.model} UNet (random weights) at {args.resolution} px ...", file=sys.stderr)
    speed_report = speed.main(speed_argv(args))
    run = whole_run(speed_report, picture, args.steps)
    minutes = (time.perf_counter() - started) / 60
    out = Path(args.out)
    run.update(reliable=speed_report["reliable"], minutes=round(minutes, 1), machine=speed_report["machine"])
    (out / "quick.json").write_text(json.dumps(run, indent=2) + "\n")
    print(summary(run, speed_report, out), flush=True)
    return {"speed": speed_report, "picture": picture, "run": run}


def summary(run: dict, speed_report: dict, out: Path) -> str:
    entry = speed_report["resolutions"][0]
    model, cpu = speed_report["config"]["model"], speed_report["machine"]["cpu"]
    lines = [
        f"\nHow much faster over a {run['steps']}-step run ({model} UNet, {entry['resolution']} px, {cpu}), and is "
        f"it the same picture (ref-sd1, same seed; SSIM 1 = identical)?",
        f"  {'row':<38} {'speed':>6}  {'calls':>5}  SSIM (lowest)",
    ]
    for row in run["rows"].values():
        figures = f"{row['speedup']:>5.2f}x  {row['calls']:>5.2f}  {row['ssim']:.3f} ({row['ssim_min']:.3f})"
        lines.append(f"  {row['label']:<38} {figures}")
    default = run["rows"][DEFAULT_ROW]
    lines.append(
        f"  (the default computes {default['full_steps']} of {run['steps']} steps at ToDo 2's speed and runs nothing "
        "at the others; calls: those each row computed in the picture run)"
    )
    verdict = "reliable" if run["reliable"] else "UNRELIABLE (see above)"
    lines.append(f"Speed figures {verdict}. Picture: {out / 'fidelity-grid-ref-sd1.png'}. {run['minutes']:.1f} min.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
