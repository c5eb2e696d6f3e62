"""``python -m tools.bench.dit.neo``: one Flux-layout run through Forge Neo's path beside ComfyUI's, on this CPU.

Neo is not on PyPI: its path here is the test suite's stand-in (``tests/hosts/neo_host.py``: Neo's call order and
script hooks, ComfyUI's classes where Neo's are ComfyUI's, Flux under Neo's class name), and ComfyUI's is the real
ComfyUI's KSampler with the "ToMe Patch" node at its defaults. The same random weights, seed and steps in both;
each path is timed patched and unpatched (best of ``--rounds``), and the two paths' outputs are compared, patched
and unpatched (the picture a setting keeps is the fidelity benchmark's question: here it is whether the two doors
compute the same thing at the same gain).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tools.common.stand_ins import hosts

REPO = Path(__file__).resolve().parents[3]
# A Flux layout of a useful size for a CPU: 2 double and 10 single blocks, 256 wide.
FLUX = {"hidden_size": 256, "num_heads": 4, "axes_dim": [16, 24, 24], "depth": 2, "depth_single_blocks": 10}
SHAPE = (1, 48, 48)  # a 48 x 48 latent: 576 image tokens


def _best(fn, rounds: int):
    times, out = [], None
    for _ in range(rounds):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return min(times), out


def measure(steps: int, rounds: int) -> dict:
    comfy_host, neo_host, webui_host = hosts()
    from tome_core.hosts.webui import args as webui_args

    model = neo_host.neo_model("flux", **FLUX)
    node_classes = comfy_host.load_our_package()
    host = webui_host.Host()
    on = webui_args.as_list(webui_args.defaults())
    on[webui_args.ARG_NAMES.index("enabled")] = True
    off = webui_host.script_args(enabled=False)

    def neo(args):
        return neo_host.process_images(host, neo_host.processing(model, args, steps=steps), "flux", shape=SHAPE)

    patched = comfy_host.patch_with_node(node_classes, model)

    def comfyui(m):
        return comfy_host.sample_dit(m, "flux", SHAPE, steps=steps, cfg=1.0)

    rows = {}
    for name, fn in (
        ("Neo off", lambda: neo(off)),
        ("Neo on", lambda: neo(on)),
        ("ComfyUI off", lambda: comfyui(model)),
        ("ComfyUI on", lambda: comfyui(patched)),
    ):
        fn()  # warm-up
        rows[name] = _best(fn, rounds)

    def gap(a, b):
        return float((rows[a][1] - rows[b][1]).abs().max())

    return {
        "steps": steps,
        "latent": list(SHAPE),
        "model": FLUX,
        "seconds": {name: round(seconds, 3) for name, (seconds, _) in rows.items()},
        "speedup": {
            "Neo": round(rows["Neo off"][0] / rows["Neo on"][0], 2),
            "ComfyUI": round(rows["ComfyUI off"][0] / rows["ComfyUI on"][0], 2),
        },
        "largest difference": {
            "Neo on vs ComfyUI on": gap("Neo on", "ComfyUI on"),
            "Neo off vs ComfyUI off": gap("Neo off", "ComfyUI off"),
        },
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one: the steadiest timing)")
    parser.add_argument("--out", default=str(REPO / "results" / "neo" / "neo-vs-comfyui.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = measure(args.steps, args.rounds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
