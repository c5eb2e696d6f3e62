"""Forge Neo: the accordion on DiTs (``tome_core/hosts/webui/dit_reuse.py``), in a stand-in that follows Neo's call
order with ComfyUI's classes where Neo's are ComfyUI's (``hosts/neo_host.py``)."""

from __future__ import annotations

import sys

import pytest
import torch
from hosts import (
    comfy_host,  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)
    neo_host,
)
from hosts.webui_host import Host, script_args

from tome_core.hosts.shared.dit_block_hook import SpanBlock, replacements
from tome_core.hosts.webui import args as webui_args
from tome_core.hosts.webui import layer_reuse as webui_layer_reuse

STEPS = 28
SHAPE = (1, 9, 13)


def shipped_defaults() -> list:
    """The accordion ticked, every control at its shipped default (ToDo 2, reuse every 3)."""
    args = webui_args.as_list(webui_args.defaults())
    args[webui_args.ARG_NAMES.index("enabled")] = True
    return args


DEFAULTS = shipped_defaults()


@pytest.fixture(scope="module")
def host():
    return Host()


@pytest.fixture(scope="module")
def flux():
    return neo_host.neo_model("flux", depth=2, depth_single_blocks=2)


def neo_job(host, patcher, args, family="flux", **kwargs):
    p = neo_host.processing(patcher, args, steps=kwargs.pop("steps", STEPS), **kwargs)
    return neo_host.process_images(host, p, family, shape=SHAPE), p


def comfyui_default(node_classes, flux, steps=STEPS):
    """The same weights, seed and steps through ComfyUI's KSampler, with a fresh node (dit_settings auto)."""
    return comfy_host.sample_dit(comfy_host.patch_with_node(node_classes, flux), "flux", SHAPE, steps=steps, cfg=1.0)


def assert_clean(patcher):
    """Nothing of ours on the loaded model or its patcher, and no pass left active."""
    model = patcher.model.diffusion_model
    forward = model.__dict__.get("forward")  # unloading sets back the bound method it took (as Forge's does)
    assert forward is None or (forward.__self__ is model and forward.__func__ is type(model).forward)
    assert not any(isinstance(v, SpanBlock) for v in replacements(patcher).values())
    assert webui_layer_reuse.active_pass() is None


def test_the_stand_in_samples_as_comfyuis_ksampler(host, flux):
    """Checks the stand-in itself: unpatched, a Neo pass computes what ComfyUI's KSampler computes."""
    off, _ = neo_job(host, flux, script_args(enabled=False))
    expected = comfy_host.sample_dit(flux, "flux", SHAPE, steps=STEPS, cfg=1.0)
    torch.testing.assert_close(off, expected, rtol=1e-4, atol=1e-5)


def test_flux_reuses_with_comfyuis_plan_and_picture_then_leaves_nothing(host, flux, monkeypatch, capsys):
    """The accordion's defaults on Neo's Flux: the family's default (reuse across steps guarded by real Flux's
    curve, no ToDo), the same full steps and the same output as ComfyUI's node on the same weights (to float
    rounding: the same plan, prediction and sampler); nothing left after the job."""
    node_classes = comfy_host.load_our_package()  # ComfyUI's copy of the engine, whose runs are recorded too
    made = comfy_host.recorded_plans(monkeypatch)
    out, p = neo_job(host, flux, DEFAULTS)
    (neo_plan,) = made
    comfy_out = comfyui_default(node_classes, flux)
    assert made[1] == neo_plan  # ComfyUI's run of the same steps planned the same full steps
    (run,) = p._tome_patch_job.reuse_runs
    assert run.reused_calls == STEPS - len(neo_plan) > 0
    assert 0 in neo_plan and {1, 2, 3} & neo_plan  # real Flux's fast first steps: some run in full
    torch.testing.assert_close(out, comfy_out, rtol=1e-4, atol=1e-5)
    off, _ = neo_job(host, flux, script_args(enabled=False))
    assert not torch.equal(out, off)  # it did reuse
    said = capsys.readouterr().out
    assert "Flux (IntegratedFluxTransformer2DModel): the family's measured default" in said
    assert f"{STEPS - run.reused_calls} of {STEPS} model calls computed in full" in said
    assert_clean(flux)
    assert torch.equal(neo_job(host, flux, script_args(enabled=False))[0], off)


NEO_FAMILIES = (
    ("qwen_image", (1, 8, 8), "Qwen-Image"),
    ("wan", (1, 3, 9, 11), "Wan"),
    ("chroma", (1, 9, 13), "Flux"),
    ("cosmos_predict2", (1, 8, 8), "Cosmos Predict2"),
)


@pytest.mark.parametrize(("family", "shape", "name"), NEO_FAMILIES)
def test_every_neo_family_reuses_with_comfyuis_plan_and_picture(host, family, shape, name, monkeypatch):
    """Neo's Qwen-Image, Wan and Chroma hand their blocks to the same hook as ComfyUI's (``backend/nn/qwen.py``,
    ``wan.py``, ``chroma.py``); Anima's loop (``anima.py``, ``MiniTrainDIT``) has none and gets an object patch on
    each span block's forward. Each: the family's default, the same full steps and output as ComfyUI's node on the
    same weights (at CFG 1, one call a step; to float rounding; Qwen-Image's guard decides alike in both), nothing
    left after the job."""
    model = neo_host.neo_model(family, **comfy_host.dit_blocks(family, 4))
    node_classes = comfy_host.load_our_package()
    made = comfy_host.recorded_plans(monkeypatch)
    p = neo_host.processing(model, DEFAULTS, steps=STEPS)
    out = neo_host.process_images(host, p, family, shape=shape)
    expected = comfy_host.sample_dit(
        comfy_host.patch_with_node(node_classes, model), family, shape, steps=STEPS, cfg=1.0
    )
    assert len(made) == 2 and made[0] == made[1]
    (run,) = p._tome_patch_job.reuse_runs
    # Qwen-Image's and Wan's guards turn planned reusing calls into full ones, in Neo as in ComfyUI: on random
    # weights, whose first block's output moves as noise does, all of Qwen-Image's (tests/test_reference_v2.py: a
    # trained one reuses).
    assert run.reused_calls == STEPS - len(made[0]) - run.guarded_calls and torch.isfinite(out).all()
    assert (run.reused_calls == 0) if name == "Qwen-Image" else (run.reused_calls > 0 or name == "Wan")
    assert (run.guarded_calls > 0) == (name in ("Qwen-Image", "Wan"))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert f"{name} ({type(model.model.diffusion_model).__name__})" in host_said(p)
    assert_clean(model)


def test_wan_22s_second_expert_starts_a_run_of_its_own(host, capsys, monkeypatch):
    """Wan 2.2: Neo's refiner switch loads the low-noise expert's weights into the same model mid-pass. Its first call
    runs every block (nothing the high-noise expert recorded predicts it) and it reuses after that; the picture is
    the unpatched one wherever every block runs. Wan's first-block guards are held off: on random weights they turn
    the reusing calls, and this is about the plan."""
    for name, module in list(sys.modules.items()):  # every loaded copy of the engine
        if name.endswith("tome_core.reuse.cache"):
            monkeypatch.setattr(module.LayerReuseRun, "_span_input_moved", lambda self, entry, span_input: False)
    high = neo_host.neo_model("wan", num_layers=4)
    low = neo_host.neo_model("wan", num_layers=4, seed=1).model.diffusion_model.state_dict()
    shape, steps = (1, 3, 9, 11), 20
    model = high.model.diffusion_model
    calls = []  # per model call: whether the span's last block ran
    first = model.blocks[0].register_forward_hook(lambda *_: calls.append(False))
    last = model.blocks[-1].register_forward_hook(lambda *_: calls.__setitem__(-1, True))
    original = {name: value.clone() for name, value in model.state_dict().items()}
    try:
        sigmas = comfy_host.comfy.samplers.calculate_sigmas(high.get_model_object("model_sampling"), "normal", steps)
        switch = 9  # the refiner takes over at this step's sigma
        p = neo_host.processing(high, DEFAULTS, steps=steps, refiner=(float(sigmas[switch]), low, "wan22-low"))
        out = neo_host.process_images(host, p, "wan", shape=shape)
    finally:
        first.remove()
        last.remove()
        model.load_state_dict(original)
    assert torch.isfinite(out).all() and len(calls) == steps
    assert calls[switch] and calls[switch - 1] is False  # the switch's call ran in full where the plan reused
    assert not all(calls[switch:])  # the low-noise expert reuses after its own first steps
    assert "the refiner 'wan22-low' took over; it starts a run of its own" in capsys.readouterr().out
    assert_clean(high)


def host_said(p) -> str:
    return " ".join(p._tome_patch_job.warned)


def test_z_image_reuses_through_object_patches_of_its_layers_with_comfyuis_plan(host, monkeypatch):
    """Z-Image / Lumina 2 (``NextDiT``): Neo's loop has no block hook, so each span layer's ``forward`` is an object
    patch of the job's clone (set while Neo has it loaded): the same plan and output as ComfyUI's node, and the
    layers compute as their class again after the job."""
    lumina = neo_host.neo_model("lumina2", n_layers=4)
    node_classes = comfy_host.load_our_package()
    made = comfy_host.recorded_plans(monkeypatch)
    out, p = neo_job(host, lumina, DEFAULTS, family="lumina2")
    expected = comfy_host.sample_dit(
        comfy_host.patch_with_node(node_classes, lumina), "lumina2", SHAPE, steps=STEPS, cfg=1.0
    )
    assert len(made) == 2 and made[0] == made[1]
    (run,) = p._tome_patch_job.reuse_runs
    assert run.reused_calls == STEPS - len(made[0]) > 0
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    for layer in lumina.model.diffusion_model.layers:
        forward = layer.__dict__.get("forward")
        assert forward is None or (forward.__self__ is layer and forward.__func__ is type(layer).forward)
    assert_clean(lumina)


def test_a_lora_on_the_job_reaches_the_skipped_and_the_computed_blocks(host, flux):
    """Neo applies a LoRA as weight patches on the job's patcher (``add_patches``, applied when it is loaded), which
    our clone carries: the job equals the same job on weights changed by hand (the same plan, the LoRA in every
    full step and in the residual the reusing steps predict), and the LoRA'd model is unchanged afterwards."""
    state = flux.model.state_dict()
    generator = torch.Generator().manual_seed(9)
    keys = ("diffusion_model.double_blocks.1.img_attn.qkv.weight", "diffusion_model.single_blocks.0.linear1.weight")
    patches = {key: ("diff", (0.05 * torch.randn(state[key].shape, generator=generator),)) for key in keys}
    with_lora = flux.clone()
    assert sorted(with_lora.add_patches(patches, 1.0)) == sorted(keys)
    out, _ = neo_job(host, with_lora, DEFAULTS, steps=12)
    baked = neo_host.neo_model("flux", depth=2, depth_single_blocks=2)
    with torch.no_grad():
        for key, (_, (diff,)) in patches.items():
            baked.model.state_dict()[key].add_(diff)
    assert torch.equal(out, neo_job(host, baked, DEFAULTS, steps=12)[0])
    assert not torch.equal(out, neo_job(host, flux, DEFAULTS, steps=12)[0])
    off, _ = neo_job(host, with_lora, script_args(enabled=False), steps=12)
    assert torch.equal(off, neo_job(host, baked, script_args(enabled=False), steps=12)[0])
    assert_clean(with_lora)


def test_a_family_neo_has_no_record_for_is_generated_unchanged_with_one_line(host, capsys):
    """A DiT whose Neo class the registry does not name (here SD3's, which Neo dropped): unchanged, one line."""
    sd3 = neo_host.neo_model("sd3")
    off, _ = neo_job(host, sd3, script_args(enabled=False), steps=12, family="sd3")
    on, p = neo_job(host, sd3, DEFAULTS, steps=12, family="sd3")
    assert torch.equal(on, off) and not p._tome_patch_job.reuse_runs
    assert "is no DiT family this patch knows in Forge Neo" in capsys.readouterr().out
    assert_clean(sd3)


def test_cond_and_uncond_batched_keep_their_own_layout_and_the_same_plan(host, flux, monkeypatch):
    """At CFG 3 Neo batches cond and uncond into one call (``cond_or_uncond`` [0, 1]): a batch layout of its own in
    the cache, the same full steps as at CFG 1, each step's one call reused where the plan says."""
    made = comfy_host.recorded_plans(monkeypatch)
    _, single = neo_job(host, flux, DEFAULTS, steps=12)
    out, batched = neo_job(host, flux, DEFAULTS, steps=12, cfg=3.0)
    assert made[0] == made[1] and torch.isfinite(out).all()
    (run,) = batched._tome_patch_job.reuse_runs
    assert run.calls == 12 and run.reused_calls == 12 - len(made[1]) > 0
    assert not run.entries  # the pass's end dropped its cache
    assert_clean(flux)


def test_the_highres_pass_gets_its_own_run_on_its_own_clone(host, flux):
    """Neo rebuilds ``forge_objects`` before the highres pass: that pass gets a clone and a run of its own, and the
    infotext records the family whose default ran, once."""
    p = neo_host.processing(flux, DEFAULTS, steps=12)
    first, second = neo_host.process_images(host, p, shape=SHAPE, passes=2)
    runs = p._tome_patch_job.reuse_runs
    assert len(runs) == 2 and runs[0] is not runs[1] and all(run.reused_calls > 0 for run in runs)
    assert torch.isfinite(first).all() and torch.isfinite(second).all()
    params = p.extra_generation_params
    assert params[webui_args.KEY_DIT] == "Flux default"  # the family whose default ran
    # Pasting it back sets the controls that give the same job (the accordion ticked, reuse on).
    pasted = webui_args.ui_values_from_infotext({key: str(value) for key, value in params.items()})
    assert pasted["enabled"] and pasted["reuse_interval"] == DEFAULTS[webui_args.ARG_NAMES.index("reuse_interval")]
    assert_clean(flux)


@pytest.mark.parametrize("family", ("flux", "chroma"))
def test_lllyasviels_forge_reuses_on_flux_and_chroma_through_object_patches_of_their_blocks(host, family, monkeypatch):
    """lllyasviel's Forge: Flux's and Chroma's loops call their blocks directly (``inner_forward``), and its sampler
    gives the model no list of the pass's sigmas. Each span block's forward is an object patch of the job's clone;
    the step comes from the WebUI's callbacks and the sigmas from the pass's sampler: the same plan and output as
    ComfyUI's node on the same weights (to float rounding), nothing left after the job."""
    forge = neo_host.forge_model(family, depth=2, depth_single_blocks=2)
    node_classes = comfy_host.load_our_package()
    made = comfy_host.recorded_plans(monkeypatch)
    p = neo_host.forge_processing(forge, DEFAULTS, steps=STEPS)
    out = neo_host.process_images(host, p, family, shape=SHAPE)
    expected = comfyui_sample(node_classes, forge, family)
    assert len(made) == 2 and made[0] == made[1]
    (run,) = p._tome_patch_job.reuse_runs
    assert run.reused_calls == STEPS - len(made[0]) > 0
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert f"Flux ({type(forge.model.diffusion_model).__name__})" in host_said(p)
    for block in [*forge.model.diffusion_model.double_blocks, *forge.model.diffusion_model.single_blocks]:
        assert "forward" not in block.__dict__ or block.__dict__["forward"].__func__ is type(block).forward
    assert_clean(forge)


def comfyui_sample(node_classes, model, family):
    return comfy_host.sample_dit(comfy_host.patch_with_node(node_classes, model), family, SHAPE, steps=STEPS, cfg=1.0)


class OtherSchedule(neo_host.ForgeSampler):
    """A sampler whose ``get_sigmas`` is not the schedule the pass samples."""

    def get_sigmas(self, p, steps):
        return super().get_sigmas(p, steps) * 1.1


@pytest.mark.parametrize("sampler", ("none", "another schedule"))
def test_lllyasviels_forge_without_the_samplers_sigmas_plans_by_step(host, sampler, monkeypatch):
    """A Forge sampler that gives no sigmas (its timestep samplers), or sigmas the pass's calls do not have: the
    plan is spaced by step rather than by noise, still guarded by the family's curve; it reuses and leaves nothing
    behind."""
    from tome_core.hosts.shared import dit_families

    forge = neo_host.forge_model("flux", depth=2, depth_single_blocks=2)
    made = comfy_host.recorded_plans(monkeypatch)
    given = object() if sampler == "none" else OtherSchedule(forge)
    p = neo_host.forge_processing(forge, DEFAULTS, steps=STEPS, sampler=given)
    out = neo_host.process_images(host, p, "flux", shape=SHAPE)
    (plan,) = made
    assert plan == dit_families.family("Flux").auto_schedule().for_run(STEPS).full
    (run,) = p._tome_patch_job.reuse_runs
    assert run.reused_calls == STEPS - len(plan) > 0 and torch.isfinite(out).all()
    assert_clean(forge)


def test_the_xyz_reuse_interval_axis_turns_the_dit_default_on_and_off(flux):
    """The X/Y/Z plot's "Reuse interval" axis on a Neo DiT: a cell with 3 turns the accordion on with the family's
    default (the infotext says so), a cell with 1 is the unpatched picture."""
    host = Host(with_xyz=True)
    host.fire("before_ui")
    (reuse_axis,) = [axis for axis in host.xyz.axis_options if axis.label == "[ToMe Patch] Reuse interval"]
    off, _ = neo_job(host, flux, script_args(enabled=False), steps=12)
    cells = {}
    for value in (1, 3):
        p = neo_host.processing(flux, script_args(enabled=False), steps=12)
        reuse_axis.apply(p, value, [1, 3])
        cells[value] = neo_host.process_images(host, p, shape=SHAPE), p
    assert torch.equal(cells[1][0], off) and not cells[1][1]._tome_patch_job.reuse_runs
    assert not torch.equal(cells[3][0], off) and cells[3][1]._tome_patch_job.reuse_runs
    assert cells[3][1].extra_generation_params[webui_args.KEY_DIT] == "Flux default"
    assert_clean(flux)


def test_reuse_interval_1_and_an_unkept_sampler_run_every_block(host, flux, capsys):
    off, _ = neo_job(host, flux, script_args(enabled=False), steps=12)
    assert torch.equal(neo_job(host, flux, script_args(method="ToDo", reuse_interval=1), steps=12)[0], off)
    assert "reuse across steps is off (reuse interval 1)" in capsys.readouterr().out
    assert torch.equal(neo_job(host, flux, DEFAULTS, steps=12, sampler="Euler a")[0], off)
    assert "sampler Euler a is not one it keeps the picture with" in capsys.readouterr().out
    assert_clean(flux)


def test_a_whole_model_wrapper_such_as_spectrum_makes_every_block_run(host, flux, capsys):
    """Neo's Spectrum forecasts whole steps through ``model_function_wrapper``: where one is on the clone, every
    call runs every block (bit for bit the unpatched output through the same wrapper), with one line."""
    calls = []

    def spectrum_like(model_function, call):
        calls.append(1)
        return model_function(call["input"], call["timestep"], **call["c"])

    wrapped = flux.clone()
    wrapped.set_model_unet_function_wrapper(spectrum_like)
    off, _ = neo_job(host, wrapped, script_args(enabled=False), steps=12)
    on, p = neo_job(host, wrapped, DEFAULTS, steps=12)
    assert torch.equal(on, off) and len(calls) == 24
    assert "another whole-model wrapper (Neo's Spectrum) decides the steps" in capsys.readouterr().out
    assert not p._tome_patch_job.reuse_runs  # no call was on the schedule: no run was made
    assert_clean(wrapped)


def test_a_call_without_its_noise_level_runs_in_full(flux):
    """A call whose ``transformer_options`` carry no ``sigmas`` (a host that calls the model another way) is no step
    of the pass: it runs every block, makes no run and raises nothing."""
    from tome_core.hosts.webui import dit_reuse as webui_dit_reuse

    p = neo_host.processing(flux, DEFAULTS, steps=12)
    settings = webui_args.parse_args(DEFAULTS).settings_for_pass(False, 0)
    owner = webui_dit_reuse.install_neo(flux.clone(), settings, p, None)
    try:
        owner.step = (0, 12)  # the WebUI's callbacks announced step 0 (as in lllyasviel's Forge)
        for options in ({}, {"sampling_sigmas": torch.linspace(1, 0, 13)}):
            owner.begin_dit_call(torch.zeros(1, 16, 9, 13), options)
            assert owner.run is None and owner.layer_run() is None
    finally:
        webui_layer_reuse.end_pass()


def test_an_error_mid_sampling_leaves_nothing_for_the_next_job(host, flux, monkeypatch):
    off, _ = neo_job(host, flux, script_args(enabled=False), steps=12)
    calls = {"n": 0}
    forward = type(flux.model.diffusion_model).forward

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("interrupted")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(flux.model.diffusion_model), "forward", failing)
    with pytest.raises(RuntimeError, match="interrupted"):
        neo_job(host, flux, DEFAULTS, steps=12)
    monkeypatch.undo()
    # The next job starts clean (its before_process ends the pass the error left) and computes as before.
    assert torch.equal(neo_job(host, flux, script_args(enabled=False), steps=12)[0], off)
    assert_clean(flux)
