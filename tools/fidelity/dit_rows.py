"""The rows of a DiT (Flux, Flux.2, Wan, Qwen-Image): this project's through the node and its reuse variants,
with the step caches and Spectrum beside them."""

from __future__ import annotations

import sys
from collections.abc import Callable

from tome_core.settings import PatchSettings
from tools.fidelity.peer_rows import FLUX_STEP_CACHE_THRESHOLDS, dit_peer_rows, spectrum_rows, step_cache_rows
from tools.fidelity.row import FidelityRow, ours
from tools.fidelity.variants import dit_variants


def dit_rows(
    nodes: dict,
    variants: bool = False,
    video: bool = False,
    args=None,
    other_step: float | None = None,
    ratios_of: Callable | None = None,
) -> list[FidelityRow]:
    """The rows of a DiT (Flux, Flux.2, Wan, Qwen-Image): ours through the node, and on the image models ToMe
    through attention (``dit_tome``), which the nodes do not offer on DiTs; the other rows patch UNets only.
    ``other_step``: the variants' step along the line other than the family's (None: a half step on Flux, a
    whole one on Wan)."""
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
    if variants:  # the choices behind the shipped DiT reuse: the schedule, the blocks that run, the prediction
        changed = dit_variants(video, other_step)
        for interval, changes in changed:
            name = f"ours reuse every {interval} variant " + " ".join(f"{k} {v}" for k, v in changes.items())
            rows.append(FidelityRow(name, "ours", dit_reuse_variant(interval, **changes), settings=changes))
        for interval in (3, 4):  # the first steps in full as EasyCache computes them (its start_percent 0.15)
            for start in (0.1, 0.15):
                name = f"ours reuse every {interval} from start_percent {start}"
                settings = {"method": "todo", "downsample_factor": 1.0, "reuse_interval": interval}
                rows.append(ours(nodes, name, start_percent=start, **settings))
        # A guard on what every reusing call computes anyway (the first block's output, as First Block Cache
        # decides): where it moved more than the threshold since the last full call, the call runs in full.
        for interval in (3, 4, 6, "default"):
            for guard in (0.05, 0.1, 0.15, 0.2):
                name = f"ours reuse {'every ' if interval != 'default' else ''}{interval} + first-block guard {guard}"
                changes = {"first_block_guard": guard}
                rows.append(FidelityRow(name, "ours", dit_reuse_variant(interval, **changes), settings=changes))
        # The line guard: a reusing call runs in full where the first block's output lies off the line through the
        # last two full calls' outputs (the path the residual's prediction follows), alone and with the guard on
        # the move since the last full call as a bound on how far the line is followed.
        for interval in (4, 6, 8):
            for line in (0.05, 0.07, 0.085, 0.1):
                name = f"ours reuse every {interval} + line guard {line}"
                changes = {"line_guard": line}
                rows.append(FidelityRow(name, "ours", dit_reuse_variant(interval, **changes), settings=changes))
        for interval in (6, 8):
            for line in (0.07, 0.1):
                for guard in (0.15, 0.2, 0.3):
                    name = f"ours reuse every {interval} + line guard {line} + first-block guard {guard}"
                    changes = {"line_guard": line, "first_block_guard": guard}
                    rows.append(FidelityRow(name, "ours", dit_reuse_variant(interval, **changes), settings=changes))
        # The guarded plans without the short run's cap (below 25 steps one step in two at most reuses, whatever
        # the interval): where the guards decide alone, a 20-step run can reuse more.
        for interval in (3, 4, 6):
            for line, guard in ((0.07, 0.15), (0.05, 0.1), (0.1, 0.15)):
                name = f"ours reuse every {interval} + line guard {line} + first-block guard {guard} uncapped"
                changes = {"line_guard": line, "first_block_guard": guard, "short_run": 0}
                rows.append(FidelityRow(name, "ours", dit_reuse_variant(interval, **changes), settings=changes))
        # First Block Cache's kind of decision on our prediction: a long interval, the first-block guard deciding.
        for interval in (12, 16):
            for guard in (0.03, 0.05, 0.07):
                name = f"ours reuse every {interval} + first-block guard {guard} uncapped"
                changes = {"first_block_guard": guard, "short_run": 0}
                rows.append(FidelityRow(name, "ours", dit_reuse_variant(interval, **changes), settings=changes))
        # The default's guard by the real model's curve at longer intervals where the curve is flat (every stretch
        # still within the published threshold on the real curve), alone and with the first-block guard.
        for interval in (4, 5, 6):
            for guard in (None, 0.1):
                name = f"ours reuse curve-guarded every {interval}" + (f" + first-block guard {guard}" if guard else "")
                changes = {"curve_guarded": True, "first_block_guard": guard}
                rows.append(FidelityRow(name, "ours", dit_reuse_variant(interval, **changes), settings=changes))
        # The real model's curve and the line guard together (the curve's steps in full, the line guard on top).
        for interval in (3, 4):
            for line in (0.05, 0.07, 0.1):
                name = f"ours reuse curve-guarded every {interval} + line guard {line}"
                changes = {"curve_guarded": True, "line_guard": line}
                rows.append(FidelityRow(name, "ours", dit_reuse_variant(interval, **changes), settings=changes))
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


def dit_reuse_variant(
    interval: int | str,
    outer=None,
    extrapolate=None,
    fixed_intervals=False,
    full_below=None,
    warm_up=0.0,
    first_block_guard=None,
    curve_guarded=False,
    line_guard=None,
    short_run=None,
) -> Callable:
    """DiT reuse across steps with engine defaults overridden: ``interval`` (every N, or "default": the family's
    plan, its interval guarded by the real model's curve), ``outer`` (blocks run at every call: at the start,
    at the end), ``extrapolate`` (None: the family's), ``fixed_intervals`` (the UNets' schedule with a tenth of
    the steps full at the start, as shipped before the schedule by noise), ``full_below`` (the noise below which
    every call runs in full, instead of the sampler's rule), ``warm_up`` (the share of the first steps run in full,
    within the interval's count), ``first_block_guard`` (a reusing call whose first block's output moved more than
    this since the last full call runs in full), ``curve_guarded`` (every ``interval``, guarded by the family's
    published curve as the default's interval is), ``line_guard`` (a reusing call whose first block's output lies
    more than this off the line through the last two full calls' outputs runs in full), ``short_run`` (runs of fewer
    steps reuse one step in two at most; None: the engine's, 0: no such cap, the guards decide alone)."""
    from tome_core.hosts.shared import dit_families
    from tome_core.reuse import IntervalSchedule, NoiseSpacedSchedule, StepCountSchedule
    from tome_core.schedule import NoiseRange
    from tools.fidelity import dit_peers
    from tools.fidelity.lab import ReuseVariant, install_dit_variant, with_warm_up

    def patch(model):
        clone = model.clone()
        every = 3 if interval == "default" else interval
        settings = PatchSettings(method="todo", downsample_factor=1.0, reuse_interval=every)
        family = dit_families.of_model("comfyui", model.model.diffusion_model)
        if interval == "default":
            schedule = family.auto_schedule()
        elif curve_guarded:
            schedule = StepCountSchedule(((0, interval),), family.curve)
        elif fixed_intervals:
            schedule = IntervalSchedule(interval, full_start=0.1)
        else:
            capped = {} if short_run is None else {"short_run": short_run}
            schedule = with_warm_up(NoiseSpacedSchedule(interval, **capped), warm_up)
        noise_range = NoiseRange(0.0, 1.0, lambda p: p)
        variant = ReuseVariant(schedule, extrapolate, outer, first_block_guard=first_block_guard, line_guard=line_guard)
        install_dit_variant(clone, settings, noise_range, variant)
        return clone if full_below is None else dit_peers.with_full_below(clone, full_below)

    return patch
