"""The DiTs added since Flux.1 and Wan 2.1, in real ComfyUI with tiny random-weight models of each family's own
class (``hosts/comfy_host.py``, ``DIT_TINY``): reuse across steps through the one door (each family's
``BlockLayout`` in its registry record) on Flux.2, Qwen-Image, HunyuanVideo 1.5, LTX-Video and Chroma Radiance; the
families that hand no block to ComfyUI's block hook get it through an instance forward of each span block (Lumina 2,
Z-Image, Cosmos Predict2 and Anima) or pass through unchanged, with the reason in the log (HiDream, OmniGen2)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

from tome_core.hosts.comfyui import dit_reuse
from tome_core.reuse import NoiseSpacedSchedule

FAMILIES = (
    "flux2", "qwen_image", "hunyuan_video15", "ltxv", "chroma_radiance", "lumina2", "z_image", "cosmos_predict2"
)  # fmt: skip
# Lumina 2, Z-Image and Cosmos Predict2 (Anima's base class) have no block hook: their span blocks get an instance
# forward (a patcher injection), so a block's module is still called at a reusing step; what runs is counted on
# its self-attention (this submodule).
FORWARD_HOOK = {"lumina2": "attention", "z_image": "attention", "cosmos_predict2": "self_attn"}
SHAPES = {
    "flux2": (1, 8, 8),
    "qwen_image": (1, 8, 8),
    "hunyuan_video15": (1, 3, 8, 8),
    "ltxv": (1, 3, 8, 8),
    "chroma_radiance": (1, 16, 16),
    "lumina2": (1, 8, 8),
    "z_image": (1, 8, 8),
    "cosmos_predict2": (1, 8, 8),
}
FAMILY_WORDS = {
    "flux2": "Flux",
    "qwen_image": "Qwen-Image",
    "hunyuan_video15": "HunyuanVideo",
    "ltxv": "LTX-Video",
    "chroma_radiance": "Flux",
    "lumina2": "Lumina 2",
    "z_image": "Lumina 2",
    "cosmos_predict2": "Cosmos Predict2",
}
NO_BLOCK_HOOK = ("hidream",)  # OmniGen2 has a record of its own: reuse through its layers' forwards
BLOCKS = 4  # the first block runs at every call, the three after it are the span
STEPS = 10  # the fewest steps that reuse
REUSE = {"reuse_interval": 3, "downsample_factor": 1.0, "dit_settings": "as set", "skip_when_slower": False}


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def dits():
    return {family: host.tiny_dit(family, **host.dit_blocks(family, BLOCKS)) for family in FAMILIES}


def blocks_in_call_order(model, family) -> list:
    diffusion_model = model.model.diffusion_model
    return [
        block
        for attribute, _ in host.DIT_BLOCK_LISTS_FOR_TESTS[family]
        for block in getattr(diffusion_model, attribute)
    ]


def count_block_calls(model, family, run) -> list[int]:
    """How often each block (in call order) ran during ``run()``."""
    blocks = blocks_in_call_order(model, family)
    if family in FORWARD_HOOK:
        blocks = [getattr(block, FORWARD_HOOK[family]) for block in blocks]
    return host.count_calls(blocks, run)


def full_steps(model, steps: int) -> int:
    import comfy.samplers

    sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "normal", steps)
    levels = [float(s) for s in sigmas[:steps]]
    return NoiseSpacedSchedule(REUSE["reuse_interval"]).for_run(steps, levels).full_steps(steps)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_door_knows_each_familys_blocks(dits, family):
    diffusion_model = dits[family].model.diffusion_model
    layout = dit_reuse.layout_of(diffusion_model)
    assert layout is not None and layout.family == FAMILY_WORDS[family]
    expected = [
        (key or "layer", i)
        for attribute, key in host.DIT_BLOCK_LISTS_FOR_TESTS[family]
        for i in range(len(getattr(diffusion_model, attribute)))
    ]
    assert layout.hook == ("forward" if family in FORWARD_HOOK else "dit")
    assert dit_reuse.block_keys(diffusion_model) == expected and len(expected) == BLOCKS


@pytest.mark.parametrize("family", FAMILIES)
def test_the_span_runs_at_full_steps_only_and_the_rest_is_exact(node_classes, dits, family):
    """The first block at every call; the three after it only at the schedule's full steps (one in two under 25
    steps, spaced by the noise), whatever the family's streams and argument names; the output finite and not the
    unpatched one. Exact: under 10 steps (every block runs), the input model after sampling the patched one, and
    the clone patched again with reuse off. CFG 1 (one call a step) keeps it quick: the batch layouts of CFG have
    their tests on Flux and Wan (test_comfyui_dit_reuse.py)."""
    model = dits[family]
    shape = SHAPES[family]
    options = copy.deepcopy(model.model_options)
    plain = {steps: host.sample_dit(model, family, shape, steps, cfg=1.0) for steps in (9, STEPS)}
    patched = host.patch_with_node(node_classes, model, **REUSE)
    assert model.model_options == options
    out = []
    counts = count_block_calls(
        patched, family, lambda: out.append(host.sample_dit(patched, family, shape, STEPS, cfg=1.0))
    )
    assert torch.isfinite(out[0]).all() and not torch.equal(out[0], plain[STEPS])
    full = full_steps(patched, STEPS)
    assert full == STEPS // 2
    assert counts == [STEPS] + [full] * (BLOCKS - 1)
    assert torch.equal(host.sample_dit(patched, family, shape, 9, cfg=1.0), plain[9])
    assert torch.equal(host.sample_dit(model, family, shape, STEPS, cfg=1.0), plain[STEPS])
    removed = host.patch_with_node(node_classes, patched, **dict(REUSE, reuse_interval=1))  # patched again: off
    assert torch.equal(host.sample_dit(removed, family, shape, STEPS, cfg=1.0), plain[STEPS])


@pytest.mark.parametrize("family", ("flux2",))
def test_auto_reuses_on_the_new_families(node_classes, dits, family):
    """A freshly added node (``dit_settings`` auto) reuses on them too: the family's interval, no ToDo (Qwen-Image's
    guarded default: the test below)."""
    patched = host.patch_with_node(node_classes, dits[family])
    counts = count_block_calls(
        patched, family, lambda: host.sample_dit(patched, family, SHAPES[family], STEPS, cfg=1.0)
    )
    assert counts[1] < counts[0]


@pytest.mark.parametrize(
    ("family", "guards", "steps"),
    (
        ("qwen_image", (0.15, 0.07), 28),
        ("qwen_image", (0.15, 0.07), 20),
        ("wan", (0.15, 0.1), 28),
        ("wan", (0.15, 0.1), 20),
    ),
    ids=("qwen-image-28", "qwen-image-20", "wan-28", "wan-20"),
)
def test_qwen_images_and_wans_default_is_every_6_with_both_first_block_guards(
    node_classes, dits, monkeypatch, family, guards, steps
):
    """Qwen-Image's and Wan's defaults (``dit_families``): every 6, no curve, each reusing call run in full where
    the first block's output lies more than 0.07 (Wan: 0.1) off the line through the last two full calls' outputs
    or moved more than 0.15 since the last one. The run's plan is every 6's (at 20 steps too: their guards alone
    decide a short run's steps), the run carries the guards, and what the span blocks computed is the plan's
    full calls plus the ones the guards turned."""
    runs = host.recorded_runs(monkeypatch)
    model = dits[family] if family in dits else host.tiny_dit(family, **host.dit_blocks(family, BLOCKS))
    shape = SHAPES.get(family, (1, 3, 8, 8))  # Wan: (batch, frames, h, w)
    patched = host.patch_with_node(node_classes, model)
    counts = count_block_calls(patched, family, lambda: host.sample_dit(patched, family, shape, steps, cfg=1.0))
    (run,) = runs
    import comfy.samplers

    sigmas = comfy.samplers.calculate_sigmas(patched.get_model_object("model_sampling"), "normal", steps)
    levels = [float(s) for s in sigmas[:steps]]
    every_6 = NoiseSpacedSchedule(6, short_run=0).for_run(steps, levels, run.full_below).full
    assert run.schedule.full == every_6 and (run.first_block_guard, run.line_guard) == guards
    assert counts == [steps] + [len(every_6) + run.guarded_calls] * (BLOCKS - 1)
    # On random weights the first block's output moves as noise does, off any line: the guards turn the reusing
    # calls, every one at Qwen-Image's tighter line guard (the engine's tests show a steady move reusing).
    assert 0 < run.guarded_calls <= steps - len(every_6)
    if family == "qwen_image":
        assert run.guarded_calls == steps - len(every_6)


def test_patches_after_each_block_run_every_block(node_classes, dits, caplog):
    """Qwen-Image's block-wise ControlNets add to the streams after each block (``patches["double_block"]``),
    which a predicted residual already holds: every block runs, with one warning."""
    family = "qwen_image"
    patched = host.patch_with_node(node_classes, dits[family], **REUSE)
    with_patch = patched.clone()
    with_patch.set_model_double_block_patch(lambda args: {"img": args["img"], "txt": args["txt"]})
    with caplog.at_level(logging.WARNING, logger="tome_patch"):
        counts = count_block_calls(
            with_patch, family, lambda: host.sample_dit(with_patch, family, SHAPES[family], STEPS, cfg=1.0)
        )
    assert len(set(counts)) == 1
    assert "patches the DiT's blocks' outputs" in caplog.text


@pytest.mark.parametrize("family", NO_BLOCK_HOOK)
@pytest.mark.parametrize("dit_settings", ("auto", "as set"))
def test_families_without_a_block_hook_pass_through_with_the_reason(node_classes, family, dit_settings, caplog):
    model = host.tiny_dit(family)
    options = copy.deepcopy(model.model_options)
    with caplog.at_level(logging.WARNING, logger="tome_patch"):
        out = host.patch_with_node(node_classes, model, dit_settings=dit_settings)
    assert out is model and model.model_options == options
    assert "unchanged" in caplog.text and "no block" in caplog.text
