"""The fidelity benchmark: do I get the same picture, sooner? Measured on the trained reference models.

``bash tools/bench.sh --fidelity`` (= ``python -m tools.fidelity``) samples a fixed set of prompts x seeds with
each row (unpatched; this project's methods and settings through the ComfyUI node; ComfyUI's built-in
TomePatchModel; tomesd 0.1.3 and a ToDo reference-style patch on the same weights) with ComfyUI's own KSampler
(Euler, CFG), at the models' training size and at twice that size, and reports for every row:
- same-seed similarity of each final image to the unpatched one: SSIM and PSNR (torchmetrics), on the colour
  channels mapped to [0, 1];
- the attribute accuracy of the reference classifier (kind, colour, position, background), mean over the
  four and all four right at once;
- the Frechet distance between the samples and real scenes in the classifier's feature space (torchmetrics'
  FrechetInceptionDistance with the classifier as feature extractor);
- the speed of the same sampling run: wall time and process CPU time, and the speed-up over unpatched.
Output: ``results/fidelity-<model>.md`` and ``.json``, a speed-versus-fidelity chart
``results/fidelity-<model>.png``, and an image grid (same prompts and seeds side by side per row)
``results/fidelity-grid-<model>.png``; ``--docs`` copies grid and chart into ``docs/``.

On the Flux reference model (``ref-flux``) the rows are unpatched, ours through the same node (ToDo 2 and 3, and
ToDo 2 in the first 60% of the steps only), and ToMe through attention at 0.5 and 0.25 (``dit_tome``: measured,
not offered by the nodes on DiTs), reuse across steps (every N and the default), and the step caches: ComfyUI's
EasyCache and LazyCache, and (``dit_peers``) First Block Cache, a TaylorSeer-style forecast and MagCache calibrated
on the reference; the UNet-only rows (tomesd, TomePatchModel, the ToDo reference patch, block scope) do not apply.

Our rows force the reduction at every size (``skip_when_slower`` off): the reference models' token grids are
smaller than the sizes where the shipped defaults switch the reduction on, and the question here is what the
reduction does to the picture. Speed at real sizes is the speed benchmark's job (``bash tools/bench.sh``).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tome_core.settings import SPECS, PatchSettings
from tools.common.host import LdmHolder, build_ldm_unet, setup_comfy
from tools.common.machine import machine, versions
from tools.fidelity.variants import UNET_VARIANTS, dit_variants
from tools.fidelity.work import count_work

ROOT = Path(__file__).resolve().parents[2]
PROMPT_SEED = 1234


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.fidelity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        default="ref-sd1,ref-sdxl,ref-flux",
        help="reference models (ref-sd1, ref-sdxl, ref-flux, ref-flux-deep, ref-flux2, ref-wan, ref-qwen; the second "
        "generation ref-qwen-v2, ref-flux-v2, ref-sdxl-v2, ref-sd1-v2)",
    )
    parser.add_argument("--scales", default="1,2", help="image sizes as multiples of the training size")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per seed (one sampling batch)")
    parser.add_argument("--seeds", type=int, default=4, help="seeds: images = prompts x seeds")
    parser.add_argument(
        "--first-seed", type=int, default=0, help="the first seed (another set of seeds: unpatched's own spread)"
    )
    parser.add_argument(
        "--first-prompt",
        type=int,
        default=0,
        help="where the prompts start in the fixed shuffled list (another set: 16 for the second 16, where settings "
        "are chosen before they are reported on the first)",
    )
    parser.add_argument("--steps", type=int, default=12, help="sampling steps")
    parser.add_argument("--sampler", default="euler", help="ComfyUI sampler name (euler, euler_ancestral, heun, ...)")
    parser.add_argument("--scheduler", default="normal", help="ComfyUI scheduler name (normal, karras, ...)")
    parser.add_argument("--cfg", type=float, default=4.0)
    parser.add_argument(
        "--any-sampler", action="store_true", help="let reuse run with a sampler it is not measured with yet"
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated words: keep rows whose name contains one ('=name': exactly that row)",
    )
    parser.add_argument("--broken", action="store_true", help="add a deliberately broken patch (plumbing check)")
    parser.add_argument(
        "--variants", action="store_true", help="add the reuse_interval variants its defaults were chosen from"
    )
    parser.add_argument("--real", type=int, default=1024, help="real scenes for the Frechet distance")
    parser.add_argument("--grid", type=int, default=8, help="images per row in the grid")
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument("--docs", action="store_true", help="copy grid and chart to docs/")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's choice)")
    return parser.parse_args(argv)


@dataclass
class FidelityRow:
    """One way of sampling: ``patch(model)`` returns the ModelPatcher to sample with."""

    name: str
    group: str  # "unpatched", "ours", "peer" or "broken"
    patch: Callable
    enter: Callable[[], None] = lambda: None
    leave: Callable[[], None] = lambda: None
    settings: dict = field(default_factory=dict)
    # Work done before the row is sampled, neither timed nor counted (MagCache's calibration run).
    prepare: Callable = lambda patcher: None


def node_patch(node_cls, **inputs) -> Callable:
    """This project's patch applied by running the ComfyUI node class, as a graph would."""

    def patch(model):
        if hasattr(node_cls, "GET_SCHEMA"):  # V3 node
            return node_cls.execute(model=model, **inputs).result[0]
        return getattr(node_cls(), node_cls.FUNCTION)(model=model, **inputs)[0]

    return patch


def load_our_nodes() -> dict:
    """Load this repository with ComfyUI's custom node loader; returns its node classes by id."""
    import asyncio

    import nodes as comfy_nodes

    if "ToMePatchAdvanced" not in comfy_nodes.NODE_CLASS_MAPPINGS:
        if not asyncio.run(comfy_nodes.load_custom_node(str(ROOT), module_parent="custom_nodes")):
            raise RuntimeError("ComfyUI did not load this repository as a custom node package")
    return comfy_nodes.NODE_CLASS_MAPPINGS


def ours(nodes: dict, name: str, **values) -> FidelityRow:
    # reuse_plan as a node added anew has it (a prompt that leaves it out means the plan before it existed).
    inputs = {"max_downsample": "auto", "skip_when_slower": False, "reuse_plan": SPECS["reuse_plan"].default, **values}
    inputs["max_downsample"] = str(inputs["max_downsample"])
    return FidelityRow(name, "ours", node_patch(nodes["ToMePatchAdvanced"], **inputs), settings=inputs)


def comfy_builtin(ratio: float) -> FidelityRow:
    from comfy_extras.nodes_tomesd import TomePatchModel

    return FidelityRow(
        f"ComfyUI TomePatchModel {ratio}",
        "peer",
        lambda model: TomePatchModel.execute(model, ratio).result[0],
        settings={"ratio": ratio},
    )


def todo_reference(factor: float, level: int) -> FidelityRow:
    from tools.common.todo_reference import todo_reference_patch

    def patch(model):
        clone = model.clone()
        clone.set_model_attn1_patch(todo_reference_patch(factor, level))
        return clone

    return FidelityRow(f"ToDo reference {factor:g}", "peer", patch, settings={"factor": factor, "level": level})


def tomesd_row(family, state_dict: dict, ratio: float, level: int, everywhere: bool) -> FidelityRow | None:
    """tomesd 0.1.3 on the WebUI's ldm UNet with the same weights, swapped in for ComfyUI's UNet by an object
    patch, so the same ComfyUI sampler drives it. None where ldm cannot build the layout (SDXL needs sgm)."""
    unet = build_ldm_unet(family, state_dict, torch.float32, torch.device("cpu"))
    if unet is None:
        return None
    import tomesd

    holder = LdmHolder(unet)
    extra = {"merge_crossattn": True, "merge_mlp": True} if everywhere else {}

    def patch(model):
        clone = model.clone()
        clone.add_object_patch("diffusion_model", unet)
        return clone

    name = f"tomesd {ratio}" + (" +cross-attn +MLP" if everywhere else "")
    return FidelityRow(
        name,
        "peer",
        patch,
        enter=lambda: tomesd.apply_patch(holder, ratio=ratio, max_downsample=level, use_rand=False, **extra),
        leave=lambda: tomesd.remove_patch(holder),
        settings={"ratio": ratio, "max_downsample": level, "use_rand": False, **extra},
    )


STEP_CACHE_THRESHOLDS = (0.1, 0.2, 0.4)  # 0.2 is the nodes' default
FLUX_STEP_CACHE_THRESHOLDS = (0.05, 0.1, 0.2, 0.4)  # on ref-flux 0.2 already skips half of the calls


def step_cache_rows(thresholds=STEP_CACHE_THRESHOLDS) -> list[FidelityRow]:
    """ComfyUI's own step caches (comfy_extras/nodes_easycache.py) at three ``reuse_threshold`` values, applied
    by running the node with its other inputs at their defaults, as a graph would. EasyCache runs with
    ``easycache_on_a_copy`` (see there) in place."""
    from comfy_extras import nodes_easycache

    rows = []
    for label, node in (("EasyCache", nodes_easycache.EasyCacheNode), ("LazyCache", nodes_easycache.LazyCacheNode)):
        for threshold in thresholds:
            inputs = {"reuse_threshold": threshold, "start_percent": 0.15, "end_percent": 0.95, "verbose": False}
            row = FidelityRow(f"{label} {threshold}", "peer", node_patch(node, **inputs), settings=inputs)
            if label == "EasyCache":
                row.enter, row.leave = easycache_on_a_copy()
            rows.append(row)
    return rows


def easycache_on_a_copy() -> tuple[Callable, Callable]:
    """``enter`` / ``leave`` that make EasyCache add its cached difference to a copy of the model input.

    ComfyUI's ``EasyCacheHolder.apply_cache_diff`` adds in place into the diffusion model's input. For flow models
    (Flux, SD3, Wan: ``CONST.calculate_input`` returns its input) in float32, where the cast to the model's dtype
    does not copy, that input is the very tensor ``calculate_denoised`` then reads, so every skipped step yields a
    wrong latent and the picture is lost (ref-flux, 28 steps: SSIM 0.32 at threshold 0.05). In fp16 / bf16, where
    users run it, the cast copies and nothing is changed; on eps-prediction UNets the input is scaled first (a new
    tensor), so this changes nothing there. This harness samples in float32: the copy gives EasyCache what its
    users get."""
    from comfy_extras import nodes_easycache

    holder = nodes_easycache.EasyCacheHolder
    original = holder.apply_cache_diff

    def on_a_copy(self, x, *args, **kwargs):
        return original(self, x.clone(), *args, **kwargs)

    def enter():
        holder.apply_cache_diff = on_a_copy

    def leave():
        holder.apply_cache_diff = original

    return enter, leave


def followed_by_easycache(row: FidelityRow, threshold: float = 0.2) -> FidelityRow:
    """``row``'s patch and then ComfyUI's EasyCache node at its defaults, as a graph chains the two nodes."""
    from comfy_extras import nodes_easycache

    inputs = {"reuse_threshold": threshold, "start_percent": 0.15, "end_percent": 0.95, "verbose": False}
    easycache = node_patch(nodes_easycache.EasyCacheNode, **inputs)
    return FidelityRow(
        f"{row.name} + EasyCache {threshold}",
        row.group,
        lambda model: easycache(row.patch(model)),
        settings={**row.settings, "easycache": inputs},
    )


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


def broken_patch(model):
    """A deliberately wrong merge: self-attention's output shifted by one token at every level."""
    clone = model.clone()
    clone.set_model_attn1_output_patch(lambda out, extra_options: out.roll(1, dims=1))
    return clone


def _shifted_attention(func, *args, **kwargs):
    return func(*args, **kwargs).roll(1, dims=1)


def broken_dit_patch(model):
    """The same wrong merge on a DiT: every attention's output shifted by one token (text and image tokens),
    through ComfyUI's ``optimized_attention_override`` (DiT blocks have no attn1 output patch)."""
    clone = model.clone()
    clone.model_options["transformer_options"]["optimized_attention_override"] = _shifted_attention
    return clone


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


def spectrum_rows(steps: int, shares: tuple[float, ...]) -> list[FidelityRow]:
    """Spectrum (``spectrum``): as Forge Neo ships it, and computing about ``shares`` of the run's steps (the
    fewest warm-up steps whose plan hits that count, window 2 or 3)."""
    from tools.fidelity import spectrum

    chosen = [spectrum.SpectrumSettings()]
    for share in shares:
        try:
            chosen.append(spectrum.settings_computing(steps, math.ceil(share * steps - 1e-9)))
        except ValueError:
            continue
    rows, seen = [], set()
    for index, settings in enumerate(chosen):
        if settings in seen:
            continue
        seen.add(settings)
        kind = "Neo's defaults, " if index == 0 else ""
        name = f"Spectrum ({kind}{settings.label(steps)} computed)"
        rows.append(FidelityRow(name, "peer", spectrum.spectrum_patch(settings), settings=vars(settings)))
    return rows


def whole_step_rows(steps: int) -> list[FidelityRow]:
    """A skipped step that runs nothing (issue #60): the whole output forecast along the line through the last two
    computed steps alone (no Chebyshev fit), over the step (Spectrum's line) or over the noise level (ours), moved
    all the way or three quarters of it; computed: the first 2, 3 or 4 steps, one in three after, the last tenth
    (11, 12, 13 of 25), Spectrum's plan of about three quarters of the steps (DPM++ 2M's low-noise share) and
    Neo's own (17 of 25)."""
    from tools.fidelity import spectrum

    plans = [spectrum.SpectrumSettings(window=3, warm_up=warm_up) for warm_up in (2, 3, 4)]
    plans.append(spectrum.settings_computing(steps, round(0.56 * steps)))  # DPM++ 2M's 1.7x target (14 of 25)
    plans.append(spectrum.settings_computing(steps, math.ceil(0.64 * steps)))  # the stochastic samplers' 1.5x
    plans.append(spectrum.settings_computing(steps, math.ceil(0.76 * steps)))
    plans.append(spectrum.SpectrumSettings())  # Neo's own plan (17 of 25)
    rows = []
    for plan in plans:
        for reach in (1.0, 0.75):
            for by_sigma in (False, True):
                settings = spectrum.SpectrumSettings(
                    blend=0.0, window=plan.window, warm_up=plan.warm_up, reach=reach, by_sigma=by_sigma
                )
                over = " over sigma" if by_sigma else ""
                name = f"whole-step line {reach}{over} ({settings.label(steps)} computed)"
                rows.append(FidelityRow(name, "ours", spectrum.spectrum_patch(settings), settings=vars(settings)))
            # The velocity forecast in place of the denoised image (``spectrum.SpectrumSettings.space``).
            for sigma_data in (1.0, 0.5):
                settings = spectrum.SpectrumSettings(
                    blend=0.0,
                    window=plan.window,
                    warm_up=plan.warm_up,
                    reach=reach,
                    by_sigma=True,
                    space="v",
                    sigma_data=sigma_data,
                )
                name = f"whole-step line {reach} over sigma in v {sigma_data} ({settings.label(steps)} computed)"
                rows.append(FidelityRow(name, "ours", spectrum.spectrum_patch(settings), settings=vars(settings)))
            # The predicted noise (an SD UNet's own output) in place of either.
            settings = spectrum.SpectrumSettings(
                blend=0.0, window=plan.window, warm_up=plan.warm_up, reach=reach, by_sigma=True, space="eps"
            )
            name = f"whole-step line {reach} over sigma in eps ({settings.label(steps)} computed)"
            rows.append(FidelityRow(name, "ours", spectrum.spectrum_patch(settings), settings=vars(settings)))
    return rows + whole_step_plan_rows(steps)


# Issue #60: the default's 13 of 25 computed steps (Euler), and each of them dropped in turn (12 of 25): what
# each computed step is worth, for the plans of 11 of 25 (2.27x).
THIRTEEN_OF_25 = (0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 22, 23, 24)
DROPPED_ONE = tuple(tuple(s for s in THIRTEEN_OF_25 if s != dropped) for dropped in THIRTEEN_OF_25[2:])
# 11 of 25: two of the 13 dropped, the pairs whose single drops cost least on `ref-sd1` and `ref-sdxl`.
DROPPED_TWO = tuple(
    tuple(s for s in THIRTEEN_OF_25 if s not in pair) for pair in ((2, 15), (2, 21), (2, 9), (15, 21), (9, 15), (2, 18))
)
# The same for DPM++ 2M on Karras sigmas: its 19 of 25 (the first ten, one in two, the last three), for 14 (1.79x).
NINETEEN_OF_25 = (*range(10), 11, 13, 15, 17, 19, 21, 22, 23, 24)
DROPPED_ONE_OF_19 = tuple(tuple(s for s in NINETEEN_OF_25 if s != dropped) for dropped in NINETEEN_OF_25[2:])
# 14 of 25 with DPM++ 2M on Karras sigmas: the ten first steps' single drops cost least on `ref-sdxl`.
FOURTEEN_OF_25 = (
    (0, 1, 4, 7, 9, 11, 13, 15, 17, 19, 21, 22, 23, 24),
    (0, 1, 3, 6, 9, 11, 13, 15, 17, 19, 21, 22, 23, 24),
    (0, 1, 2, 5, 9, 11, 13, 15, 17, 19, 21, 22, 23, 24),
    (0, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 22, 23, 24),
    (0, 1, 5, 8, 9, 11, 13, 15, 17, 19, 21, 22, 23, 24),
    # Steps 15, 17, 23 and 24 each cost nothing alone on `ref-sdxl`: left out with some of the first ten.
    (0, 1, 2, 3, 4, 6, 7, 8, 9, 11, 13, 19, 21, 22),
    (0, 1, 2, 3, 4, 6, 8, 9, 11, 13, 19, 21, 22, 24),
    (0, 1, 3, 4, 6, 8, 9, 11, 13, 15, 19, 21, 22, 24),
)


NAMED_PLANS = (THIRTEEN_OF_25, *DROPPED_ONE, *DROPPED_TWO, NINETEEN_OF_25, *DROPPED_ONE_OF_19, *FOURTEEN_OF_25)

# Full steps and reusing steps (the outer layers only) of 25; the others run nothing (``hybrid``).
HYBRIDS = (
    ((0, 1, 3, 6, 12, 18, 21, 22, 23, 24), (2, 9, 15)),
    ((0, 1, 2, 3, 6, 12, 18, 21, 22, 23, 24), (9, 15)),
    ((0, 1, 3, 6, 12, 18, 22, 23, 24), (2, 9, 15, 21)),
    ((0, 1, 3, 6, 12, 18, 21, 22, 23, 24), (2, 4, 5, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 19, 20)),
)


def whole_step_plan_rows(steps: int) -> list[FidelityRow]:
    """The whole step along ours' line (three quarters, over the noise level) on plans named step by step (25
    steps), with full, reusing and skipped steps in one run (``hybrid``), and on plans decided per image
    (``adaptive``)."""
    from tools.fidelity import adaptive, hybrid, spectrum

    line = {"blend": 0.0, "reach": 0.75, "by_sigma": True}
    rows = []
    for at in NAMED_PLANS if steps == 25 else ():
        settings = spectrum.SpectrumSettings(at=at, **line)
        name = f"whole-step plan ({settings.label(steps)})"
        rows.append(FidelityRow(name, "ours", spectrum.spectrum_patch(settings), settings=vars(settings)))
    # The two 11-of-25 plans that kept the most on both first references, forecasting the velocity or the noise.
    for at in DROPPED_TWO[:1] + DROPPED_TWO[2:3] if steps == 25 else ():
        for space in ("v", "eps"):
            settings = spectrum.SpectrumSettings(at=at, space=space, **line)
            name = f"whole-step plan ({settings.label(steps)}) in {space}"
            rows.append(FidelityRow(name, "ours", spectrum.spectrum_patch(settings), settings=vars(settings)))
    for full, reused in HYBRIDS if steps == 25 else ():
        for layer_reach in (0.5, 0.75):
            schedule = {"kind": "named", "full": full, "extrapolate": layer_reach}
            patch = hybrid.hybrid_patch(
                layer_reuse_variant(3, **schedule), tuple(s for s in range(25) if s not in full + reused)
            )
            name = f"hybrid full {' '.join(map(str, full))} reuse {' '.join(map(str, reused))} (reach {layer_reach})"
            rows.append(FidelityRow(name, "ours", patch, settings={"full": full, "reused": reused}))
    for tail in (1, 3):
        for tolerance in (0.1, 0.2, 0.3):
            settings = adaptive.AdaptiveSettings(budget=11, warm_up=4, tail=tail, tolerance=tolerance)
            name = f"whole-step per image ({settings.label(steps)})"
            rows.append(FidelityRow(name, "ours", adaptive.adaptive_patch(settings), settings=vars(settings)))
    return rows


_COMPACT_DEFAULTS: dict = {}


def compact_slopes(threshold: int | None) -> None:
    """Every loaded copy of the engine (ComfyUI loads the node package under its folder's name) keeps a DiT
    residual's slope in 4 bits from ``threshold`` bytes on; None: the engine's own threshold again."""
    for name, module in list(sys.modules.items()):
        if name.endswith("tome_core.reuse.cache"):
            _COMPACT_DEFAULTS.setdefault(name, module.COMPACT_SLOPE_BYTES)
            module.COMPACT_SLOPE_BYTES = _COMPACT_DEFAULTS[name] if threshold is None else threshold


def dit_peer_rows(ratios_of: Callable | None = None) -> list[FidelityRow]:
    """The published DiT step caches ComfyUI does not ship (``dit_peers``: measured, not offered); MagCache where
    ``ratios_of(model)`` gives its calibration."""
    from tools.fidelity import dit_peers

    rows = []
    for threshold in (0.06, 0.12, 0.24) if ratios_of else ():  # diffusers' default; its authors' Flux settings
        settings = {"threshold": threshold, "max_skips": 3, "retention": 0.2, "ratios": "calibrated"}
        patch = dit_peers.magcache_patch(threshold, ratios_of)
        name = f"MagCache {threshold} (calibrated)"
        rows.append(FidelityRow(name, "peer", patch, settings=settings, prepare=ratios_of))
    for threshold in (0.08, 0.12, 0.2):  # 0.08 and 0.12: the published Flux.1-dev figures (1.55x, 1.91x)
        settings = {"threshold": threshold}
        rows.append(
            FidelityRow(
                f"First Block Cache {threshold}",
                "peer",
                dit_peers.first_block_cache_patch(threshold),
                settings=settings,
            )
        )
    for policy in dit_peers.CACHE_DIT_PLANS:  # cached steps run the first block (DBCache F1B0)
        settings = {"policy": policy, "Fn_compute_blocks": 1, "Bn_compute_blocks": 0}
        patch = dit_peers.cache_dit_plan_patch(policy)
        rows.append(FidelityRow(f"cache-dit fixed plan {policy}", "peer", patch, settings=settings))
    settings = {"interval": 5, "first": 3, "order": 1}
    rows.append(
        FidelityRow("TaylorSeer-style every 5", "peer", dit_peers.taylorseer_style_patch(5, 3), settings=settings)
    )
    return rows


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


def keep_asked_rows(rows: list[FidelityRow], args, broken=broken_patch) -> list[FidelityRow]:
    if args.broken:
        rows.append(FidelityRow("broken (shifted tokens)", "broken", broken))
    if args.only:
        words = [w.strip() for w in args.only.split(",") if w.strip()]
        # "=name" keeps the row of exactly that name, any other word every row whose name contains it
        rows = [
            r
            for r in rows
            if r.group == "unpatched" or any(r.name == w[1:] if w.startswith("=") else w in r.name for w in words)
        ]
    return rows


def rows_for(name: str, base_model, args) -> list[FidelityRow]:
    from tools.fidelity.reference import models

    nodes = load_our_nodes()
    if models.is_dit(name):  # Flux, Flux.2, Wan, Qwen-Image: the same rows (the family comes from the model)
        # The step the family does not take, as variants: half on Flux (its own is whole), whole on the others.
        other_step = 0.5 if models.is_flux(name) else 1.0
        ratios_of = magcache_calibration(name, args)
        rows = dit_rows(nodes, args.variants, models.is_video(name), args, other_step, ratios_of)
        return keep_asked_rows(rows, args, broken_dit_patch)
    family = models.FAMILIES[name]
    finest = 1 if family.depth[0] else 2  # the finest level that has attention
    rows = [
        FidelityRow("unpatched", "unpatched", lambda model: model),
        ours(nodes, "ours ToMe 0.5", method="tome", ratio=0.5),
        ours(nodes, "ours ToDo 2", method="todo", downsample_factor=2.0),
    ]
    if "scope" in SPECS:  # the whole transformer block on merged tokens, at the two finest attention levels
        for ratio in (0.5, 0.3):
            rows.append(
                ours(nodes, f"ours block {ratio}", method="tome", ratio=ratio, scope="block", max_downsample=finest * 2)
            )
    if "reuse_interval" in SPECS:  # reuse across steps, layer by layer (tome_core/reuse/)
        rows += layer_reuse_rows(nodes, args.variants)
    rows += [comfy_builtin(0.5), todo_reference(2.0, finest)]
    rows += step_cache_rows()
    # The default's work: 12 of 25 (SDXL), 13 (forecast), 15 (SD1.x); 14 (DPM++ 2M's 1.7x target); 16 and 19 (DPM++
    # 2M on Karras sigmas under the forecasts of today and before).
    rows += spectrum_rows(args.steps, (0.48, 0.52, 0.56, 0.6, 0.64, 0.76))
    if args.variants:  # EasyCache at the work of the default's plan (12 full steps of 25: 0.48 of the calls)
        rows += [row for row in step_cache_rows((0.5, 0.6)) if row.name.startswith("EasyCache")]
        rows += whole_step_rows(args.steps)
    state_dict = base_model.diffusion_model.state_dict()
    for everywhere in (False, True):
        row = tomesd_row(family, state_dict, 0.5, finest, everywhere)
        if row is not None:
            rows.append(row)
    return keep_asked_rows(rows, args)


def magcache_calibration(name: str, args, prompts: int = 4) -> Callable:
    """``ratios_of(model)``: MagCache's calibration of the reference (the step-to-step ratio of its block stack's
    residual on the image tokens, as ``step_change`` measures it) from one unpatched run at the benchmark's steps,
    CFG, sampler and scheduler, on ``prompts`` prompts the benchmark does not report; once per model."""
    calibrated: dict = {}

    def ratios_of(model) -> list[float]:
        key = id(model.model)
        if key not in calibrated:
            calibrated[key] = calibrate_magcache(name, model, args, prompts)
        return calibrated[key]

    return ratios_of


def benchmark_prompts(first: int, count: int) -> torch.Tensor:
    """The benchmark's prompts: every prompt in one fixed shuffled order, ``count`` of them from ``first`` on
    (``--first-prompt`` 0 and 16: the two prompt sets)."""
    from tools.fidelity.reference import data

    every = data.all_prompts().as_tensor()
    order = torch.randperm(len(every), generator=torch.Generator().manual_seed(PROMPT_SEED))
    return every[order[first:][:count]]


def calibrate_magcache(name: str, model, args, prompts: int) -> list[float]:
    import nodes as comfy_nodes

    from tools.fidelity.reference import models
    from tools.fidelity.residuals import ResidualRecorder, ratios

    _, encoder = models.load_reference(name)
    after = args.first_prompt + args.prompts  # after the reported ones: none of them
    chosen = benchmark_prompts(after, prompts)
    size = models.train_size(name)
    positive = conditioning(name, model.model, encoder, chosen, size)
    negative = conditioning(name, model.model, encoder, models.PromptEncoder.empty(1), size)
    latent = {"samples": torch.zeros(models.latent_shape(name, prompts, size))}
    recorder = ResidualRecorder(model.model.diffusion_model, image_tokens=True)
    try:
        with torch.no_grad():
            comfy_nodes.common_ksampler(
                model, 0, args.steps, args.cfg, args.sampler, args.scheduler, positive, negative, latent
            )
    finally:
        recorder.remove()
    per_step = len(recorder.residuals) // args.steps  # cond and uncond in one call or two
    streams = [ratios(recorder.residuals[k::per_step])["norm_ratio"] for k in range(per_step)]
    return [sum(values) / len(values) for values in zip(*streams, strict=True)]


def conditioning(name: str, base_model, encoder, prompt_indices: torch.Tensor, size: int) -> list:
    """ComfyUI CONDITIONING for a batch of prompts (SDXL: pooled vector and size conditioning too; Flux: pooled
    vector and the guidance value it was trained with; Wan and Qwen-Image: the text tokens alone)."""
    from tools.fidelity.reference import models

    with torch.no_grad():
        context, pooled = encoder(prompt_indices)
    extra = {}
    if models.is_video(name) or models.is_qwen(name):
        pass
    elif models.is_flux(name):
        extra = {"pooled_output": pooled, "guidance": models.FLUX_GUIDANCE}
    elif models.FAMILIES[name].adm_channels:
        pixels = models.TRAIN_SIZE * 8  # the size conditioning the model was trained with
        extra = {"pooled_output": pooled, "width": pixels, "height": pixels, "crop_w": 0, "crop_h": 0}
        extra.update(target_width=pixels, target_height=pixels)
    return [[context, extra]]


def sample_row(row: FidelityRow, patcher, positive, negative, shape: tuple, args):
    """All samples of one row: (seeds * prompts, *shape[1:]) in data space (images or clips), with wall and CPU
    seconds; ``shape`` is one seed's empty latent."""
    import nodes as comfy_nodes

    model = row.patch(patcher)
    row.enter()
    # Measuring reuse with a sampler the rule does not know yet: every loaded copy of the engine's rule (ComfyUI
    # loads the node package under its folder's name) lets it through for this row.
    rules = [m for name, m in sys.modules.items() if name.endswith("tome_core.reuse.samplers")]
    kept = [(rule.SAMPLERS_THAT_KEEP_THE_PICTURE, rule.SCHEDULES_THAT_LOSE_THE_PICTURE) for rule in rules]
    if getattr(args, "any_sampler", False):  # the sampler and its schedule (Karras sigmas) both let through
        for rule, (samplers, schedules) in zip(rules, kept, strict=True):
            rule.SAMPLERS_THAT_KEEP_THE_PICTURE = samplers | {args.sampler}
            rule.SCHEDULES_THAT_LOSE_THE_PICTURE = schedules - {args.scheduler}
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        images = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            latent = {"samples": torch.zeros(shape)}
            # Without gradients, as ComfyUI's executor runs a prompt: most samplers say so themselves, uni_pc does
            # not (it would keep every step's graph).
            with torch.no_grad():
                (out,) = comfy_nodes.common_ksampler(
                    model, seed, args.steps, args.cfg, args.sampler, args.scheduler, positive, negative, latent
                )
            images.append(patcher.model.process_latent_in(out["samples"]))  # undo the latent scale factor
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        for rule, (samplers, schedules) in zip(rules, kept, strict=True):
            rule.SAMPLERS_THAT_KEEP_THE_PICTURE = samplers
            rule.SCHEDULES_THAT_LOSE_THE_PICTURE = schedules
        row.leave()
    return torch.cat(images), wall, cpu


def image_metrics(images: torch.Tensor, reference: torch.Tensor) -> dict:
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    from tools.fidelity.reference.data import to_rgb

    a, b = to_rgb(images), to_rgb(reference)
    ssim = structural_similarity_index_measure(a, b, data_range=1.0, reduction="none")
    psnr = peak_signal_noise_ratio(a, b, data_range=1.0, reduction="none", dim=(1, 2, 3))
    identical = bool(torch.equal(images, reference))
    return {
        "ssim": float(ssim.mean()),
        "ssim_min": float(ssim.min()),
        "psnr": None if identical else float(psnr[torch.isfinite(psnr)].mean()),
        "identical_to_unpatched": identical,
    }


def attribute_accuracy(classifier, images: torch.Tensor, prompts: torch.Tensor) -> dict:
    from tools.fidelity.reference.data import ATTRIBUTES

    with torch.no_grad():
        predicted = torch.stack([logits.argmax(1) for logits in classifier(images)], dim=1)
    correct = predicted == prompts
    result = {name: float(correct[:, i].float().mean()) for i, name in enumerate(ATTRIBUTES)}
    result["mean"] = float(correct.float().mean())
    result["all_four"] = float(correct.all(dim=1).float().mean())
    return result


def motion_metrics(clips: torch.Tensor, reference: torch.Tensor) -> dict:
    """How a row's clips move against unpatched's, from the frame-to-frame differences of the colour channels
    (``d = frame t+1 - frame t``): ``motion_error`` is mean |d_row - d_unpatched| / mean |d_unpatched| (0: the same
    motion), ``motion_kept`` mean |d_row| / mean |d_unpatched| (1: as much motion; below 1 motion lost or
    blurred, above 1 flicker)."""
    from tools.fidelity.reference.data import frames_of, to_rgb

    def steps(x):
        frames = to_rgb(frames_of(x)).unflatten(0, x.shape[:1] + x.shape[2:3])  # (N, T, 3, H, W)
        return frames[:, 1:] - frames[:, :-1]

    moved, moved_reference = steps(clips), steps(reference)
    scale = float(moved_reference.abs().mean())
    return {
        "motion_error": float((moved - moved_reference).abs().mean()) / scale,
        "motion_kept": float(moved.abs().mean()) / scale,
    }


class FrechetDistance:
    """Frechet distance to real scenes in the classifier's feature space (torchmetrics keeps the real side)."""

    def __init__(self, classifier, real: torch.Tensor):
        from torchmetrics.image.fid import FrechetInceptionDistance

        from tools.fidelity.reference.models import ClassifierFeatures

        self.metric = FrechetInceptionDistance(
            feature=ClassifierFeatures(classifier), normalize=True, reset_real_features=False
        )
        with torch.no_grad():
            self.metric.update(real, real=True)

    def __call__(self, images: torch.Tensor) -> float:
        self.metric.reset()
        with torch.no_grad():
            self.metric.update(images, real=False)
            return float(self.metric.compute())


def evaluate_model(name: str, args, log) -> dict:
    import comfy.model_patcher

    from tools.fidelity.reference import data, models

    base, encoder = models.load_reference(name)
    classifier = models.load_classifier(name)
    video = models.is_video(name)
    # A clip's metrics are its frames' (SSIM, attributes, FD), each frame an image, plus its motion.
    frames, per_frame = models.as_images(name)
    train_size = models.train_size(name)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
    prompts = benchmark_prompts(args.first_prompt, args.prompts)
    labels = prompts.repeat(args.seeds, 1)  # image i of seed s is prompt i
    real, _ = models.samples(name, args.real // per_frame, train_size, torch.Generator().manual_seed(PROMPT_SEED + 1))
    fresh, fresh_prompts = models.samples(name, len(labels), train_size, torch.Generator().manual_seed(PROMPT_SEED + 2))
    frechet = FrechetDistance(classifier, frames(real))
    reference_rows = {
        "real scenes": {
            "frechet": frechet(frames(fresh)),
            "accuracy": attribute_accuracy(
                classifier, frames(fresh), fresh_prompts.as_tensor().repeat_interleave(per_frame, 0)
            ),
        }
    }
    negative = conditioning(name, base, encoder, models.PromptEncoder.empty(1), train_size)
    rows = rows_for(name, base, args)
    records, grids = [], {}
    for scale in [int(s) for s in args.scales.split(",")]:
        size = train_size * scale
        shape = models.latent_shape(name, len(prompts), size)
        positive = conditioning(name, base, encoder, prompts, size)
        # Warm-up (untimed): the first sampling call at a size pays for allocations and caches.
        warm = argparse.Namespace(**{**vars(args), "seeds": 1, "steps": 1})
        sample_row(rows[0], patcher, positive, negative, shape, warm)
        baseline = None
        for row in rows:
            log(f"{name} {size}x{size}: {row.name} ...")
            row.prepare(patcher)
            with count_work(row, patcher) as work:
                images, wall, cpu_s = sample_row(row, patcher, positive, negative, shape, args)
            if baseline is None:
                baseline = {"images": images, "wall": wall, "cpu": cpu_s, "work": work}
            record = {
                "model": name,
                "size": size,
                "row": row.name,
                "group": row.group,
                "settings": row.settings,
                "wall_s": wall,
                "cpu_s": cpu_s,
                "speedup": baseline["wall"] / wall,
                "speedup_cpu": baseline["cpu"] / cpu_s,
                **image_metrics(frames(images), frames(baseline["images"])),
                **(motion_metrics(images, baseline["images"]) if video else {}),
                "accuracy": attribute_accuracy(classifier, frames(images), labels.repeat_interleave(per_frame, 0)),
                "frechet": frechet(frames(images)),
                "work": work.summary(baseline["work"]),
            }
            records.append(record)
            grids[(size, row.name)] = frames(images[: max(1, args.grid // per_frame)])
            motion = f"motion error {record['motion_error']:.3f}, " if video else ""
            log(
                f"  ssim {record['ssim']:.3f}, {motion}accuracy {record['accuracy']['mean']:.3f}, "
                f"FD {record['frechet']:.2f}, {wall:.1f} s ({record['speedup']:.2f}x), "
                f"calls {record['work'].get('call_share', 1):.2f}, tokens {record['work'].get('token_share', 1):.2f}"
            )
    from tools.fidelity.report import pareto_fronts

    return {
        "model": name,
        "prompts": [data.describe(data.Prompts.from_tensor(prompts), i) for i in range(len(prompts))],
        "reference": reference_rows,
        "records": records,
        "pareto_front": pareto_fronts(records),
        "grids": grids,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    setup_comfy("cpu")
    import comfy.utils

    from tools.fidelity import report as fidelity_report
    from tools.fidelity.reference import models

    comfy.utils.PROGRESS_BAR_ENABLED = False  # one log line per row instead

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    def log(message):
        print(f"[{time.time() - started:6.0f} s] {message}", flush=True)

    reports = {}
    for name in args.models.split(","):
        result = evaluate_model(name, args, log)
        report = {
            "machine": machine(torch.device("cpu")),
            "versions": versions(),
            "settings": {k: v for k, v in vars(args).items() if k not in ("out", "docs")},
            "full_depth": models.FULL_DEPTH.get(name),
            "date": time.strftime("%Y-%m-%d"),
            "minutes": round((time.time() - started) / 60, 1),
            **{k: v for k, v in result.items() if k != "grids"},
        }
        paths = fidelity_report.write(report, result["grids"], out)
        print(fidelity_report.table(report))
        if args.docs:
            for path in paths:
                shutil.copy(path, ROOT / "docs" / path.name)
        (out / f"fidelity-{name}.json").write_text(json.dumps(report, indent=2) + "\n")
        reports[name] = report
    return reports


if __name__ == "__main__":
    main()
