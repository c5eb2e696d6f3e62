"""The default in ComfyUI (ToDo 2 with reuse_interval 3), and what was saved before it became the default.

A node added anew sends every widget's value, so it gets today's defaults. A workflow saved with today's node
stores reuse_interval (1 before the change) among its widget values, and an API prompt saved with it names it;
a prompt saved before the input existed leaves it out, which means 1 (``settings.IMPLIED_WHEN_ABSENT``)."""

from __future__ import annotations

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

from tome_core.settings import SPECS

HW = (15, 23)
# "ToMe Patch" as a workflow saved with the node before the change stores it: method, ratio, downsample_factor,
# max_downsample, start_percent, end_percent, skip_when_slower, scope, reuse_interval (the defaults then).
SAVED_WIDGETS = ["todo", 0.5, 2.0, "auto", 0.0, 1.0, True, "self-attention", 1]


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def model():
    return host.tiny_model("sd15")


def reuse_interval_of(patched) -> int | None:
    """The interval of the layer reuse a patched clone carries (None: no reuse across steps)."""
    for wrapper in patched.wrappers.get("apply_model", {}).get("tome_patch_layer_reuse", []):
        return wrapper.__self__.schedule.interval
    return None


def run(model, steps):
    return host.sample(model, "sd15", latent_hw=HW, steps=steps, batch=2)


@pytest.mark.parametrize("node_id", ["ToMePatch", "ToMePatchAdvanced"])
def test_a_node_added_anew_gets_todo_2_with_reuse_every_third_step(node_classes, model, node_id):
    inputs = {spec.id: spec.default for spec in node_classes[node_id].GET_SCHEMA().inputs[1:]}
    assert (inputs["method"], inputs["downsample_factor"], inputs["reuse_interval"]) == ("todo", 2.0, 3)
    assert reuse_interval_of(host.patch_with_node(node_classes, model, advanced=node_id.endswith("Advanced"))) == 3


def test_a_workflow_saved_with_the_node_before_the_change_keeps_reuse_off(node_classes, model):
    node = node_classes["ToMePatch"]
    names = [spec.id for spec in node.GET_SCHEMA().inputs[1:]]
    # Widget values are positional: the front end maps them like this (dit_settings and reuse_plan came after
    # the change).
    assert names[len(SAVED_WIDGETS) :] == ["dit_settings", "reuse_plan"]
    names = names[: len(SAVED_WIDGETS)]
    patched = host.run_node(node, model=model, **dict(zip(names, SAVED_WIDGETS, strict=True)))
    assert reuse_interval_of(patched) is None


def full_steps_of(patched, steps: int = 25) -> int:
    """How many of ``steps`` the layer reuse a patched clone carries runs in full."""
    for wrapper in patched.wrappers.get("apply_model", {}).get("tome_patch_layer_reuse", []):
        return wrapper.__self__.schedule.full_steps(steps)
    raise AssertionError("no reuse across steps")


def test_a_workflow_saved_before_reuse_plan_existed_keeps_one_step_in_n(node_classes, model):
    """reuse_plan came after reuse every 3 was the default: a workflow saved then stores values up to
    dit_settings, and a prompt saved then leaves reuse_plan out; both run 14 full steps of 25 (every N) as they
    did; one saved with "auto" keeps the SD1.x plan (12 of 25), and a node added anew forecasts whole steps
    ("forecast v3", 13 of 25 computed). The pictures differ, and each saved one is bit-identical to its plan set by
    hand."""
    node = node_classes["ToMePatch"]
    names = [spec.id for spec in node.GET_SCHEMA().inputs[1:]]
    assert names[-1] == "reuse_plan" and SPECS["reuse_plan"].default == "forecast v3"
    saved = dict(zip(names[:-1], [*SAVED_WIDGETS[:-1], 3, "auto"], strict=True))
    older = host.run_node(node, model=model, **saved)
    saved_auto = host.run_node(node, model=model, **saved, reuse_plan="auto")
    fresh = host.patch_with_node(node_classes, model)
    by_hand = host.patch_with_node(node_classes, model, reuse_plan="every N")
    auto_by_hand = host.patch_with_node(node_classes, model, reuse_plan="auto")
    assert (full_steps_of(older), full_steps_of(by_hand), full_steps_of(saved_auto)) == (14, 14, 12)
    assert full_steps_of(older, 20) == full_steps_of(saved_auto, 20)  # the plans differ from 25 steps only
    assert torch.equal(run(older, 25), run(by_hand, 25))
    assert torch.equal(run(saved_auto, 25), run(auto_by_hand, 25))
    assert not torch.equal(run(older, 25), run(saved_auto, 25))
    assert not torch.equal(run(saved_auto, 25), run(fresh, 25))


def test_api_prompts_saved_before_the_change_keep_reuse_off(node_classes, model):
    node = node_classes["ToMePatch"]
    names = [spec.id for spec in node.GET_SCHEMA().inputs[1:]][: len(SAVED_WIDGETS)]
    today = dict(zip(names, SAVED_WIDGETS, strict=True))
    older = {k: v for k, v in today.items() if k not in ("scope", "reuse_interval")}  # before the inputs existed
    for inputs in (today, older):
        assert reuse_interval_of(host.run_node(node, model=model, **inputs)) is None
    assert reuse_interval_of(host.run_node(node, model=model, **dict(older, reuse_interval=3))) == 3


def test_the_default_reuses_from_10_steps_and_leaves_shorter_runs_to_todo_alone(node_classes, model):
    """Under 10 steps (distilled models, Lightning/LCM LoRAs) the default computes exactly what ToDo 2 alone
    does; at 12 steps it reuses, and the picture differs from ToDo 2 alone."""
    default = host.patch_with_node(node_classes, model)
    todo_only = host.patch_with_node(node_classes, model, reuse_interval=1)
    for steps in (4, 8):
        assert torch.equal(run(default, steps), run(todo_only, steps))
    assert not torch.equal(run(default, 12), run(todo_only, 12))


@pytest.mark.parametrize(
    ("sampler", "scheduler", "said"),
    [
        ("euler_ancestral", "normal", "sampler euler_ancestral is not one"),
        ("lms", "normal", "sampler lms is not one"),
        ("dpmpp_2m", "exponential", "sampler dpmpp_2m on exponential sigmas"),
        ("dpmpp_2m", "beta", "sampler dpmpp_2m on beta sigmas: reuse_plan 'forecast v3' loses the picture there"),
        ("uni_pc", "normal", "sampler uni_pc is not one"),  # measured on DiTs only (tests/test_comfyui_dit_reuse.py)
        ("euler", "karras", "sampler euler on karras sigmas is not one"),  # found from the sigmas themselves
    ],
)
def test_samplers_it_does_not_keep_the_picture_with_run_every_step_in_full(
    node_classes, model, sampler, scheduler, said, caplog
):
    """Ancestral and multistep samplers, and Karras sigmas, lose the picture with reuse (docs/step-reuse.md): the
    default then computes exactly what ToDo 2 alone does, and the log says why."""
    default = host.patch_with_node(node_classes, model)
    todo_only = host.patch_with_node(node_classes, model, reuse_interval=1)
    options = {"latent_hw": HW, "steps": 12, "batch": 2, "sampler": sampler, "scheduler": scheduler}
    with caplog.at_level("INFO", logger="tome_patch"):
        out = host.sample(default, "sd15", **options)
    assert any(said in r.getMessage() for r in caplog.records)
    assert torch.equal(out, host.sample(todo_only, "sd15", **options))


def test_dpmpp_2m_on_karras_sigmas_under_auto_reuses_with_every_call_below_sigma_1_in_full(node_classes, model):
    """DPM++ 2M on Karras sigmas (the WebUI's default sampler; docs/step-reuse.md): "auto" takes the general
    plan (14 full steps of 25, half the line; not the family's 12) and reuses at its reusing steps whose sigma is
    1.0 or more, every call below runs in full; the picture is not ToDo 2 alone's."""
    import comfy.samplers

    default = host.patch_with_node(node_classes, model, reuse_plan="auto")
    todo_only = host.patch_with_node(node_classes, model, reuse_interval=1)
    (hooks,) = [w.__self__ for w in default.wrappers["apply_model"]["tome_patch_layer_reuse"]]
    options = {"latent_hw": HW, "steps": 25, "batch": 2, "sampler": "dpmpp_2m", "scheduler": "karras"}
    out = host.sample(default, "sd15", **options)
    sigmas = comfy.samplers.calculate_sigmas(default.get_model_object("model_sampling"), "karras", 25)
    run = hooks.last_run
    assert (run.schedule.full_steps(25), run.extrapolate, hooks.schedule.full_steps(25)) == (14, 0.5, 12)
    planned = [step for step in range(25) if not run.schedule.is_full(step, 25)]
    kept = [step for step in planned if float(sigmas[step]) >= 1.0]
    assert 0 < len(kept) < len(planned)  # the rule takes some of the plan's reusing steps, not all
    assert (run.full_below, run.reused_calls) == (1.0, len(kept))
    assert not torch.equal(out, host.sample(todo_only, "sd15", **options))


def test_dpmpp_2m_on_karras_sigmas_under_every_n_keeps_every_step_in_full(node_classes, model, caplog):
    """A workflow saved with reuse_plan "every N" (or before that input existed, which reads as "every N") ran DPM++
    2M on Karras sigmas with every step in full: it still does, bit for bit ToDo 2 alone, and the log says why."""
    every_n = host.patch_with_node(node_classes, model, reuse_plan="every N")
    todo_only = host.patch_with_node(node_classes, model, reuse_interval=1)
    (hooks,) = [w.__self__ for w in every_n.wrappers["apply_model"]["tome_patch_layer_reuse"]]
    options = {"latent_hw": HW, "steps": 25, "batch": 2, "sampler": "dpmpp_2m", "scheduler": "karras"}
    with caplog.at_level("INFO", logger="tome_patch"):
        out = host.sample(every_n, "sd15", **options)
    assert hooks.last_run is None
    assert any("sampler dpmpp_2m on karras sigmas is not one" in r.getMessage() for r in caplog.records)
    assert torch.equal(out, host.sample(todo_only, "sd15", **options))


def test_only_karras_sigmas_are_taken_for_karras(model):
    """The Karras check on the levels each of ComfyUI's schedulers gives (the model's sigma range, 12 steps), and
    on the stretches of them that denoise below 1, KSamplerAdvanced's step ranges and SplitSigmas hand a sampler:
    only Karras's are Karras, the stretches "part of karras"."""
    import comfy.samplers

    from tome_core.reuse import EXPONENTIAL, KARRAS, KARRAS_PART, KL_OPTIMAL, karras_schedule, schedule_of

    sampling = model.get_model_object("model_sampling")
    low, high = float(sampling.sigma_min), float(sampling.sigma_max)
    for name in comfy.samplers.SCHEDULER_NAMES:
        sigmas = comfy.samplers.calculate_sigmas(sampling, name, 12)
        assert karras_schedule(sigmas, low, high) == (KARRAS if name == "karras" else None), name
        whole = comfy.samplers.calculate_sigmas(sampling, name, 25)
        for part in (whole[10:], whole[:13], whole[5:20]):  # denoise 0.6; a first pass; a middle stretch
            # A stretch over less than a factor 2 of noise (linear_quadratic's first half) may lie within the
            # check's tolerance of a Karras one: it then counts as one, and so runs in full (either is safe).
            if name != "karras" and float(part[0]) < 2 * float(part[part > 0][-1]):
                continue
            assert karras_schedule(part, low, high) == (KARRAS_PART if name == "karras" else None), name
        # Exponential and KL-optimal sigmas are read from the levels too, whole or a stretch (the plans lose the
        # picture there); every other schedule is none of these.
        named = {"karras": KARRAS, "exponential": EXPONENTIAL, "kl_optimal": KL_OPTIMAL}.get(name)
        assert schedule_of(sigmas, low, high) == named, name
        if name in ("exponential", "kl_optimal"):
            assert schedule_of(whole[5:20], low, high) == named, name
