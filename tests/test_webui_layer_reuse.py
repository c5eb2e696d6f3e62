"""Reuse across steps, layer by layer (setting reuse_interval), in the WebUI (ldm UNet) and on Forge, in jobs run
the way the hosts run them (see webui_host.py): the step of each model call comes from the cfg_denoiser
callbacks, one run per sampling pass."""

from __future__ import annotations

import types

import pytest
import torch
from hosts.webui_host import ForgeSDModel, Host, Processing, SDModel, make_unet, process_images, run_job, script_args

from tome_core import PatchSettings
from tome_core.hosts.webui import layer_reuse as webui_layer_reuse
from tome_core.hosts.webui import ldm_patch
from tome_core.reuse import IntervalSchedule, SkippableLayer

STEPS = tuple(range(999, 0, -83))  # 13 DDPM timesteps, a short run: full steps 0-2, 4, 6, 8, 10-12
HR_STEPS = (599, 499, 399, 299, 199, 99, 49)  # 7 steps
# Reuse alone (no token reduction), of the layers: the plan "auto" (the default "forecast" runs no layer at Euler's
# skipped steps; test_webui_forecast.py).
REUSE = {"method": "ToDo", "downsample_factor": 1.0, "reuse_interval": 3, "reuse_plan": "auto"}


@pytest.fixture(scope="module")
def host():
    return Host()


def job(host, sd_model, args, **kwargs):
    return run_job(host, sd_model, args, **{"steps": STEPS, "hr_steps": HR_STEPS, **kwargs})


def runs_of(p):
    return p._tome_patch_job.reuse_runs


def reused_calls(steps, interval, calls_per_step=1):
    """What the schedule reuses: every call of a step that is not full (the first steps are full, so the cache is
    complete by then)."""
    return calls_per_step * (steps - IntervalSchedule(interval).full_steps(steps))


def unet_of(sd_model):
    if hasattr(sd_model, "forge_unet_original"):
        return sd_model.forge_unet_original.model.diffusion_model
    return sd_model.model.diffusion_model


def skippable_layers(unet):
    return [m for m in unet.modules() if isinstance(m.__dict__.get("forward"), SkippableLayer)]


def assert_clean(sd_model):
    """No layer forward, no hook, no pass of ours left (Forge: the forwards it put back compute the class's)."""
    unet = unet_of(sd_model)
    assert not ldm_patch.is_patched(unet)
    assert not skippable_layers(unet) and not unet._forward_pre_hooks and not unet._forward_hooks
    for module in unet.modules():
        forward = module.__dict__.get("forward")
        assert forward is None or (forward.__self__ is module and forward.__func__ is type(module).forward)
    assert webui_layer_reuse.active_pass() is None


@pytest.mark.parametrize("layout", ["sd1", "sdxl"])
def test_interval_3_reuses_the_scheduled_calls_then_leaves_nothing(host, layout):
    sd_model = SDModel(make_unet(layout))
    baseline, _ = job(host, sd_model, script_args(enabled=False))
    seen = []
    out, p = job(
        host,
        sd_model,
        script_args(**REUSE),
        on_step=lambda p, step: seen.append(len(skippable_layers(unet_of(p.sd_model)))),
    )
    (run,) = runs_of(p)
    assert (run.steps, run.calls, run.reused_calls) == (13, 13, reused_calls(13, 3)) and run.reused_calls == 3
    assert not run.entries and run.current is None  # the cache went with the pass
    assert seen == [run.layers] * 13
    assert torch.isfinite(out).all() and not torch.equal(out, baseline)
    scale = baseline.abs().max().item()
    assert (out - baseline).abs().max().item() < 0.5 * scale  # the same picture, changed in its details
    assert p.extra_generation_params["ToMe reuse interval"] == 3
    assert_clean(sd_model)
    again, _ = job(host, sd_model, script_args(enabled=False))
    assert torch.equal(again, baseline)  # removal restores the exact computation
    assert not host.console


@pytest.mark.parametrize(("layout", "extrapolate"), [("sd1", 0.75), ("sdxl", 0.5)])
def test_a_job_of_25_steps_takes_its_familys_plan(host, layout, extrapolate):
    """From 25 steps the default interval follows the UNet family's plan (``reuse.plans.UNET_LONG_RUN_PLANS``):
    12 full steps of 25 on both layouts, three quarters of the line on SD1.x (attention at full resolution)."""
    sd_model = SDModel(make_unet(layout))
    out, p = job(host, sd_model, script_args(**REUSE), steps=tuple(range(999, 0, -40)))
    (run,) = runs_of(p)
    assert (run.steps, run.reused_calls, run.extrapolate) == (25, 25 - 12, extrapolate)
    assert torch.isfinite(out).all()
    assert_clean(sd_model)
    # reuse_plan "every N" (a job saved before the plans existed): 14 full steps of 25, half the line.
    _, p = job(host, sd_model, script_args(**{**REUSE, "reuse_plan": "every N"}), steps=tuple(range(999, 0, -40)))
    (run,) = runs_of(p)
    assert (run.steps, run.reused_calls, run.extrapolate) == (25, 25 - 14, 0.5)
    assert_clean(sd_model)


@pytest.mark.parametrize(
    ("job_of", "said"),
    [
        ({"sampler": "DPM++ 2M", "scheduler": "Uniform"}, "reuse across steps is off: sampler DPM++ 2M is not one"),
        ({"sampler": "DPM2 a"}, "reuse across steps is off: sampler DPM2 a is not one"),
        ({"scheduler": "Karras"}, "reuse across steps is off: sampler Euler on karras sigmas is not one"),
        # Automatic: Karras for DPM++ SDE
        ({"sampler": "DPM++ SDE"}, "reuse across steps is off: sampler DPM++ SDE on karras sigmas is not one"),
    ],
    ids=("dpmpp-2m-uniform", "dpm2-a", "euler-karras", "dpmpp-sde-automatic"),
)
def test_a_sampler_it_does_not_keep_the_picture_with_runs_every_step_in_full(host, capsys, job_of, said):
    """With "DPM++ 2M" off Karras sigmas (or any sampler but Euler, Heun, DDIM, DPM++ SDE and DPM++ 2M), and with
    Euler on the "Karras" schedule type (ref-sdxl 0.946) or DPM++ SDE on "Automatic" (Karras sigmas for it), the
    pass reuses nothing: the output is that of reuse off, and the console says why, once."""
    sd_model = SDModel(make_unet("sd1"))
    off, _ = job(host, sd_model, script_args(**{**REUSE, "reuse_interval": 1}), **job_of)
    capsys.readouterr()
    out, p = job(host, sd_model, script_args(**REUSE), **job_of)
    assert not runs_of(p) and torch.equal(out, off)
    assert capsys.readouterr().out.count(said) == 1


@pytest.mark.parametrize(
    "job_of",
    [{"sampler": "DPM++ 2M"}, {"sampler": "DPM++ 2M", "scheduler": "Karras"}, {"sampler": "DPM++ 2M Karras"}],
    ids=("automatic", "karras", "label-before-v1.9"),
)
def test_dpmpp_2m_on_karras_sigmas_reuses_with_every_call_below_sigma_1_in_full(host, job_of):
    """The WebUI's default sampler: "DPM++ 2M" on "Automatic" (Karras sigmas for it), on "Karras", and the label
    "DPM++ 2M Karras" of WebUIs before v1.9 take the general plan (14 full steps of 25, not the family's 12) and
    reuse at its reusing steps whose sigma is 1.0 or more; every call below runs in full (docs/step-reuse.md)."""
    from hosts.webui_host import SIGMAS

    steps = tuple(range(999, 0, -40))
    sd_model = SDModel(make_unet("sd1"))
    _, p = job(host, sd_model, script_args(**REUSE), steps=steps, **job_of)
    (run,) = runs_of(p)
    assert (run.schedule.full_steps(25), run.extrapolate, run.full_below) == (14, 0.5, 1.0)  # the general plan
    plan = [step for step in range(25) if not run.schedule.is_full(step, 25)]
    kept = [step for step in plan if float(SIGMAS[steps[step]]) >= 1.0]
    assert 0 < len(kept) < len(plan) and run.reused_calls == len(kept)
    assert_clean(sd_model)


def test_dpmpp_2m_on_karras_sigmas_under_every_n_keeps_every_step_in_full(host, capsys):
    """An infotext saved with the reuse plan "every N" (or before that setting existed, which reads as "every N")
    ran the WebUI's default sampler with every step in full: it still does, the output that of reuse off."""
    sd_model = SDModel(make_unet("sd1"))
    steps = tuple(range(999, 0, -40))
    off, _ = job(host, sd_model, script_args(**{**REUSE, "reuse_interval": 1}), steps=steps, sampler="DPM++ 2M")
    capsys.readouterr()
    args = script_args(**{**REUSE, "reuse_plan": "every N"})
    out, p = job(host, sd_model, args, steps=steps, sampler="DPM++ 2M")
    assert not runs_of(p) and torch.equal(out, off)
    assert capsys.readouterr().out.count("reuse across steps is off: sampler DPM++ 2M on karras sigmas is not one") == 1
    assert_clean(sd_model)


def test_interval_1_is_bit_identical_and_installs_nothing(host):
    sd_model = SDModel(make_unet("sd1"))
    baseline, _ = job(host, sd_model, script_args(enabled=False))
    off, p = job(host, sd_model, script_args(**{**REUSE, "reuse_interval": 1}))
    assert torch.equal(off, baseline) and runs_of(p) == [] and "ToMe method" not in p.extra_generation_params
    todo, _ = job(host, sd_model, script_args(method="ToDo"))
    seen = []
    todo_1, p = job(
        host, sd_model, script_args(method="ToDo", reuse_interval=1), on_step=lambda p, s: seen.append(p.sd_model)
    )
    assert torch.equal(todo_1, todo) and runs_of(p) == [] and "ToMe reuse interval" not in p.extra_generation_params
    assert not skippable_layers(unet_of(sd_model)) and not host.console


def test_with_todo_both_apply_and_removal_restores_the_unet(host):
    sd_model = SDModel(make_unet("sd1"))
    baseline, _ = job(host, sd_model, script_args(enabled=False))
    todo, _ = job(host, sd_model, script_args(method="ToDo", max_downsample="2"))
    both, p = job(host, sd_model, script_args(method="ToDo", max_downsample="2", reuse_interval=3, reuse_plan="auto"))
    assert runs_of(p)[0].reused_calls == reused_calls(13, 3)
    assert not torch.equal(both, todo) and not torch.equal(both, baseline)
    assert_clean(sd_model)
    # The adapter's own API: ldm_patch' removal (remove_patch, remove_all) takes the layer forwards too.
    unet = unet_of(sd_model)
    x, t, context = torch.randn(2, 4, 8, 8), torch.full((2,), 500.0), torch.randn(2, 5, 32)
    with torch.no_grad():
        plain = unet(x, t, context=context)
        settings = PatchSettings(method="todo", downsample_factor=1.0, reuse_interval=3, reuse_plan="auto")
        for remove in (lambda: ldm_patch.remove_patch(unet), ldm_patch.remove_all):
            assert not ldm_patch.install_patch(unet, settings)  # the reduction does nothing ...
            euler = types.SimpleNamespace(sampler_name="Euler")  # a job of a sampler reuse keeps the picture with
            schedule = webui_layer_reuse.schedule_for(settings, unet, webui_layer_reuse.decision_for(settings, euler))
            assert webui_layer_reuse.install_ldm(unet, settings, euler, schedule) is not None  # ... the reuse does
            assert ldm_patch.is_patched(unet) and skippable_layers(unet)
            # A call outside a denoiser call has no known step: it runs in full.
            assert torch.equal(unet(x, t, context=context), plain)
            remove()
            webui_layer_reuse.end_pass()
            assert_clean(sd_model)
            assert torch.equal(unet(x, t, context=context), plain)


def test_highres_pass_gets_its_own_run(host):
    sd_model = SDModel(make_unet("sd1"))
    out, p = job(host, sd_model, script_args(**REUSE), enable_hr=True)
    first, second = runs_of(p)
    assert (first.steps, first.reused_calls) == (13, reused_calls(13, 3))
    assert (second.steps, second.calls, second.reused_calls) == (7, 7, reused_calls(7, 3))
    assert not first.entries and not second.entries
    assert_clean(sd_model)


def test_cond_and_uncond_apart_keep_their_own_cache(host):
    """With batch_cond_uncond off the WebUI makes two UNet calls per step with the same shape: each keeps its own
    record (by its position in the denoiser call), so the picture is that of the batched calls."""
    sd_model = SDModel(make_unet("sd1"))
    baseline, _ = job(host, sd_model, script_args(enabled=False))
    batched, _ = job(host, sd_model, script_args(**REUSE))
    apart, p = job(host, sd_model, script_args(**REUSE), batch_cond_uncond=False)
    (run,) = runs_of(p)
    assert (run.calls, run.reused_calls) == (26, reused_calls(13, 3, calls_per_step=2))
    effect = (batched - baseline).abs().max().item()
    # Batched and separate calls round their sums in another order: 1.2e-4 of the effect at most on an Intel Xeon
    # (less on an AMD EPYC). Calls that shared one record would differ by the order of the effect itself.
    assert (apart - batched).abs().max().item() <= 1e-3 * effect


def test_step_of_each_call_from_the_callbacks_euler_and_heun(host):
    """``sampling_step`` lags one step behind (the sampler's callback runs after a step's calls); the step comes
    from the denoiser's call counter and agrees with it. Heun: two calls per step but the last."""
    seen = []

    def record(params):
        seen.append((params.sampling_step, webui_layer_reuse.denoiser_step(params)))

    host.callbacks.cfg_denoiser.append(record)
    try:
        job(host, SDModel(make_unet("sd1")), script_args(**REUSE))
        euler, seen[:] = list(seen), []
        _, p = job(host, SDModel(make_unet("sd1")), script_args(**REUSE), sampler="Heun")
        heun = list(seen)
    finally:
        host.callbacks.cfg_denoiser.remove(record)
    assert euler == [(max(i - 1, 0), (i, 13)) for i in range(13)]
    heun_steps = [i for i in range(12) for _ in range(2)] + [12]
    assert heun == [(max(i - 1, 0), (i, 13)) for i in heun_steps]
    (run,) = runs_of(p)
    assert (run.calls, run.reused_calls) == (25, reused_calls(13, 3, calls_per_step=2))


def _params(sampling_step, steps, calls, expected, denoiser=True):
    d = types.SimpleNamespace(step=calls, total_steps=expected, p=None) if denoiser else None
    return types.SimpleNamespace(sampling_step=sampling_step, total_sampling_steps=steps, denoiser=d)


def test_a_step_that_does_not_agree_with_the_host_is_unknown():
    assert webui_layer_reuse.denoiser_step(_params(3, 10, 4, 10)) == (4, 10)
    assert webui_layer_reuse.denoiser_step(_params(1, 10, 4, 10)) is None  # more calls than the sampler's steps
    assert webui_layer_reuse.denoiser_step(_params(9, 10, 10, 10)) is None  # past the last step
    assert webui_layer_reuse.denoiser_step(_params(0, 10, 0, 10, denoiser=False)) is None  # no denoiser given
    assert webui_layer_reuse.denoiser_step(_params(0, 0, 0, 0)) is None


def test_an_exception_mid_sampling_leaves_nothing_for_the_next_job(host):
    sd_model = SDModel(make_unet("sd1"))
    baseline, _ = job(host, sd_model, script_args(enabled=False))

    def fail(p, step):
        if step == 6:  # after reusing steps 3 and 5
            assert skippable_layers(unet_of(sd_model))
            assert webui_layer_reuse.active_pass().run.reused_calls == 2
            raise RuntimeError("out of memory")

    p = Processing(sd_model, script_args(**REUSE))
    p.steps, p.on_step = STEPS, fail
    with pytest.raises(RuntimeError), torch.no_grad():
        process_images(host, p)  # postprocess is skipped, as in the WebUI
    out, _ = job(host, sd_model, script_args(enabled=False))
    assert torch.equal(out, baseline)
    assert_clean(sd_model)


# --- Forge ----------------------------------------------------------------------------------------------------------


def _forge_and_ldm(layout="sd1"):
    return ForgeSDModel(make_unet(layout, seed=5)), SDModel(make_unet(layout, seed=5))


@pytest.mark.parametrize(
    "values",
    [
        REUSE,
        {"method": "ToDo", "max_downsample": "2", "reuse_interval": 3, "reuse_plan": "auto"},
        {"method": "ToDo", "reuse_interval": 2, "reuse_plan": "auto"},
    ],
)
def test_forge_gives_the_ldm_result(host, values):
    """(ToDo: ToMe's own matching is not compared here; Forge and ldm break its ties in their own float order.)"""
    forge, ldm = _forge_and_ldm()
    args = script_args(**values)
    forge_out, forge_p = job(host, forge, args, enable_hr=True)
    ldm_out, ldm_p = job(host, ldm, args, enable_hr=True)
    plain, _ = job(host, ldm, script_args(enabled=False), enable_hr=True)
    assert not torch.equal(forge_out, plain)
    torch.testing.assert_close(forge_out, ldm_out, rtol=0, atol=1e-6)
    counts = [[(run.calls, run.reused_calls) for run in runs_of(p)] for p in (forge_p, ldm_p)]
    assert counts[0] == counts[1] and len(counts[0]) == 2  # one run per pass (Forge's double highres call too)
    assert not host.console


def test_forge_object_patches_are_set_per_pass_and_undone_by_the_next_load(host):
    forge, _ = _forge_and_ldm()
    unet = unet_of(forge)
    never, _ = job(host, forge, script_args(enabled=False))
    seen = []

    def probe(p, step):
        patches = p.sd_model.forge_objects.unet.object_patches
        seen.append(
            (
                sum(isinstance(v, SkippableLayer) for v in patches.values()),
                isinstance(unet.__dict__.get("forward"), webui_layer_reuse.CallBoundary),
            )
        )

    patched, p = job(host, forge, script_args(**REUSE), on_step=probe)
    layers = runs_of(p)[0].layers
    assert seen == [(layers, True)] * 13 and len(skippable_layers(unet)) == layers
    assert forge.forge_unet_original.object_patches == {}
    again, _ = job(host, forge, script_args(enabled=False))  # Forge unloads our clone: its patches are undone
    assert torch.equal(again, never) and not torch.equal(patched, never)
    assert_clean(forge)


def test_forge_exception_mid_sampling_leaves_nothing_for_the_next_job(host):
    forge, _ = _forge_and_ldm()
    never, _ = job(host, forge, script_args(enabled=False))

    def fail(p, step):
        if step == 4:
            raise RuntimeError("out of memory")

    p = Processing(forge, script_args(**REUSE))
    p.steps, p.on_step = STEPS, fail
    with pytest.raises(RuntimeError), torch.no_grad():
        process_images(host, p)
    out, _ = job(host, forge, script_args(enabled=False))
    assert torch.equal(out, never)
    assert_clean(forge)


@pytest.mark.parametrize(("plan", "full"), [("auto", 12), ("every N", 14)])
def test_forge_follows_the_reuse_plan_as_the_ldm_unet_does(host, plan, full):
    """At 25 steps Forge runs the plan ``reuse_plan`` says, as the WebUI's own UNet does: 12 full steps of 25 with
    ``auto`` (SD1.x's family plan), 14 with ``every N``, and the same output."""
    forge, ldm = _forge_and_ldm()
    args = script_args(**{**REUSE, "reuse_plan": plan})
    steps = tuple(range(999, 0, -40))
    forge_out, forge_p = job(host, forge, args, steps=steps)
    ldm_out, ldm_p = job(host, ldm, args, steps=steps)
    torch.testing.assert_close(forge_out, ldm_out, rtol=0, atol=1e-6)
    for p in (forge_p, ldm_p):
        (run,) = runs_of(p)
        assert (run.steps, run.reused_calls) == (25, 25 - full)
    job(host, forge, script_args(enabled=False))  # the next job removes what this one set
    assert_clean(forge)
