"""This project's reuse across steps on the UNets, layer by layer: the node's rows and the engine variants its
defaults were chosen from."""

from __future__ import annotations

import math
from collections.abc import Callable

from tome_core.settings import PatchSettings
from tools.fidelity.peer_rows import followed_by_easycache
from tools.fidelity.row import FidelityRow, ours
from tools.fidelity.variants import UNET_VARIANTS


def first_order_at_reusing_steps(clone):
    """``clone`` (patched with reuse across steps) with each reusing call's output blended with the call before it
    so that a two-step sampler (DPM++ 2M: ``(1 + c) * D_i - c * D_i-1``, ``c = h_i / (2 h_i-1)``) takes a first
    order step with the predicted output instead of amplifying its error by ``1 + c``. Measured, not shipped: the
    blend assumes DPM++ 2M's update, and ComfyUI's CFG is linear in each call's output, so it carries over."""
    from tome_core.hosts.comfyui.layer_reuse import RUN_KEY
    from tome_core.schedule import step_of

    previous: dict = {}

    def wrapper(executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kwargs):
        found = (transformer_options or {}).get(RUN_KEY)
        if found is None:
            return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
        run, sigmas = found
        calls, reused = run.calls, run.reused_calls
        out = executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
        was_reused = run.reused_calls > reused if run.calls > calls else bool(run.current and run.current.reuse)
        step = step_of(sigmas, float(t.max()))
        key = (tuple(str(u) for u in transformer_options.get("uuids") or ()), tuple(x.shape))
        last = previous.get(key)
        if was_reused and step and last is not None and last[0] == step - 1 and float(sigmas[step + 1]) > 0:
            h = math.log(float(sigmas[step]) / float(sigmas[step + 1]))
            h_last = math.log(float(sigmas[step - 1]) / float(sigmas[step]))
            c = h / (2 * h_last)
            out = (out + c * last[1]) / (1 + c)
        previous[key] = (step, out)
        return out

    clone.add_wrapper_with_key("apply_model", "fidelity_first_order", wrapper)
    return clone


def layer_reuse_rows(nodes: dict, variants: bool) -> list[FidelityRow]:
    """Setting reuse_interval alone (ToDo off) and with ToDo 2; with ``variants`` the engine variants its
    defaults were chosen from (the predictor, the outer blocks)."""
    rows = []
    for interval in (2, 3, 4):
        rows.append(
            ours(nodes, f"ours reuse every {interval}", method="todo", downsample_factor=1.0, reuse_interval=interval)
        )
    for interval in (2, 3):
        rows.append(ours(nodes, f"ours ToDo 2 + reuse every {interval}", method="todo", reuse_interval=interval))
    # The default before "forecast" (what a job saved with reuse_plan "auto" runs), with ToDo 2 and alone.
    rows.append(ours(nodes, "ours ToDo 2 + reuse every 3 plan auto", method="todo", reuse_interval=3,
                     reuse_plan="auto"))  # fmt: skip
    rows.append(ours(nodes, "ours reuse every 3 plan auto", method="todo", downsample_factor=1.0, reuse_interval=3,
                     reuse_plan="auto"))  # fmt: skip
    # The forecast before "forecast v2" (DPM++ 2M on Karras sigmas: 19 of 25 computed), what a job saved with it runs.
    rows.append(ours(nodes, "ours reuse every 3 plan forecast", method="todo", downsample_factor=1.0, reuse_interval=3,
                     reuse_plan="forecast"))  # fmt: skip
    # Space and time: ToDo in every call EasyCache computes (layer reuse stands down under a step cache).
    rows.append(followed_by_easycache(ours(nodes, "ours ToDo 2", method="todo")))
    if not variants:
        return rows
    # DPM++ 2M: a first-order step at the reusing steps (``first_order_at_reusing_steps``).
    default = next(row for row in rows if row.name == "ours ToDo 2 + reuse every 3")
    rows.append(
        FidelityRow(
            "ours ToDo 2 + reuse every 3 variant first order at reusing steps",
            "ours",
            lambda model: first_order_at_reusing_steps(default.patch(model)),
            settings={**default.settings, "first_order_at_reusing_steps": True},
        )
    )
    # The plan before the family plans (what a job saved before ``reuse_plan`` existed runs).
    rows.append(
        ours(nodes, "ours ToDo 2 + reuse every 3 plan every N", method="todo", reuse_interval=3, reuse_plan="every N")
    )
    # The inner layers forecast from the last eight full steps as Spectrum forecasts whole steps (``forecast``).
    from tools.fidelity.forecast import forecast_hooks

    spectral = ours(nodes, "ours ToDo 2 + reuse every 3 variant Spectrum's forecast", method="todo", reuse_interval=3)
    spectral.enter, spectral.leave = forecast_hooks()
    rows.append(spectral)
    alone = ours(nodes, "ours reuse every 3 variant Spectrum's forecast", method="todo", downsample_factor=1.0,
                 reuse_interval=3)  # fmt: skip
    alone.enter, alone.leave = forecast_hooks()
    rows.append(alone)
    changed = UNET_VARIANTS
    for interval, changes in changed:
        name = f"ours reuse every {interval} variant " + " ".join(f"{k} {v}" for k, v in changes.items())
        rows.append(FidelityRow(name, "ours", *layer_reuse_variant_hooks(interval, **changes), settings=changes))
    return rows


def layer_reuse_variant_hooks(interval, any_sigmas=False, **changes) -> tuple:
    """``layer_reuse_variant``'s patch, with ``enter`` / ``leave`` that let reuse run on any sigmas
    (``any_sigmas``: Karras sigmas too, which the shipped rule stands reuse down on)."""
    patch = layer_reuse_variant(interval, **changes)
    if not any_sigmas:
        return (patch,)
    from tome_core.hosts.comfyui import layer_reuse as layer_reuse_hooks

    kept = layer_reuse_hooks.schedule_name

    def enter():
        layer_reuse_hooks.schedule_name = lambda guider, sigmas: None

    def leave():
        layer_reuse_hooks.schedule_name = kept

    return patch, enter, leave


def layer_reuse_variant(
    interval,
    extrapolate=0.5,
    outer=1,
    by_sigma=True,
    todo=1.0,
    kind="interval",
    order=1,
    full_below=None,
    first_block_guard=None,
    line_guard=None,
    rate_guard=None,
    **schedule,
) -> Callable:
    """Layer reuse with engine defaults overridden (the variants the setting's defaults were chosen from), after
    ToDo at factor ``todo`` (1: none). ``kind`` "noise": the full steps spaced by the logarithm of the noise
    (``NoiseSpacedSchedule``, the DiTs' schedule; ``interval`` may be fractional there), else the interval
    schedule; ``by_sigma`` "log": the line drawn over log sigma."""
    from tome_core.hosts.comfyui import layer_reuse as layer_reuse_hooks
    from tome_core.hosts.shared.model_patcher import patched_clone
    from tome_core.reuse import IntervalSchedule
    from tome_core.schedule import NoiseRange
    from tools.fidelity.hybrid import NamedSchedule
    from tools.fidelity.lab import EdgeSchedule, ReuseVariant, install_unet_variant

    def patch(model):
        everywhere = NoiseRange(0.0, 1.0, lambda p: p)
        todo_only = PatchSettings(method="todo", downsample_factor=todo, skip_when_slower=False)
        clone = patched_clone(model, todo_only, lambda p: p) if todo != 1.0 else model.clone()
        # The setting's value only turns reuse on here (the schedule is the variant's, which may go past its range).
        # The layers' reuse ("auto": the plan the variants were measured against, not "forecast"'s whole steps).
        settings = PatchSettings(
            method="todo", downsample_factor=1.0, reuse_interval=min(math.ceil(interval), 16), reuse_plan="auto"
        )
        # A variant changes the schedule its rows were measured against: the last two steps full and no short-run
        # or few-steps rule (docs/step-reuse.md, "before"); it names any other value.
        if kind == "noise":  # the shipped short-run and few-steps rules unless named
            schedule_ = EdgeSchedule(interval, **schedule)
        elif kind == "named":  # the full steps named one by one (``hybrid.NamedSchedule``)
            schedule_ = NamedSchedule(interval, **schedule)
        else:
            schedule_ = IntervalSchedule(interval, **{"short_run": 0, "full_end": 2, "min_steps": 0, **schedule})
        variant = ReuseVariant(
            schedule_, extrapolate, outer, by_sigma, order, first_block_guard, line_guard, rate_guard
        )
        install_unet_variant(clone, settings, everywhere, variant)
        if full_below is not None:  # every call below this sigma in full, in place of the sampler's rule
            hooks = clone.injections[layer_reuse_hooks.INJECTION_KEY][0].hooks
            new_run = hooks.new_run
            hooks.new_run = lambda steps, levels=None, _rule=0.0: new_run(steps, levels, full_below)
        return clone

    return patch
