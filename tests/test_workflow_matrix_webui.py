"""The workflow matrix in the WebUI (the stand-in of tests/hosts/webui_host.py, its tiny random ldm UNet): every
sampler label the decision knows and a few it does not, on each schedule type and on none (an API request), in
txt2img, a highres pass with another sampler and img2img at denoising strength 0.6. Each pass either reuses with
the plan ``plans.decide`` names for its sampler and schedule or runs every call, and the console says which.

The stand-in's loop steps as Euler whatever the label (as Heun for "Heun"): what is checked is the door's choice
(``layer_reuse.sampler_and_schedule``, ``decision_for``) and that the pass runs it.
"""

from __future__ import annotations

import pytest
import torch
from hosts.webui_host import ControlNetUnit, Host, Processing, SDModel, make_unet, process_images, script_args
from test_webui_layer_reuse import assert_clean, runs_of

from tome_core.reuse import FORECAST, FULL, LAYERS, decide
from tome_core.reuse.plans import DEFAULT_REUSE_PLAN

PLAN = {"method": "ToDo", "downsample_factor": 1.0, "reuse_interval": 3, "reuse_plan": DEFAULT_REUSE_PLAN}  # no ToDo
KNOWN = ("Euler", "DDIM", "Heun", "DPM++ SDE", "DPM++ 2M", "DPM++ 2M Karras")  # the last: the label before v1.9
UNKNOWN = ("Euler a", "DPM++ 2M SDE", "LMS", "DPM2 a", "UniPC")
SCHEDULES = ("Automatic", "Karras", "Uniform", "Exponential", None)  # None: an API request that names none
WORKFLOWS = ("txt2img", "highres", "img2img")
# The schedules "Automatic" gives that the rules tell apart (v1.10.1 modules/sd_samplers_kdiffusion.py).
AUTOMATIC = {"DPM++ 2M": "Karras", "DPM++ SDE": "Karras"}
LONG = tuple(range(999, 0, -80))  # 13 steps: from 10 a plan reuses
SHORT = (999, 666, 333)  # a pass expected in full: the decision does not read the step count
HR_LONG = tuple(range(599, 0, -50))  # 12 steps
IMG2IMG_SCHEDULE = tuple(range(999, 0, -50))  # 20 steps, of which strength 0.6 runs the last int(0.6 * 20) + 1
DENOISE = 0.6


@pytest.fixture(scope="module")
def host():
    return Host()


@pytest.fixture(scope="module")
def sd_model():
    return SDModel(make_unet("sd1"))


class Img2Img(Processing):
    """StableDiffusionProcessingImg2Img as far as the decision reads it (``init_images``, ``denoising_strength``);
    its pass runs the last steps of the schedule (sd_samplers_kdiffusion.py ``sample_img2img``: t_enc + 1), here
    from the noise alone (an init image of zeros): the start latent changes no count."""

    def __init__(self, sd_model, args, **kwargs):
        super().__init__(sd_model, args, **kwargs)
        self.init_images = [None]
        self.denoising_strength = DENOISE


def schedule_of(label: str, schedule: str | None, part: bool) -> tuple[str, str | None]:
    """(sampler, schedule) as the decision should get them: "Automatic" and none are the sampler's own; a pass over
    part of a Karras schedule (highres, img2img) is "part of karras"."""
    if label.endswith(" Karras"):
        label, schedule = label[: -len(" Karras")], "karras"
    elif schedule in (None, "Automatic"):
        schedule = AUTOMATIC.get(label)
    karras = (schedule or "").lower() == "karras"
    return label, ("part of karras" if part and karras else schedule)


def first_sampler(label: str) -> str:
    """The first pass's sampler of a highres job whose highres pass samples with ``label``."""
    return "DDIM" if label == "Euler" else "Euler"


def expected(label, schedule, workflow):
    """The decision of each pass."""
    if workflow == "highres":
        first = schedule_of(first_sampler(label), None if schedule is None else "Automatic", False)
        return [decide(DEFAULT_REUSE_PLAN, *first, 3),
                decide(DEFAULT_REUSE_PLAN, *schedule_of(label, schedule, True), 3)]  # fmt: skip
    return [decide(DEFAULT_REUSE_PLAN, *schedule_of(label, schedule, workflow == "img2img"), 3)]


def job(host, sd_model, label, schedule, workflow, decisions):
    """Run the job; returns p and, per pass, (UNet calls, calls whose middle block computed, calls expected)."""
    steps = [SHORT if d.runs == FULL else None for d in decisions]
    p = (Img2Img if workflow == "img2img" else Processing)(sd_model, script_args(**PLAN))
    p.sampler, p.scheduler = label, schedule
    if workflow == "img2img":
        p.steps = steps[0] or IMG2IMG_SCHEDULE[-(int(DENOISE * len(IMG2IMG_SCHEDULE)) + 1) :]
    else:
        p.steps = steps[0] or LONG
    if workflow == "highres":
        p.enable_hr, p.sampler, p.hr_sampler_name = True, first_sampler(label), label
        p.scheduler, p.hr_scheduler = (None if schedule is None else "Automatic"), schedule  # the pass's own
        p.hr_steps = steps[1] or HR_LONG
    unet = sd_model.model.diffusion_model
    counts = {False: [0, 0], True: [0, 0]}  # per pass (is_hr_pass): UNet calls, middle block computed
    handles = [
        unet.register_forward_pre_hook(lambda *_: counts[p.is_hr_pass].__setitem__(0, counts[p.is_hr_pass][0] + 1)),
        unet.middle_block[0].in_layers.register_forward_pre_hook(
            lambda *_: counts[p.is_hr_pass].__setitem__(1, counts[p.is_hr_pass][1] + 1)
        ),
    ]
    try:
        with torch.no_grad():
            process_images(host, p)
    finally:
        for handle in handles:
            handle.remove()
    passes = [(p.steps, p.sampler)] + ([(p.hr_steps, label)] if workflow == "highres" else [])
    expected_calls = [2 * len(s) - 1 if sampler == "Heun" else len(s) for s, sampler in passes]
    return p, [(*counts[hr], calls) for hr, calls in zip((False, True), expected_calls, strict=False)]


CASES = [(label, schedule, w) for label in KNOWN + UNKNOWN for schedule in SCHEDULES for w in WORKFLOWS]


@pytest.mark.parametrize(("label", "schedule", "workflow"), CASES, ids=[f"{lb}-{s}-{w}" for lb, s, w in CASES])
def test_each_pass_reuses_with_the_plan_decide_names_or_says_why_not(host, sd_model, capsys, label, schedule,
                                                                     workflow):  # fmt: skip
    """A pass the decision runs in full: every call computes, no run, and the console gives the decision's reason.
    One it reuses: the run of the decision's plan; a forecast computes the calls of its schedule only, layer reuse
    the inner layers of its full calls only; the console's count is the run's."""
    decisions = expected(label, schedule, workflow)
    capsys.readouterr()
    p, passes = job(host, sd_model, label, schedule, workflow, decisions)
    said = capsys.readouterr().out
    runs = runs_of(p)
    reusing = [d for d in decisions if d.runs != FULL]
    kinds = {FORECAST: "WholeStepRun", LAYERS: "LayerReuseRun"}
    assert [type(run).__name__ for run in runs] == [kinds[d.runs] for d in reusing]
    runs = iter(runs)
    for decision, (calls, computed, expected_calls) in zip(decisions, passes, strict=True):
        assert calls == expected_calls
        if decision.runs == FULL:
            assert computed == calls
            assert f"reuse across steps is off: {decision.why}; every step runs in full" in said
            continue
        run = next(runs)
        assert run.calls == calls and computed == run.calls - run.reused_calls
        assert f"reuse across steps: {run.summary()}" in said
        if decision.runs == FORECAST:  # a short run may compute every step (DPM++ 2M off Karras under 15 steps)
            steps = run.steps
            assert computed == sum(decision.schedule.is_full(step, steps) for step in range(steps))
        else:
            assert run.reused_calls > 0
    assert ("reuse across steps is off" in said) == (len(reusing) < len(decisions))
    assert_clean(sd_model)


# Each a pass the door runs in full though ``decide`` gives its sampler and schedule a plan: (the job's sampler,
# schedule, options for the job, ControlNet units, the line).
RULES = {
    "sigma-range": ("Euler", "SGM Uniform", {"sigma_max": 20.0}, [], "on SGM Uniform sigmas with sigma_max 20"),
    "karras-exponential": ("Euler", "Karras Exponential", {}, [], "on Karras Exponential sigmas: no plan is measured"),
    "controlnet-range": ("Euler", "Automatic", {}, [ControlNetUnit(guidance_start=0.3)], "guidance start-end 0.3-1"),
}
RULE_CASES = [(rule, workflow) for rule in RULES for workflow in WORKFLOWS]


@pytest.mark.parametrize(("rule", "workflow"), RULE_CASES, ids=[f"{r}-{w}" for r, w in RULE_CASES])
def test_a_pass_whose_plan_is_unknown_runs_every_call_in_every_workflow(host, sd_model, capsys, rule, workflow):
    """A custom sigma range (an API request's ``override_settings``), the "Karras Exponential" schedule and a
    ControlNet unit that guides part of the pass: ``decide`` names a plan, the door runs every call of every pass
    (the highres pass with the first pass's sampler and schedule) and says why once."""
    label, schedule, options, units, line = RULES[rule]
    assert decide(DEFAULT_REUSE_PLAN, label, schedule.lower(), 3).runs != FULL
    p = (Img2Img if workflow == "img2img" else Processing)(sd_model, [*script_args(**PLAN), *units])
    p.sampler, p.scheduler, p.override_settings = label, schedule, options
    p.steps = IMG2IMG_SCHEDULE[-(int(DENOISE * len(IMG2IMG_SCHEDULE)) + 1) :] if workflow == "img2img" else LONG
    p.enable_hr, p.hr_steps = workflow == "highres", HR_LONG
    unet = sd_model.model.diffusion_model
    counts = {False: [0, 0], True: [0, 0]}  # per pass (is_hr_pass): UNet calls, middle block computed
    handles = [
        unet.register_forward_pre_hook(lambda *_: counts[p.is_hr_pass].__setitem__(0, counts[p.is_hr_pass][0] + 1)),
        unet.middle_block[0].in_layers.register_forward_pre_hook(
            lambda *_: counts[p.is_hr_pass].__setitem__(1, counts[p.is_hr_pass][1] + 1)
        ),
    ]
    capsys.readouterr()
    try:
        with torch.no_grad():
            process_images(host, p)
    finally:
        for handle in handles:
            handle.remove()
    said = capsys.readouterr().out
    assert runs_of(p) == []
    assert counts[False][0] == len(p.steps) and counts[False] == counts[False][:1] * 2
    assert counts[True] == ([len(HR_LONG)] * 2 if workflow == "highres" else [0, 0])
    assert said.count("reuse across steps is off") == 1 and line in said
    assert_clean(sd_model)
