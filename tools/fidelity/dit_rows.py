"""The rows of a DiT (Flux, Flux.2, Wan, Qwen-Image): this project's through the node, with the step caches and
Spectrum beside them."""

from __future__ import annotations

import sys
from collections.abc import Callable

from tools.fidelity.peer_rows import FLUX_STEP_CACHE_THRESHOLDS, dit_peer_rows, spectrum_rows, step_cache_rows
from tools.fidelity.row import FidelityRow, ours


def dit_rows(
    nodes: dict,
    variants: bool = False,
    video: bool = False,
    args=None,
    ratios_of: Callable | None = None,
) -> list[FidelityRow]:
    """The rows of a DiT (Flux, Flux.2, Wan, Qwen-Image): ours through the node, and on the image models ToMe
    through attention (``dit_tome``), which the nodes do not offer on DiTs; the other rows patch UNets only.
    ``variants``: the node's start_percent and the slope in 4 bits beside the default."""
    from tools.fidelity import dit_tome

    rows = [
        FidelityRow("unpatched", "unpatched", lambda model: model),
        ours(nodes, "ours ToDo 2", method="todo", downsample_factor=2.0),
        ours(nodes, "ours ToDo 3", method="todo", downsample_factor=3.0),
        # The first 60% of the schedule only: the last, low-noise steps that draw the details run in full.
        ours(nodes, "ours ToDo 2 until 60%", method="todo", downsample_factor=2.0, end_percent=0.6),
    ]
    for ratio in () if video else (0.5, 0.25):  # the measurement behind offering ToDo only on DiTs
        settings = {"method": "tome", "ratio": ratio, "scope": "attention (prototype)"}
        rows.append(
            FidelityRow(f"ToMe attention {ratio} (not shipped)", "ours", dit_tome.patch(ratio), settings=settings)
        )
    # Reuse across steps (tome_core/hosts/comfyui/dit_reuse.py): alone, and with ToDo 2 on the calls that run.
    # On video also 5, 12 and 16: First Block Cache's thresholds reach 3.1x, 4.4x and 6.2x there (Flux loses the
    # picture from 6 on).
    for interval in (2, 3, 4, 6, 8) + ((5, 12, 16) if video else ()):
        rows.append(
            ours(nodes, f"ours reuse every {interval}", method="todo", downsample_factor=1.0, reuse_interval=interval)
        )
    for interval in (3,):
        rows.append(ours(nodes, f"ours ToDo 2 + reuse every {interval}", method="todo", reuse_interval=interval))
    # What a node added anew runs: the family's interval, guarded by the real model's published step-to-step change.
    rows.append(ours(nodes, "ours default", dit_settings="auto"))
    if variants:
        for interval in (3, 4):  # the first steps in full as EasyCache computes them (its start_percent 0.15)
            for start in (0.1, 0.15):
                name = f"ours reuse every {interval} from start_percent {start}"
                settings = {"method": "todo", "downsample_factor": 1.0, "reuse_interval": interval}
                rows.append(ours(nodes, name, start_percent=start, **settings))
        for interval in (3, 4, 6, 8):  # the slope in 4 bits, as large caches keep it, forced on the reference
            name = f"ours reuse every {interval} variant slope in 4 bits"
            row = ours(nodes, name, method="todo", downsample_factor=1.0, reuse_interval=interval)
            row.enter, row.leave = (lambda: compact_slopes(0)), (lambda: compact_slopes(None))
            rows.append(row)
    steps = args.steps if args is not None else 28
    shares = (0.4, 0.5)  # near the DiT defaults' work (2.0-2.5x)
    return rows + step_cache_rows(FLUX_STEP_CACHE_THRESHOLDS) + dit_peer_rows(ratios_of) + spectrum_rows(steps, shares)


_COMPACT_DEFAULTS: dict = {}


def compact_slopes(threshold: int | None) -> None:
    """Every loaded copy of the engine (ComfyUI loads the node package under its folder's name) keeps a DiT
    residual's slope in 4 bits from ``threshold`` bytes on; None: the engine's own threshold again."""
    for name, module in list(sys.modules.items()):
        if name.endswith("tome_core.reuse.cache"):
            _COMPACT_DEFAULTS.setdefault(name, module.COMPACT_SLOPE_BYTES)
            module.COMPACT_SLOPE_BYTES = _COMPACT_DEFAULTS[name] if threshold is None else threshold
