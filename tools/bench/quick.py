"""The main command's default: how much faster over a whole sampling run, and is it the same picture? About three
minutes on a 2-core CPU.

Four rows over a 25-step run: unpatched, this project's default (ToDo 2 with reuse across steps every third step),
ToDo 2 alone, and ComfyUI's EasyCache at its default threshold (0.2), in three parts, each through the same entry
points as the full benchmarks:
1. picture (``tools.fidelity.run``): the trained reference model ``ref-sd1`` at 64x64 latents, four prompts of
   one seed, 25 Euler steps, every row's same-seed SSIM against unpatched; EasyCache's share of computed model
   calls comes from here (it decides from the picture which calls to skip).
2. speed of one model call (``tools.bench.speed``): SD1.5's full-size UNet with random weights at 768 px,
   unpatched against ToDo 2 in A/B pairs, with the spread of each row and the reliability line, as in the full run.
3. a reusing call (``tools.bench.unet.steps``): the same UNet's cost of a step that reuses (only the outer layers
   run), as a share of an unpatched call.

Whole-run speed, converted as ``tools.bench.unet.steps`` does (the default's schedule is fixed, so a run is its full
steps at ToDo 2's cost plus its reusing steps at theirs): ``25 / (full / ToDo 2 speed-up + reusing x reusing
share)``; EasyCache computes a share of the calls at the unpatched cost and skips the rest for next to nothing:
``1 / calls``.

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
PICTURE_ROWS = (DEFAULT_ROW, TODO_ROW, EASYCACHE_ROW)
SPEED_ROWS = ("ours ToDo 2",)
LABELS = {
    "unpatched": "unpatched",
    DEFAULT_ROW: "ToDo 2 + reuse every 3 (the default)",
    TODO_ROW: "ToDo 2 alone",
    EASYCACHE_ROW: "ComfyUI EasyCache 0.2 (its default)",
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bash tools/bench.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sd15", help="UNet of the speed parts (tiny: a plumbing check)")
    parser.add_argument("--resolution", default="768", help="image size of the speed parts in px")
    parser.add_argument("--max-minutes", type=float, default=2.0, help="time for the speed part's timed pairs")
    parser.add_argument("--steps", type=int, default=25, help="steps of the sampling run (picture and conversion)")
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
    only = ",".join(f"={name}" for name in PICTURE_ROWS)
    return [
        "--models", "ref-sd1", "--scales", "2", "--prompts", "4", "--seeds", "1", "--grid", "4",
        "--steps", str(args.steps), "--real", "256", "--only", only, "--out", args.out,
    ]  # fmt: skip


def reusing_share(args, bench) -> float:
    """The cost of a reusing call of the default as a share of an unpatched call (one of each, CPU time), on the
    speed part's model (``bench``: built once for both parts)."""
    from tools.bench.unet import steps

    side = int(args.resolution) // 8
    costs = steps.per_call(bench.patcher, steps.ROWS["ToDo 2 + reuse every 3"], bench.family, (side, side), 0)
    return costs["reusing_call_s"] / costs["unpatched_call_s"]


def whole_run(speed_report: dict, picture: dict, reusing: float, steps: int, attention_levels=(1, 2, 4)) -> dict:
    """Each row's speed-up over a run of ``steps`` (see the module docstring) and its picture figures; the default's
    full steps are those of the speed part's UNet (its ``attention_levels``: SD1.5's by default)."""
    from tome_core.reuse import unet_schedule
    from tome_core.settings import SPECS

    call = {row["row"]: row for row in speed_report["resolutions"][0]["rows"]}
    todo = call[TODO_ROW]["speedup"]
    records = {record["row"]: record for record in picture["records"]}
    full = unet_schedule(SPECS["reuse_interval"].default, attention_levels).full_steps(steps)
    calls = records[EASYCACHE_ROW]["work"].get("call_share", 1.0)
    speed = {
        "unpatched": 1.0,
        DEFAULT_ROW: steps / (full / todo + (steps - full) * reusing),
        TODO_ROW: todo,
        EASYCACHE_ROW: 1.0 / calls,
    }
    rows = {}
    for name, label in LABELS.items():
        record = records[name]
        rows[name] = {
            "label": label,
            "speedup": speed[name],
            "ssim": record["ssim"],
            "ssim_min": record["ssim_min"],
            "calls": record["work"].get("call_share", 1.0),
        }
    rows[DEFAULT_ROW]["full_steps"] = full
    return {
        "steps": steps,
        "reusing_share": reusing,
        "todo_spread_pct": call[TODO_ROW].get("speedup_spread_pct"),
        "rows": rows,
    }


def main(argv=None) -> dict:
    from tome_core.hosts.shared import unet_layout
    from tools.bench import speed
    from tools.fidelity import run as fidelity

    args = parse_args(argv)
    started = time.perf_counter()
    print(f"1/3 picture: reference model ref-sd1, {args.steps} steps, the same seed per row ...", file=sys.stderr)
    picture = fidelity.main(picture_argv(args))["ref-sd1"]
    print(f"2/3 speed of a call: {args.model} UNet (random weights) at {args.resolution} px ...", file=sys.stderr)
    built = {}
    speed_report = speed.main(speed_argv(args), keep=built)
    print("3/3 speed of a reusing call ...", file=sys.stderr, flush=True)
    levels = unet_layout.attention_levels(built["bench"].patcher.model.diffusion_model)
    run = whole_run(speed_report, picture, reusing_share(args, built["bench"]), args.steps, levels)
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
        f"  (the default runs {default['full_steps']} of {run['steps']} steps in full at ToDo 2's speed, the others at "
        f"{run['reusing_share']:.0%} of an unpatched step; EasyCache's calls are those it computed in the picture run)"
    )
    verdict = "reliable" if run["reliable"] else "UNRELIABLE (see above)"
    lines.append(f"Speed figures {verdict}. Picture: {out / 'fidelity-grid-ref-sd1.png'}. {run['minutes']:.1f} min.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
