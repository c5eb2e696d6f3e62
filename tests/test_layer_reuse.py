"""Setting reuse_interval (reuse across steps, layer by layer) in a real ComfyUI 0.3.75 with small random-weight UNets.

The cache belongs to one sampling run: made when the run starts, dropped when it ends (however it ends) and
whenever the step order, the schedule, the batch layout or the shape says it may not belong to the call; a call
that reuses runs only the outer layers; interval 1 and removal are bit-identical to unpatched; other patches
(ControlNet, LoRA-style weight patches, attention patches, EasyCache/LazyCache, torch.compile) keep working.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

HW = (15, 23)
STEPS = 10  # IntervalSchedule(3), a short run: full steps 0, 1, 3 and 5-9 (the last four); reusing 2, 4
REUSING_STEPS = 2
REUSE = {"method": "todo", "downsample_factor": 1.0, "reuse_interval": 3, "reuse_plan": "auto"}  # the layers


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def models():
    return {family: host.tiny_model(family) for family in ("sd15", "sdxl")}


_references: dict = {}


def reference_of(model, family="sd15", **kwargs):
    """The unpatched sampling result (computed once per model, family and arguments)."""
    key = (id(model), family, tuple(sorted(kwargs.items())))
    if key not in _references:
        _references[key] = run(model, family, **kwargs)
    return _references[key]


def patch(node_classes, model, **values):
    return host.patch_with_node(node_classes, model, **{**REUSE, **values})


def run(model, family="sd15", **kwargs):
    return host.sample(model, family, **{"latent_hw": HW, "steps": STEPS, "batch": 2, **kwargs})


def hooks_of(patched):
    """The LayerReuseHooks of a patched clone (kept by its APPLY_MODEL wrapper)."""
    for wrapper in patched.wrappers.get("apply_model", {}).get("tome_patch_layer_reuse", []):
        return wrapper.__self__
    return None


def inner_layers(model):
    from tome_core.hosts.shared.unet_layout import inner_layers as layers_of

    return [layer for _, layer in layers_of(model.model.diffusion_model)]


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_interval_one_and_removal_are_bit_identical(node_classes, models, family):
    model = models[family]
    reference = reference_of(model, family)
    off = patch(node_classes, model, reuse_interval=1)
    assert not any(off.wrappers.values()) and not off.injections
    assert torch.equal(run(off, family), reference)
    patched = patch(node_classes, model)
    assert not torch.equal(run(patched, family), reference)
    removed = patch(node_classes, patched, reuse_interval=1)  # the node applied again, turned off
    assert not any(removed.wrappers.values()) and not any(removed.injections.values())
    assert torch.equal(run(removed, family), reference)
    assert torch.equal(run(model, family), reference)  # loading the input model ejects our forwards
    assert not any("forward" in layer.__dict__ for layer in inner_layers(model))


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_reusing_steps_run_only_the_outer_layers_and_keep_the_picture_within_reason(node_classes, models, family):
    model = models[family]
    reference = reference_of(model, family)
    patched = patch(node_classes, model)
    calls = []
    # A part of the first inner layer: it runs at full steps only (the layer's own hooks run either way).
    part = next(inner_layers(model)[0].children())
    handle = part.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        out = run(patched, family)
    finally:
        handle.remove()
    last = hooks_of(patched).last_run
    assert last.calls == STEPS and last.reused_calls == REUSING_STEPS
    assert len(calls) == STEPS - REUSING_STEPS
    assert out.shape == reference.shape and torch.isfinite(out).all()
    assert (out - reference).abs().mean() < 0.2 * reference.abs().mean()


def test_the_cache_is_dropped_when_the_run_ends_and_nothing_stays_on_the_options(node_classes, models):
    model = models["sd15"]
    patched = patch(node_classes, model)
    run(patched)
    hooks = hooks_of(patched)
    adapter = sys.modules[type(hooks).__module__]
    assert hooks.last_run.entries == {} and hooks.layer_run() is None
    assert adapter.RUN_KEY not in patched.model_options.get("transformer_options", {})


def test_an_interrupted_run_drops_its_cache_and_the_next_run_is_as_fresh(node_classes, models, monkeypatch):
    import comfy.samplers

    model = models["sdxl"]
    patched = patch(node_classes, model)
    real = comfy.samplers.KSAMPLER.sample
    seen = []

    def interrupting(self, model_wrap, sigmas, extra_args, callback, *args, **kwargs):
        def interrupt(
            step, *rest
        ):  # as the user's cancel does (comfy.model_management.throw_exception_if_processing_interrupted)
            seen.append(step)
            if step == 5:
                raise KeyboardInterrupt("stopped by the user")
            if callback is not None:
                callback(step, *rest)

        return real(self, model_wrap, sigmas, extra_args, interrupt, *args, **kwargs)

    monkeypatch.setattr(comfy.samplers.KSAMPLER, "sample", interrupting)
    with pytest.raises(KeyboardInterrupt):
        run(patched, "sdxl")
    monkeypatch.undo()
    hooks = hooks_of(patched)
    assert seen[-1] == 5 and hooks.last_run.entries == {} and hooks.layer_run() is None
    assert torch.equal(run(patched, "sdxl"), run(patch(node_classes, model), "sdxl"))


def test_runs_back_to_back_with_other_sizes_step_counts_and_denoise_share_nothing(node_classes, models):
    import nodes as comfy_nodes

    model = models["sdxl"]
    patched = patch(node_classes, model)
    run(patched, "sdxl", latent_hw=(16, 16), steps=6, batch=1)
    # img2img: a partial denoise samples the tail of a longer schedule, a run of its own
    latent = {"samples": torch.randn(1, 4, 12, 12, generator=torch.Generator().manual_seed(0))}
    positive, negative = host.conditioning("sdxl", 1, seed=1), host.conditioning("sdxl", 1, seed=2)
    comfy_nodes.common_ksampler(patched, 1, 12, 5.0, "euler", "normal", positive, negative, latent, denoise=0.5)
    assert hooks_of(patched).last_run.calls == 12 and hooks_of(patched).last_run.reused_calls > 0
    after_other_runs = run(patched, "sdxl")
    fresh = run(patch(node_classes, model), "sdxl")
    assert torch.equal(after_other_runs, fresh)


def test_the_schedule_and_its_short_runs():
    """Full steps: the first fifth (two at least), the last four, one in N between; under 25 steps one in two at
    least (the steps lie further apart there); under 10 steps every step."""
    from tome_core.reuse import IntervalSchedule

    def pattern(schedule, steps):
        return "".join("F" if schedule.is_full(step, steps) else "." for step in range(steps))

    assert pattern(IntervalSchedule(3), 25) == "FFFFF..F..F..F..F..F.FFFF"
    assert pattern(IntervalSchedule(3), 30) == "FFFFFF..F..F..F..F..F..F..FFFF"
    assert pattern(IntervalSchedule(3), 24) == pattern(IntervalSchedule(2), 24) == "FFFFF.F.F.F.F.F.F.F.FFFF"
    assert pattern(IntervalSchedule(4), 12) == pattern(IntervalSchedule(2), 12) == "FFF.F.F.FFFF"
    assert pattern(IntervalSchedule(3, short_run=0), 12) == "FFF..F..FFFF"
    assert pattern(IntervalSchedule(3), 10) == "FF.F.FFFFF"
    assert pattern(IntervalSchedule(1), 12) == "F" * 12
    for steps in (4, 6, 8, 9):  # distilled models, Lightning/LCM LoRAs, Turbo: nothing reused
        assert pattern(IntervalSchedule(3), steps) == "F" * steps
    assert pattern(IntervalSchedule(3, min_steps=0), 8) == "FF.FFFFF"
    with pytest.raises(ValueError, match="short_run"):
        IntervalSchedule(3, short_run=-1)
    with pytest.raises(ValueError, match="min_steps"):
        IntervalSchedule(3, min_steps=-1)


def test_the_default_interval_on_a_unet_plans_long_runs_per_family():
    """reuse_interval 3 over 25 steps or more: 12 full steps of 25, SD1.x's (attention at full resolution) with the
    first three full and three quarters of the line, SDXL's with the last four full and half the line; shorter
    runs, other intervals and a UNet of unknown layout take the general schedule, bit for bit as before."""
    from tome_core.reuse import IntervalSchedule, LayerReuse, unet_schedule

    def pattern(schedule, steps):
        return "".join("F" if schedule.is_full(step, steps) else "." for step in range(steps))

    sd1, sdxl = unet_schedule(3, (1, 2, 4)), unet_schedule(3, (2, 4))
    assert pattern(sd1, 25) == "FFF..F..F..F..F..F..F.FFF" and sd1.full_steps(25) == 12
    assert pattern(sdxl, 25) == "FF..F..F..F..F..F..F.FFFF" and sdxl.full_steps(25) == 12
    assert pattern(sd1, 30) == "FFFF..F..F..F..F..F..F..F..FFF"
    assert pattern(sdxl, 30) == "FFF..F..F..F..F..F..F..F..FFFF"
    for steps in (8, 10, 12, 20, 24):
        assert pattern(sd1, steps) == pattern(sdxl, steps) == pattern(IntervalSchedule(3), steps), steps
    for interval in (1, 2, 4):
        assert unet_schedule(interval, (1, 2, 4)) == unet_schedule(interval, (2, 4)) == IntervalSchedule(interval)
    assert unet_schedule(3, None) == unet_schedule(3, ()) == IntervalSchedule(3)
    # reuse_plan "every N" (what a job saved before the plans existed ran): the general schedule, 14 of 25.
    for levels in ((1, 2, 4), (2, 4)):
        assert unet_schedule(3, levels, "every N") == IntervalSchedule(3)
        assert unet_schedule(3, levels, "every N").full_steps(25) == 14
        assert unet_schedule(3, levels, "auto") == unet_schedule(3, levels)
    # The reach of the line is the plan's in its runs, the owner's elsewhere.
    owner = LayerReuse(sd1, layers=2, extrapolate=0.5)
    assert owner.new_run(25).extrapolate == 0.75 and owner.new_run(20).extrapolate == 0.5
    assert LayerReuse(sdxl, layers=2, extrapolate=0.3).new_run(25).extrapolate == 0.5
    assert LayerReuse(IntervalSchedule(3), layers=2, extrapolate=0.3).new_run(25).extrapolate == 0.3


@pytest.mark.parametrize("family, full", [("sd15", 12), ("sdxl", 12)])
def test_a_comfyui_run_of_25_steps_takes_its_familys_plan(node_classes, models, family, full):
    """The node's default on a tiny SD1.5 (attention at full resolution) and SDXL (none there) UNet: 13 of 25 steps
    reuse, and the SD1.5 run moves three quarters along the line."""
    from tome_core.hosts.shared.unet_layout import attention_levels

    levels = attention_levels(models[family].model.diffusion_model)
    assert (1 in levels) == (family == "sd15")
    patched = patch(node_classes, models[family])
    out = host.sample(patched, family, latent_hw=(8, 8), steps=25, batch=1)
    assert torch.isfinite(out).all()
    last = hooks_of(patched).last_run
    assert last.calls % 25 == 0 and last.reused_calls * 25 == last.calls * (25 - full)  # one or two calls a step
    assert last.extrapolate == (0.75 if family == "sd15" else 0.5)


# Wan's noise levels in ComfyUI at 30 steps (shift 8, the ``simple`` scheduler), rounded.
WAN_SIGMAS_30 = [
    *(1.0, 0.996, 0.991, 0.986, 0.981, 0.976, 0.97, 0.963, 0.957, 0.949, 0.941, 0.933, 0.923, 0.913, 0.902),
    *(0.889, 0.875, 0.86, 0.842, 0.823, 0.8, 0.774, 0.745, 0.71, 0.667, 0.616, 0.553, 0.471, 0.365, 0.22),
]


def test_the_dit_schedule_spaces_its_full_steps_by_the_noise():
    """One step in N runs in full: the first one, then one each time the noise fell by the same fraction. Where
    the noise hardly moves (Wan's first half) the full steps lie far apart, where it falls fast (the last steps,
    where the details form) they follow each other. The steps a host runs in full (below ``full_below``) come on
    top; short runs as on the UNets."""
    from tome_core.reuse import NoiseSpacedSchedule

    def pattern(interval, steps, levels, full_below=0.0, **rules):
        plan = NoiseSpacedSchedule(interval, **rules).for_run(steps, levels, full_below)
        return "".join("F" if plan.is_full(step, steps) else "." for step in range(steps))

    assert pattern(3, 30, WAN_SIGMAS_30) == "F...........F.....F..F.F.FFFFF"
    assert pattern(6, 30, WAN_SIGMAS_30) == "F....................F....F.FF"
    for interval in (2, 3, 4, 5, 6, 8):
        assert pattern(interval, 30, WAN_SIGMAS_30).count("F") == math.ceil(30 / interval)
    # With UniPC the last three (below 0.5) run in full on top of one in 6 (10) of the other 27.
    assert pattern(6, 30, WAN_SIGMAS_30, full_below=0.5) == "F..............F.....F..F.FFFF"
    assert pattern(10, 30, WAN_SIGMAS_30, full_below=0.5) == "F..................F....F..FFF"
    # Evenly falling noise: by the same fraction, so closer together as the noise gets low.
    even = [1.0 - step / 30 for step in range(30)]
    assert pattern(3, 30, even) == pattern(3, 30, None) == "F......F....F...F...F..F.F.FFF"
    # Only the ratios count: the same steps at noise levels ten times as high (a UNet's sigmas).
    assert pattern(3, 30, [10 * level for level in WAN_SIGMAS_30]) == pattern(3, 30, WAN_SIGMAS_30)
    assert pattern(1, 30, WAN_SIGMAS_30) == "F" * 30
    twenty = [1.0 - step / 20 for step in range(20)]
    assert pattern(6, 20, twenty) == pattern(2, 20, twenty) == "F...F..F..F.F.F.FFFF"  # under 25: 2 at most
    for steps in (4, 8, 9):  # distilled models, Lightning LoRAs: nothing reused
        assert pattern(3, steps, even[:steps]) == "F" * steps
    assert pattern(3, 9, even[:9], min_steps=0, short_run=0) == "F..F..F.."
    plan = NoiseSpacedSchedule(3).for_run(30, WAN_SIGMAS_30)
    assert plan.is_full(5, 31)  # a run of another length than planned: every step in full
    with pytest.raises(ValueError, match="interval"):
        NoiseSpacedSchedule(0)
    with pytest.raises(ValueError, match="min_steps"):
        NoiseSpacedSchedule(3, min_steps=-1)


def test_a_warm_up_runs_the_first_steps_in_full_within_the_same_count():
    """``warm_up`` (measured, not shipped: docs/dit.md; the benchmarks' ``tools.fidelity.lab``): the first share of
    the steps run in full, and the count of full steps stays one in ``interval``, so the later ones lie further
    apart."""
    from tome_core.reuse import NoiseSpacedSchedule
    from tools.fidelity.lab import EdgeSchedule, with_warm_up

    levels = [1.0 - step / 28 for step in range(28)]
    plain = NoiseSpacedSchedule(3).for_run(28, levels).full
    for share, first in ((0.05, 2), (0.1, 3), (0.15, 5)):
        warm = with_warm_up(NoiseSpacedSchedule(3), share).for_run(28, levels).full
        assert set(range(first)) <= warm and first not in warm and len(warm) == len(plain), share
    assert EdgeSchedule(3, warm_up=0.0).for_run(28, levels) == NoiseSpacedSchedule(3).for_run(28, levels)
    assert with_warm_up(NoiseSpacedSchedule(3), 0.0) == NoiseSpacedSchedule(3)
    with pytest.raises(ValueError, match="warm_up"):
        EdgeSchedule(3, warm_up=1.5)


def test_the_noise_schedule_can_keep_its_first_and_last_steps_full():
    """A UNet's schedule by the noise (measured for issue #37, not shipped; ``tools.fidelity.lab.EdgeSchedule``):
    the first ``full_first`` and the last ``full_end`` steps run in full, the last ones on top of one in N of the
    others, as the steps below ``full_below``; the defaults keep the DiTs' plan."""
    from tome_core.reuse import NoiseSpacedSchedule
    from tools.fidelity.lab import EdgeSchedule

    def pattern(steps, levels, **options):
        plan = EdgeSchedule(**options).for_run(steps, levels)
        return "".join("F" if plan.is_full(step, steps) else "." for step in range(steps))

    # ComfyUI's "normal" sigmas of the SD schedule at 25 steps, rounded.
    sd = [
        *(14.615, 11.436, 9.077, 7.302, 5.949, 4.904, 4.086, 3.438, 2.918, 2.496, 2.149, 1.859, 1.616, 1.408),
        *(1.228, 1.071, 0.932, 0.808, 0.695, 0.591, 0.494, 0.4, 0.306, 0.203, 0.029),
    ]
    assert pattern(25, sd, interval=3, full_first=2, full_end=3) == "FF.F..F..F..F...F..F..FFF"
    assert pattern(25, sd, interval=3, full_first=2, full_end=4) == "FF..F..F..F...F...F..FFFF"
    assert pattern(25, sd, interval=3.5, full_first=2, full_end=3).count("F") == math.ceil(22 / 3.5) + 3
    plain = NoiseSpacedSchedule(3).for_run(30, WAN_SIGMAS_30)
    assert pattern(30, WAN_SIGMAS_30, interval=3, full_first=1, full_end=0) == "".join(
        "F" if plain.is_full(step, 30) else "." for step in range(30)
    )
    assert pattern(25, sd, interval=3, full_first=30, full_end=30) == "F" * 25
    with pytest.raises(ValueError, match="full_first"):
        EdgeSchedule(3, full_first=0)
    with pytest.raises(ValueError, match="full_end"):
        EdgeSchedule(3, full_end=-1)


def test_the_parabola_through_three_full_steps():
    """The parabola (measured for issue #37, not shipped; ``tools.fidelity.lab.ParabolaRun``): a reusing call
    follows the parabola through the last three full steps' features (exact on a feature quadratic in the
    position), moved ``extrapolate`` of the way from the last one; the shipped run keeps two and draws the line."""
    from tome_core.reuse import IntervalSchedule, LayerReuseRun
    from tools.fidelity.lab import ParabolaRun

    def feature_at(x):
        return torch.full((1, 2, 3, 3), 1.0 + 2.0 * x - 0.5 * x * x)

    def recorded(run_class, extrapolate):
        run = run_class(IntervalSchedule(1), steps=6, layers=1, extrapolate=extrapolate)
        for step in range(3):
            run.begin_call(step, "a")
            run.run_layer(0, lambda step=step: feature_at(step), (), {})
            run.end_call()
        return run, run.entries["a"]

    run, entry = recorded(ParabolaRun, 1.0)
    assert len(entry.outputs) == 3
    assert torch.allclose(run.predict(entry, 4.0), feature_at(4.0))
    last = feature_at(2.0)
    run, entry = recorded(ParabolaRun, 0.5)
    assert torch.allclose(run.predict(entry, 4.0), last + 0.5 * (feature_at(4.0) - last))
    run, entry = recorded(LayerReuseRun, 1.0)
    assert len(entry.outputs) == 2
    assert torch.allclose(run.predict(entry, 4.0), torch.lerp(feature_at(1.0), last, 3.0))


def test_step_order_schedule_and_layout_changes_compute_in_full():
    from tome_core.reuse import IntervalSchedule, LayerReuseRun

    schedule = IntervalSchedule(100, full_start=0.0, full_end=0, short_run=0, min_steps=0)
    run = LayerReuseRun(schedule, steps=6, layers=2)
    # Two full steps at least: a line to extrapolate on.
    assert [schedule.is_full(s, 6) for s in range(6)] == [True, True] + [False] * 4
    ran = []

    def layer(tag):
        def forward(x):
            ran.append(tag)
            return x + 1

        return forward

    x = torch.ones(2, 3)

    def call(step, key="a", value=x):
        reusing = run.begin_call(step, key)
        outs = [run.run_layer(0, layer("inner"), (value,), {}), run.run_layer(1, layer("boundary"), (value * 2,), {})]
        run.end_call()
        return reusing, outs

    assert not call(0)[0] and not call(1)[0]
    reusing, (zeros, predicted) = call(2)
    assert reusing and torch.equal(zeros, torch.zeros(2, 3)) and torch.equal(predicted, x * 2 + 1)
    assert ran == ["inner", "boundary"] * 2  # nothing ran at the reusing step
    assert not call(2, key="b")[0]  # another batch layout: nothing recorded for it, in full
    assert not call(1)[0] and run.entries.keys() == {"a"}  # the steps went back: dropped, in full, recorded anew
    assert not call(None)[0] and run.entries == {}  # a sigma off the schedule: dropped, in full
    assert not call(3, value=x * 3)[0]  # nothing of this run left: in full, recorded anew
    reusing, (_, predicted) = call(4)
    assert reusing and torch.equal(predicted, x * 6 + 1)  # one record, no line yet: that step's feature as it was
    assert run.reused_calls == 2 and run.calls == 8


def test_a_layout_that_missed_the_latest_full_step_computes_in_full():
    """ComfyUI batches cond and uncond into one call or splits them by its memory estimate, which can change
    during a run: a layout that missed a full step (the other layout ran it) must not draw its line through the
    steps before it (found on ref-flux-deep: reuse every 3 kept 0.994 where the layouts changed, 0.999 where
    not). It computes in full and records afresh; a layout that is up to date goes on reusing."""
    from tome_core.reuse import FullSteps, LayerReuseRun

    run = LayerReuseRun(FullSteps(8, frozenset({0, 1, 4})), steps=8, layers=1)

    def call(step, key):
        reusing = run.begin_call(step, key)
        run.run_layer(0, lambda: torch.full((2, 3), float(step)), (), {})
        run.end_call()
        return reusing

    assert not call(0, "joined") and not call(1, "joined")
    assert call(2, "joined")
    assert not call(3, "apart")  # a new layout: nothing recorded for it, in full
    assert call(3, "joined")  # it missed no full step: its line is as good as ever
    assert not call(4, "apart")  # a full step, run by the other layout only
    assert not call(5, "joined")  # it missed step 4: in full, not a line through steps 0 and 1
    assert call(5, "apart") and call(6, "joined") and call(6, "apart")  # both up to date
    assert run.reused_calls == 5 and run.calls == 10


def test_a_reusing_call_with_unchanged_inner_features_equals_the_full_call():
    """Where the math says so the reuse is exact: the prediction from two equal recorded features is the feature."""
    from tome_core.reuse import IntervalSchedule, LayerReuseRun

    schedule = IntervalSchedule(2, full_start=0.0, full_end=0, short_run=0, min_steps=0)
    run = LayerReuseRun(schedule, steps=4, layers=1, extrapolate=1.0)
    feature = torch.randn(1, 8, 5, 5)
    for step in (0, 1):
        run.begin_call(step, "a")
        run.run_layer(0, lambda: (feature.clone(),), (), {})
        run.end_call()
    assert run.begin_call(2, "a")
    (out,) = run.run_layer(0, lambda: pytest.fail("a reusing call must not run the layer"), (), {})
    assert torch.equal(out, feature)


def test_cond_and_uncond_batched_or_apart_give_the_same_picture(node_classes, models, monkeypatch):
    model = models["sd15"]
    patched = patch(node_classes, model)
    batched = run(patched)
    monkeypatch.setattr(patched.model, "memory_required", lambda *args, **kwargs: float("inf"))
    apart = run(patched)
    last = hooks_of(patched).last_run
    assert last.calls == 2 * STEPS and last.reused_calls == 2 * REUSING_STEPS  # cond and uncond each reuse
    # Batched and single matrix products round differently, and the prediction carries the difference over
    # steps: close, not bit-identical. The same picture: far below what the reuse itself changes.
    change = (batched - reference_of(model)).abs().mean()
    assert (apart - batched).abs().mean() < change / 100 and (apart - batched).abs().max() < 1e-2


def test_composes_with_todo_attention_patches_and_weight_patches(node_classes, models):
    model = models["sd15"]
    seen = []

    def other_attn1_patch(n, context, value, extra_options):
        seen.append(n.shape[1])
        return n, context, value

    other = model.clone()
    other.set_model_attn1_patch(other_attn1_patch)
    weight_key = next(k for k in model.model_state_dict() if k.endswith("output_blocks.5.1.proj_out.weight"))
    other.add_patches({weight_key: (torch.full_like(model.model_state_dict()[weight_key], 0.01),)}, 1.0)
    only_others = run(other)
    both = patch(node_classes, other, method="todo", downsample_factor=2.0, skip_when_slower=False)
    out = run(both)
    assert not torch.equal(out, only_others) and torch.isfinite(out).all()
    assert hooks_of(both).last_run.reused_calls == REUSING_STEPS
    assert seen  # the other node's attention patch still runs (in the outer layers at reusing steps too)
    # The weight patch reaches the outer layer at reusing steps: without it the result differs.
    assert not torch.equal(out, run(patch(node_classes, model, method="todo", downsample_factor=2.0)))


def test_composes_with_a_controlnet(node_classes, models):
    import nodes as comfy_nodes

    model = models["sd15"]
    control = host.tiny_controlnet()
    hint = torch.rand(1, HW[0] * 8, HW[1] * 8, 3, generator=torch.Generator().manual_seed(4))
    positive, negative = host.conditioning("sd15", 1, seed=1), host.conditioning("sd15", 1, seed=2)
    positive, negative = comfy_nodes.ControlNetApplyAdvanced().apply_controlnet(
        positive, negative, control, hint, 1.0, 0.0, 1.0
    )

    def sample(m):
        latent = {"samples": torch.zeros(2, 4, *HW)}
        (out,) = comfy_nodes.common_ksampler(m, 42, STEPS, 5.0, "euler", "normal", positive, negative, latent)
        return out["samples"]

    patched = patch(node_classes, model)
    out = sample(patched)
    assert torch.isfinite(out).all() and not torch.equal(out, sample(model))
    assert hooks_of(patched).last_run.reused_calls == REUSING_STEPS
    # The ControlNet's residual reaches the outer layers at reusing steps: without the control the result differs.
    assert not torch.equal(out, run(patch(node_classes, model)))


@pytest.mark.parametrize("cache", ["EasyCacheNode", "LazyCacheNode"])
def test_composes_with_comfyuis_step_caches(node_classes, models, cache):
    from comfy_extras import nodes_easycache

    model = models["sd15"]
    ours = patch(node_classes, model)
    node = getattr(nodes_easycache, cache)
    both = node.execute(ours, reuse_threshold=0.2, start_percent=0.15, end_percent=0.95, verbose=False).result[0]
    out = run(both, steps=12)
    assert torch.isfinite(out).all()
    # Both skipping steps lose the picture: ours stands down for the run, the step cache decides alone.
    assert hooks_of(ours).last_run is None
    cache_only = node.execute(model, reuse_threshold=0.2, start_percent=0.15, end_percent=0.95, verbose=False)
    assert torch.equal(out, run(cache_only.result[0], steps=12))
    with_todo = patch(node_classes, model, downsample_factor=2.0, skip_when_slower=False)
    both = node.execute(with_todo, reuse_threshold=0.2, start_percent=0.15, end_percent=0.95, verbose=False)
    assert not torch.equal(run(both.result[0], steps=12), out)  # ToDo still applies under the step cache


def test_a_whole_model_wrapper_such_as_spectrum_decides_the_steps_alone(node_classes, models, caplog):
    """A node that wraps the whole model call (``model_function_wrapper``: the Spectrum ports forecast whole steps
    there) on the model ours patched: ours stands down for the run with one line, and the output is the wrapper's
    alone on the unpatched model, bit for bit."""
    import logging

    model = models["sd15"]
    calls = []

    def whole_step_cache(model_function, args):
        calls.append(1)
        return model_function(args["input"], args["timestep"], **args["c"])

    ours = patch(node_classes, model)
    both = ours.clone()
    both.set_model_unet_function_wrapper(whole_step_cache)
    alone = model.clone()
    alone.set_model_unet_function_wrapper(whole_step_cache)
    with caplog.at_level(logging.WARNING, logger="tome_patch"):
        out = run(both, steps=12)
    assert torch.equal(out, run(alone, steps=12)) and len(calls) == 24
    assert hooks_of(ours).last_run is None and "another node wraps the whole model call" in caplog.text


def test_forges_unet_pass_stands_down_under_a_whole_model_wrapper(capsys):
    """Forge Neo's Spectrum sets ``model_function_wrapper`` on the patcher the job samples with: the pass's first
    UNet call finishes our pass (no run, every step in full) with one line."""
    from types import SimpleNamespace

    from tome_core.hosts.webui import layer_reuse as webui_layer_reuse
    from tome_core.reuse import IntervalSchedule
    from tome_core.schedule import NoiseRange

    def job(wrapper):
        unet = SimpleNamespace(model_options={"model_function_wrapper": wrapper} if wrapper else {})
        p = SimpleNamespace(sd_model=SimpleNamespace(forge_objects=SimpleNamespace(unet=unet)))
        owner = webui_layer_reuse.PassReuse(p, IntervalSchedule(3), 4, NoiseRange(0.0, 1.0, lambda q: q))
        boundary = webui_layer_reuse.CallBoundary(owner, torch.nn.Identity(), inner=lambda x, **kwargs: x)
        owner.step = (0, 12)
        boundary(torch.zeros(1, 4, 8, 8), transformer_options={})
        return owner

    plain = job(None)
    assert not plain.finished and plain.run is not None  # no wrapper: the pass goes on, its run made at step 0
    wrapped = job(lambda function, args: function(args["input"], args["timestep"], **args["c"]))
    assert wrapped.finished and wrapped.run is None
    assert "another whole-model wrapper (Neo's Spectrum) decides the steps" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_and_reuses(node_classes, dtype):
    model = host.tiny_model("sd15", dtype=dtype)
    patched = patch(node_classes, model)
    out = run(patched, steps=STEPS)
    assert torch.isfinite(out).all()
    assert hooks_of(patched).last_run.reused_calls == REUSING_STEPS


def test_the_patched_unet_compiles(node_classes, models):
    """torch.compile of the diffusion model (as ComfyUI's TorchCompileModel node does, backend eager here): the
    same picture as without compiling, and reusing steps still reuse."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    model = models["sd15"]
    patched = patch(node_classes, model)
    small = {"steps": STEPS, "latent_hw": (8, 8), "batch": 1}  # reusing steps 2 and 4
    eager = run(patched, "sd15", **small)
    compiled = patched.clone()
    set_torch_compile_wrapper(compiled, backend="eager", keys=["diffusion_model"])
    torch._dynamo.reset()
    try:
        out = run(compiled, "sd15", **small)
    finally:
        torch._dynamo.reset()
    assert hooks_of(compiled).last_run.reused_calls == REUSING_STEPS
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


def test_a_dit_or_a_patcher_without_wrappers_is_left_as_it_is(node_classes):
    flux = host.tiny_dit("flux")
    patched = host.patch_with_node(node_classes, flux, **REUSE, dit_settings="as set")
    assert hooks_of(patched) is None  # DiTs: layer reuse is for UNets; ToDo factor 1 leaves nothing either


def test_a_large_residual_keeps_its_slope_in_four_bits():
    """Above ``COMPACT_SLOPE_BYTES`` an entry keeps its last record whole and the slope to the one before in 4
    bits with a scale per token: the prediction moves from the exact one by at most half a step of that scale
    times how far along the line it goes (the rounding), an unchanged residual predicts exactly, and the entry
    holds the last record plus half a byte per value."""
    from tome_core.reuse.cache import _Entry

    generator = torch.Generator().manual_seed(0)
    first = torch.randn(2, 50, 96, generator=generator)
    last = first + 0.1 * torch.randn(2, 50, 96, generator=generator)
    exact, compact = _Entry(), _Entry()
    for entry, squeeze in ((exact, False), (compact, True)):
        entry.record(0.9, first, squeeze)
        entry.record(0.7, last, squeeze)
    assert len(exact.outputs) == 2 and exact.slope is None
    assert len(compact.outputs) == 1 and compact.slope is not None
    along = 0.5 * (0.6 - 0.7) / (0.7 - 0.9)  # extrapolate 0.5, half a step of the line ahead
    step = (last - first).abs().amax(dim=-1, keepdim=True) / 7
    error = (compact.predict(0.6, 0.5) - exact.predict(0.6, 0.5)).abs()
    assert (error <= along * step / 2 + 1e-6).all()
    assert error.max() > 0  # the rounding is there
    assert torch.equal(compact.predict(0.6, 0.0), last)
    assert compact.nbytes() == last.numel() * 4 + last.numel() // 2 + 2 * 50 * 4
    assert exact.nbytes() == 2 * last.numel() * 4

    still = _Entry()  # the residual did not change: the line is flat, the prediction exact
    still.record(0.9, last, True)
    still.record(0.7, last.clone(), True)
    assert torch.equal(still.predict(0.5, 0.5), last)

    from tome_core.reuse.cache import _PackedSlope

    whole_rows = _PackedSlope.of(last - first, 0.9)
    rows = _PackedSlope.ROWS
    _PackedSlope.ROWS = 7  # packed a few tokens at a time (the float32 working copies stay small): the same bytes
    try:
        in_parts = _PackedSlope.of(last - first, 0.9)
    finally:
        _PackedSlope.ROWS = rows
    assert torch.equal(in_parts.packed, whole_rows.packed) and torch.equal(in_parts.scale, whole_rows.scale)
    assert in_parts.unpacked(torch.bfloat16).dtype == torch.bfloat16

    odd = _Entry()  # an odd last axis cannot be packed two to a byte: both records stay whole
    odd.record(0.9, first[..., :95], True)
    odd.record(0.7, last[..., :95], True)
    assert len(odd.outputs) == 2 and odd.slope is None


def test_the_span_keeps_a_compact_slope_from_the_size_on(monkeypatch):
    import tome_core.reuse.cache as engine
    from tome_core.reuse import LayerReuseRun, NoiseSpacedSchedule

    def recorded(threshold):
        monkeypatch.setattr(engine, "COMPACT_SLOPE_BYTES", threshold)
        run = LayerReuseRun(NoiseSpacedSchedule(1).for_run(12), 12, 1)  # every step full: records
        for step in (0, 1):
            run.begin_call(step, "layout", position=1.0 - step / 12)
            joined = torch.full((1, 4, 8), float(step))
            run.start_span(joined)
            run.end_span(joined + step + 1)
            run.end_call()
        return run.entries["layout"]

    assert recorded(0).slope is not None
    whole = recorded(4 * 8 * 4 + 1)  # one byte more than a residual: kept whole
    assert whole.slope is None and len(whole.outputs) == 2


def test_the_first_block_guard_runs_a_reusing_call_in_full_where_the_span_input_moved():
    """``first_block_guard`` (Qwen-Image's default carries one): a reusing call whose span input moved more than
    the threshold since the last full call (mean |x - x_full| / mean |x_full|) runs in full and records; one that
    moved less reuses, and without the guard every scheduled reuse happens."""
    from tome_core.reuse import LayerReuseRun, NoiseSpacedSchedule

    def reuses(guard, inputs):
        run = LayerReuseRun(NoiseSpacedSchedule(4).for_run(12), 12, 1, first_block_guard=guard)
        done = []
        for step, value in enumerate(inputs):
            run.begin_call(step, "layout", position=1.0 - step / 12)
            joined = torch.full((1, 4, 8), value)
            done.append(run.start_span(joined))
            if not done[-1]:
                run.end_span(joined + 1.0)
            run.end_call()
        return done, run.guarded_calls

    full = NoiseSpacedSchedule(4).for_run(12).full
    steady = [1.0] * 12
    moving = [1.0 + step for step in range(12)]  # moves by 1 a step: 100% and more after a full step
    unguarded, _ = reuses(None, moving)
    assert unguarded == [step not in full for step in range(12)]
    assert reuses(0.05, steady) == (unguarded, 0)  # still: the guard keeps every reuse
    guarded, turned = reuses(0.05, moving)
    assert not any(guarded) and turned == sum(unguarded)  # every reusing call moved: all run in full
    slow = [1.0 + 0.02 * step for step in range(12)]  # 2% a step: the second step after a full one passes 3%
    guarded, turned = reuses(0.03, slow)
    assert 0 < turned < sum(unguarded) and all(not g for g, u in zip(guarded, unguarded, strict=True) if not u)


def test_a_unets_guards_weigh_the_first_inner_layers_input():
    """On a UNet the guards read the input of the first inner layer (the outer input block's output, computed at
    every call). The rate guard (measured, not shipped; ``tools.fidelity.lab.RateGuardRun``): each reusing call's
    move of that input, times how much the boundary changed per unit of input change between the last two full
    calls, adds up since the last full call; past the threshold the call runs in full. An input that grows 1% a
    step under a boundary of input**1 (rate 1) keeps every scheduled reuse at 0.045 (at most 3 x 0.01 per
    stretch); under input**3 (rate 3: 0.03 a step) the second call of each stretch runs in full. The first-block
    guard reads the same input: 1% a step against 0.015 turns the second call of each stretch."""
    from tome_core.reuse import IntervalSchedule, LayerReuseRun
    from tools.fidelity.lab import RateGuardRun

    schedule = IntervalSchedule(4, full_start=0.0, full_end=0, short_run=0, min_steps=0)  # full: 0, 1, 5, 9

    def reuses(power, rate=None, moved=None):
        if rate is None:
            run = LayerReuseRun(schedule, 12, 2, first_block_guard=moved)
        else:
            run = type("At", (RateGuardRun,), {"rate_guard": rate})(schedule, 12, 2, first_block_guard=moved)
        done = []
        for step in range(12):
            done.append(run.begin_call(step, "layout"))
            x = torch.full((1, 4, 8), 1.01**step)
            h = run.run_layer(0, lambda t: t.clone(), (x,), {})
            run.run_layer(1, lambda t: t**power, (h if not done[-1] else x,), {})
            done[-1] = run.current.reuse
            run.end_call()
        return [step for step, reused in enumerate(done) if reused], run.guarded_calls

    scheduled = [2, 3, 4, 6, 7, 8, 10, 11]
    assert reuses(3) == (scheduled, 0)  # no guard
    assert reuses(1, rate=0.045) == (scheduled, 0)
    assert reuses(3, rate=0.045) == ([2, 4, 6, 8, 10], 3)
    assert reuses(3, rate=0.5) == (scheduled, 0)
    assert reuses(1, moved=0.015) == ([2, 4, 6, 8, 10], 3)


def test_the_line_guard_lets_a_straight_move_reuse_and_stops_a_bend():
    """``line_guard``: a reusing call runs in full where its span input lies off the line through the last two full
    calls' inputs. An input that moves at a steady rate (1 a step, far more than 5% since the last full call)
    stays on that line and reuses; one that zigzags off it runs in full; before two full calls exist it weighs the
    move since the last one. With the guard on the move since the last full call too, either one runs a call in
    full."""
    from tome_core.reuse import LayerReuseRun, NoiseSpacedSchedule

    def reuses(inputs, line=None, since_last=None):
        run = LayerReuseRun(NoiseSpacedSchedule(4).for_run(12), 12, 1, first_block_guard=since_last, line_guard=line)
        done = []
        for step, value in enumerate(inputs):
            run.begin_call(step, "layout", position=1.0 - step / 12)
            joined = torch.full((1, 4, 8), float(value))
            done.append(run.start_span(joined))
            if not done[-1]:
                run.end_span(joined + 1.0)
            run.end_call()
        return done

    full = NoiseSpacedSchedule(4).for_run(12).full  # steps 0, 4, 7 and 9-11
    unguarded = [step not in full for step in range(12)]
    steady = [10.0 + step for step in range(12)]
    assert not any(reuses(steady, since_last=0.05))  # every reusing call moved 7% or more since the last full one
    # Step 1 has only step 0's input to weigh against (10% moved): in full. From then on the line through the last
    # two full calls puts every input exactly where it is: each scheduled reuse happens.
    assert reuses(steady, line=0.05) == [u and step != 1 for step, u in enumerate(unguarded)]
    zigzag = [10.0 + step + 3.0 * (step % 2) for step in range(12)]  # 20% off any line through two of them
    assert not any(reuses(zigzag, line=0.05))
    assert not any(reuses(steady, line=0.05, since_last=0.05))  # on the line, but moved: the other guard stops it
    assert reuses(steady, line=0.05, since_last=1.0) == reuses(steady, line=0.05)


def test_a_schedules_own_first_block_guard_reaches_each_run():
    """A DiT family's default carries its guards in its schedule (``StepCountSchedule.first_block_guard``,
    ``line_guard``): every run the hooks make takes them at construction; none: no guard. A benchmark's variant
    gives its own schedule the guards (``tools.fidelity.lab.GuardedSchedule``), which replace both."""
    from tome_core.reuse import LayerReuse, StepCountSchedule
    from tools.fidelity.lab import GuardedSchedule

    guarded = LayerReuse(StepCountSchedule(((0, 4),), first_block_guard=0.1), layers=1)
    assert guarded.new_run(12).first_block_guard == 0.1
    assert LayerReuse(StepCountSchedule(((0, 4),)), layers=1).new_run(12).first_block_guard is None
    assert "moved more than 0.1 since" in StepCountSchedule(((0, 4),), first_block_guard=0.1).describe()
    lined = LayerReuse(StepCountSchedule(((0, 8),), line_guard=0.07), layers=1)
    assert (lined.new_run(12).first_block_guard, lined.new_run(12).line_guard) == (None, 0.07)
    assert "lies more than 0.07 off the line" in lined.schedule.describe()
    variant = LayerReuse(GuardedSchedule(lined.schedule, first_block_guard=0.1), layers=1)
    assert (variant.new_run(12).first_block_guard, variant.new_run(12).line_guard) == (0.1, None)
    assert variant.new_run(12).schedule == lined.new_run(12).schedule
    for wrong in (0.0, -0.1):
        with pytest.raises(ValueError, match="first_block_guard must be above 0"):
            StepCountSchedule(((0, 4),), first_block_guard=wrong)
        with pytest.raises(ValueError, match="line_guard must be above 0"):
            StepCountSchedule(((0, 4),), line_guard=wrong)


def test_a_step_change_curve_counts_as_magcache_and_guards_the_fast_steps():
    """``StepChangeCurve``: MagCache's accumulated error (``acc *= ratio``, ``err += |1 - acc|``, reset at a full
    step), its nearest-step reading for another step count, and the guard that runs a step in full where a
    stretch would pass the threshold."""
    import math

    from tome_core.hosts.shared import dit_families
    from tome_core.reuse import NoiseSpacedSchedule, StepChangeCurve

    curve = StepChangeCurve((1.0, 1.1, 1.1, 1.0), threshold=0.4)
    assert curve.errors({0}, 4) == pytest.approx([0.0, 0.1, 0.31, 0.52])
    assert curve.errors({0, 2}, 4) == pytest.approx([0.0, 0.1, 0.0, 0.0])
    assert curve.guard({0}, 4) == {0, 3}  # step 3 would take the stretch to 0.52
    assert StepChangeCurve((1.0, 1.0, 1.0), 0.01).guard({0}, 3) == {0}  # flat: nothing added
    # Another step count reads the nearest calibrated step: round(step * (L - 1) / (steps - 1)).
    ratios = tuple(1.0 + step / 100 for step in range(28))
    assert StepChangeCurve(ratios, 0.24).at(28) == list(ratios)
    assert StepChangeCurve(ratios, 0.24).at(50)[:4] == [1.0, 1.01, 1.01, 1.02]
    for bad in (
        dict(ratios=(1.0,), threshold=0.1),
        dict(ratios=(1.0, 0.0), threshold=0.1),
        dict(ratios=(1.0, 1.1), threshold=0),
    ):
        with pytest.raises(ValueError):
            StepChangeCurve(**bad)
    # Real FLUX.1-dev at 28 steps on Flux's noise levels in ComfyUI (shift 1.15): every 3 computes step 0 and
    # then reuses steps 1-8 (error 4.3 on the real curve); the guard computes steps 2 and 5 too.
    levels = [math.exp(1.15) / (math.exp(1.15) + (1 / (1 - step / 28) - 1)) for step in range(28)]
    every_3 = NoiseSpacedSchedule(3).for_run(28, levels).full
    flux = dit_families.family("Flux").curve
    assert sorted(every_3)[:2] == [0, 9] and max(flux.errors(every_3, 28)) > 4
    assert flux.guard(every_3, 28) - every_3 == {2, 5}
    assert max(flux.errors(flux.guard(every_3, 28), 28)) <= flux.threshold


def keeps_the_picture_with(sampler, schedule=None, dit=False, plan="auto"):
    """Whether ``plans.decide`` lets reuse run with ``sampler`` on ``schedule``."""
    from tome_core.reuse import FULL, decide

    return decide(plan, sampler, schedule, None if dit else 3, dit=dit).runs != FULL


def full_below_noise(sampler, schedule=None, dit=True, plan="auto"):
    """The noise level below which ``plans.decide`` runs every call in full (0: none, or no reuse at all)."""
    from tome_core.reuse import FULL, decide

    decision = decide(plan, sampler, schedule, None if dit else 3, dit=dit)
    return 0.0 if decision.runs == FULL else (decision.fallback or decision).full_below


def test_the_webuis_unipc_label_reuses_on_dits_only_with_its_corrector_rule():
    """Forge Neo's sampler label "UniPC" is ComfyUI's uni_pc: reuse runs with it on DiTs only, and its calls below
    noise 0.5 run in full (the corrector's rule)."""
    from tome_core.reuse import FULL_BELOW_NOISE_WITH_A_CORRECTOR

    assert keeps_the_picture_with("UniPC", "Simple", dit=True)
    assert not keeps_the_picture_with("UniPC", "Simple", dit=False)
    assert not keeps_the_picture_with("UniPC", "Karras", dit=True)
    assert full_below_noise("UniPC") == FULL_BELOW_NOISE_WITH_A_CORRECTOR == 0.5
    assert full_below_noise("Euler") == 0.0


def test_dpmpp_2m_reuses_on_unets_on_karras_sigmas_only_with_its_low_noise_calls_in_full():
    """DPM++ 2M (each host's name for it) on Karras sigmas: reuse runs on UNets, with every call below sigma 1.0 in
    full; on other sigmas, and on DiTs, it stands down as before; UniPC's rule stays the DiTs'."""
    for name in ("dpmpp_2m", "DPM++ 2M", "DPMSolverMultistepScheduler"):
        assert keeps_the_picture_with(name, "karras") and keeps_the_picture_with(name, "Karras")
        assert not keeps_the_picture_with(name, None) and not keeps_the_picture_with(name, "exponential")
        assert not keeps_the_picture_with(name, "karras", dit=True)
        assert full_below_noise(name, "karras", dit=False) == 1.0
        assert full_below_noise(name, None, dit=False) == full_below_noise(name, "karras", dit=True) == 0.0
    for name in ("dpmpp_2m_sde", "dpmpp_3m_sde", "euler"):  # not measured, or lose the picture on Karras sigmas
        assert not keeps_the_picture_with(name, "karras")
    assert full_below_noise("uni_pc", dit=False) == 0.0 and full_below_noise("uni_pc") == 0.5
    # Only under reuse_plan "auto": a job saved with "every N" ran this sampler in full and keeps doing so.
    assert not keeps_the_picture_with("dpmpp_2m", "karras", plan="every N")
    assert full_below_noise("dpmpp_2m", "karras", dit=False, plan="every N") == 0.0
    assert keeps_the_picture_with("euler", plan="every N") and full_below_noise("uni_pc", plan="every N") == 0.5


def test_streams_of_two_widths_join_into_rows_and_split_back_exactly():
    """LTX-2's blocks pass on the tuple (video tokens, audio tokens) of two widths and two token counts: joined, both
    are cut into rows of one width (the widths' gcd) and come back as the same tuple, bit for bit; streams of one
    width still join along the token axis, as text and image tokens always did."""
    from tome_core.reuse import join_streams, split_streams

    video, audio = torch.randn(2, 12, 32), torch.randn(2, 5, 24)
    streams = {"img": (video, audio)}
    joined = join_streams(streams)
    assert joined.shape == (2, 12 * 32 // 8 + 5 * 24 // 8, 8)
    back = split_streams(joined, streams)
    assert isinstance(back["img"], tuple) and len(back["img"]) == 2
    assert torch.equal(back["img"][0], video) and torch.equal(back["img"][1], audio)
    silent = {"img": (video, torch.randn(2, 0, 24))}  # a video-only run: no audio tokens
    back = split_streams(join_streams(silent), silent)
    assert torch.equal(back["img"][0], video) and back["img"][1].shape == (2, 0, 24)
    text, image = torch.randn(2, 3, 32), torch.randn(2, 12, 32)
    assert torch.equal(join_streams({"txt": text, "img": image}), torch.cat((text, image), 1))
    assert join_streams({"img": {"video": video}}) is None  # a kind it does not know


def test_a_stream_it_cannot_join_makes_the_run_stand_down(caplog):
    """A block that hands over a stream of a kind reuse does not know: the block runs, that call and every later
    call of the run compute every block, and the log says so once."""
    import logging

    from tome_core.reuse import LayerReuseRun, NoiseSpacedSchedule

    run = LayerReuseRun(NoiseSpacedSchedule(3).for_run(12), 12, 1)
    ran = []

    def call(step, streams):
        run.begin_call(step, "layout", position=1.0 - step / 12)
        out = run.span_block(True, True, streams, lambda: ran.append(step) or streams, lambda out: out)
        run.end_call()
        return out

    tensor = {"img": torch.ones(1, 4, 8)}
    for step in range(3):
        call(step, tensor)
    with caplog.at_level(logging.WARNING, logger="tome_patch"):
        call(3, {"img": {"video": torch.ones(1, 4, 8)}})
        for step in range(4, 12):
            call(step, tensor)
    assert run.stood_down is not None and "dict" in run.stood_down
    reused_before = run.reused_calls
    assert ran[-9:] == list(range(3, 12)) and reused_before == 3 - len(ran[:-9]) > 0  # only before step 3
    assert caplog.text.count("stands down for this run") == 1
