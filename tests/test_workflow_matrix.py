"""The workflow matrix in ComfyUI: every sampler and scheduler ComfyUI lists, in each workflow it has for them
(``comfy_host.WORKFLOWS``: txt2img; img2img at denoise 0.6; two KSamplerAdvanced passes with leftover noise; PAG and
SAG at CFG 1 and 4), under the node's default. A pass either reuses with the plan ``plans.decide`` names for its
sampler and schedule, or runs every call in full with one log line that says why.

The plan is chosen once per pass at the door (``LayerReuseHooks.outer_sample_wrapper``) from the sampler object and
the sigmas ComfyUI hands it. Every combination goes through ComfyUI's own path to that door, and a probe behind the
door records what the pass was given, without sampling (milliseconds each). Sampling the tiny random UNet then shows
that what runs is what the door named: every sampler that reuses with every scheduler (txt2img), with every
workflow, and a pass of each reason to run in full. The pictures: test_workflow_matrix_pictures.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

from tome_core.reuse import FORECAST, FULL, LAYERS, decide
from tome_core.reuse.plans import DEFAULT_REUSE_PLAN, Decision

HW = (8, 8)  # SAG blurs with a 13-wide kernel: 7 is the least it pads
STEPS = 25
SAMPLERS = host.comfy.samplers.KSampler.SAMPLERS
SCHEDULERS = host.comfy.samplers.SCHEDULER_NAMES
RUN_KEY = "tome_patch_layer_reuse_run"
# ComfyUI's "ddim" runs k-diffusion's Euler; dpm_fast and dpm_adaptive run functions of its own, with no sampler name.
DOOR_NAMES = {"ddim": "euler", "dpm_fast": None, "dpm_adaptive": None}
# ComfyUI drops the next-to-last level (the lowest above 0) for these (KSampler.DISCARD_PENULTIMATE_SIGMA_SAMPLERS).
DISCARD = host.comfy.samplers.KSampler.DISCARD_PENULTIMATE_SIGMA_SAMPLERS
REUSING = ("euler", "heun", "dpmpp_sde", "dpmpp_2m")  # the samplers with a rule; ddim is Euler


@pytest.fixture(scope="module", autouse=True)
def no_progress_bar():
    import comfy.utils

    saved, comfy.utils.PROGRESS_BAR_ENABLED = comfy.utils.PROGRESS_BAR_ENABLED, False
    yield
    comfy.utils.PROGRESS_BAR_ENABLED = saved


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def model():
    return host.tiny_model("sd15")


@pytest.fixture(scope="module")
def inputs():
    start = torch.randn(1, 4, *HW, generator=torch.Generator().manual_seed(3))
    return host.conditioning("sd15", seed=1), host.conditioning("sd15", seed=2), torch.zeros(1, 4, *HW), start


def passes(workflow) -> list[str]:
    """The part of its schedule each pass of ``workflow`` samples."""
    return {"img2img": ["tail"], "advanced": ["head", "tail"]}.get(workflow[0], ["whole"])


def expected_schedule(sampler: str, scheduler: str, part: str) -> str | None:
    """The schedule the door should read from a pass's sigmas (``plans.decide``'s words)."""
    if scheduler == "linear_quadratic" and part == "head":
        # Its first 12 levels lie near a line, as a short stretch of a Karras schedule does (within the detection's
        # 1e-3): read as part of one, the pass runs every step, the safe way.
        return "part of karras"
    if scheduler in ("exponential", "kl_optimal"):  # read from the levels: the plans lose the picture there
        return scheduler
    if scheduler == "beta":  # read from the levels, whole or a stretch
        return "beta"
    if scheduler != "karras":
        return None
    if sampler in DISCARD:  # without the lowest level: a stretch of a Karras schedule, whatever the pass
        return "part of karras"
    return "karras" if part == "whole" else "part of karras"


# PAG's and SAG's nodes add a post-CFG function: such a pass runs in full.
POST_CFG = Decision(
    FULL, "a post-CFG function calls the model again at each step (PAG, SAG, ...): no plan is measured with one"
)


def expected(sampler, scheduler, workflow):
    """The decision of each pass of ``workflow``."""
    if workflow[0] in ("pag", "sag"):
        return [POST_CFG]
    name = DOOR_NAMES.get(sampler, sampler)
    return [
        decide(DEFAULT_REUSE_PLAN, name, expected_schedule(sampler, scheduler, part), 3) for part in passes(workflow)
    ]


def full_line(decision) -> str:
    return (
        f"ToMe reuse across steps is off for this run: {decision.why}; every step runs in full. ToDo/ToMe still apply."
    )


class DoorProbe:
    """An OUTER_SAMPLE wrapper behind ours: records the run our door handed the pass (None: none) and its steps, and
    returns the latent without sampling."""

    def __init__(self):
        self.passes = []

    def __call__(self, executor, noise, latent_image, sampler, sigmas, *args, **kwargs):
        state = executor.class_obj.model_options.get("transformer_options", {}).get(RUN_KEY)
        self.passes.append((None if state is None else state.run, len(sigmas) - 1))
        return latent_image


def kind_of(run) -> str | None:
    """A run's class name (ComfyUI loads the package under its folder's name: another copy of our classes)."""
    return None if run is None else type(run).__name__


def computed(schedule, steps: int) -> list[int]:
    """The steps ``schedule`` computes of ``steps`` (ComfyUI's copy of our classes never equals ours)."""
    return [step for step in range(steps) if schedule.is_full(step, steps)]


RUN_CLASS = {FORECAST: "WholeStepRun", LAYERS: "LayerReuseRun", FULL: None}


@pytest.mark.parametrize("workflow", host.WORKFLOWS, ids=[f"{n}-cfg{c:g}" for n, c in host.WORKFLOWS])
def test_every_sampler_and_scheduler_gets_the_plan_decide_names_or_a_line_why_not(
    node_classes, model, inputs, caplog, workflow
):
    """All 42 x 9 combinations per workflow, through ComfyUI's path up to the sampler: a pass the decision runs in
    full gets no run and the one line with the decision's reason; one it reuses gets the run of the decision's plan
    (a forecast: its schedule; layer reuse: its low-noise limit) and no such line."""
    patched = host.patch_with_node(node_classes, model)
    probe = DoorProbe()
    patched.add_wrapper_with_key("outer_sample", "workflow_matrix_probe", probe)
    wrong = []
    for sampler in SAMPLERS:
        for scheduler in SCHEDULERS:
            caplog.clear()
            probe.passes.clear()
            with caplog.at_level(logging.INFO, logger="tome_patch"):
                host.run_workflow(patched, workflow, sampler, scheduler, *inputs, steps=STEPS)
            lines = [r.getMessage() for r in caplog.records if "is off for this run" in r.getMessage()]
            decisions = expected(sampler, scheduler, workflow)
            said = [full_line(d) for d in decisions if d.runs == FULL]
            got = [(kind_of(run), steps) for run, steps in probe.passes]
            ok = len(got) == len(decisions) and lines == said
            for (run, steps), decision in zip(probe.passes, decisions, strict=False):
                ok = ok and kind_of(run) == RUN_CLASS[decision.runs]
                if decision.runs == FORECAST:
                    ok = (
                        ok
                        and computed(run.schedule, steps) == computed(decision.schedule, steps)
                        and run.steps == steps
                    )
                elif decision.runs == LAYERS:
                    ok = ok and run.full_below == decision.full_below and run.steps == steps
            if not ok:
                wrong.append((sampler, scheduler, [d.runs for d in decisions], got, lines))
    assert not wrong, "\n".join(map(str, wrong))


# --- what runs: sampling the tiny UNet ------------------------------------------------------------------------------


def sampled(model, workflow, sampler, scheduler, inputs):
    """(samples, UNet calls, calls whose middle block computed) of ``workflow``: a skipped forecast step never calls
    the UNet, a layer-reusing call skips its inner layers, the middle block among them."""
    unet = model.model.diffusion_model
    inner = unet.middle_block[0].in_layers  # inside an inner layer: runs only where that layer computes
    calls, ran = [], []
    handles = [
        unet.register_forward_pre_hook(lambda *_: calls.append(1)),
        inner.register_forward_pre_hook(lambda *_: ran.append(1)),
    ]
    try:
        out = host.run_workflow(model, workflow, sampler, scheduler, *inputs, steps=STEPS)
    finally:
        for handle in handles:
            handle.remove()
    return out, len(calls), len(ran)


def summary_line(run) -> str:
    """What the log says of a run that reused (``run.summary()``, in the engine's words)."""
    done = f"{run.calls - run.reused_calls} of {run.calls} model calls computed"
    if kind_of(run) == "WholeStepRun":
        return f"ToMe reuse across steps: {done}; {run.reused_calls} ran nothing"
    return f"ToMe reuse across steps: {done} in full; {run.reused_calls} ran only"


def assert_runs_what_the_log_names(node_classes, model, inputs, caplog, monkeypatch, workflow, sampler, scheduler):
    """A pass the decision runs in full: the unpatched picture bit for bit, every call, the line why. A pass that
    reuses: the run of the decision's plan, every model call the unpatched workflow makes counted, the UNet called
    at the computed ones only (a forecast) or its inner layers computed there only (layer reuse), and the log's
    count is the run's."""
    decisions = expected(sampler, scheduler, workflow)
    plain, plain_calls, _ = sampled(model, workflow, sampler, scheduler, inputs)
    patched = host.patch_with_node(node_classes, model, downsample_factor=1.0)  # no ToDo: reuse alone
    runs = host.recorded_runs(monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        out, calls, inner = sampled(patched, workflow, sampler, scheduler, inputs)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ToMe reuse across steps")]
    reusing = [d for d in decisions if d.runs != FULL]
    assert [kind_of(run) for run in runs] == [RUN_CLASS[d.runs] for d in reusing]
    assert [line for line in lines if "is off for this run" in line] == [
        full_line(d) for d in decisions if d not in reusing
    ]
    said = [line for line in lines if "is off for this run" not in line]
    assert len(said) == len(runs) and all(
        line.startswith(summary_line(run)) for line, run in zip(said, runs, strict=True)
    )
    if not reusing:
        assert torch.equal(out, plain) and calls == plain_calls
        return
    assert sum(run.calls for run in runs) == plain_calls  # every model call the sampler makes passed the door
    # DPM++ SDE calls the model at a mid-step noise level off the schedule, which drops the records: it reuses
    # nothing (docs/step-reuse.md), and its log line says so.
    assert all((run.reused_calls > 0) != (sampler == "dpmpp_sde") for run in runs)
    for run, decision in zip(runs, reusing, strict=True):
        if decision.runs == FORECAST:  # one model call per step (Euler, DPM++ 2M)
            assert run.calls - run.reused_calls == len(computed_steps := computed(decision.schedule, run.steps))
            assert run.calls == run.steps and computed_steps
    full_calls = sum(run.calls - run.reused_calls for run in runs)
    whole = decisions[0].runs == FORECAST
    assert (calls, inner) == ((full_calls, full_calls) if whole else (plain_calls, full_calls))


# Each workflow beside txt2img (each scheduler: test_workflow_matrix_schedulers.py) with each sampler that reuses, on
# the schedule it reuses on; PAG and SAG (at CFG 1 SAG turns ComfyUI's CFG 1 shortcut off); a sampler without a plan.
CASES = [
    *[(w, s, "karras" if s == "dpmpp_2m" else "normal") for w in host.WORKFLOWS[1:3] for s in REUSING],
    (("pag", 4.0), "euler", "normal"),
    (("sag", 1.0), "euler", "normal"),
    (host.WORKFLOWS[0], "euler_ancestral", "normal"),
]


@pytest.mark.parametrize(
    ("workflow", "sampler", "scheduler"), CASES, ids=[f"{w[0]}-cfg{w[1]:g}-{s}-{c}" for w, s, c in CASES]
)
def test_each_workflow_runs_what_the_log_names(
    node_classes, model, inputs, caplog, monkeypatch, workflow, sampler, scheduler
):
    assert_runs_what_the_log_names(node_classes, model, inputs, caplog, monkeypatch, workflow, sampler, scheduler)


@pytest.mark.parametrize(("sampler", "options"), [("euler", {"s_churn": 0.5}), ("heun", {"s_churn": 1.0})])
def test_a_sampler_given_churn_runs_every_step_with_a_line(node_classes, model, inputs, caplog, sampler, options):
    """No built-in node sets s_churn for Euler or Heun (SamplerEulerAncestral is another sampler), but a custom
    node's ``comfy.samplers.ksampler(name, extra_options)`` can: with noise added at each step the pass runs every
    step, the unpatched picture, with one line naming the option."""
    import comfy.sample
    import comfy.samplers

    positive, negative, empty, _ = inputs
    churned = comfy.samplers.ksampler(sampler, options)
    sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "normal", STEPS)

    def run(patcher):
        calls = []
        handle = patcher.model.diffusion_model.register_forward_pre_hook(lambda *_: calls.append(1))
        try:
            noise = comfy.sample.prepare_noise(empty, 0)
            with torch.no_grad():
                out = comfy.sample.sample_custom(
                    patcher, noise, 4.0, churned, sigmas, positive, negative, empty, seed=0
                )
        finally:
            handle.remove()
        return out, len(calls)

    plain, plain_calls = run(model)
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        out, calls = run(host.patch_with_node(node_classes, model, downsample_factor=1.0))
    assert calls == plain_calls and torch.equal(out, plain)
    name, value = next(iter(options.items()))
    assert caplog.text.count(f"sampler {sampler} with {name} {value:g} adds noise at each step") == 1
