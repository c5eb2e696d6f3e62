"""Reuse across steps on ComfyUI's DiTs (``tome_core/hosts/comfyui/dit_reuse.py``), in real ComfyUI with tiny
random-weight models of its own classes, deep enough that a span of several blocks follows the first block."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

from tome_core.hosts.comfyui import dit_reuse
from tome_core.hosts.comfyui.layer_reuse import RUN_KEY, RunState
from tome_core.hosts.shared import dit_families
from tome_core.reuse import IntervalSchedule, NoiseSpacedSchedule, decide

FAMILIES = ("flux", "chroma", "sd3", "wan")
# Four blocks each: Flux and Chroma two double and two single (the span crosses from one kind to the other).
SD3_CONTEXT = {"target": "torch.nn.Linear", "params": {"in_features": 64, "out_features": 256}}  # 64 x depth wide
DEEPER = {
    "flux": {"depth": 2, "depth_single_blocks": 2},
    "chroma": {"depth": 2, "depth_single_blocks": 2},
    "sd3": {"depth": 4, "context_embedder_config": SD3_CONTEXT},
    "wan": {"num_layers": 4},
}
SHAPES = {"flux": (1, 9, 13), "chroma": (1, 7, 9), "sd3": (1, 11, 7), "wan": (1, 3, 9, 11)}
STEPS = 12
# The span's blocks, per family (the first block runs at every call).
SPAN = {
    "flux": [("double_block", 1), ("single_block", 0), ("single_block", 1)],
    "chroma": [("double_block", 1), ("single_block", 0), ("single_block", 1)],
    "sd3": [("double_block", 1), ("double_block", 2)],  # its last block returns no text: it runs too
    "wan": [("double_block", 1), ("double_block", 2), ("double_block", 3)],
}
REUSE = {"reuse_interval": 3, "downsample_factor": 1.0}  # reuse alone: ToDo has its own tests


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def dits():
    return {family: host.tiny_dit(family, **DEEPER[family]) for family in FAMILIES}


def patch(node_classes, model, **values):
    return host.patch_with_node(node_classes, model, **{"skip_when_slower": False, "dit_settings": "as set", **values})


def blocks_of(model, family):
    """The DiT's blocks in call order, each with its ``patches_replace["dit"]`` key."""
    diffusion_model = model.model.diffusion_model
    return dict(zip(dit_reuse.block_keys(diffusion_model), _modules(diffusion_model, family), strict=True))


def _modules(diffusion_model, family):
    if family in ("flux", "chroma"):
        return [*diffusion_model.double_blocks, *diffusion_model.single_blocks]
    return list(diffusion_model.joint_blocks if family == "sd3" else diffusion_model.blocks)


class BlockCalls:
    """Counts each block's forward calls (forward hooks, removed on exit)."""

    def __init__(self, model, family):
        self.blocks = blocks_of(model, family)

    def __enter__(self):
        self.counts = dict.fromkeys(self.blocks, 0)
        self.handles = [
            block.register_forward_hook(lambda *_, key=key: self.counts.__setitem__(key, self.counts[key] + 1))
            for key, block in self.blocks.items()
        ]
        return self.counts

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def passing_on(args, extra):
    """Another node's block replacement that leaves the block out: the streams go on untouched."""
    return {name: args[name] for name in ("img", "txt") if name in args}


def planned_full_steps(model, steps: int, sampler="euler", part=None) -> int:
    """The full steps of a run of ``steps`` (``part``: the steps of a longer schedule that one sampling samples)
    at reuse every 3, on the model's noise levels as ``sample_dit`` samples them."""
    import comfy.samplers

    sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "normal", steps)
    levels = [float(s) for s in sigmas[:steps]][part or slice(None)]
    plan = NoiseSpacedSchedule(REUSE["reuse_interval"]).for_run(
        len(levels), levels, decide(None, sampler, None, dit=True).full_below
    )
    return plan.full_steps(len(levels))


def assert_span_ran_at_full_steps(counts, family, full, steps, calls_per_step):
    keys = list(counts)
    assert keys[1 : 1 + len(SPAN[family])] == SPAN[family]
    for outer in set(keys) - set(SPAN[family]):
        assert counts[outer] == steps * calls_per_step  # the first block (SD3: and the last) runs at every call
    assert 0 < full < steps
    assert {counts[key] for key in SPAN[family]} == {full * calls_per_step}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("calls_per_step", (2, 1), ids=("cond-uncond-apart", "cond-uncond-batched"))
def test_the_span_runs_at_full_steps_only(node_classes, dits, family, calls_per_step):
    """Cond and uncond in two calls (prompts of other lengths) or batched into one (the same length)."""
    patched = patch(node_classes, dits[family], **REUSE)
    negative_tokens = 5 if calls_per_step == 2 else 9
    with BlockCalls(patched, family) as counts:
        out = host.sample_dit(patched, family, SHAPES[family], steps=STEPS, negative_tokens=negative_tokens)
    assert torch.isfinite(out).all()
    full = planned_full_steps(patched, STEPS)
    assert full == STEPS // 2  # under 25 steps one in two at most, spaced by the noise
    assert_span_ran_at_full_steps(counts, family, full, STEPS, calls_per_step)


def test_uni_pc_reuses_on_dits(node_classes, dits):
    """UniPC, Wan's usual sampler, keeps the DiT reference's picture with reuse (docs/dit.md): the span runs at the
    schedule's full steps only, as with Euler (on UNets it runs every step: tests/test_comfyui_defaults.py)."""
    patched = patch(node_classes, dits["wan"], **REUSE)
    with torch.no_grad(), BlockCalls(patched, "wan") as counts:  # uni_pc keeps its graph otherwise
        host.sample_dit(patched, "wan", SHAPES["wan"], steps=STEPS, sampler="uni_pc")
    assert_span_ran_at_full_steps(counts, "wan", planned_full_steps(patched, STEPS, "uni_pc"), STEPS, 2)


def test_uni_pc_runs_the_low_noise_steps_in_full(node_classes, dits):
    """UniPC's corrector multiplies a predicted output's error at low noise (docs/dit.md): with a shift of 3
    (ModelSamplingSD3) over 30 steps, every step below noise 0.5 runs every block; they count among the one
    step in two of the others, spaced by the noise above 0.5."""
    import comfy.samplers
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3

    from tome_core.reuse import FULL_BELOW_NOISE_WITH_A_CORRECTOR

    shifted = ModelSamplingSD3().patch(dits["wan"], 3.0)[0]
    patched = patch(node_classes, shifted, reuse_interval=2, downsample_factor=1.0)
    steps = 30
    with torch.no_grad(), BlockCalls(patched, "wan") as counts:
        host.sample_dit(patched, "wan", SHAPES["wan"], steps=steps, sampler="uni_pc")
    sigmas = comfy.samplers.calculate_sigmas(shifted.get_model_object("model_sampling"), "normal", steps)
    low = sum(float(s) < FULL_BELOW_NOISE_WITH_A_CORRECTOR for s in sigmas[:steps])
    assert 3 < low < steps // 2
    assert {counts[key] for key in SPAN["wan"]} == {2 * (low + (steps - low + 1) // 2)}  # cond and uncond apart
    # Which steps ran the span: every call below 0.5, and above it the rest of the budget, one call in two.
    levels = [float(s) for s in sigmas[:steps]]
    plan = NoiseSpacedSchedule(2).for_run(steps, levels, FULL_BELOW_NOISE_WITH_A_CORRECTOR)
    assert all(plan.is_full(step, steps) for step in range(steps) if levels[step] < FULL_BELOW_NOISE_WITH_A_CORRECTOR)


def test_bf16_keeps_the_arithmetic_exact(node_classes):
    """In bf16 too (as users run Flux), where the span changes nothing a reusing call changes nothing."""
    model = host.tiny_dit("flux", dtype=torch.bfloat16, **DEEPER["flux"])
    foreign = model.clone()
    for block_type, index in SPAN["flux"]:
        foreign.set_model_patch_replace(passing_on, "dit", block_type, index)
    expected = host.sample_dit(foreign, "flux", SHAPES["flux"], steps=STEPS)
    patched = patch(node_classes, foreign, **REUSE)
    with BlockCalls(patched, "flux") as counts:
        out = host.sample_dit(patched, "flux", SHAPES["flux"], steps=STEPS)
    assert counts[("double_block", 0)] == 2 * STEPS  # sampled, in bf16, every call through the first block
    assert torch.equal(out, expected)


def test_wan22_two_models_each_sample_their_part(node_classes):
    """Wan 2.2: a high-noise and a low-noise model each sample part of one schedule (KSamplerAdvanced start and
    end steps); each part is a sampling run of its own, reused on its own schedule."""
    high = patch(node_classes, host.tiny_dit("wan", seed=1, **DEEPER["wan"]), **REUSE)
    low = patch(node_classes, host.tiny_dit("wan", seed=2, **DEEPER["wan"]), **REUSE)
    steps, switch = 24, 12
    with BlockCalls(high, "wan") as first:
        part = host.sample_dit(high, "wan", SHAPES["wan"], steps=steps, start_step=0, last_step=switch)
    with BlockCalls(low, "wan") as second:
        out = host.sample_dit(low, "wan", SHAPES["wan"], steps=steps, latent=part, start_step=switch,
                              last_step=steps, disable_noise=True)  # fmt: skip
    assert torch.isfinite(out).all()
    assert_span_ran_at_full_steps(first, "wan", planned_full_steps(high, steps, part=slice(0, switch)), switch, 2)
    later = planned_full_steps(low, steps, part=slice(switch, steps))
    assert_span_ran_at_full_steps(second, "wan", later, steps - switch, 2)


def test_wan22s_second_pass_predicts_nothing_from_the_first(node_classes, monkeypatch):
    """The two passes of a Wan 2.2 workflow through one patched model (the worst case: the same hooks): the
    low-noise pass is a run of its own, planned on its own steps, and gives exactly what it gives when nothing ran
    before it; and through two patched experts too, nothing the high-noise pass recorded reaches the other."""
    model = host.tiny_dit("wan", seed=1, **DEEPER["wan"])
    shared = patch(node_classes, model, **REUSE)
    steps, switch = 24, 12
    runs = host.recorded_runs(monkeypatch)
    part = host.sample_dit(shared, "wan", SHAPES["wan"], steps=steps, start_step=0, last_step=switch)
    low = {"steps": steps, "latent": part, "start_step": switch, "last_step": steps, "disable_noise": True}
    after = host.sample_dit(shared, "wan", SHAPES["wan"], **low)
    alone = host.sample_dit(patch(node_classes, model, **REUSE), "wan", SHAPES["wan"], **low)
    assert torch.equal(after, alone)
    first, second, third = runs
    assert first is not second and (first.steps, second.steps) == (switch, steps - switch)
    assert second.reused_calls > 0 and second.reused_calls == third.reused_calls
    expert = patch(node_classes, host.tiny_dit("wan", seed=2, **DEEPER["wan"]), **REUSE)
    after_high = host.sample_dit(expert, "wan", SHAPES["wan"], **low)
    fresh = host.sample_dit(patch(node_classes, host.tiny_dit("wan", seed=2, **DEEPER["wan"]), **REUSE), "wan",
                            SHAPES["wan"], **low)  # fmt: skip
    assert torch.equal(after_high, fresh)


@pytest.mark.parametrize("family", FAMILIES)
def test_reusing_calls_add_the_span_residual_to_its_input_exactly(node_classes, dits, family):
    """Where the span's blocks change nothing (another node's replacement passes them over), its residual is
    zero, and a reusing call must give exactly what every block computing gives: the picture bit for bit. This
    checks the streams passed on, joined and split (Flux: text and image joined for the single blocks)."""
    foreign = dits[family].clone()
    for block_type, index in SPAN[family]:
        foreign.set_model_patch_replace(passing_on, "dit", block_type, index)
    expected = host.sample_dit(foreign, family, SHAPES[family], steps=STEPS)
    patched = patch(node_classes, foreign, **REUSE)
    with BlockCalls(patched, family) as counts:
        out = host.sample_dit(patched, family, SHAPES[family], steps=STEPS)
    assert counts[next(iter(counts))] > 0
    assert torch.equal(out, expected)


@pytest.mark.parametrize("family", ("flux", "wan"))
def test_a_compact_slope_changes_the_prediction_by_its_rounding_only(node_classes, dits, family, monkeypatch):
    """Large caches keep the line's slope in 4 bits (``COMPACT_SLOPE_BYTES``), forced here on the tiny models in
    every loaded copy of the engine: where the span changes nothing the picture stays bit for bit, and where it
    changes something reuse still reuses and the output stays close to the whole-record one."""
    engines = [m for name, m in sys.modules.items() if name.endswith("tome_core.reuse.cache")]
    whole = host.sample_dit(patch(node_classes, dits[family], **REUSE), family, SHAPES[family], steps=STEPS)
    foreign = dits[family].clone()
    for block_type, index in SPAN[family]:
        foreign.set_model_patch_replace(passing_on, "dit", block_type, index)
    expected = host.sample_dit(foreign, family, SHAPES[family], steps=STEPS)
    for engine in engines:
        monkeypatch.setattr(engine, "COMPACT_SLOPE_BYTES", 0)
    assert torch.equal(host.sample_dit(patch(node_classes, foreign, **REUSE), family, SHAPES[family], steps=STEPS),
                       expected)  # fmt: skip
    compact = host.sample_dit(patch(node_classes, dits[family], **REUSE), family, SHAPES[family], steps=STEPS)
    assert not torch.equal(compact, whole)  # the rounding is there
    # The rounding moves a reusing call's residual by a fourteenth of a token's largest change at most, times how
    # far along the line it goes: over the run 0.2% (Flux) and 0.4% (Wan) of the output here (bound: 2%).
    assert (compact - whole).norm() / whole.norm() < 0.02


@pytest.mark.parametrize("family", ("flux", "wan"))
def test_reuse_changes_the_output_and_off_or_removed_is_bit_identical(node_classes, dits, family):
    model = dits[family]
    unpatched = host.sample_dit(model, family, SHAPES[family], steps=STEPS)
    patched = patch(node_classes, model, **REUSE)
    reused = host.sample_dit(patched, family, SHAPES[family], steps=STEPS)
    assert not torch.equal(reused, unpatched)
    off = patch(node_classes, model, reuse_interval=1, downsample_factor=1.0)
    assert torch.equal(host.sample_dit(off, family, SHAPES[family], steps=STEPS), unpatched)
    again = patch(node_classes, patched, reuse_interval=1, downsample_factor=2.0)  # the earlier patch goes
    replaced = again.model_options["transformer_options"].get("patches_replace", {}).get("dit", {})
    assert not any(isinstance(value, dit_reuse.SpanBlock) for value in replaced.values())
    assert torch.equal(host.sample_dit(model, family, SHAPES[family], steps=STEPS), unpatched)  # input untouched


def test_few_steps_reuse_nothing(node_classes, dits):
    """Under 10 steps (distilled models, Lightning LoRAs) the default reuses nothing: ToDo alone, bit for bit."""
    model = dits["flux"]
    todo = host.sample_dit(patch(node_classes, model, reuse_interval=1), "flux", SHAPES["flux"], steps=8)
    both = host.sample_dit(patch(node_classes, model, reuse_interval=3), "flux", SHAPES["flux"], steps=8)
    assert torch.equal(both, todo)


def test_another_nodes_replacement_set_after_ours_makes_every_call_full(node_classes, dits, caplog):
    family = "flux"
    patched = patch(node_classes, dits[family], **REUSE)
    expected = host.sample_dit(patch(node_classes, dits[family], reuse_interval=1, downsample_factor=1.0), family,
                               SHAPES[family], steps=STEPS)  # fmt: skip
    later = patched.clone()

    def computing(args, extra):
        return extra["original_block"](args)

    later.set_model_patch_replace(computing, "dit", *SPAN[family][1])
    with caplog.at_level(logging.WARNING, logger="tome_patch"), BlockCalls(later, family) as counts:
        out = host.sample_dit(later, family, SHAPES[family], steps=STEPS)
    assert len(set(counts.values())) == 1  # every block at every call
    assert torch.equal(out, expected)
    assert "another node replaces one of the DiT's inner blocks" in caplog.text


def test_a_replacement_set_before_ours_runs_on_full_calls_and_comes_back(node_classes, dits):
    family = "wan"
    runs = []

    def computing(args, extra):
        runs.append(1)
        return extra["original_block"](args)

    foreign = dits[family].clone()
    foreign.set_model_patch_replace(computing, "dit", *SPAN[family][0])
    patched = patch(node_classes, foreign, **REUSE)
    host.sample_dit(patched, family, SHAPES[family], steps=STEPS)
    assert 0 < len(runs) < STEPS * 2
    off = patch(node_classes, patched, reuse_interval=1)
    assert off.model_options["transformer_options"]["patches_replace"]["dit"][SPAN[family][0]] is computing


def test_runs_back_to_back_and_after_an_interrupted_one_start_afresh(node_classes, dits):
    """A run of another size and step count, and a run after one that failed half way, compute exactly what
    they compute on a freshly patched model: nothing of the earlier run is reused."""
    family = "flux"
    shape_b = (1, 7, 11)
    fresh = host.sample_dit(patch(node_classes, dits[family], **REUSE), family, shape_b, steps=15)

    patched = patch(node_classes, dits[family], **REUSE)
    host.sample_dit(patched, family, SHAPES[family], steps=STEPS)
    assert torch.equal(host.sample_dit(patched, family, shape_b, steps=15), fresh)

    calls = []

    def failing(args, extra):  # on the first block, outside the span: fails at the 8th call
        calls.append(1)
        if len(calls) == 8:
            raise RuntimeError("interrupted")
        return extra["original_block"](args)

    failing_model = dits[family].clone()
    failing_model.set_model_patch_replace(failing, "dit", "double_block", 0)
    patched = patch(node_classes, failing_model, **REUSE)
    with pytest.raises(RuntimeError, match="interrupted"):
        host.sample_dit(patched, family, SHAPES[family], steps=STEPS)
    assert torch.equal(host.sample_dit(patched, family, shape_b, steps=15), fresh)


def test_a_controlnet_call_computes_every_block():
    """ControlNet adds to the streams between blocks, which a skipped span would count twice: such a call runs
    without the run, so every block computes."""
    hooks = dit_reuse.DitReuseHooks(IntervalSchedule(3), SPAN["flux"], ("txt", "img"), None, extrapolate=1.0)
    seen = []

    def executor(*args, **kwargs):
        seen.append(hooks.layer_run())
        return torch.zeros(1)

    run = hooks.new_run(STEPS)
    options = {RUN_KEY: RunState(run, torch.linspace(1, 0, STEPS + 1))}
    hooks.apply_model_wrapper(executor, torch.zeros(1, 16, 4, 4), torch.tensor([0.5]), control={"input": []},
                              transformer_options=options)  # fmt: skip
    assert seen == [None] and run.calls == 0


def test_kontext_reference_latents_reuse(node_classes, dits):
    family = "flux"
    reference = torch.randn(1, 16, 6, 5, generator=torch.Generator().manual_seed(5))
    patched = patch(node_classes, dits[family], **REUSE)
    with BlockCalls(patched, family) as counts:
        out = host.sample_dit(patched, family, SHAPES[family], steps=STEPS, reference_latents=[reference])
    assert torch.isfinite(out).all()
    assert counts[SPAN[family][0]] < counts[("double_block", 0)]


def test_the_log_says_what_was_computed(node_classes, dits, caplog):
    patched = patch(node_classes, dits["wan"], **REUSE)
    with caplog.at_level(logging.INFO, logger="tome_patch"):
        host.sample_dit(patched, "wan", SHAPES["wan"], steps=STEPS)
    assert "ran only the first block" in caplog.text


REFUSED = {family.classes("comfyui")[0]: family.no_reuse for family in dit_families.FAMILIES if family.no_reuse}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_variants_that_add_between_blocks_are_not_reused(name):
    """VACE adds hints between blocks, which a skipped span would count twice; S2V, HuMo and Animate add inputs of
    their own between blocks; HiDream and Cosmos 1.0 have no block hook: no span there (Wan's variants still get
    ToDo where their tokens are Wan's), and the log has the reason, from the model's record (``no_reuse``). Each
    derives from a class the registry knows, or has blocks of the names it would look for."""
    wan = type("WanModel", (torch.nn.Module,), {"blocks": [1, 2, 3, 4]})
    assert dit_reuse.block_keys(wan()) is not None
    variant = type(name, (wan,), {})()
    assert dit_reuse.block_keys(variant) is None and dit_reuse.layout_of(variant) is None
    assert dit_reuse.known_without_reuse(variant) and dit_reuse.why_not(variant) == REFUSED[name]


def test_compiled_model_samples_the_same(node_classes, dits):
    """torch.compile (ComfyUI's wrapper, eager backend) through the block replacements: the same picture."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    patched = patch(node_classes, dits["sd3"], **REUSE)
    expected = host.sample_dit(patched, "sd3", SHAPES["sd3"], steps=STEPS)
    compiled = patched.clone()
    set_torch_compile_wrapper(compiled, backend="eager")
    torch._dynamo.reset()
    try:
        out = host.sample_dit(compiled, "sd3", SHAPES["sd3"], steps=STEPS)
    finally:
        torch._dynamo.reset()
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family, extrapolate", [("flux", 1.0), ("chroma", 1.0), ("sd3", 0.5), ("wan", 0.5)])
def test_flux_predicts_a_whole_step_along_the_line_and_the_others_half_of_one(
    node_classes, dits, family, extrapolate, monkeypatch
):
    """``dit_families``: the extrapolation: measured per family on the references (docs/dit.md)."""
    runs = []
    for engine in [m for name, m in sys.modules.items() if name.endswith("tome_core.reuse")]:

        def record(self, *args, _made=engine.LayerReuseRun.__init__, **kwargs):
            _made(self, *args, **kwargs)
            runs.append(self)

        monkeypatch.setattr(engine.LayerReuseRun, "__init__", record)
    host.sample_dit(patch(node_classes, dits[family], **REUSE), family, SHAPES[family], steps=STEPS)
    assert runs and {run.extrapolate for run in runs} == {extrapolate}
