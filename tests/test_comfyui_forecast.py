"""ComfyUI: ``reuse_plan``'s forecasts ("forecast v2", the default, and "forecast"), where a skipped step runs no
layer and its denoised image is drawn along the line through the last two computed steps
(``tome_core.reuse.whole_step``).

On ComfyUI's own KSampler path with a tiny random SD1.5 UNet: which steps compute per sampler, that a skipped
step calls nothing of the model, which samplers keep "auto"'s layer reuse, and that the user's step range holds."""

from __future__ import annotations

import logging

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

HW = (15, 23)


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def model():
    return host.tiny_model("sd15")


def kind_of(run) -> str:
    """The run's class name (ComfyUI loads the package under its folder's name: another copy of our classes)."""
    return type(run).__name__


def hooks_of(patched):
    (hooks,) = [w.__self__ for w in patched.wrappers["apply_model"]["tome_patch_layer_reuse"]]
    return hooks


def sample_counting(patched, steps=25, sampler="euler", scheduler="normal", seed=42, **options):
    """The sampled latent and how many times the UNet itself ran (``options``: ``host.sample``'s)."""
    unet = patched.model.diffusion_model
    calls = []
    handle = unet.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        out = host.sample(patched, "sd15", latent_hw=HW, steps=steps, batch=2, sampler=sampler, scheduler=scheduler,
                          seed=seed, **options)  # fmt: skip
    finally:
        handle.remove()
    return out, len(calls)


def test_the_default_computes_13_of_25_euler_steps_and_runs_nothing_at_the_others(node_classes, model):
    """Euler, 25 steps: the first 4, one in 3 after, the last 3 (13) call the UNet; ComfyUI calls it once per step
    with cond and uncond batched, so 13 UNet calls. The picture stays nearer the unpatched one than another seed's
    picture does (a random tiny UNet moves less smoothly than a trained one, so no tighter bound holds for it)."""
    patched = host.patch_with_node(node_classes, model, downsample_factor=1.0)
    out, unet_calls = sample_counting(patched)
    run = hooks_of(patched).last_run
    assert kind_of(run) == "WholeStepRun"
    computed = [step for step in range(25) if run.schedule.is_full(step, 25)]
    assert computed == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 22, 23, 24]
    assert (unet_calls, run.calls - run.reused_calls, run.extrapolate) == (13, 13, 0.75)
    assert torch.isfinite(out).all()
    full, _ = sample_counting(model)
    other_seed, _ = sample_counting(model, seed=7)
    assert (out - full).norm() < (other_seed - full).norm()


def test_a_skipped_step_returns_the_line_through_the_last_two_computed_denoised_images(
    node_classes, model, monkeypatch
):
    """What ``apply_model`` returns at step 4 (skipped) is the denoised image of steps 2 and 3 moved three quarters
    of the way along their line over sigma, exactly (ComfyUI's ``apply_model`` returns the denoised image)."""
    patched = host.patch_with_node(node_classes, model, downsample_factor=1.0)
    seen = []
    base = type(patched.model)
    apply_model = base.apply_model

    def recorded(self, x, t, *args, **kwargs):
        out = apply_model(self, x, t, *args, **kwargs)
        seen.append((float(t.max()), out.clone()))
        return out

    monkeypatch.setattr(base, "apply_model", recorded)
    sample_counting(patched)
    (s2, d2), (s3, d3), (s4, d4) = seen[2:5]
    expected = torch.lerp(d2, d3, 1.0 + 0.75 * (s4 - s3) / (s3 - s2))
    assert torch.equal(d4, expected)


def test_dpmpp_2m_on_karras_sigmas_computes_16_of_25_and_a_job_saved_with_forecast_19(node_classes, model):
    """The default ("forecast v3", as "forecast v2") computes the first 4 steps, one in 2 and the last 3; a workflow
    saved with "forecast" (the plan before) keeps its first 10 in full (19 of 25), and a picture not the default's."""
    options = {"sampler": "dpmpp_2m", "scheduler": "karras"}
    patched = host.patch_with_node(node_classes, model)
    out, unet_calls = sample_counting(patched, **options)
    run = hooks_of(patched).last_run
    assert kind_of(run) == "WholeStepRun" and unet_calls == 16 == run.calls - run.reused_calls
    assert [step for step in range(25) if run.schedule.is_full(step, 25)][:6] == [0, 1, 2, 3, 5, 7]
    saved = host.patch_with_node(node_classes, model, reuse_plan="forecast")
    before, before_calls = sample_counting(saved, **options)
    assert before_calls == 19 == hooks_of(saved).last_run.calls - hooks_of(saved).last_run.reused_calls
    assert not torch.equal(before, out)


def test_dpmpp_2m_off_karras_sigmas_computes_20_of_25_and_a_job_saved_with_forecast_v2_every_step(node_classes, model):
    """The default ("forecast v3") forecasts DPM++ 2M on ComfyUI's normal sigmas at its high-noise steps (20 of 25);
    a workflow saved with "forecast v2" computes every step, its picture that of reuse off."""
    options = {"sampler": "dpmpp_2m", "scheduler": "normal"}
    patched = host.patch_with_node(node_classes, model)
    out, unet_calls = sample_counting(patched, **options)
    run = hooks_of(patched).last_run
    assert kind_of(run) == "WholeStepRun" and unet_calls == 20 == run.calls - run.reused_calls
    saved, saved_calls = sample_counting(host.patch_with_node(node_classes, model, reuse_plan="forecast v2"), **options)
    off, _ = sample_counting(host.patch_with_node(node_classes, model, reuse_interval=1), **options)
    assert saved_calls == 25 and torch.equal(saved, off) and not torch.equal(out, off)


def test_samplers_without_a_forecast_plan_keep_autos_layer_reuse_bit_for_bit(node_classes, model):
    """Heun has no forecast plan: "forecast v2" runs it as "auto" does (the layers' reuse), bit for bit; the
    default ("forecast v3") the same with its calls below sigma 0.4 in full (fewer reused)."""
    forecast = host.patch_with_node(node_classes, model, reuse_plan="forecast v2")
    auto = host.patch_with_node(node_classes, model, reuse_plan="auto")
    out, _ = sample_counting(forecast, steps=12, sampler="heun")
    run = hooks_of(forecast).last_run
    assert kind_of(run) == "LayerReuseRun" and run.reused_calls > 0
    assert torch.equal(out, sample_counting(auto, steps=12, sampler="heun")[0])
    default = host.patch_with_node(node_classes, model)
    as_v2 = host.patch_with_node(node_classes, model, reuse_plan="forecast v2")
    sample_counting(default, sampler="heun")
    sample_counting(as_v2, sampler="heun")
    fewer, before = hooks_of(default).last_run, hooks_of(as_v2).last_run
    assert fewer.full_below == 0.4 and 0 < fewer.reused_calls < before.reused_calls


def test_outside_the_step_range_every_step_computes(node_classes, model):
    """start_percent / end_percent bound where steps may be skipped: from 0.5 on, the first half computes."""
    patched = host.patch_with_node(node_classes, model, start_percent=0.5)
    _, unet_calls = sample_counting(patched)
    run = hooks_of(patched).last_run
    skipped_early = [s for s in range(25) if not run.schedule.is_full(s, 25) and s < 8]
    assert skipped_early and unet_calls > 13


def test_composes_with_a_controlnet_and_a_weight_patch(node_classes, model):
    """At the computed steps the ControlNet's residual and another node's weight patch reach the UNet, so the
    forecast carries them on: each changes the result, and nothing fails."""
    import nodes as comfy_nodes

    control = host.tiny_controlnet()
    hint = torch.rand(1, HW[0] * 8, HW[1] * 8, 3, generator=torch.Generator().manual_seed(4))
    positive, negative = host.conditioning("sd15", 1, seed=1), host.conditioning("sd15", 1, seed=2)
    controlled = comfy_nodes.ControlNetApplyAdvanced().apply_controlnet(
        positive, negative, control, hint, 1.0, 0.0, 1.0
    )

    def sample(patched, conds=(positive, negative)):
        latent = {"samples": torch.zeros(2, 4, *HW)}
        (out,) = comfy_nodes.common_ksampler(patched, 42, 12, 5.0, "euler", "normal", *conds, latent)
        return out["samples"]

    patched = host.patch_with_node(node_classes, model)
    plain = sample(patched)
    with_control = sample(patched, controlled)
    assert torch.isfinite(with_control).all() and not torch.equal(with_control, plain)
    assert kind_of(hooks_of(patched).last_run) == "WholeStepRun" and hooks_of(patched).last_run.reused_calls > 0
    weighted = model.clone()
    key = next(k for k in model.model_state_dict() if k.endswith("output_blocks.5.1.proj_out.weight"))
    weighted.add_patches({key: (torch.full_like(model.model_state_dict()[key], 0.01),)}, 1.0)
    assert not torch.equal(sample(host.patch_with_node(node_classes, weighted)), plain)


@pytest.mark.parametrize("cache", ["EasyCacheNode", "LazyCacheNode"])
def test_comfyuis_step_caches_decide_the_steps_alone(node_classes, model, cache):
    """Two step caches at once would each take the other's forecast for a real change: under EasyCache or
    LazyCache the forecast stands down for the run, and the output is the step cache's with ToDo 2."""
    from comfy_extras import nodes_easycache

    node = getattr(nodes_easycache, cache)
    settings = {"reuse_threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95, "verbose": False}
    ours = host.patch_with_node(node_classes, model)
    both = node.execute(ours, **settings).result[0]
    todo = node.execute(host.patch_with_node(node_classes, model, reuse_interval=1), **settings).result[0]
    assert torch.equal(sample_counting(both, steps=12)[0], sample_counting(todo, steps=12)[0])
    assert hooks_of(ours).last_run is None


@pytest.mark.parametrize(
    ("sampler", "scheduler", "computed"),
    [("dpmpp_2m", "karras", 25), ("euler", "karras", 25), ("euler", "normal", 13)],
)
def test_part_of_a_karras_schedule_runs_every_step_and_says_why(node_classes, model, caplog, sampler, scheduler,
                                                                computed):  # fmt: skip
    """KSampler at denoise 0.6 samples the last stretch of a longer schedule: on Karras sigmas it is recognised as
    part of one, where no plan is measured, so every step runs and one line says why (not "the sampler"); on the
    normal schedule Euler keeps its forecast."""
    patched = host.patch_with_node(node_classes, model, downsample_factor=1.0)
    hooks_of(patched).last_run = None
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        _, unet_calls = sample_counting(patched, sampler=sampler, scheduler=scheduler, denoise=0.6)
    assert unet_calls == computed
    said = f"sampler {sampler} on part of a Karras schedule" in caplog.text
    assert said == (scheduler == "karras") and (hooks_of(patched).last_run is None) == said


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_a_pass_with_pag_runs_every_step_and_says_why(node_classes, model, caplog, cfg):
    """PerturbedAttentionGuidance adds a post-CFG function that calls the model again at each step: no plan is
    measured with one, so the pass computes every call (the sampler's and PAG's) and the log says why."""
    from comfy_extras.nodes_pag import PerturbedAttentionGuidance

    patched = host.patch_with_node(node_classes, model, downsample_factor=1.0)
    pag = PerturbedAttentionGuidance.execute(patched, 3.0).result[0]
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        _, unet_calls = sample_counting(pag, cfg=cfg)
    assert unet_calls == 2 * 25 and "a post-CFG function calls the model again" in caplog.text


def test_a_second_call_of_a_layout_in_one_sampler_call_keeps_records_of_its_own():
    """Within one sampler call (PREDICT_NOISE), each call of a batch layout is a model call of its own (context
    windows, a node's extra call): its own key, so its own records; the next sampler call counts afresh, and so does
    a call at another noise level where no PREDICT_NOISE wrapper said so."""
    from tome_core.hosts.comfyui.layer_reuse import RunState

    state, x = RunState(None, None), torch.zeros(2, 4, 8, 8)
    first, second = state.key(["c", "u"], x, 5.0), state.key(["c", "u"], x, 5.0)
    assert first != second and state.key(["c"], x, 5.0) != first
    state.calls.clear()  # what the PREDICT_NOISE wrapper does at each sampler call
    assert state.key(["c", "u"], x, 5.0) == first
    assert state.key(["c", "u"], x, 4.0) == first  # a new noise level: a new sampler call
