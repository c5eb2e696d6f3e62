"""``tome_core.apply_patch`` / ``remove_patch`` on real diffusers pipelines, assembled offline (diffusers_host).

Every pipeline runs end to end: tokenizer, CLIP text encoder(s), CFG sampling with a real scheduler, VAE decoding.
The latents are 16x16, below the sizes where ``skip_when_slower`` lets a level be reduced, so the tests force the
reduction with ``skip_when_slower=False`` (one test checks that the default leaves such small images alone).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hosts import diffusers_host as H

import tome_core
from tome_core import PatchSettings, Reducer
from tome_core.hosts.diffusers import step_range, unet_patch

# The token reduction alone, at every size (reuse across steps, on by default, has its own tests).
FORCE = {"skip_when_slower": False, "reuse_interval": 1}
KINDS = ("txt2img", "img2img", "inpaint", "controlnet", "sdxl")


@pytest.fixture(scope="module")
def pipes():
    return {}


def pipeline(pipes, kind):
    return H.cached_pipeline(pipes, kind)


def unet_inputs(unet, size=16, batch=2, seed=3):
    """Latent, timestep and text states for a direct UNet call (plus SDXL's added conditioning)."""
    generator = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, unet.config.in_channels, size, size, generator=generator)
    states = torch.randn(batch, 7, unet.config.cross_attention_dim, generator=generator)
    kwargs = {"encoder_hidden_states": states}
    if unet.config.addition_embed_type == "text_time":
        kwargs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(batch, H.TEXT_DIM, generator=generator),
            "time_ids": torch.tensor([[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]]).repeat(batch, 1),
        }
    return sample, kwargs


def call(unet, sample, kwargs, timestep=500.0):
    with torch.no_grad():
        return unet(sample, torch.tensor(timestep), **kwargs).sample


def module_snapshot(unet):
    """Everything a patch could leave behind: each module's class, attributes and hooks."""
    return [
        (name, type(m), sorted(m.__dict__), len(m._forward_pre_hooks), len(m._forward_hooks))
        for name, m in unet.named_modules()
    ]


# --- the documented usage on every kind of pipeline --------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_pipeline_is_reduced_and_restored_exactly(pipes, kind):
    pipe = pipeline(pipes, kind)
    plain = H.run(pipe, kind)
    assert tome_core.apply_patch(pipe, method="tome", ratio=0.5, **FORCE) is pipe
    tome = H.run(pipe, kind)
    tome_core.apply_patch(pipe, method="todo", downsample_factor=2, **FORCE)
    todo = H.run(pipe, kind)
    assert tome_core.remove_patch(pipe) is pipe
    again = H.run(pipe, kind)
    assert np.array_equal(again, plain)  # removal: bit-identical to never patched
    for reduced in (tome, todo):
        assert np.isfinite(reduced).all() and reduced.shape == plain.shape
        assert not np.array_equal(reduced, plain)


def test_a_ratio_without_a_method_is_tome_as_in_tomesd():
    """tomesd's ``apply_patch(pipe, ratio=0.5)`` keeps its meaning; with neither ratio nor method: ToDo factor 2."""
    unet = H.sd1_unet()
    sample, kwargs = unet_inputs(unet)
    outputs = {}
    for name, settings in {
        "ratio only": {"ratio": 0.5},
        "tome": {"method": "tome", "ratio": 0.5},
        "nothing": {},
        "todo 2": {"method": "todo", "downsample_factor": 2.0},
    }.items():
        tome_core.apply_patch(unet, **settings, **FORCE)
        outputs[name] = call(unet, sample, kwargs)
    tome_core.remove_patch(unet)
    assert torch.equal(outputs["ratio only"], outputs["tome"])
    assert torch.equal(outputs["nothing"], outputs["todo 2"])
    assert not torch.equal(outputs["tome"], outputs["todo 2"])


def test_default_settings_leave_small_images_alone(pipes):
    """``apply_patch(pipe, ratio=0.5)`` as documented: at 256 tokens the skip_when_slower rule reduces nothing."""
    pipe = pipeline(pipes, "txt2img")
    plain = H.run(pipe, "txt2img")
    tome_core.apply_patch(pipe, method="tome", ratio=0.5)
    try:
        assert np.array_equal(H.run(pipe, "txt2img"), plain)
    finally:
        tome_core.remove_patch(pipe)


def test_levels_follow_the_layout():
    """Automatic levels: the finest with attention, so SDXL (none at level 1) is reduced at level 2."""
    sd1, sdxl = H.sd1_unet(), H.sdxl_unet()
    assert unet_patch.attention_levels(sd1) == (1, 2)
    assert unet_patch.attention_levels(sdxl) == (2, 4)
    seen = []
    original = Reducer.start_block

    def spy(self, x, latent_hw, block_key=None, metric=None):
        reduction = original(self, x, latent_hw, block_key, metric)
        seen.append((block_key, x.shape[1], reduction is not None))
        return reduction

    for unet, reduced_tokens in ((sd1, 256), (sdxl, 64)):
        seen.clear()
        sample, kwargs = unet_inputs(unet)
        tome_core.apply_patch(unet, method="tome", ratio=0.5, **FORCE)
        Reducer.start_block = spy
        try:
            call(unet, sample, kwargs)
        finally:
            Reducer.start_block = original
            tome_core.remove_patch(unet)
        assert {tokens for _, tokens, reduced in seen if reduced} == {reduced_tokens}
        assert len(seen) == len(unet_patch.transformer_blocks(unet))


# --- settings and models that are refused ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        {"ratio": 0.9},
        {"ratio": "0.5"},
        {"method": "fast"},
        {"max_downsample": 3},
        {"start_percent": 0.8, "end_percent": 0.2},
        {"sx": 1, "sy": 1},
        {"not_a_setting": 1},
    ],
)
def test_bad_settings_raise_the_engine_message_and_change_nothing(values):
    unet = H.sd1_unet()
    before = module_snapshot(unet)
    with pytest.raises(ValueError) as from_engine:
        PatchSettings.from_values(**values)
    with pytest.raises(ValueError) as from_patch:
        tome_core.apply_patch(unet, **values)
    assert str(from_patch.value) == str(from_engine.value)
    assert module_snapshot(unet) == before


def test_models_it_cannot_patch_are_refused_by_name():
    """Flux, SD3 and Wan are patched (tests/test_diffusers_dit.py); other transformers and UNets are not."""
    from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel, UNet2DConditionModel, UNet2DModel

    dit = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1, sample_size=8, patch_size=2
    )
    dit_pipe = DiTPipeline(transformer=dit, vae=None, scheduler=DDIMScheduler())
    no_attention = UNet2DConditionModel(
        block_out_channels=(32, 32),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        mid_block_type=None,
        layers_per_block=1,
        cross_attention_dim=16,
        norm_num_groups=8,
    )
    unconditional = UNet2DModel(
        block_out_channels=(32, 32),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
    )
    cases = [
        (dit_pipe, "DiTPipeline (its denoiser is DiTTransformer2DModel)"),
        (dit, "DiTTransformer2DModel"),
        (unconditional, "UNet2DModel"),
        (no_attention, "has no transformer blocks"),
        (object(), "got object"),
    ]
    for model, named in cases:
        before = module_snapshot(model) if isinstance(model, torch.nn.Module) else None
        with pytest.raises(TypeError) as refused:
            tome_core.apply_patch(model, method="tome", ratio=0.5)
        assert named in str(refused.value)
        assert "UNet2DConditionModel" in str(refused.value)  # names what is supported
        assert "FluxTransformer2DModel" in str(refused.value) and "WanTransformer3DModel" in str(refused.value)
        if before is not None:
            assert module_snapshot(model) == before
        assert tome_core.remove_patch(model) is model  # removing from anything is harmless


def test_tomesd_on_the_unet_is_a_conflict(pipes):
    import tomesd

    pipe = pipeline(pipes, "txt2img")
    tomesd.apply_patch(pipe, ratio=0.5)
    try:
        before = module_snapshot(pipe.unet)
        with pytest.raises(ValueError, match="tomesd.remove_patch"):
            tome_core.apply_patch(pipe, method="tome", ratio=0.5)
        assert module_snapshot(pipe.unet) == before
    finally:
        tomesd.remove_patch(pipe)


def test_tomesd_on_top_of_ours_unwinds_in_either_order():
    """tomesd wraps whatever class a block has: its removal and ours must both restore the original class."""
    import tomesd

    unet = H.sd1_unet()
    original = module_snapshot(unet)
    sample, kwargs = unet_inputs(unet)
    plain = call(unet, sample, kwargs)
    tome_core.apply_patch(unet, method="tome", ratio=0.5, **FORCE)
    tomesd.apply_patch(unet, ratio=0.5)
    tome_core.remove_patch(unet)  # ours first: tomesd's record of the class it replaced now skips ours
    tomesd.remove_patch(unet)
    assert [entry[1] for entry in module_snapshot(unet)] == [entry[1] for entry in original]
    assert torch.equal(call(unet, sample, kwargs), plain)


# --- removal, re-patching, randomness, step range -----------------------------------------------------------------


@pytest.mark.parametrize("make", [H.sd1_unet, H.sdxl_unet])
def test_patching_twice_equals_once_and_removal_leaves_nothing(make):
    unet = make()
    before = module_snapshot(unet)
    sample, kwargs = unet_inputs(unet)
    plain = call(unet, sample, kwargs)
    tome_core.apply_patch(unet, method="todo", **FORCE)
    tome_core.apply_patch(unet, method="tome", ratio=0.4, merge_crossattn=True, **FORCE)
    twice = call(unet, sample, kwargs)
    for _, block in unet_patch.transformer_blocks(unet):
        assert [c.__name__ for c in type(block).__mro__].count("TomePatchDiffusersBlock") == 1
    assert len(unet._forward_pre_hooks) == 1
    tome_core.remove_patch(unet)
    assert module_snapshot(unet) == before
    assert torch.equal(call(unet, sample, kwargs), plain)
    tome_core.apply_patch(unet, method="tome", ratio=0.4, merge_crossattn=True, **FORCE)
    assert torch.equal(call(unet, sample, kwargs), twice)
    tome_core.remove_patch(unet)
    tome_core.remove_patch(unet)  # twice is harmless
    assert module_snapshot(unet) == before


def test_settings_that_change_nothing_install_nothing():
    unet = H.sd1_unet()
    before = module_snapshot(unet)
    for values in (
        {"method": "tome", "ratio": 0.0},
        {"method": "todo", "downsample_factor": 1.0},
        {"start_percent": 0.5, "end_percent": 0.5},
    ):
        tome_core.apply_patch(unet, **values, **FORCE)
        assert module_snapshot(unet) == before


def test_random_destinations_are_seeded_and_never_touch_the_global_rng(pipes):
    pipe = pipeline(pipes, "txt2img")
    runs = {}
    for seed in (7, 7, 8):
        tome_core.apply_patch(pipe, method="tome", ratio=0.5, use_rand=True, seed=seed, **FORCE)
        state = torch.random.get_rng_state()
        sample, kwargs = unet_inputs(pipe.unet)
        call(pipe.unet, sample, kwargs)
        assert torch.equal(torch.random.get_rng_state(), state)
        runs.setdefault(seed, []).append(H.run(pipe, "txt2img"))
    tome_core.remove_patch(pipe)
    assert np.array_equal(runs[7][0], runs[7][1])
    assert not np.array_equal(runs[7][0], runs[8][0])


def _reduced_timesteps(pipe, kind, **settings):
    """(timestep, reduced?) of each UNet call of one generation."""
    calls = []
    original = Reducer.start_block

    def record_call(module, args, kwargs):
        calls.append([float(args[1] if len(args) > 1 else kwargs["timestep"]), False])

    def spy(self, *args, **kwargs):
        calls[-1][1] = True
        return original(self, *args, **kwargs)

    tome_core.apply_patch(pipe, method="tome", ratio=0.5, **FORCE, **settings)
    handle = pipe.unet.register_forward_pre_hook(record_call, with_kwargs=True)
    Reducer.start_block = spy
    try:
        H.run(pipe, kind, steps=10)
    finally:
        Reducer.start_block = original
        handle.remove()
        tome_core.remove_patch(pipe)
    return calls


def test_step_range_follows_the_pipelines_scheduler(pipes):
    """DDPM-trained models: percent p is the training timestep (1 - p) * 999, what DDIM/Euler pass to the UNet."""
    pipe = pipeline(pipes, "txt2img")
    calls = _reduced_timesteps(pipe, "txt2img", start_percent=0.3, end_percent=0.6)
    assert len(calls) == 10
    assert all(reduced == (399.6 < t <= 699.3) for t, reduced in calls), calls
    assert {reduced for _, reduced in calls} == {True, False}
    sdxl = pipeline(pipes, "sdxl")  # Euler: fractional timesteps
    calls = _reduced_timesteps(sdxl, "sdxl", end_percent=0.5)
    assert all(reduced == (t > 499.5) for t, reduced in calls) and {r for _, r in calls} == {True, False}


def test_step_range_of_edm_schedulers_is_sigma_based():
    """EDM-style schedulers give the UNet precondition_noise(sigma); percent p is the log-interpolated sigma."""
    from diffusers import EDMEulerScheduler

    scheduler = EDMEulerScheduler(sigma_min=0.002, sigma_max=80.0)
    to_timestep = step_range.percent_to_unet_timestep(scheduler)
    middle = (0.002 * 80.0) ** 0.5
    assert to_timestep(0.5) == pytest.approx(float(scheduler.precondition_noise(torch.tensor(middle))), abs=1e-6)
    assert to_timestep(0.2) > to_timestep(0.5) > to_timestep(0.8)  # noisier earlier
    ddim = step_range.percent_to_unet_timestep(H.ddim())
    assert ddim(0.25) == pytest.approx(749.25)


def test_a_scheduler_swapped_after_patching_is_followed(pipes):
    from diffusers import EDMEulerScheduler

    pipe = pipeline(pipes, "txt2img")
    original = pipe.scheduler
    tome_core.apply_patch(pipe, method="tome", ratio=0.5, end_percent=0.5, **FORCE)
    try:
        step_range = pipe.unet.__dict__[unet_patch._STATE].step_range
        assert step_range.contains(600.0) and not step_range.contains(400.0)
        pipe.scheduler = EDMEulerScheduler()
        threshold = float(pipe.scheduler.precondition_noise(torch.tensor((0.002 * 80.0) ** 0.5)))
        assert step_range.contains(threshold + 0.01) and not step_range.contains(threshold - 0.01)
    finally:
        pipe.scheduler = original
        tome_core.remove_patch(pipe)


# --- attention processors, chunked feed-forward, compile ----------------------------------------------------------


def _processors():
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0, SlicedAttnProcessor

    found = {"sdpa": AttnProcessor2_0(), "classic": AttnProcessor(), "sliced": SlicedAttnProcessor(slice_size=3)}
    try:
        import xformers  # noqa: F401
        from diffusers.models.attention_processor import XFormersAttnProcessor

        found["xformers"] = XFormersAttnProcessor()
    except ImportError:
        pass  # not installed on CPU-only machines; the same reduced inputs would reach it
    return found


@pytest.mark.parametrize("settings", [{"ratio": 0.5, "merge_crossattn": True}, {"method": "todo"}])
def test_every_attention_processor_computes_the_same_reduction(settings):
    """The patch changes what attn1/attn2 are given, not how they attend: every processor computes the same.

    SDPA, the classic baddbmm-softmax processor and attention slicing differ only in float summation order
    (a few fp32 ulp); the bound 1e-5 of the output's scale is 1000x below what the patch itself changes.
    """
    unet = H.sd1_unet()
    sample, kwargs = unet_inputs(unet)
    outputs = {}
    for name, processor in _processors().items():
        unet.set_attn_processor(processor)
        plain = call(unet, sample, kwargs)
        tome_core.apply_patch(unet, **settings, **FORCE)
        outputs[name] = call(unet, sample, kwargs)
        tome_core.remove_patch(unet)
        assert torch.equal(call(unet, sample, kwargs), plain)
        scale = plain.abs().max()
        assert (outputs[name] - plain).abs().max() > 1e-2 * scale
    for name, out in outputs.items():
        torch.testing.assert_close(out, outputs["sdpa"], rtol=0, atol=1e-5 * float(out.abs().max()), msg=name)


def _load_random_ip_adapter(unet, image_dim=16, seed=40):
    """An IP-Adapter as diffusers loads one (``_load_ip_adapter_weights``), with random weights: image projection
    to 4 tokens plus to_k_ip / to_v_ip for every cross-attention, numbered 1, 3, 5, ... as in the weight files."""
    generator = torch.Generator().manual_seed(seed)
    cross = unet.config.cross_attention_dim
    adapter = {}
    key = 1
    for name in unet.attn_processors:
        if name.endswith("attn2.processor"):
            if name.startswith("mid_block"):
                hidden = unet.config.block_out_channels[-1]
            elif name.startswith("up_blocks"):
                hidden = list(reversed(unet.config.block_out_channels))[int(name.split(".")[1])]
            else:
                hidden = unet.config.block_out_channels[int(name.split(".")[1])]
            for part in ("to_k_ip", "to_v_ip"):
                adapter[f"{key}.{part}.weight"] = torch.randn(hidden, cross, generator=generator) / cross**0.5
            key += 2
    projection = {
        "proj.weight": torch.randn(4 * cross, image_dim, generator=generator) / image_dim**0.5,
        "proj.bias": torch.zeros(4 * cross),
        "norm.weight": torch.ones(cross),
        "norm.bias": torch.zeros(cross),
    }
    unet._load_ip_adapter_weights([{"image_proj": projection, "ip_adapter": adapter}], low_cpu_mem_usage=False)


def test_ip_adapter_processors_with_and_without_masks():
    from diffusers.image_processor import IPAdapterMaskProcessor
    from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0

    pipe = H.make_pipeline("txt2img")
    _load_random_ip_adapter(pipe.unet)
    assert any(isinstance(p, IPAdapterAttnProcessor2_0) for p in pipe.unet.attn_processors.values())
    embeds = [torch.randn(2, 1, 16, generator=torch.Generator().manual_seed(4))]  # negative, positive
    mask = torch.zeros(1, 1, H.IMAGE_PX, H.IMAGE_PX)
    mask[..., :, : H.IMAGE_PX // 2] = 1.0
    masks = IPAdapterMaskProcessor().preprocess(mask, height=H.IMAGE_PX, width=H.IMAGE_PX)
    masked = {"ip_adapter_masks": [masks.reshape(1, 1, H.IMAGE_PX, H.IMAGE_PX)]}
    for extra in ({}, {"cross_attention_kwargs": masked}):
        plain = H.run(pipe, "txt2img", ip_adapter_image_embeds=embeds, **extra)
        tome_core.apply_patch(pipe, method="tome", ratio=0.5, merge_crossattn=True, **FORCE)
        merged = H.run(pipe, "txt2img", ip_adapter_image_embeds=embeds, **extra)
        tome_core.apply_patch(pipe, method="tome", ratio=0.5, **FORCE)
        self_only = H.run(pipe, "txt2img", ip_adapter_image_embeds=embeds, **extra)
        tome_core.remove_patch(pipe)
        assert np.array_equal(H.run(pipe, "txt2img", ip_adapter_image_embeds=embeds, **extra), plain)
        assert np.isfinite(merged).all() and not np.array_equal(merged, plain)
        # With masks (resized to the query count as an image grid) cross-attention queries are never merged.
        assert np.array_equal(merged, self_only) == bool(extra)


def test_chunked_feed_forward_with_merged_mlp():
    """``set_chunk_feed_forward`` (what a pipeline's ``enable_forward_chunking`` calls on every transformer block)
    splits the MLP's tokens; merged token counts need not divide the chunk."""
    unet = H.sd1_unet()
    sample, kwargs = unet_inputs(unet)
    # 256 -> 180 tokens, not a multiple of 8
    tome_core.apply_patch(unet, method="tome", ratio=0.3, merge_mlp=True, **FORCE)
    whole = call(unet, sample, kwargs)
    for _, block in unet_patch.transformer_blocks(unet):
        block.set_chunk_feed_forward(chunk_size=8, dim=1)
    chunked = call(unet, sample, kwargs)
    tome_core.remove_patch(unet)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-5 * float(whole.abs().max()))


@pytest.mark.parametrize("step_range", [False, True])
def test_patched_unet_compiles(step_range):
    """Without a step range the patched UNet traces as one graph; with one, the step decision reads the timestep
    once per UNet call (its single graph break, before any block). One trace, with Dynamo's own count of graph
    breaks; the "eager" backend runs its graphs without inductor's long compile, bit-identical to eager mode."""
    from torch._dynamo.utils import counters

    unet = H.sdxl_unet()
    sample, kwargs = unet_inputs(unet)
    settings = {"method": "tome", "ratio": 0.5, "use_rand": True, "merge_crossattn": True, "merge_mlp": True, **FORCE}
    if step_range:
        settings["end_percent"] = 0.7
    tome_core.apply_patch(unet, **settings)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            eager = call(unet, sample, kwargs)
            counters.clear()
            compiled = torch.compile(unet, backend="eager")
            assert torch.equal(compiled(sample, torch.tensor(500.0), **kwargs).sample, eager)
            breaks = counters["graph_break"]
            assert sum(breaks.values()) == int(step_range), dict(breaks)
    finally:
        torch._dynamo.reset()
        tome_core.remove_patch(unet)


def test_compiled_unet_follows_patch_changes():
    """A UNet compiled before, while or after patching: Dynamo guards the block classes, so every change of the
    patch (apply, re-apply with other settings, remove) recompiles instead of running a stale graph."""
    unet = H.sd1_unet()
    sample, kwargs = unet_inputs(unet)
    expected = {"plain": call(unet, sample, kwargs)}
    for name, settings in (("tome", {"ratio": 0.5}), ("todo", {"method": "todo"})):
        tome_core.apply_patch(unet, **settings, **FORCE)
        expected[name] = call(unet, sample, kwargs)
    tome_core.remove_patch(unet)
    torch._dynamo.reset()
    compiled = torch.compile(unet, backend="eager")
    try:
        assert torch.equal(call(compiled, sample, kwargs), expected["plain"])
        for name in ("tome", "todo", "todo", "plain", "tome"):
            if name == "plain":
                tome_core.remove_patch(compiled)
            else:
                settings = {"ratio": 0.5} if name == "tome" else {"method": "todo"}
                tome_core.apply_patch(compiled, **settings, **FORCE)  # the compiled wrapper is accepted too
            assert torch.equal(call(compiled, sample, kwargs), expected[name]), name
    finally:
        tome_core.remove_patch(unet)
        torch._dynamo.reset()
