"""The nodes on DiTs inside a real ComfyUI 0.3.75: Flux, Chroma, SD3.5 and Wan 2.1 of ComfyUI's own classes
(small, random weights), sampled through its KSampler at odd sizes."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

from tome_core.hosts.comfyui import dit as comfy_dit
from tome_core.joint_attention import ImageTokens
from tome_core.settings import PatchSettings

FAMILIES = ("flux", "chroma", "sd3", "wan")
# Odd sizes: latents that do not divide by the patch size, and (Wan) an odd frame count; batch 2.
SHAPES = {"flux": (2, 9, 13), "chroma": (2, 7, 9), "sd3": (2, 11, 7), "wan": (2, 3, 9, 11)}


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def dits():
    return {family: host.tiny_dit(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def unpatched(dits):
    return {family: host.sample_dit(dits[family], family, SHAPES[family]) for family in FAMILIES}


def patch(node_classes, model, **values):
    # The tiny grids are far below the skip_when_slower threshold: force the reduction unless a test says not.
    values.setdefault("skip_when_slower", False)
    values.setdefault("dit_settings", "as set")  # the inputs as set: ``auto`` has tests of its own
    return host.patch_with_node(node_classes, model, **values)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_clone_samples_the_right_shape_and_changes_the_output(node_classes, dits, unpatched, family):
    patched = patch(node_classes, dits[family])
    assert patched is not dits[family]
    out = host.sample_dit(patched, family, SHAPES[family])
    assert out.shape == unpatched[family].shape
    assert torch.isfinite(out).all()
    assert not torch.equal(out, unpatched[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_off_is_bit_identical(node_classes, dits, unpatched, family):
    shape = SHAPES[family]
    for values in (
        {"downsample_factor": 1.0},
        {"start_percent": 0.5, "end_percent": 0.5},
        {"skip_when_slower": True},  # the tiny grids are below the threshold: never reduced
    ):
        out = host.sample_dit(patch(node_classes, dits[family], **values), family, shape)
        assert torch.equal(out, unpatched[family]), values


def test_input_model_is_never_changed(node_classes, dits, unpatched):
    model = dits["flux"]
    before = (copy.deepcopy(model.model_options), copy.deepcopy(model.wrappers))
    patched = patch(node_classes, model)
    host.sample_dit(patched, "flux", SHAPES["flux"])
    assert (model.model_options, model.wrappers) == before
    # Sampling the input model after the patched clone ran: nothing of the patch is left behind.
    assert torch.equal(host.sample_dit(model, "flux", SHAPES["flux"]), unpatched["flux"])


def test_step_range_reduces_only_part_of_the_steps(node_classes, dits):
    shape = SHAPES["sd3"]
    plain = host.sample_dit(dits["sd3"], "sd3", shape, steps=2)
    full = host.sample_dit(patch(node_classes, dits["sd3"]), "sd3", shape, steps=2)
    late = host.sample_dit(patch(node_classes, dits["sd3"], start_percent=0.5), "sd3", shape, steps=2)
    assert not torch.equal(late, full) and not torch.equal(late, plain)


@pytest.mark.parametrize("family", FAMILIES)
def test_only_image_keys_are_downsampled(node_classes, dits, family):
    """Every query stays; text keys stay whole; the image keys of self- and joint attention become a quarter
    (ceil per side, per frame for video); Wan's cross-attention to the text is left as it is."""
    counter = host.KeyCounter()
    patched = patch(node_classes, host.with_override(dits[family], counter))
    batch, *grid = SHAPES[family]
    host.sample_dit(patched, family, (batch, *grid), steps=1)
    frames = grid[0] if family == "wan" else 1
    h, w = -(-grid[-2] // 2), -(-grid[-1] // 2)
    image, kept = frames * h * w, frames * -(-h // 2) * -(-w // 2)
    assert counter.calls
    for queries, keys in counter.calls:
        if family == "wan" and queries != keys and keys in (9, 5):  # cross-attention: the text, untouched
            continue
        text = queries - image  # joint attention: whatever precedes the image is the text (0 for self-attention)
        assert text >= 0 and keys == text + kept, (queries, keys)


def test_reference_latents_stay_whole(node_classes, dits):
    """Flux Kontext: the reference image's tokens follow the image and keep all their keys."""
    counter = host.KeyCounter()
    patched = patch(node_classes, host.with_override(dits["flux"], counter))
    reference = torch.randn(1, 16, 6, 5, generator=torch.Generator().manual_seed(5))
    out = host.sample_dit(patched, "flux", (1, 9, 13), steps=1, reference_latents=[reference])
    assert out.shape == (1, 16, 9, 13) and torch.isfinite(out).all()
    image, kept, ref = 5 * 7, 3 * 4, 3 * 3
    assert {keys - (queries - image - ref) for queries, keys in counter.calls} == {kept + ref}


def test_another_attention_override_is_wrapped_not_replaced(node_classes, dits):
    ours = host.sample_dit(patch(node_classes, dits["sd3"]), "sd3", SHAPES["sd3"])
    counter = host.KeyCounter()
    both = host.sample_dit(patch(node_classes, host.with_override(dits["sd3"], counter)), "sd3", SHAPES["sd3"])
    assert counter.calls and any(keys < queries for queries, keys in counter.calls)  # it got our reduced keys
    assert torch.equal(both, ours)


def test_foreign_block_replacement_still_runs(node_classes, dits):
    """A block replacement of another node (``patches_replace["dit"]``, e.g. a block cache) and the patch compose."""
    runs = []

    def replacement(args, extra):
        runs.append(1)
        return extra["original_block"](args)

    for family in ("flux", "wan"):
        ours = host.sample_dit(patch(node_classes, dits[family]), family, SHAPES[family])
        foreign = dits[family].clone()
        foreign.set_model_patch_replace(replacement, "dit", "double_block", 0)
        runs.clear()
        both = host.sample_dit(patch(node_classes, foreign), family, SHAPES[family])
        assert runs and torch.equal(both, ours)


def test_weight_patch_composes(node_classes, dits, unpatched):
    """A LoRA-like weight patch (``add_patches``) applies under the patch, and factor 1 leaves only it."""
    model = dits["wan"]
    key = "diffusion_model.blocks.0.self_attn.q.weight"
    weight = model.model.diffusion_model.blocks[0].self_attn.q.weight
    lora = model.clone()
    lora.add_patches({key: (torch.full_like(weight, 0.05),)}, 1.0)
    lora_only = host.sample_dit(lora, "wan", SHAPES["wan"])
    assert not torch.equal(lora_only, unpatched["wan"])
    off = host.sample_dit(patch(node_classes, lora, downsample_factor=1.0), "wan", SHAPES["wan"])
    assert torch.equal(off, lora_only)
    both = host.sample_dit(patch(node_classes, lora), "wan", SHAPES["wan"])
    todo_only = host.sample_dit(patch(node_classes, model), "wan", SHAPES["wan"])
    assert not torch.equal(both, lora_only) and not torch.equal(both, todo_only)


def test_video_downsampling_in_time_handles_uneven_frames(dits):
    """The engine's time factor (frames halved too) on 3 frames: ceil keeps the last frame covered."""
    model = dits["wan"]
    settings = PatchSettings.from_values(method="todo", skip_when_slower=False)
    sigma = model.get_model_object("model_sampling").percent_to_sigma
    counter = host.KeyCounter()
    clone = comfy_dit.patched_clone(host.with_override(model, counter), settings, sigma, time_factor=2.0)
    out = host.sample_dit(clone, "wan", (1, 3, 9, 11), steps=1)
    assert torch.isfinite(out).all()
    assert (3 * 5 * 6, 2 * 3 * 3) in counter.calls
    with pytest.raises(ValueError, match="time_factor"):
        comfy_dit.patched_clone(model, settings, sigma, time_factor=3.0)


def test_image_tokens_find_their_place_or_nothing():
    tokens = ImageTokens((1, 3, 4), after=5)
    assert tokens.start_in(7 + 12 + 5) == 7
    assert tokens.start_in(10) is None  # fewer tokens than the image and reference: another layout
    assert ImageTokens((2, 3, 4), before=0).start_in(25) is None


def test_unsupported_dit_passes_through_unchanged(node_classes, caplog):
    dit = host.tiny_dit("hidream")
    before = copy.deepcopy(dit.model_options)
    with caplog.at_level(logging.WARNING, logger="tome_patch"):
        out = patch(node_classes, dit)
    assert out is dit and dit.model_options == before
    assert "HiDream" in caplog.text and "no block" in caplog.text and "unchanged" in caplog.text


def test_tome_on_a_dit_is_refused_with_a_message(node_classes, dits, caplog):
    model = dits["flux"]
    with caplog.at_level(logging.WARNING, logger="tome_patch"):
        out = patch(node_classes, model, method="tome")
    assert out is model
    assert "method tome is not available for Flux" in caplog.text


def test_inputs_that_do_not_apply_are_named(node_classes, dits, caplog):
    with caplog.at_level(logging.WARNING, logger="tome_patch"):
        out = patch(node_classes, dits["sd3"], max_downsample="2")
    assert out is not dits["sd3"]
    assert "max_downsample does not apply to SD3" in caplog.text


def test_bad_value_is_a_clear_error(node_classes, dits):
    with pytest.raises(ValueError, match=r"downsample_factor must be a number from 1.0 to 8.0"):
        patch(node_classes, dits["wan"], downsample_factor=9.0)


def test_compiled_model_samples_the_same(node_classes, dits):
    """torch.compile (ComfyUI's own wrapper, eager backend: the graph capture without code generation) traces
    through the attention override and computes what the uncompiled patched model computes."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    patched = patch(node_classes, dits["sd3"])
    expected = host.sample_dit(patched, "sd3", SHAPES["sd3"])
    compiled = patched.clone()
    set_torch_compile_wrapper(compiled, backend="eager")
    torch._dynamo.reset()
    try:
        out = host.sample_dit(compiled, "sd3", SHAPES["sd3"])
    finally:
        torch._dynamo.reset()
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5)
