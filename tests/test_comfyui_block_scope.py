"""Scope block in a real ComfyUI 0.3.75: whole transformer blocks on merged tokens, through patcher injections."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from hosts import comfy_host as host  # noqa: I001  (before any ComfyUI import: sys.path, CPU mode)

FAMILIES = ("sd15", "sdxl")
HW = (15, 23)
# Reuse across steps off (the default is 3): these tests are about the token reduction alone.
BLOCK = {"method": "tome", "scope": "block", "skip_when_slower": False, "max_downsample": "4", "reuse_interval": 1}


@pytest.fixture(scope="module")
def node_classes():
    return host.load_our_package()


@pytest.fixture(scope="module")
def models():
    return {family: host.tiny_model(family) for family in FAMILIES}


patch = host.patch_with_node


def run(model, family="sd15", **kwargs):
    return host.sample(model, family, **{"latent_hw": HW, "steps": 2, **kwargs})


def blocks_of(model):
    return [m for _, m in model.model.diffusion_model.named_modules() if type(m).__name__ == "BasicTransformerBlock"]


def forwards_left(model) -> int:
    return sum("forward" in block.__dict__ for block in blocks_of(model))


def test_scope_is_the_input_before_reuse_interval_in_both_nodes(node_classes):
    for node_id in ("ToMePatch", "ToMePatchAdvanced"):
        inputs = [i for i in node_classes[node_id].GET_SCHEMA().inputs if i.id != "calibration_target"]
        assert [i.id for i in inputs[-4:]] == ["scope", "reuse_interval", "dit_settings", "reuse_plan"]
        scope = inputs[-4]
        assert scope.id == "scope" and scope.default == "self-attention"
        assert list(scope.options) == ["self-attention", "block", "reuse"]
        assert "whole transformer block" in scope.tooltip


def test_a_saved_workflow_with_the_removed_scope_reuse_runs_as_self_attention_and_says_why(
    node_classes, models, caplog
):
    """Scope "reuse" was removed; a workflow or API prompt saved with it still validates (it stays among the
    options) and samples exactly as scope self-attention, with one warning naming the reason."""
    model = models["sd15"]
    settings = dict(BLOCK, max_downsample="auto")
    with caplog.at_level("WARNING", logger="tome_patch"):
        retired = run(patch(node_classes, model, **dict(settings, scope="reuse")))
    assert any("scope 'reuse' was removed" in r.getMessage() for r in caplog.records)
    self_attention = run(patch(node_classes, model, **dict(settings, scope="self-attention")))
    assert torch.equal(retired, self_attention)
    assert not torch.equal(retired, run(model))  # the reduction did run


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_block_scope_changes_sampling_on_odd_sizes(node_classes, models, family, batch):
    model = models[family]
    reference = run(model, family, batch=batch)
    self_attention = run(patch(node_classes, model, **dict(BLOCK, scope="self-attention")), family, batch=batch)
    out = run(patch(node_classes, model, **BLOCK), family, batch=batch)
    assert out.shape == reference.shape and torch.isfinite(out).all()
    assert not torch.equal(out, reference) and not torch.equal(out, self_attention)


@pytest.mark.parametrize("family", FAMILIES)
def test_ratio_zero_installs_nothing_and_is_bit_identical(node_classes, models, family):
    model = models[family]
    reference = run(model, family, batch=2)
    off = patch(node_classes, model, **dict(BLOCK, ratio=0.0))
    assert not off.injections and not off.object_patches
    assert torch.equal(run(off, family, batch=2), reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_nothing_is_left_after_sampling_and_removal_is_bit_identical(node_classes, models, family):
    model = models[family]
    reference = run(model, family, batch=2)
    patched = patch(node_classes, model, **BLOCK)
    assert "tome_patch" in patched.injections and not model.injections
    assert forwards_left(model) == 0
    run(patched, family, batch=2)
    # While the patched clone is loaded its blocks carry our forward; loading the input model ejects it.
    assert forwards_left(model) == len(blocks_of(model))
    assert torch.equal(run(model, family, batch=2), reference)
    assert forwards_left(model) == 0
    # Turning the patch off on the patched model removes all of it.
    off = patch(node_classes, patched, method="tome", ratio=0.0, reuse_interval=1)
    assert not off.injections and "tome_patch_owner" not in off.model_options["transformer_options"]
    assert torch.equal(run(off, family, batch=2), reference)


def test_input_model_is_never_changed_and_clones_do_not_mix(node_classes, models):
    model = models["sdxl"]
    before = copy.deepcopy(model.model_options)
    block = patch(node_classes, model, **BLOCK)
    attn = patch(node_classes, model, **dict(BLOCK, scope="self-attention"))
    assert model.model_options == before and not model.injections and not model.object_patches
    assert "tome_patch" not in attn.injections
    alone = {"block": run(block, "sdxl"), "attn": run(attn, "sdxl"), "plain": run(model, "sdxl")}
    for name, clone in (("attn", attn), ("block", block), ("plain", model), ("block", block), ("attn", attn)):
        assert torch.equal(run(clone, "sdxl"), alone[name])


def test_applying_twice_replaces_the_earlier_patch(node_classes, models):
    model = models["sd15"]
    once = patch(node_classes, model, **BLOCK)
    twice = patch(node_classes, patch(node_classes, model, **dict(BLOCK, ratio=0.3)), **BLOCK)
    assert len(twice.injections["tome_patch"]) == 1
    assert torch.equal(run(twice), run(once))
    # From scope block to self-attention: the injection goes, the attention hooks come.
    attn = patch(node_classes, once, **dict(BLOCK, scope="self-attention"))
    assert "tome_patch" not in attn.injections
    assert "tome_patch_owner" not in attn.model_options["transformer_options"]
    assert torch.equal(run(attn), run(patch(node_classes, model, **dict(BLOCK, scope="self-attention"))))


def test_a_forward_left_on_the_blocks_does_nothing_for_another_patcher(node_classes, models):
    """If ComfyUI ever ran another clone of the model without ejecting ours (its loaded-model bookkeeping switches
    to the parent when a clone is garbage-collected), our forward must compute the unpatched block exactly."""
    model = models["sd15"]
    latent = torch.randn(2, 4, *HW, generator=torch.Generator().manual_seed(4))
    reference = host.unet_output(model, latent)
    patched = patch(node_classes, model, **BLOCK)
    patched.patch_model()  # loads and injects
    try:
        assert forwards_left(model) == len(blocks_of(model))
        assert not torch.equal(host.unet_output(patched, latent), reference)
        assert torch.equal(host.unet_output(model, latent), reference)  # the input model's options: inert
    finally:
        patched.unpatch_model()
    assert forwards_left(model) == 0


def test_one_plan_per_level_and_model_call(node_classes, models, monkeypatch):
    # The engine as ComfyUI loaded it: a submodule of the custom node package, not the top-level tome_core.
    package = node_classes["ToMePatch"].__module__.rpartition(".")[0]
    matching = sys.modules[f"{package}.tome_core.matching"]
    made = []
    real = matching.make_plan
    monkeypatch.setattr(matching, "make_plan", lambda *args: made.append(args[0].shape) or real(*args))
    model = models["sdxl"]  # levels 2 and 4 with attention, two blocks per transformer, 14 blocks in all
    patched = patch(node_classes, model, **BLOCK)
    latent = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(4))
    patched.patch_model()
    try:
        for _ in range(2):
            host.unet_output(patched, latent, family="sdxl")
    finally:
        patched.unpatch_model()
    assert made == [(2, 64, 64), (2, 16, 64)] * 2  # level 2 (8x8) and level 4 (4x4), once per call each


@pytest.mark.parametrize("ours_first", [True, False])
def test_composes_with_another_nodes_attn1_patch(node_classes, models, ours_first):
    model = models["sd15"]
    calls = []

    def scale_keys(n, context, value, extra_options):
        calls.append(n.shape[1])
        return n, context * 0.5, value

    def with_foreign(m):
        m = m.clone()
        m.set_model_attn1_patch(scale_keys)
        return m

    if ours_first:
        chained = with_foreign(patch(node_classes, model, **BLOCK))
    else:
        chained = patch(node_classes, with_foreign(model), **BLOCK)
    foreign_only = run(with_foreign(model))
    ours_only = run(patch(node_classes, model, **BLOCK))
    calls.clear()
    out = run(chained)
    # The other patch runs in every block, on the merged tokens where ours merged them (345 -> 173 at level 1).
    assert 173 in calls and 345 not in calls
    assert torch.isfinite(out).all()
    assert not torch.equal(out, foreign_only) and not torch.equal(out, ours_only)


def _lora_like(model) -> dict:
    """A weight patch in the format LoRA loading produces ("diff" per key), on sub-layers of two blocks."""
    generator = torch.Generator().manual_seed(9)
    state = model.model.state_dict()
    keys = [
        "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight",
        "diffusion_model.input_blocks.1.1.transformer_blocks.0.ff.net.0.proj.weight",
        "diffusion_model.output_blocks.3.1.transformer_blocks.0.attn2.to_v.weight",
    ]
    return {key: ("diff", (0.05 * torch.randn(state[key].shape, generator=generator),)) for key in keys}


@pytest.mark.parametrize("lora_first", [True, False])
def test_weight_patches_apply_under_the_block_patch(node_classes, lora_first):
    """LoRA-style weight patches (ModelPatcher.add_patches) reach the same weights with scope block on: the result
    equals scope block on a model whose weights were changed by hand. No module is replaced, no key renamed."""
    model = host.tiny_model("sd15")
    patches = _lora_like(model)

    def with_lora(m):
        m = m.clone()
        assert sorted(m.add_patches(patches, 1.0)) == sorted(patches)
        return m

    if lora_first:
        both = patch(node_classes, with_lora(model), **BLOCK)
    else:
        both = with_lora(patch(node_classes, model, **BLOCK))
    out = run(both)
    ours_only = run(patch(node_classes, model, **BLOCK))

    baked = host.tiny_model("sd15")
    with torch.no_grad():
        state = baked.model.state_dict()
        for key, (_, (diff,)) in patches.items():
            state[key].add_(diff)
    assert torch.equal(out, run(patch(node_classes, baked, **BLOCK)))
    assert not torch.equal(out, ours_only)
    # And without our patch the weight patch is still exactly the hand-changed model.
    assert torch.equal(run(with_lora(model)), run(baked))


class FailOnSecondStep:
    def __init__(self):
        self.sigmas_seen = []

    def __call__(self, n, context, value, extra_options):
        sigma = float(extra_options["sigmas"].max())
        if sigma not in self.sigmas_seen:
            self.sigmas_seen.append(sigma)
        if len(self.sigmas_seen) >= 2:
            raise RuntimeError("foreign patch failed")
        return n, context, value


def test_an_exception_mid_sampling_leaves_nothing_behind(node_classes, models):
    model = models["sd15"]
    never_patched = run(model, batch=2)
    ours = patch(node_classes, model, **BLOCK)
    ours_before = run(ours, batch=2)
    failing = ours.clone()
    failing.set_model_attn1_patch(FailOnSecondStep())
    with pytest.raises(RuntimeError, match="foreign patch failed"):
        run(failing, batch=2)
    assert torch.equal(run(model, batch=2), never_patched)
    assert forwards_left(model) == 0
    assert torch.equal(run(ours, batch=2), ours_before)


def test_step_range_applies_to_scope_block(node_classes, models):
    model = models["sd15"]
    kwargs = dict(steps=4)
    reference = run(model, **kwargs)
    full = run(patch(node_classes, model, **BLOCK), **kwargs)
    first_half = run(patch(node_classes, model, **dict(BLOCK, end_percent=0.5)), **kwargs)
    empty = run(patch(node_classes, model, **dict(BLOCK, start_percent=0.5, end_percent=0.5)), **kwargs)
    assert not torch.equal(first_half, reference) and not torch.equal(first_half, full)
    assert torch.equal(empty, reference)


def test_patched_unet_compiles_without_graph_breaks(node_classes, models):
    """As the compile test of the hooks (test_comfyui_hardening.py), with the blocks' injected forward."""
    model = models["sdxl"]
    patched = patch(node_classes, model, **dict(BLOCK, end_percent=0.7), advanced=True, use_rand=True, seed=2)
    unet = patched.model.diffusion_model
    latent = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    context = host.conditioning("sdxl", 2)[0][0]
    y = torch.randn(2, host.SDXL_TINY["adm_in_channels"], generator=torch.Generator().manual_seed(3))
    options = dict(patched.model_options["transformer_options"], sigmas=torch.full((2,), 5.0))
    (wrapper,) = patched.get_wrappers("apply_model", "tome_patch")
    wrapper(lambda *args, **kwargs: None, latent, torch.full((2,), 5.0), transformer_options=options)
    assert options["tome_patch_active"] is True

    def forward(x, transformer_options):
        return unet(
            x, timesteps=torch.full((2,), 500.0), context=context, y=y, transformer_options=dict(transformer_options)
        )

    patched.patch_model()
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            eager = forward(latent, options)
            # fullgraph: any graph break fails the trace, with Dynamo's reason
            compiled = torch.compile(forward, backend="eager", fullgraph=True)(latent, options)
            unpatched = forward(latent, {})
    finally:
        patched.unpatch_model()
        torch._dynamo.reset()
    assert torch.equal(compiled, eager)
    assert not torch.equal(eager, unpatched)
