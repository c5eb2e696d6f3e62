"""ToDo on the DiT families added after Flux, SD3 and Wan, in real ComfyUI 0.3.75 with tiny random-weight models of
each family's own class (``hosts/comfy_host.py``): Qwen-Image, HunyuanVideo 1.5, LTX-Video, Lumina 2, Z-Image, and
Flux.2 (Flux's class). The keys and values of the image (video) tokens of self- and joint attention are reduced;
text, padding and reference tokens stay whole; every other call (cross-attention, the text and image refiners) is
left as it is. CFG 1 and one or two steps keep it quick."""

from __future__ import annotations

import copy

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

from tome_core.hosts.comfyui import dit as comfy_dit
from tome_core.hosts.shared import dit_families
from tome_core.joint_attention import SequenceDownsample
from tome_core.settings import PatchSettings

FAMILIES = ("qwen_image", "hunyuan_video15", "ltxv", "lumina2", "z_image", "flux2")
# Odd sizes where the family allows them (LTX-Video's patchifier needs whole patches; patch 1 anyway).
SHAPES = {
    "qwen_image": (1, 9, 7),
    "hunyuan_video15": (1, 3, 7, 9),
    "ltxv": (1, 3, 8, 8),
    "lumina2": (1, 9, 7),
    "z_image": (1, 9, 7),
    "flux2": (1, 9, 7),
}
WORDS = {
    "qwen_image": "Qwen-Image",
    "hunyuan_video15": "HunyuanVideo",
    "ltxv": "LTX-Video",
    "lumina2": "Lumina 2",
    "z_image": "Lumina 2",
    "flux2": "Flux",
}
# (queries, keys) of every attention call of one model evaluation, unpatched and with ToDo 2 (a quarter of the grid's
# keys, ceil per side). The prompt has 9 text tokens.
CALLS = {
    # [text 9, image 5x4 (9x7 latent, patch 2, padded up)] -> 9 + 3x2 image keys.
    "qwen_image": ({(29, 29)}, {(29, 15)}),
    # Text refiner (the 9 text tokens alone): left alone. [video 3x7x9, text 9] -> 3x4x5 video keys + 9.
    "hunyuan_video15": ({(9, 9), (198, 198)}, {(9, 9), (198, 69)}),
    # Cross-attention to the 9 text tokens: left alone. Self-attention over 3x8x8 video tokens -> 3x4x4.
    "ltxv": ({(192, 9), (192, 192)}, {(192, 9), (192, 48)}),
    # Caption refiner (9) and image refiner (5x4): left alone. [caption 9, image 20] -> 9 + 6.
    "lumina2": ({(9, 9), (20, 20), (29, 29)}, {(9, 9), (20, 20), (29, 15)}),
    # Z-Image pads the caption (9 -> 32) and the image (20 -> 32) with pad tokens: refiners (32 each) left alone;
    # [caption 32, image 20, image pad 12] -> 32 + 6 + 12.
    "z_image": ({(32, 32), (64, 64)}, {(32, 32), (64, 50)}),
    # Flux.2's text encoder output is padded to 512 tokens; [text 512, image 9x7 (patch 1)] -> 512 + 5x4.
    "flux2": ({(575, 575)}, {(575, 532)}),
}


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def dits():
    return {family: host.tiny_dit(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def unpatched(dits):
    return {family: host.sample_dit(dits[family], family, SHAPES[family], steps=2, cfg=1.0) for family in FAMILIES}


def patch(node_classes, model, **values):
    values.setdefault("skip_when_slower", False)  # the tiny grids are far below every threshold
    values.setdefault("dit_settings", "as set")
    return host.patch_with_node(node_classes, model, **values)


def sample(model, family, steps=2, **extra):
    return host.sample_dit(model, family, SHAPES[family], steps=steps, cfg=1.0, **extra)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_door_knows_the_family(dits, family):
    found = comfy_dit.token_layout_of(dits[family].model.diffusion_model)
    assert found is not None and found.family == WORDS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_only_the_image_keys_of_self_and_joint_attention_are_reduced(node_classes, dits, family):
    plain, reduced = CALLS[family]
    counter = host.KeyCounter()
    sample(host.with_override(dits[family], counter), family, steps=1)
    assert set(counter.calls) == plain
    counter = host.KeyCounter()
    sample(patch(node_classes, host.with_override(dits[family], counter)), family, steps=1)
    assert set(counter.calls) == reduced


@pytest.mark.parametrize("family", FAMILIES)
def test_output_changes_and_every_off_is_bit_identical(node_classes, dits, unpatched, family):
    """ToDo changes the output (finite); factor 1, dit_settings auto (no ToDo on DiTs; reuse needs 10 steps) and
    an empty step range leave it bit for bit; the input model is untouched; patching the patched clone again with
    factor 1 removes ToDo."""
    model = dits[family]
    before = (copy.deepcopy(model.model_options), copy.deepcopy(model.wrappers))
    patched = patch(node_classes, model)
    out = sample(patched, family)
    assert out.shape == unpatched[family].shape and torch.isfinite(out).all()
    assert not torch.equal(out, unpatched[family])
    assert (model.model_options, model.wrappers) == before
    assert torch.equal(sample(model, family), unpatched[family])
    for values in (
        {"downsample_factor": 1.0},
        {"dit_settings": "auto"},
        {"start_percent": 0.5, "end_percent": 0.5},
        {"skip_when_slower": True},  # tiny grids: below the threshold
    ):
        assert torch.equal(sample(patch(node_classes, model, **values), family), unpatched[family]), values
    removed = patch(node_classes, patched, downsample_factor=1.0)
    assert torch.equal(sample(removed, family), unpatched[family])


@pytest.mark.parametrize(
    ("family", "reference", "image", "kept", "ref", "text"),
    [
        ("qwen_image", (1, 16, 1, 6, 5), 5 * 4, 3 * 2, 3 * 3, 9),  # 5-D latents, patch 2
        ("flux2", (1, 128, 6, 5), 9 * 7, 5 * 4, 6 * 5, 512),  # patch 1, text padded to 512
    ],
)
def test_reference_latents_stay_whole(node_classes, dits, family, reference, image, kept, ref, text):
    """Qwen-Image Edit and Flux.2: the reference latent's tokens follow the image and keep all their keys."""
    counter = host.KeyCounter()
    patched = patch(node_classes, host.with_override(dits[family], counter))
    latent = torch.randn(*reference, generator=torch.Generator().manual_seed(5))
    out = sample(patched, family, steps=1, reference_latents=[latent])
    assert torch.isfinite(out).all()
    assert set(counter.calls) == {(text + image + ref, text + kept + ref)}


def test_hunyuan_video_reference_latent_and_text_mask(node_classes, dits):
    """HunyuanVideo: a reference latent's tokens (as wide as the model input) come before the video, kept whole;
    a padded text's mask (additive, over the joint sequence) is downsampled with the keys."""
    family = "hunyuan_video15"
    counter = host.KeyCounter()
    patched = patch(node_classes, host.with_override(dits[family], counter))
    reference = torch.randn(1, 65, 1, 7, 9, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(1, 9, dtype=torch.long)
    mask[:, 6:] = 0
    out = sample(patched, family, steps=1, ref_latent=reference, attention_mask=mask)
    assert torch.isfinite(out).all()
    ref, video, kept, text = 7 * 9, 3 * 7 * 9, 3 * 4 * 5, 9
    assert set(counter.calls) == {(text, text), (ref + video + text, ref + kept + text)}


def test_hunyuan_video_vision_tokens_join_the_text(dits):
    """HunyuanVideo 1.5's image-to-video vision tokens (``clip_fea``) are text for the layout: counted after the
    video, kept whole."""
    family = comfy_dit.token_layout_of(dits["hunyuan_video15"].model.diffusion_model)
    x = torch.zeros(1, 32, 3, 7, 9)
    tokens = family.image_tokens(x, {"clip_fea": torch.zeros(1, 4, 1152)}, torch.zeros(1, 9, 64))
    assert tokens.grid == (3, 7, 9) and tokens.before == 0 and tokens.after == 13
    assert tokens.start_in(189 + 13) == 0 and tokens.start_in(9) is None  # the text refiner: no place


@pytest.mark.parametrize("family", FAMILIES)
def test_a_sequence_of_another_layout_is_left_as_it_is(dits, family):
    """The override passes a call on as it is where the sequence has fewer tokens than the grid and what must follow
    it, and, where the tokens before the grid are counted exactly (all but Flux's and Qwen-Image's text of any
    length), where it is one token longer or shorter than the layout."""
    diffusion_model = dits[family].model.diffusion_model
    batch, *grid = SHAPES[family]
    channels = host.DIT_LATENT_CHANNELS[family]
    x = torch.zeros(batch, channels, *(grid if family in host.DIT_VIDEO else [1, *grid]))
    if family in ("lumina2", "z_image", "flux2"):  # 4-D latents
        x = x[:, :, 0]
    tokens = comfy_dit.token_layout_of(diffusion_model).image_tokens(x, {}, torch.zeros(1, 9, 64))
    _, reduced = CALLS[family]
    total = max(queries for queries, keys in reduced if keys < queries)
    assert tokens is not None and tokens.start_in(total) is not None
    settings = PatchSettings.from_values(method="todo", skip_when_slower=False)
    override = comfy_dit.AttentionOverride(SequenceDownsample(settings), tokens)
    lengths = [tokens.count + tokens.after - 1] + ([total - 1, total + 1] if tokens.before is not None else [])
    for n in lengths:
        q = k = v = torch.randn(1, n, 8)
        passed = override(lambda *args, **kwargs: args, q, k, v, 2)
        assert passed[1] is k and passed[2] is v


def test_qwen_image_of_several_frames_is_no_image(dits):
    family = comfy_dit.token_layout_of(dits["qwen_image"].model.diffusion_model)
    assert family.image_tokens(torch.zeros(1, 16, 2, 8, 8), {}) is None
    assert family.image_tokens(torch.zeros(1, 16, 8, 8), {}).grid == (1, 4, 4)


def test_lumina_2_reduces_from_its_measured_threshold(node_classes, dits):
    """skip_when_slower on (the default): Z-Image / Lumina 2 from 2304 image tokens (768 px) on, LTX-Video from
    4096 (slower below on a GPU), as measured; Qwen-Image and HunyuanVideo keep the engine's ToDo threshold (1024)."""
    tokens = {family.name: family.todo_min_image_tokens for family in dit_families.FAMILIES}
    assert {name: tokens[name] for name in ("Qwen-Image", "HunyuanVideo", "LTX-Video")} == {
        "Qwen-Image": None,
        "HunyuanVideo": None,
        "LTX-Video": 4096,
    }
    assert tokens["Lumina 2"] == 2304
    for side, grid in ((96, 48 * 48), (94, 47 * 47)):  # 2304 image tokens, then 2209
        counter = host.KeyCounter()
        patched = patch(node_classes, host.with_override(dits["z_image"], counter), skip_when_slower=True)
        host.sample_dit(patched, "z_image", (1, side, side), steps=1, cfg=1.0)
        joint = [(queries, keys) for queries, keys in counter.calls if queries > grid]
        assert joint and all((keys < queries) == (grid >= 2304) for queries, keys in joint), (side, joint)


def test_hunyuan_image_21_is_a_still_image_of_the_same_layout():
    """HunyuanImage 2.1: ``HunyuanVideo`` with a 2-D patch on 4-D latents; ByT5's glyph tokens join the text where
    the model has their input layer; a 5-D input there, or a call without text, is no layout of its own."""
    family = comfy_dit.TokenLayout("HunyuanVideo", (2, 2), comfy_dit._hunyuan_tokens, text_inputs=("txt_byt5",))
    context = torch.zeros(1, 9, 64)
    tokens = family.image_tokens(torch.zeros(1, 64, 9, 7), {"txt_byt5": torch.zeros(1, 5, 1472)}, context)
    assert (tokens.grid, tokens.before, tokens.after) == ((1, 5, 4), 0, 14)
    assert family.image_tokens(torch.zeros(1, 64, 1, 9, 7), {}, context) is None
    assert family.image_tokens(torch.zeros(1, 64, 9, 7), {}) is None


@pytest.mark.parametrize("family", ("z_image", "hunyuan_video15"))
def test_todo_and_reuse_across_steps_together(node_classes, family):
    """ToDo with reuse every 3 over 10 steps: the reduced calls are the blocks that run (Lumina 2 / Z-Image through
    its span blocks' instance forwards, HunyuanVideo through the block hook); the output is finite and differs
    from reuse alone."""
    model = host.tiny_dit(family, **host.dit_blocks(family, 4))
    reuse = {"reuse_interval": 3, "skip_when_slower": False, "dit_settings": "as set"}
    counter = host.KeyCounter()
    both = host.patch_with_node(node_classes, host.with_override(model, counter), **reuse)
    out = host.sample_dit(both, family, SHAPES[family], 10, cfg=1.0)
    alone = host.sample_dit(
        host.patch_with_node(node_classes, model, **dict(reuse, downsample_factor=1.0)),
        family,
        SHAPES[family],
        10,
        cfg=1.0,
    )
    assert torch.isfinite(out).all() and not torch.equal(out, alone)
    _, reduced = CALLS[family]
    assert set(counter.calls) == reduced
    # One joint attention per block: the first block at each of the 10 steps, the 3 after it at the 5 full steps
    # (test_comfyui_dit_families.py pins that schedule).
    assert sum(keys < queries for queries, keys in counter.calls) == 10 + 5 * 3


def first_attention_weight(model) -> tuple[str, torch.Tensor]:
    """The patcher's key and the tensor of the first block's first attention weight matrix."""
    for name, weight in model.model.diffusion_model.named_parameters():
        if weight.dim() == 2 and any(word in name for word in ("attn", "attention")):
            return f"diffusion_model.{name}", weight
    raise AssertionError("no attention weight")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_weight_patch_applies_under_todo(node_classes, dits, unpatched, family):
    """A LoRA-like weight patch (``add_patches``) applies under ToDo: factor 1 gives the weight patch's own output
    bit for bit, ToDo on it differs from both ToDo alone and the weight patch alone."""
    model = dits[family]
    key, weight = first_attention_weight(model)
    lora = model.clone()
    lora.add_patches({key: (torch.full_like(weight, 0.05),)}, 1.0)
    lora_only = sample(lora, family)
    assert not torch.equal(lora_only, unpatched[family])
    assert torch.equal(sample(patch(node_classes, lora, downsample_factor=1.0), family), lora_only)
    both = sample(patch(node_classes, lora), family)
    assert torch.isfinite(both).all()
    assert not torch.equal(both, lora_only) and not torch.equal(both, sample(patch(node_classes, model), family))


@pytest.mark.parametrize("family", ("qwen_image", "z_image"))  # the block hook; the span blocks' forwards
def test_compiled_model_samples_the_same(node_classes, dits, family):
    """torch.compile (ComfyUI's own wrapper, eager backend: the graph capture without code generation) traces
    through the families' ToDo and computes what the uncompiled patched model computes."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    patched = patch(node_classes, dits[family])
    expected = sample(patched, family)
    compiled = patched.clone()
    set_torch_compile_wrapper(compiled, backend="eager")
    torch._dynamo.reset()
    try:
        out = sample(compiled, family)
    finally:
        torch._dynamo.reset()
    # The same operations, traced: equal up to float rounding of a reordered graph.
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5)
    assert not torch.equal(out, sample(dits[family], family))
